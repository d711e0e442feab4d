"""``argus allocator``: the cluster's allocator as a gRPC service (``argus.v1.Allocator``).

Workers send it heartbeats, routers their arrivals and classifications; it re-plans every
``--period-s`` seconds and at once when a worker joins, leaves or misses 3 heartbeats
(``--heartbeat-s`` apart) or when cache retrieval forces AC → SM, and streams each plan
(worker → level, PASM, strategy) to the routers that watch. ``--classifier`` must name the
routers' classifier directory (the default is theirs): the plans price each class the
routers send with the Q(v | c) of its ``calibration.json``; ``--classifier none`` plans with
level averages. Binds loopback unless ``--host`` says otherwise (it is an internal
endpoint). Prints ``argus allocator listening on HOST:PORT`` once bound; Ctrl-C or SIGTERM
stops it.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from argus import defaults
from argus.cli.internal import add_internal_tls_arguments, internal_tls_dir
from argus.cli.main import CLIError, config_error

if TYPE_CHECKING:
    from argus.allocator.strategy import StrategyConfig


class AllocatorCommand:
    name = "allocator"
    help = "Run the allocator service (gRPC): plans for the cluster's workers and routers."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default=defaults.LOOPBACK, help="address to bind")
        parser.add_argument("--port", type=int, default=0, help="port (0: any free port)")
        parser.add_argument("--profile", help="profile file (default: the embedded one)")
        parser.add_argument(
            "--classifier",
            help="the routers' classifier directory, whose Q(v | c) prices their classes "
            "(default: classifiers/minilm-l2-logistic-int8); none: plan with level averages",
        )
        parser.add_argument(
            "--period-s",
            type=float,
            default=defaults.PLANNING_PERIOD_S,
            help="re-plan at least this often (default: %(default)s)",
        )
        parser.add_argument(
            "--heartbeat-s",
            type=float,
            default=defaults.HEARTBEAT_S,
            help="workers' heartbeat interval; 3 missed heartbeats mean dead "
            "(default: %(default)s)",
        )
        parser.add_argument(
            "--max-workers", type=int, default=defaults.MAX_WORKERS, help="workers tracked"
        )
        parser.add_argument(
            "--max-watchers",
            type=int,
            default=defaults.MAX_WATCHERS,
            help="open WatchPlan streams at most",
        )
        parser.add_argument(
            "--retrieval-threshold-s",
            type=float,
            default=defaults.RETRIEVAL_THRESHOLD_S,
            help="cache retrieval p99 above this switches AC → SM (default: %(default)s)",
        )
        parser.add_argument(
            "--retrieval-window-s",
            type=float,
            default=defaults.RETRIEVAL_WINDOW_S,
            help="window of that p99, and of the healthy probes that switch back "
            "(default: %(default)s)",
        )
        parser.add_argument(
            "--planner",
            default=defaults.PLANNERS[0],
            choices=defaults.PLANNERS,
            help="joint: one program over (class × level); paper: Eq. 1 with level averages, "
            "then ODA (default: %(default)s)",
        )
        parser.add_argument(
            "--strategy-choice",
            default=defaults.STRATEGY_CHOICES[0],
            choices=defaults.STRATEGY_CHOICES,
            help="best: plan AC and SM each period and keep the better; ac-first: AC while "
            "retrieval is healthy, the paper's prototype (§4.6) (default: %(default)s)",
        )
        parser.add_argument(
            "--slo-s",
            type=float,
            default=None,
            help="the SLO the queueing caps plan against, seconds (default: 3 × the best "
            "level's latency on the profile's first GPU class, the routers' rule)",
        )
        parser.add_argument(
            "--cache-plan",
            action=argparse.BooleanOptionalAction,
            default=True,  # AllocatorSettings.cache_plan (tests/test_defaults.py checks)
            help="price the AC levels by what the routers' probes of the workers' caches find; "
            "--no-cache-plan plans every AC request as a hit at its level's K (default: "
            "%(default)s)",
        )
        parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here")
        add_internal_tls_arguments(parser, "allocator")

    def run(self, args: argparse.Namespace) -> int:
        from argus.allocator.app import AllocatorSettings, serve
        from argus.allocator.config import ControlConfig, StrategyChoice
        from argus.allocator.planner import PlannerMode
        from argus.profiles import ProfileError

        tls_dir = internal_tls_dir(args, "allocator")
        try:  # the configs check every value, before anything binds
            control = ControlConfig(
                period_s=args.period_s,
                heartbeat_s=args.heartbeat_s,
                max_workers=args.max_workers,
                retrieval=retrieval_config(args),
                planner=PlannerMode(args.planner),
                strategy_choice=StrategyChoice(args.strategy_choice),
                slo_s=args.slo_s,
            )
            settings = AllocatorSettings(
                host=args.host,
                port=args.port,
                profile=args.profile,
                control=control,
                max_watchers=args.max_watchers,
                metrics_port=args.metrics_port,
                classifier=args.classifier,
                internal_tls_dir=tls_dir,
                cache_plan=args.cache_plan,
            )
        except ValueError as err:
            raise config_error(err, args) from None
        try:
            return serve(settings)  # a bad classifier fails before binding too
        except (ValueError, ProfileError, OSError) as err:
            raise CLIError(str(err)) from None


def retrieval_config(args: argparse.Namespace) -> StrategyConfig:
    """The AC↔SM switch's config from ``--retrieval-*``; its ValueError names the flag's
    field (``threshold_s`` is ``retrieval_threshold_s`` here)."""
    from argus.allocator.strategy import StrategyConfig

    try:
        return StrategyConfig(
            threshold_s=args.retrieval_threshold_s, window_s=args.retrieval_window_s
        )
    except ValueError as err:
        raise ValueError(f"retrieval_{err}") from None
