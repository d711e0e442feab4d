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
from argus.cli.main import (
    CLIError,
    add_nice_argument,
    config_error,
    lower_priority,
    passive_openmp,
)


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
        add_nice_argument(parser)
        add_internal_tls_arguments(parser, "controlnet")

    def run(self, args: argparse.Namespace) -> int:
        lower_priority(args.nice)  # before any thread starts
        passive_openmp()  # before torch loads
        from argus.worker.adapters.controlnet.app import ControlNetSettings, serve
        from argus.worker.adapters.controlnet.errors import ControlNetError

        tls_dir = internal_tls_dir(args, "controlnet")
        unsized = args.cache_size is None and args.cache_bytes is None  # the service's default
        try:  # the settings check every value
            settings = ControlNetSettings(
                catalog=args.catalog,
                base_family=args.base_family,
                host=args.host,
                port=args.port,
                device=args.device,
                dtype=args.dtype,
                policy=args.policy,
                cache_size=ControlNetSettings.cache_size if unsized else args.cache_size,
                cache_bytes=args.cache_bytes,
                preload=tuple(args.preload),
                max_sessions=args.max_sessions,
                metrics_port=args.metrics_port,
                internal_tls_dir=tls_dir,
            )
        except ValueError as err:
            raise config_error(err, args) from None
        try:
            return serve(settings)
        except (ValueError, ControlNetError, OSError) as err:
            raise CLIError(str(err)) from None
