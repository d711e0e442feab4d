"""``argus router``: the cluster's public endpoint (``argus.v1.Router``).

It follows the allocator's plans (``--allocator HOST:PORT``), classifies each prompt, routes it
through the plan's shift map to a worker and forwards it; it reports arrivals and classified
levels back to the allocator every ``--report-period-s``. The public endpoint can carry TLS
(``--tls-cert`` and ``--tls-key``, PEM files) and bearer-token authentication
(``--auth-token-file``: every call but health checks needs ``authorization: Bearer TOKEN``).
Binds loopback unless ``--host`` says otherwise. Prints ``argus router listening on
HOST:PORT`` once bound; Ctrl-C or SIGTERM stops it. ``--max-cost`` caps a request's size:
pixels × steps in units of the profile's reference request (1024 × 1024 at 50 steps for the
default profile); a larger request is INVALID_ARGUMENT naming width, height and steps.
``--http-port`` (0: any free port) also serves the OpenAI-compatible images API over HTTP
(``POST /v1/images/generations``, ``GET /v1/models``, ``/healthz``, ``/readyz``; same bearer
token) and prints ``argus router http on http://HOST:PORT/v1`` once bound.
"""

from __future__ import annotations

import argparse
import math

from argus.cli.internal import add_internal_tls_arguments, internal_tls_dir
from argus.cli.main import CLIError


class RouterCommand:
    name = "router"
    help = "Run a router (gRPC): the public Generate endpoint in front of the workers."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--allocator", required=True, help="allocator HOST:PORT")
        parser.add_argument("--host", default="127.0.0.1", help="address to bind")
        parser.add_argument("--port", type=int, default=0, help="port (0: any free port)")
        parser.add_argument("--router-id", default="router-0", help="id in allocator reports")
        parser.add_argument("--profile", help="profile file (default: the embedded one)")
        parser.add_argument(
            "--classifier", help="classifier directory (default: classifiers/minilm-logistic)"
        )
        parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here")
        parser.add_argument(
            "--metrics-host", default="127.0.0.1", help="address of /metrics (internal)"
        )
        parser.add_argument("--tls-cert", help="PEM certificate chain of the public endpoint")
        parser.add_argument("--tls-key", help="PEM private key of the public endpoint")
        parser.add_argument(
            "--auth-token-file", help="file holding the bearer token callers must send"
        )
        parser.add_argument(
            "--report-period-s", type=float, default=1.0, help="statistics to the allocator"
        )
        parser.add_argument(
            "--default-deadline-ms",
            type=int,
            default=30_000,
            help="deadline of requests that set none",
        )
        parser.add_argument(
            "--max-in-flight", type=int, default=256, help="requests served at once; more: busy"
        )
        parser.add_argument(
            "--max-id-bytes",
            type=int,
            default=64 * 2**20,
            help="bytes of answers kept for retries of a request id, oldest dropped first "
            "(default: 64 MiB)",
        )
        parser.add_argument(
            "--max-cost",
            type=float,
            help="largest request accepted: pixels × steps in reference requests of the profile "
            "(default: no cap)",
        )
        parser.add_argument(
            "--http-port",
            type=int,
            help="serve the OpenAI-compatible images API over HTTP here (0: any free port; "
            "default: off)",
        )
        parser.add_argument(
            "--http-host", default="127.0.0.1", help="address of the HTTP API (public)"
        )
        parser.add_argument(
            "--default-steps",
            type=int,
            help="the workers' --default-steps: requests without steps are not routed to "
            "levels that skip as many (default: not capped)",
        )
        add_internal_tls_arguments(parser, "router")

    def run(self, args: argparse.Namespace) -> int:
        from argus.grpc_server import check_address
        from argus.profiles import ProfileError
        from argus.router.app import RouterSettings, serve

        ports = (
            ("--port", args.port),
            ("--metrics-port", args.metrics_port),
            ("--http-port", args.http_port),
        )
        for flag, port in ports:
            if port is not None and not 0 <= port < 65536:
                raise CLIError(f"{flag}: {port} outside 0..65535")
        if not (math.isfinite(args.report_period_s) and args.report_period_s > 0):
            raise CLIError(f"--report-period-s: {args.report_period_s} must be positive")
        for flag, value in (
            ("--default-deadline-ms", args.default_deadline_ms),
            ("--max-in-flight", args.max_in_flight),
        ):
            if value < 1:
                raise CLIError(f"{flag}: {value} must be positive")
        if args.max_id_bytes < 0:
            raise CLIError(f"--max-id-bytes: {args.max_id_bytes} must be >= 0")
        if args.max_cost is not None and not (math.isfinite(args.max_cost) and args.max_cost > 0):
            raise CLIError(f"--max-cost: {args.max_cost} must be a positive number")
        if args.default_steps is not None and args.default_steps < 1:
            raise CLIError(f"--default-steps: {args.default_steps} must be positive")
        tls_dir = internal_tls_dir(args, "router")
        try:
            check_address(args.allocator, "--allocator")
            settings = RouterSettings(
                allocator=args.allocator,
                host=args.host,
                port=args.port,
                router_id=args.router_id,
                profile=args.profile,
                classifier=args.classifier,
                metrics_port=args.metrics_port,
                metrics_host=args.metrics_host,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                auth_token_file=args.auth_token_file,
                report_period_s=args.report_period_s,
                default_deadline_ms=args.default_deadline_ms,
                max_in_flight=args.max_in_flight,
                max_id_bytes=args.max_id_bytes,
                max_cost=args.max_cost,
                default_steps=args.default_steps,
                http_port=args.http_port,
                http_host=args.http_host,
                internal_tls_dir=tls_dir,
            )
            settings.security()  # a bad certificate or token file fails before any loading
            return serve(settings)
        except (ValueError, ProfileError, OSError) as err:
            raise CLIError(str(err)) from None
