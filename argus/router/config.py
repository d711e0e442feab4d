"""The router's configuration, one home for each of its fields.

:class:`RouterServiceConfig` is how a router serves (admission, pricing, the request ledger,
retries, routing): :class:`~argus.router.core.RouterCore` and the decision it runs,
:class:`~argus.router.policy.RouterPolicy`, read it, and the simulator builds one for its
planned policies. :class:`RoutingConfig` is the part that shapes routing between plans. The
router process's settings (:class:`argus.router.app.RouterSettings`: ports, TLS, files) hold
a :class:`RouterServiceConfig` rather than copies of its fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from argus import defaults
from argus.profiles.edit_cost import EditCostModel
from argus.request_limits import ImageLimits
from argus.router.admission import AdmissionRule
from argus.router.edit_balance import BALANCERS
from argus.router.service_times import ServiceTimeConfig
from argus.slo import default_slo_s
from argus.types import ProfileSet

EDIT_BALANCER = "plan"  # edits are routed as generations, on the plan (Eq. 3)
EDIT_BALANCERS = (EDIT_BALANCER, *BALANCERS)
EDIT_BATCH = defaults.EDIT_BATCH  # the workers' --edit-batch default
EDIT_TEMPLATES = 64  # templates believed held per worker (the simulator's CACHE_TEMPLATES)


@dataclass(frozen=True)
class RoutingConfig:
    """How the router routes between plans."""

    prompt_aware: bool = True
    """Route by the classifier's level through the PASM; False: by the load shares F alone."""

    spill_on_refusal: bool = True
    """When the chosen worker cannot finish a request by its deadline, admit it on the nearest
    level (slower first on equal distance, the scheduler's fallback order) whose quickest live
    worker can, before refusing it (:meth:`~argus.router.policy.RouterPolicy.route`). False:
    refuse on the chosen worker's prediction alone."""

    backlog_replan_per_worker: float = 2.0
    """Queued requests per live worker above which an early re-plan is wanted."""

    min_replan_interval_s: float = 10.0
    """Early re-plans are wanted at most this often, seconds."""

    cache_aware: bool = True
    """Mirror the workers' approximate caches (:mod:`argus.router.cache_mirror`) and send an
    AC request to the worker of its level whose cached neighbour serves it soonest, admitted
    at the step that neighbour allows (:mod:`argus.router.cache_routing`); the router then
    loads the workers' prompt encoder. False: Eq. 3 on the routed K, no encoder."""

    cache_probe_interval_s: float = 0.1
    """Outside AC plans (where every prompt with a cached neighbour anywhere is embedded to
    choose its worker), a prompt is embedded to probe the caches for the allocator at most
    this often, seconds (0: every prompt): what AC would find, at a bounded encoder cost."""

    late_binding_window: int = defaults.LATE_BINDING_WINDOW
    """Requests sent to a worker at once, the one it runs included; the router holds the rest
    and sends each to the first worker of its level with room, refusing at once one that can
    no longer finish by its deadline (:mod:`argus.router.late_binding`). 0: every admitted
    request is sent to its worker at once. With an edit balancer a worker is sent at least
    ``edit_batch``, so that its edits can batch."""

    def __post_init__(self) -> None:
        if self.late_binding_window < 0:
            raise ValueError(f"late_binding_window: must be >= 0, got {self.late_binding_window}")
        if not (math.isfinite(self.cache_probe_interval_s) and self.cache_probe_interval_s >= 0):
            raise ValueError(
                f"cache_probe_interval_s: must be >= 0, got {self.cache_probe_interval_s}"
            )
        if not self.backlog_replan_per_worker > 0.0:
            raise ValueError(
                f"backlog_replan_per_worker: must be > 0, got {self.backlog_replan_per_worker}"
            )
        if not self.min_replan_interval_s >= 0.0:
            raise ValueError(
                f"min_replan_interval_s: must be >= 0, got {self.min_replan_interval_s}"
            )


