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
token) and prints ``argus router http on http://HOST:PORT/v1`` once bound. The router watches
the quality scores workers send (``argus worker --score-sample``) for drift, in windows of
``--drift-window`` scores (0: off), and on drift retrains the classifier in the background and
swaps it in (``--no-drift-retrain``: watch only); see :mod:`argus.router.drift`.
``--edit-balancer`` places inpainting edits: "plan" (the default) routes
them as generations; "mask-aware" keeps the plan's level and sends each to the worker of that
level where the edit cost model predicts it finishes first, preferring one that answered an edit
of its template, and refuses at once one that would miss its deadline; ``--edit-batch`` is the
workers' ``--edit-batch``, the edits a worker runs together.
"""

from __future__ import annotations

import argparse
from typing import Any

from argus import defaults
from argus.cli.internal import add_internal_tls_arguments, internal_tls_dir
from argus.cli.main import CLIError, config_error


class RouterCommand:
    name = "router"
    help = "Run a router (gRPC): the public Generate endpoint in front of the workers."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        # the drift flags' defaults are the configs' own (light modules: no torch, no grpc)
        from argus.classifier.drift import DriftConfig
        from argus.router.config import EDIT_BALANCER, EDIT_BALANCERS, EDIT_BATCH, RoutingConfig
        from argus.router.drift import DriftSettings

        parser.add_argument("--allocator", required=True, help="allocator HOST:PORT")
        parser.add_argument("--host", default=defaults.LOOPBACK, help="address to bind")
        parser.add_argument("--port", type=int, default=0, help="port (0: any free port)")
        parser.add_argument(
            "--router-id", default=defaults.ROUTER_ID, help="id in allocator reports"
        )
        parser.add_argument("--profile", help="profile file (default: the embedded one)")
        parser.add_argument(
            "--classifier",
            help="classifier directory (default: classifiers/minilm-l2-logistic-int8)",
        )
        parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here")
        parser.add_argument(
            "--metrics-host", default=defaults.LOOPBACK, help="address of /metrics (internal)"
        )
        parser.add_argument("--tls-cert", help="PEM certificate chain of the public endpoint")
        parser.add_argument("--tls-key", help="PEM private key of the public endpoint")
        parser.add_argument(
            "--auth-token-file", help="file holding the bearer token callers must send"
        )
        parser.add_argument(
            "--report-period-s",
            type=float,
            default=defaults.REPORT_PERIOD_S,
            help="statistics to the allocator (default: %(default)s)",
        )
        parser.add_argument(
            "--default-deadline-ms",
            type=int,
            default=defaults.DEFAULT_DEADLINE_MS,
            help="deadline of requests that set none (default: %(default)s)",
        )
        parser.add_argument(
            "--max-in-flight",
            type=int,
            default=defaults.MAX_IN_FLIGHT,
            help="requests served at once; more: busy (default: %(default)s)",
        )
        parser.add_argument(
            "--late-binding-window",
            type=int,
            default=RoutingConfig.late_binding_window,
            help="requests sent to a worker at once; the router holds the rest and sends each "
            "to the first worker of its level with room, refusing at once what can no longer "
            "finish in time (0: send every request at once; default: %(default)s)",
        )
        parser.add_argument(
            "--max-id-bytes",
            type=int,
            default=defaults.MAX_ID_BYTES,
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
            "--http-host", default=defaults.LOOPBACK, help="address of the HTTP API (public)"
        )
        parser.add_argument(
            "--default-steps",
            type=int,
            help="the workers' --default-steps: requests without steps are not routed to "
            "levels that skip as many (default: not capped)",
        )
        parser.add_argument(
            "--default-size",
            type=int,
            help="the workers' --default-size: requests without width or height are priced at "
            "this side (default: the profile's reference size)",
        )
        cache = parser.add_argument_group("cache-aware routing (the workers' approximate caches)")
        cache.add_argument(
            "--cache-routing",
            action=argparse.BooleanOptionalAction,
            default=RoutingConfig.cache_aware,
            help="mirror the workers' caches and send an AC request to the worker whose cached "
            "neighbour serves it soonest; loads the workers' prompt encoder (default: "
            "%(default)s)",
        )
        cache.add_argument(
            "--cache-encoder",
            metavar="DIR",
            help="the workers' --encoder-dir (default: all-MiniLM-L6-v2, as the workers')",
        )
        cache.add_argument(
            "--scheduler",
            default=defaults.SCHEDULER,
            help="the workers' --scheduler, part of the cache key (default: %(default)s)",
        )
        cache.add_argument(
            "--cache-probe-interval-s",
            type=float,
            default=RoutingConfig.cache_probe_interval_s,
            help="outside AC plans, embed a prompt to probe the caches for the allocator at most "
            "this often (0: every prompt; default: %(default)s)",
        )
        edits = parser.add_argument_group("inpainting edits")
        edits.add_argument(
            "--edit-balancer",
            choices=EDIT_BALANCERS,
            default=EDIT_BALANCER,
            help="how inpainting edits are placed and admitted: plan (as generations) or an "
            "edit balancer on the edit cost model (default: %(default)s)",
        )
        edits.add_argument(
            "--edit-batch",
            type=int,
            default=EDIT_BATCH,
            help="the workers' --edit-batch: edits a worker runs together (default: %(default)s)",
        )
        edits.add_argument(
            "--edit-batch-table",
            metavar="FILE",
            help="the workers' measured latency-per-batch table (benchmarks/bench_edit_cost.py "
            "--write-table): the edit cost model is its fit for the profile's base model at "
            "--default-size (default: the model derived from InstGenIE's figures)",
        )
        drift = parser.add_argument_group("drift retraining (workers' quality scores)")
        drift.add_argument(
            "--drift-window",
            type=int,
            default=DriftConfig.window,
            help="scores per drift window (0: no drift monitoring; default %(default)s)",
        )
        drift.add_argument(
            "--drift-tolerance",
            type=float,
            default=DriftConfig.tolerance,
            help="a window drifts when its median is this far below the moving average "
            "(default %(default)s)",
        )
        drift.add_argument(
            "--drift-retrain",
            action=argparse.BooleanOptionalAction,
            default=DriftSettings.retrain,
            help="retrain and swap the classifier on drift (default: %(default)s)",
        )
        drift.add_argument(
            "--drift-min-labels",
            type=int,
            default=DriftSettings.min_examples,
            help="prompts scored at two levels or more a retrain needs (default %(default)s)",
        )
        add_internal_tls_arguments(parser, "router")

    def run(self, args: argparse.Namespace) -> int:
        from argus.profiles import ProfileError
        from argus.router.app import RouterSettings, serve
        from argus.router.config import RouterServiceConfig, RoutingConfig

        tls_dir = internal_tls_dir(args, "router")
        try:  # the settings check every value, before anything loads
            service = RouterServiceConfig(
                router_id=args.router_id,
                default_deadline_ms=args.default_deadline_ms,
                max_in_flight=args.max_in_flight,
                max_id_bytes=args.max_id_bytes,
                max_cost=args.max_cost,
                default_steps=args.default_steps,
                default_size=args.default_size,
                scheduler=args.scheduler,
                routing=RoutingConfig(
                    cache_aware=args.cache_routing,
                    cache_probe_interval_s=args.cache_probe_interval_s,
                    late_binding_window=args.late_binding_window,
                ),
                edit_balancer=args.edit_balancer,
                edit_batch=args.edit_batch,
                edit_cost=edit_cost_model(args),
            )
            settings = RouterSettings(
                allocator=args.allocator,
                host=args.host,
                port=args.port,
                profile=args.profile,
                classifier=args.classifier,
                metrics_port=args.metrics_port,
                metrics_host=args.metrics_host,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                auth_token_file=args.auth_token_file,
                report_period_s=args.report_period_s,
                service=service,
                http_port=args.http_port,
                http_host=args.http_host,
                internal_tls_dir=tls_dir,
                drift=drift_settings(args),
                cache_encoder=args.cache_encoder,
            )
        except ValueError as err:
            raise config_error(err, args) from None
        try:
            settings.security()  # a bad certificate or token file fails before any loading
            return serve(settings)
        except (ValueError, ProfileError, OSError) as err:
            raise CLIError(str(err)) from None


def drift_settings(args: argparse.Namespace) -> Any:
    """The router's drift retraining from its flags (None when ``--drift-window`` is 0);
    ValueError names the bad field (the configs check their own values)."""
    from argus.classifier.drift import DriftConfig
    from argus.router.drift import DriftSettings

    if args.drift_window < 0:
        raise ValueError(f"drift_window: must be >= 0 (0: off), got {args.drift_window}")
    if args.drift_window == 0:
        return None
    return DriftSettings(
        monitor=DriftConfig(window=args.drift_window, tolerance=args.drift_tolerance),
        retrain=args.drift_retrain,
        min_examples=args.drift_min_labels,
    )


def edit_cost_model(args: argparse.Namespace) -> Any:
    """The edit cost model ``--edit-batch-table`` gives (None without one): the fit of the
    curve of the profile's base model at ``--default-size`` (the reference size without it),
    or of the table's first curve. A bad table raises ValueError naming the file."""
    if not args.edit_batch_table:
        return None
    from argus.profiles import default_profiles, load_profiles
    from argus.profiles.batch_curve import load_batch_table

    table = load_batch_table(args.edit_batch_table)
    profiles = load_profiles(args.profile) if args.profile else default_profiles()
    size = args.default_size or profiles.reference.width
    return table.cost_model(profiles.levels[0].model, size, size)
