"""Prometheus metrics of a worker process: the one module here that touches prometheus_client
for the request path (the cache exports its retrieval histograms itself).

Names carry the ``argus_worker_`` prefix and base units; label sets are fixed and bounded
(levels come from the profile, outcomes and states from enums).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from argus.contracts.generate import GenerateResult
from argus.worker.editing.activation_cache import EditCacheEvents
from argus.worker.editing.activation_store import StoreListener, Tier
from argus.worker.editing.lane import LaneEvents

# latency buckets from 50 ms (tiny models on a CPU) to 2 min (SDXL at K = 0 on a slow GPU)
LATENCY_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    3.0,
    4.0,
    5.0,
    7.5,
    10.0,
    15.0,
    30.0,
    60.0,
    120.0,
)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else REGISTRY
        self.latency = Histogram(
            "argus_worker_request_seconds",
            "Generate latency inside the worker (queue wait included), by level and strategy",
            ["level", "strategy", "cache"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_wait = Histogram(
            "argus_worker_queue_seconds",
            "Time a request waited for the GPU",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.errors = Counter(
            "argus_worker_errors",
            "Generate calls that failed, by gRPC status code",
            ["code"],
            registry=reg,
        )
        self.substituted = Counter(
            "argus_worker_substituted",
            "Requests served by the active model because their level's model was not loaded",
            registry=reg,
        )
        self.stopped = Counter(
            "argus_worker_stopped",
            "Requests stopped before they finished, by reason (cancelled: the client went away; "
            "expired: the deadline passed) and stage (queued: never got the GPU; running: "
            "stopped after it got the GPU, at a step, block or tile boundary or before decoding)",
            ["reason", "stage"],
            registry=reg,
        )
        self.decodes_skipped = Counter(
            "argus_worker_decodes_skipped",
            "Requests stopped because their predicted decode could not finish before their "
            "deadline (also counted in argus_worker_stopped as expired)",
            registry=reg,
        )
        self.queue_length = Gauge(
            "argus_worker_queue_length",
            "Requests waiting or running",
            registry=reg,
        )
        self.model_loads = Counter(
            "argus_worker_model_loads",
            "Models loaded, by model name",
            ["model"],
            registry=reg,
        )
        self.model_load_seconds = Histogram(
            "argus_worker_model_load_seconds",
            "Time to load a model",
            ["model"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
            registry=reg,
        )
        # a model's load loads only its parts that are not resident
        # (argus/worker/models/components.py)
        self.part_load_seconds = Histogram(
            "argus_worker_part_load_seconds",
            "Time to load one part of a model (text encoder, tokenizer, UNet, VAE), by part; a "
            "part shared with a resident model is not loaded again",
            ["part"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
            registry=reg,
        )
        # argus/worker/models/cuda_graphs.py: paid once per model, piece of work and shape
        self.graph_captures = Counter(
            "argus_worker_cuda_graph_captures",
            "CUDA graphs captured, by model and piece of work (unet, controlnet-step, "
            "controlnet-encode, controlnet-decode, edit-replay)",
            ["model", "work"],
            registry=reg,
        )
        self.graph_failures = Counter(
            "argus_worker_cuda_graph_failures",
            "CUDA graph captures that failed, by model and piece of work; that work then runs "
            "eagerly (an edit replay: that edit)",
            ["model", "work"],
            registry=reg,
        )
        self.graph_capture_seconds = Histogram(
            "argus_worker_cuda_graph_capture_seconds",
            "Time to capture one CUDA graph (its warm-up calls and the recording)",
            ["model"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=reg,
        )
        # argus/worker/models/compiled.py: torch.compile and its warm-up run, once per load
        self.compile_seconds = Gauge(
            "argus_worker_compile_seconds",
            "Time the last load of a model spent compiling its UNet (torch.compile and one "
            "warm-up run at the serving size; --compile), by model",
            ["model"],
            registry=reg,
        )

        self.edit_cache = EditCacheMetrics(reg)
        self.lane = LaneMetrics(reg)

    def watch_queue(self, length: Callable[[], float]) -> None:
        self.queue_length.set_function(length)

    def observe(self, result: GenerateResult) -> None:
        strategy = "" if result.strategy is None else result.strategy.value
        cache = "" if result.cache is None else result.cache.value
        self.latency.labels(result.level, strategy, cache).observe(result.timing.total_ms / 1e3)
        self.queue_wait.observe(result.timing.queue_ms / 1e3)
        if result.substituted:
            self.substituted.inc()

    def observe_error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def observe_stopped(self, reason: str, stage: str) -> None:
        self.stopped.labels(reason, stage).inc()

    def observe_decode_skipped(self) -> None:
        self.decodes_skipped.inc()

    def observe_load(self, model: str, seconds: float, parts: Mapping[str, float]) -> None:
        """A model's load: its time in all, and each part it loaded (part → seconds)."""
        self.model_loads.labels(model).inc()
        self.model_load_seconds.labels(model).observe(seconds)
        for part, part_s in parts.items():
            self.part_load_seconds.labels(part).observe(part_s)

    def observe_capture(self, model: str, work: str, seconds: float) -> None:
        """A CUDA graph captured for ``work`` on ``model`` in ``seconds``."""
        self.graph_captures.labels(model, work).inc()
        self.graph_capture_seconds.labels(model).observe(seconds)

    def observe_capture_failure(self, model: str, work: str) -> None:
        """A CUDA graph of ``work`` on ``model`` that could not be captured."""
        self.graph_failures.labels(model, work).inc()

    def observe_compile(self, model: str, seconds: float) -> None:
        """``model``'s UNet compiled and warmed up in ``seconds`` at its load."""
        self.compile_seconds.labels(model).set(seconds)