@dataclass(frozen=True)
class RouterServiceConfig:
    """How one router process serves requests."""

    router_id: str = defaults.ROUTER_ID
    """Stable id in the allocator's reports."""

    default_deadline_ms: int = defaults.DEFAULT_DEADLINE_MS
    """Deadline of requests that set none, milliseconds."""

    max_in_flight: int = defaults.MAX_IN_FLIGHT
    """Requests served at once; more are refused as OVERLOADED (bounded memory)."""

    id_window_s: float = 300.0
    """Seconds a finished request id is remembered for retries."""

    max_ids: int = 4096
    """Request ids remembered at most (finished ones are dropped oldest first)."""

    max_id_bytes: int = defaults.MAX_ID_BYTES
    """Bytes of finished answers kept for retries (about their serialized size), oldest
    dropped first; a retry whose answer was dropped is ANSWER_DROPPED naming its id, never run
    twice."""

    down_for_s: float = 5.0
    """Seconds a worker that failed with UNAVAILABLE is routed around."""

    max_attempts: int = 3
    """Workers tried per request."""

    slo_s: float | None = None
    """Latency objective of the SLO-violation count; None: 3 × the best level's latency."""

    limits: ImageLimits = field(default_factory=ImageLimits)
    """Largest image accepted (the workers' limits)."""

    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """How the router routes between plans."""

    admission: AdmissionRule = field(default_factory=AdmissionRule)
    """How sure the predicted completion must be to admit a request (the simulator's rule)."""

    max_cost: float | None = None
    """Largest request accepted, in reference requests of the profile (pixels × steps over the
    reference's; 80 for 2048 × 2048 at 1000 steps against 1024 × 1024 at 50); None: no cap."""

    default_steps: int | None = None
    """The workers' default steps (``argus worker --default-steps``): a request without
    ``steps`` runs that many, so no level may skip as many, and is priced at that many. None:
    not known, not capped, priced at the profile's reference steps."""

    default_size: int | None = None
    """The workers' default image side (``argus worker --default-size``): a request without
    ``width`` or ``height`` is priced at it. None: priced at the profile's reference size."""

    scheduler: str = defaults.SCHEDULER
    """The workers' ``--scheduler``: part of the approximate cache's key, so the router looks a
    prompt up in its mirror of the caches under the key the workers filed it with."""

    service_times: ServiceTimeConfig = field(default_factory=ServiceTimeConfig)
    """How the workers' service times are learned from their replies (admission and worker
    selection read them, not the profile's latencies, once a worker has answered)."""

    edit_balancer: str = EDIT_BALANCER
    """How an inpainting edit is placed and admitted: "plan" routes and prices it as a
    generation of its size (Eq. 3 on the plan, full cost); any balancer of
    :data:`argus.router.edit_balance.BALANCERS` keeps the plan's level and chooses among that
    level's live workers on the router's account of their edits in flight and the templates
    they hold ("mask-aware": InstGenIE's Algorithm 2), admitting on the edit cost model's
    predicted finish (a miss priced as a full run)."""

    edit_batch: int = EDIT_BATCH
    """The workers' batch bound for edits (``argus worker --edit-batch``) the router assumes:
    that many of a worker's edits in flight run together, the rest wait."""

    edit_templates: int = EDIT_TEMPLATES
    """Templates the router believes each worker holds, at most (least recently used out)."""

    edit_cost: EditCostModel | None = None
    """The shape of an edit's step time, ``a + p·b + c·Σm`` (its seconds come from each
    worker's learned service time); None: :func:`~argus.profiles.edit_cost.default_cost_model`,
    the paper-derived SDXL shape."""

    def __post_init__(self) -> None:
        if not self.scheduler:
            raise ValueError("scheduler: must not be empty")
        if self.edit_balancer not in EDIT_BALANCERS:
            known = ", ".join(EDIT_BALANCERS)
            raise ValueError(f"edit_balancer: unknown {self.edit_balancer!r}; known: {known}")
        if self.edit_batch < 1:
            raise ValueError(f"edit_batch: must be >= 1, got {self.edit_batch}")
        if self.edit_templates < 0:
            raise ValueError(f"edit_templates: must be >= 0, got {self.edit_templates}")
        if self.max_cost is not None and not (math.isfinite(self.max_cost) and self.max_cost > 0):
            raise ValueError(f"max_cost: must be a finite number > 0, got {self.max_cost}")
        for name in ("default_deadline_ms", "max_in_flight", "max_ids", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.id_window_s < 0.0 or self.down_for_s < 0.0:
            raise ValueError("id_window_s, down_for_s: must be >= 0")
        if self.default_steps is not None and self.default_steps < 1:
            raise ValueError(f"default_steps: must be >= 1, got {self.default_steps}")
        if self.default_size is not None and self.default_size < 1:
            raise ValueError(f"default_size: must be >= 1, got {self.default_size}")
        if self.max_id_bytes < 0:
            raise ValueError(f"max_id_bytes: must be >= 0, got {self.max_id_bytes}")
        if self.slo_s is not None and not self.slo_s > 0.0:
            raise ValueError(f"slo_s: must be > 0, got {self.slo_s}")

    def slo_for(self, profiles: ProfileSet) -> float:
        """The SLO in seconds: ``slo_s``, or the shared rule (:func:`argus.slo.default_slo_s`)
        on the profile's first worker class, so live and simulated reports agree."""
        if self.slo_s is not None:
            return self.slo_s
        return default_slo_s(profiles, profiles.worker_classes[:1])
