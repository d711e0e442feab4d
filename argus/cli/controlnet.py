"""``argus controlnet``: the shared ControlNet service (gRPC ``argus.v1.ControlNet``, Katz §5).

``--catalog tiny`` serves a dozen seeded random tiny ControlNets per base family (no GPU or
weights needed); ``--catalog DIR`` serves diffusers ControlNets laid out as
``DIR/<family>/<name>/`` (safetensors only). ``--base-family`` restricts the service to one
family. The most popular ControlNets stay on the device: ``--cache-size N`` of them, or
``--cache-bytes B`` of weights, evicted by ``--policy lru|lfu``. Prints
``argus controlnet listening on HOST:PORT`` once bound; Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import argparse

from argus.cli.internal import add_internal_tls_arguments, internal_tls_dir
from argus.cli.main import CLIError


class ControlNetCommand:
    name = "controlnet"
    help = "Run the shared ControlNet service (gRPC)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--catalog", default="tiny", help="'tiny' or a catalog directory")
        parser.add_argument(
            "--base-family", choices=("sd15", "sdxl"), help="serve one family (default: all)"
        )
        parser.add_argument("--host", default="127.0.0.1", help="address to bind")
        parser.add_argument("--port", type=int, default=0, help="port (0: any free port)")
        parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
        parser.add_argument("--dtype", default="auto", help="auto, fp32, fp16 or bf16")
        parser.add_argument("--policy", default="lru", choices=("lru", "lfu"))
        size = parser.add_mutually_exclusive_group()
        size.add_argument("--cache-size", type=int, help="ControlNets kept resident (default 8)")
        size.add_argument("--cache-bytes", type=int, help="bytes of ControlNets kept resident")
        parser.add_argument(
            "--preload", action="append", default=[], help="FAMILY/NAME to load at start"
        )
        parser.add_argument("--max-sessions", type=int, default=64, help="requests in flight")
        parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here")
        add_internal_tls_arguments(parser, "controlnet")

    def run(self, args: argparse.Namespace) -> int:
        from argus.worker.controlnet.app import ControlNetSettings, serve
        from argus.worker.controlnet.errors import ControlNetError

        if not 0 <= args.port < 65536:
            raise CLIError(f"--port: {args.port} outside 0..65535")
        for flag, value in (("--cache-size", args.cache_size), ("--cache-bytes", args.cache_bytes)):
            if value is not None and value < 1:
                raise CLIError(f"{flag}: {value} must be positive")
        if args.max_sessions < 1:
            raise CLIError(f"--max-sessions: {args.max_sessions} must be positive")
        tls_dir = internal_tls_dir(args, "controlnet")
        settings = ControlNetSettings(
            catalog=args.catalog,
            base_family=args.base_family,
            host=args.host,
            port=args.port,
            device=args.device,
            dtype=args.dtype,
            policy=args.policy,
            cache_size=None if args.cache_bytes is not None else (args.cache_size or 8),
            cache_bytes=args.cache_bytes,
            preload=tuple(args.preload),
            max_sessions=args.max_sessions,
            metrics_port=args.metrics_port,
            internal_tls_dir=tls_dir,
        )
        try:
            return serve(settings)
        except (ValueError, ControlNetError, OSError) as err:
            raise CLIError(str(err)) from None