class LaneMetrics(LaneEvents):
    """The edit lane's batched steps (argus/worker/editing/lane.py): how many requests each ran."""

    def __init__(self, reg: CollectorRegistry) -> None:
        self.batch = Histogram(
            "argus_worker_edit_batch_size",
            "Edits run together in one batched denoising step (--edit-batch)",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16),
            registry=reg,
        )

    def on_batch_step(self, rows: int) -> None:
        self.batch.observe(rows)


class EditCacheMetrics(StoreListener, EditCacheEvents):
    """The mask-aware activation cache's metrics (argus/worker/editing/activation_cache.py): the
    store's
    events (it calls these under its lock; each only touches a metric) and the cache's."""

    def __init__(self, reg: CollectorRegistry) -> None:
        self.requests = Counter(
            "argus_worker_edit_cache_requests",
            "Inpainting edits that could use the activation cache, by outcome (hit: replayed "
            "their template's record; miss: none, the run recorded one; evicted: a record was "
            "there when the edit was queued and gone when it ran, so it ran in full)",
            ["outcome"],
            registry=reg,
        )
        self.lookups = Counter(
            "argus_worker_edit_cache_lookups",
            "Record lookups by the tier that answered (device, host, disk) or miss",
            ["tier"],
            registry=reg,
        )
        self.evictions = Counter(
            "argus_worker_edit_cache_evictions",
            "Records pushed out of a tier by its byte bound (device: freed, the host or disk "
            "tier still holds them; host: demoted to disk or dropped; disk: deleted)",
            ["tier"],
            registry=reg,
        )
        self.bytes = Gauge(
            "argus_worker_edit_cache_bytes",
            "Bytes of records held, by tier (device, host, disk)",
            ["tier"],
            registry=reg,
        )
        self.load_seconds = Histogram(
            "argus_worker_edit_cache_load_seconds",
            "Time to read one template's record from a tier into host memory",
            ["tier"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
            registry=reg,
        )
        self.record_bytes = Histogram(
            "argus_worker_edit_cache_record_bytes",
            "Bytes of one template's recorded activations",
            buckets=tuple(2.0**k for k in range(16, 36, 2)),  # 64 KiB to 16 GiB
            registry=reg,
        )
        self.dropped = Counter(
            "argus_worker_edit_cache_dropped",
            "Records kept in no tier (larger than both bounds, or a failed disk write)",
            registry=reg,
        )

    def on_outcome(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def on_record(self, nbytes: int) -> None:
        self.record_bytes.observe(nbytes)

    def on_hit(self, tier: Tier, nbytes: int) -> None:
        self.lookups.labels(tier).inc()

    def on_miss(self) -> None:
        self.lookups.labels("miss").inc()

    def on_evict(self, tier: Tier, nbytes: int) -> None:
        self.evictions.labels(tier).inc()

    def on_load(self, tier: Tier, seconds: float, nbytes: int) -> None:
        self.load_seconds.labels(tier).observe(seconds)

    def on_bytes(self, tier: Tier, nbytes: int) -> None:
        self.bytes.labels(tier).set(nbytes)

    def on_drop(self, nbytes: int) -> None:
        self.dropped.inc()
