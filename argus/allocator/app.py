"""Assemble the allocator process from its settings: profile, classifier, control, gRPC
server, loop.

:class:`AllocatorSettings` is the allocator process's one settings type: what the process
binds, loads and exports, and the :class:`~argus.allocator.config.ControlConfig` it plans
with (each planning setting is that config's field, not a copy here). Every ``argus
allocator`` flag (and every Helm value) maps to one field of either.

The joint planner prices each class the routers send with Q(v | c), so the allocator reads
the routers' classifier too (``calibration.json`` only: no model, no torch), at start-up: a
strategy whose artifact has a calibration is planned with its Q, one without it (an artifact
from before calibration, which the router classifies by arg-max level) with the level
averages and a warning. A calibration the router would refuse, or one without Q, stops the
allocator before it binds. Its :func:`~argus.classifier.serving.classifier_key` is logged,
exported (``argus_allocator_classifier``) and compared with the one each router reports.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from argus import defaults
from argus.allocator.config import ControlConfig
from argus.allocator.control import ControlLoop
from argus.plumbing.grpc_server import check_port, wait_for_shutdown
from argus.profiles import default_profiles, load_profiles
from argus.types import ProfileSet

if TYPE_CHECKING:
    from argus.classifier.serving import PlanningClasses

log = logging.getLogger(__name__)

NO_CLASSIFIER = "none"  # --classifier none: plan every strategy with the level averages


@dataclass(frozen=True)
class AllocatorSettings:
    host: str = defaults.LOOPBACK  # internal endpoint: loopback unless told otherwise
    port: int = 0  # 0: any free port, printed at start
    profile: str | None = None  # a profile file; None: the embedded default
    control: ControlConfig = field(default_factory=ControlConfig)  # how it plans (it checks
    # its own fields): period, heartbeats, workers tracked, retrieval switching, ...
    max_watchers: int = defaults.MAX_WATCHERS  # open WatchPlan streams
    metrics_port: int | None = None  # Prometheus /metrics on host:port; None: off
    classifier: str | None = None  # the routers' classifier directory, whose Q(v | c) prices
    # their classes; None: the committed default (as the router's); "none": level averages
    internal_tls_dir: str | None = None  # ca.crt, allocator.crt/.key; None: plaintext
    cache_plan: bool = True  # price AC levels by what the routers' probes of the caches
    # find (argus.allocator.cache_plan); False: every AC request a hit at its level's K

    def __post_init__(self) -> None:
        check_port(self.port, "port")
        check_port(self.metrics_port, "metrics_port")
        if self.max_watchers < 1:
            raise ValueError(f"max_watchers: must be >= 1, got {self.max_watchers}")

    def planning_classes(self, profiles: ProfileSet) -> PlanningClasses | None:
        """What :attr:`classifier` gives the planner, checked against ``profiles``; None for
        ``"none"``. ValueError (``ArtifactError``) names the file and field at fault."""
        if self.classifier == NO_CLASSIFIER:
            return None
        from argus.classifier.serving import read_planning_classes

        classes = read_planning_classes(self.classifier)
        for strategy, quality in classes.class_quality.items():
            names = tuple(level.name for level in profiles.levels_for(strategy))
            if names and quality.levels != names:
                raise ValueError(
                    f"{classes.directory}: the {strategy} classifier's levels "
                    f"{', '.join(quality.levels)} differ from the profile's {', '.join(names)}"
                )
        return classes


def log_classes(classes: PlanningClasses | None) -> None:
    """Say at start-up what the routers' classes are priced with, strategy by strategy."""
    if classes is None:
        log.info("--classifier none: every strategy planned with level averages")
        return
    where = f"classifier {classes.key} ({classes.directory})"
    if classes.class_quality:
        strategies = ", ".join(s.value for s in classes.class_quality)
        log.info("%s: %s planned with the Q(v | c) of its calibrated classes", where, strategies)
    for strategy in classes.by_level:
        log.warning(
            "%s: the %s artifact has no calibration.json: routers classify its prompts by "
            "arg-max level, which are planned with level averages",
            where,
            strategy.value,
        )


def tick_interval_s(heartbeat_s: float) -> float:
    """How often the loop looks for dead workers and due plans: four times per heartbeat
    interval, so a dead worker is dropped within 3¼ intervals of its last heartbeat."""
    return min(1.0, max(0.01, heartbeat_s / 4))


def serve(settings: AllocatorSettings, *, ready: threading.Event | None = None) -> int:
    """Run the allocator until SIGINT or SIGTERM; prints ``listening on HOST:PORT`` once bound."""
    from argus.allocator.metrics import AllocatorMetrics
    from argus.allocator.service import create_server
    from argus.plumbing.grpc_server import start_metrics
    from argus.plumbing.internal_tls import InternalTLS

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    profiles = load_profiles(settings.profile) if settings.profile else default_profiles()
    config = settings.control
    tls = None
    if settings.internal_tls_dir is not None:
        tls = InternalTLS.load(settings.internal_tls_dir, "allocator")
    classes = settings.planning_classes(profiles)
    log_classes(classes)
    metrics = AllocatorMetrics(profiles)
    cache = None
    if settings.cache_plan:
        from argus.allocator.cache_plan import CachePlanner
        from argus.profiles import load_cache_rules

        cache = CachePlanner(load_cache_rules(settings.profile or "default"))
    server, port, servicer = create_server(
        profiles,
        f"{settings.host}:{settings.port}",
        config=config,
        max_watchers=settings.max_watchers,
        metrics=metrics,
        class_quality=None if classes is None else classes.class_quality,
        classifier_key="" if classes is None else classes.key,
        tls=tls,
        cache=cache,
    )
    if settings.metrics_port is not None:
        start_metrics(settings.host, settings.metrics_port)
    loop = ControlLoop(servicer.control, tick_interval_s(config.heartbeat_s))
    server.start()
    loop.start()
    print(f"argus allocator listening on {settings.host}:{port}", flush=True)
    try:
        wait_for_shutdown(ready)
    finally:
        loop.stop()
        servicer.close()  # NOT_SERVING, and every watch stream ends
        server.stop(grace=2).wait()
    return 0
