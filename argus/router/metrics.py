"""Prometheus metrics of a router process (``argus_router_*``).

Label sets are bounded: levels and strategies come from the profile, codes and reasons from
fixed sets, workers from the plan (a router's plan holds the cluster's workers; the per-worker
queue gauge is rebuilt from each plan, so workers that left do not linger).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from argus.types import ProfileSet, Strategy

# from a few ms (stub workers) to 2 min (SDXL at K = 0 on a slow GPU)
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    30.0,
    60.0,
    120.0,
)
# router-side time: classification, routing, the hop to the worker
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
QUALITY_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.975, 1.0)

# the step a cache-routed request resumes at (K of the default profile's levels, 50 steps)
STEP_BUCKETS = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0)
SIMILARITY_BUCKETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.975, 1.0)

REJECT_REASONS = ("deadline", "late", "busy", "ids")  # "late": refused while held
TEMPLATE_BELIEFS = ("held", "not_held")  # the edits-placed counter's ``template`` label


class RouterMetrics:
    def __init__(self, profiles: ProfileSet, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else REGISTRY
        self._quality = {level.name: level.quality for level in profiles.levels}
        self.requests = Counter(
            "argus_router_requests",
            "Generate calls answered, by gRPC status code",
            ["code"],
            registry=reg,
        )
        self.latency = Histogram(
            "argus_router_request_seconds",
            "End-to-end latency of served requests at the router, by served level and strategy",
            ["level", "strategy"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.overhead = Histogram(
            "argus_router_overhead_seconds",
            "Router time of served requests not spent in the worker (classify, route, network)",
            buckets=OVERHEAD_BUCKETS,
            registry=reg,
        )
        self.refusal = Histogram(
            "argus_router_refusal_seconds",
            "Time from a call's arrival in the router's core to its refusal (RESOURCE_EXHAUSTED:"
            " admission or busy), the router's own part of a refusal's latency",
            buckets=OVERHEAD_BUCKETS,
            registry=reg,
        )
        self.classify = Histogram(
            "argus_router_classify_seconds",
            "Time to classify one prompt (micro-batch wait included)",
            buckets=OVERHEAD_BUCKETS,
            registry=reg,
        )
        self.slo_violations = Counter(
            "argus_router_slo_violations",
            "Admitted requests served later than the SLO or not served in time",
            registry=reg,
        )
        self.rejected = Counter(
            "argus_router_admissions_rejected",
            "Requests refused at admission with RESOURCE_EXHAUSTED, by reason",
            ["reason"],
            registry=reg,
        )
        self.retries = Counter(
            "argus_router_retries",
            "Requests sent again to another worker after one was unavailable",
            registry=reg,
        )
        self.routed = Counter(
            "argus_router_routed",
            "Served requests by the level the classifier chose and the level that served them",
            ["strategy", "classified", "served"],
            registry=reg,
        )
        self.quality = Histogram(
            "argus_router_served_quality",
            "Relative quality Q (profile) of the level each request was served at",
            buckets=QUALITY_BUCKETS,
            registry=reg,
        )
        self.in_flight = Gauge(
            "argus_router_in_flight", "Requests being served by this router", registry=reg
        )
        self.worker_queue = Gauge(
            "argus_router_worker_queue",
            "Requests this router has outstanding at each worker of the plan",
            ["worker"],
            registry=reg,
        )
        self.plan_version = Gauge(
            "argus_router_plan_version", "Version of the plan the router follows", registry=reg
        )
        self.plan_changes = Counter(
            "argus_router_plans_installed", "Plans the router installed", registry=reg
        )
        self.strategy = Gauge(
            "argus_router_strategy",
            "1 for the strategy of the plan the router follows, 0 for the other",
            ["strategy"],
            registry=reg,
        )
        self.classifier_retrains = Counter(
            "argus_router_classifier_retrains",
            "Classifier models swapped in by drift retraining",
            registry=reg,
        )
        self.ids_evicted = Counter(
            "argus_router_id_answers_evicted",
            "Answers the request-id ledger dropped to stay within its byte budget "
            "(a retry of such an id is FAILED_PRECONDITION)",
            registry=reg,
        )
        self.http_requests = Counter(
            "argus_router_http_requests",
            "HTTP (OpenAI images API) answers, by route and HTTP status",
            ["route", "status"],
            registry=reg,
        )
        self.edits_placed = Counter(
            "argus_router_edits_placed",
            "Inpainting edits placed on a worker by the edit balancer (--edit-balancer), by "
            "balancer and whether the worker was believed to hold the edit's template",
            ["balancer", "template"],
            registry=reg,
        )
        self.spills = Counter(
            "argus_router_spills",
            "Requests admitted at another level than the one routed to, because the chosen "
            "worker could not finish them by their deadline (the spill on refusal), by the "
            "PASM's target level and the level that served",
            ["target", "served"],
            registry=reg,
        )
        self.cache_moved = Counter(
            "argus_router_cache_moved",
            "AC requests the mirrored caches sent to another worker of their model than Eq. 3's "
            "on the routed K (a worker holding a closer neighbour serves them sooner)",
            registry=reg,
        )
        self.cache_step = Histogram(
            "argus_router_cache_routed_step",
            "Cache-routed AC requests by the step their neighbour on the chosen worker allows "
            "(0: a predicted miss, a full generation)",
            buckets=STEP_BUCKETS,
            registry=reg,
        )
        self.cache_similarity = Histogram(
            "argus_router_cache_routed_similarity",
            "Cache-routed AC requests with a neighbour on the chosen worker, by the cosine "
            "similarity of that neighbour as the router's mirror sees it",
            buckets=SIMILARITY_BUCKETS,
            registry=reg,
        )
        self.cache_entries = Gauge(
            "argus_router_cache_entries",
            "Cache entries the router mirrors from its workers' cache events, all workers",
            registry=reg,
        )
        self.cache_skipped = Counter(
            "argus_router_cache_events_skipped",
            "Workers' cache events the router did not apply to its mirror, by reason (width, "
            "not_finite, unknown_evict, error)",
            ["reason"],
            registry=reg,
        )
        self.cache_forgotten = Counter(
            "argus_router_cache_forgotten",
            "Times a worker's mirrored cache entries were dropped, by reason (restart, "
            "truncated, left, error)",
            ["reason"],
            registry=reg,
        )
        self.cache_embed = Histogram(
            "argus_router_cache_embed_seconds",
            "Time to embed a prompt with the workers' encoder and look it up in the mirrored "
            "caches (only prompts that route on them or probe them)",
            buckets=OVERHEAD_BUCKETS,
            registry=reg,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.requests.labels("OK")
        self.slo_violations.inc(0)

    def observe_served(
        self,
        level: str,
        strategy: Strategy,
        classified: str,
        total_s: float,
        worker_s: float,
        late: bool,
    ) -> None:
        self.requests.labels("OK").inc()
        self.latency.labels(level, strategy.value).observe(total_s)
        self.overhead.observe(max(0.0, total_s - worker_s))
        self.routed.labels(strategy.value, classified, level).inc()
        if level in self._quality:
            self.quality.observe(self._quality[level])
        if late:
            self.slo_violations.inc()

    def observe_edit_placed(self, balancer: str, *, held: bool) -> None:
        """One edit placed by ``balancer`` (a name of a fixed set)."""
        belief = TEMPLATE_BELIEFS[0] if held else TEMPLATE_BELIEFS[1]
        self.edits_placed.labels(balancer, belief).inc()

    def observe_cache_routed(self, step: int, similarity: float | None, *, moved: bool) -> None:
        """One AC request routed on the mirrored caches."""
        self.cache_step.observe(step)
        if similarity is not None:
            self.cache_similarity.observe(similarity)
        if moved:
            self.cache_moved.inc()

    def observe_http(self, route: str, status: int) -> None:
        """One HTTP answer; ``route`` is one of the app's paths or "other"."""
        self.http_requests.labels(route, str(status)).inc()

    def observe_plan(self, version: int, strategy: Strategy, workers: Mapping[str, int]) -> None:
        self.plan_version.set(version)
        self.plan_changes.inc()
        for s in Strategy:
            self.strategy.labels(s.value).set(1.0 if s is strategy else 0.0)
        self.worker_queue.clear()
        self.observe_queues(workers)

    def observe_queues(self, queues: Mapping[str, int]) -> None:
        for worker, length in queues.items():
            self.worker_queue.labels(worker).set(length)
