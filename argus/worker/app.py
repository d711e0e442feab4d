"""Assemble a worker process from its settings: models, cache, encoder, engine, gRPC server.

:class:`WorkerSettings` is the one config type of a worker; every ``argus worker`` flag (and,
later, every Helm value) maps to one field.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from argus import defaults
from argus.plumbing.grpc_server import check_address, check_port, wait_for_shutdown
from argus.plumbing.internal_tls import InternalTLS
from argus.profiles import default_profiles, load_cache_rules, load_profiles
from argus.profiles.batch_curve import BatchTable, BatchTableError, load_batch_table
from argus.profiles.cache_evidence import DEFAULT_RULE, KRule
from argus.types import ProfileSet, Strategy
from argus.worker.adapters.workflow import AdapterSettings, WorkerAdapters
from argus.worker.editing.activation_cache import EditCache
from argus.worker.engine import Worker, WorkerConfig
from argus.worker.membership import (
    HeartbeatChannel,
    Membership,
    MembershipConfig,
    default_advertise,
)
from argus.worker.metrics import WorkerMetrics
from argus.worker.models.compiled import check_compile_mode
from argus.worker.models.registry import ModelRegistry
from argus.worker.models.sources import TINY_PREFIX, TINY_VARIANTS
from argus.worker.scoring import ScoreSampler, load_scorer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    model: str = "tiny"  # "tiny", or a diffusers directory for the AC base model
    variants: tuple[tuple[str, str], ...] = ()  # extra (model name, directory) pairs for SM
    host: str = defaults.LOOPBACK
    port: int = 0  # 0: any free port, printed at start
    worker_id: str = defaults.WORKER_ID
    profile: str | None = None  # a profile file; None: the embedded default
    level: str | None = None  # the level served at start; None: the first AC level
    device: str = "auto"
    dtype: str = "auto"
    scheduler: str = defaults.SCHEDULER
    memory_budget_gib: float | None = None
    # ready models kept resident at most (their shared parts once); 1: one model at a time
    max_resident: int = defaults.MAX_RESIDENT_MODELS
    cuda_graphs: int | None = defaults.CUDA_GRAPHS  # graphs kept; 0: eager; None: 8 on CUDA
    # torch.compile of the UNet (argus/worker/models/compiled.py): its mode; None: eager
    compile_mode: str | None = None
    compile_backend: str = defaults.COMPILE_BACKEND  # eager and aot_eager: for tests
    edit_batch: int = defaults.EDIT_BATCH  # edits batched at step boundaries; 1: one at a time
    decode_thread: bool = defaults.DECODE_THREAD  # batched edits decode off the device thread
    # measured latency-per-batch curves (benchmarks/bench_edit_cost.py --write-table): each
    # model's and size's bound is its knee, at most edit_batch; None: edit_batch for all
    edit_batch_table: str | None = None
    # the table read from edit_batch_table when the settings are checked (None: no table)
    edit_batch_curves: BatchTable | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # approximate cache
    cache: bool = True
    cache_dir: str | None = None  # latent store and Qdrant Edge shard; None: a temp dir
    qdrant_url: str | None = None  # a Qdrant server; None: Qdrant Edge in process
    qdrant_collection: str = "argus-prompts"
    index_outage_file: str | None = None  # fault injection: index unreachable while it exists
    cache_max_entries: int | None = defaults.CACHE_MAX_ENTRIES
    cache_max_bytes: int | None = None
    # raises every floor of the profile's similarity → K rule to at least this; 0: the rule
    min_similarity: float = 0.0
    encoder_dir: str | None = None  # BERT directory for prompt embeddings; None: MiniLM
    # the mask-aware activation cache of edits: host bytes (0: off), then a disk tier; each
    # bound a count of bytes or "auto" (argus.defaults says what auto means for each)
    edit_cache_bytes: int | str = defaults.EDIT_CACHE_HOST_BYTES
    edit_cache_dir: str | None = None  # None: host memory only
    edit_cache_disk_bytes: int | str = defaults.EDIT_CACHE_DISK_BYTES
    # records kept on the model's device in front of the host tier (0: none)
    edit_cache_device_bytes: int | str = defaults.EDIT_CACHE_DEVICE_BYTES
    # request path
    default_size: int = defaults.DEFAULT_SIZE
    default_steps: int = defaults.DEFAULT_STEPS
    max_queue: int = defaults.MAX_QUEUE
    threads: int = 16
    metrics_port: int | None = None  # Prometheus /metrics on host:port; None: off
    # drift monitoring (argus.worker.scoring): share of images scored for the router, 0: off
    score_sample: float = defaults.SCORE_SAMPLE
    scorer_dir: str | None = None  # PickScore (any CLIP) directory; None: a tiny random CLIP
    # Katz adapters: LoRA library, ControlNet service, latent parallelism (all off by default)
    adapters: AdapterSettings = field(default_factory=AdapterSettings)
    # cluster membership (argus.worker.membership): off without an allocator
    allocator: str | None = None  # the allocator's HOST:PORT; None: a standalone worker
    advertise: str | None = None  # HOST:PORT reported in heartbeats; None: the bound host:port
    worker_class: str | None = None  # GPU type, a worker class of the profile; None: the first
    # internal plane: ca.crt, worker.crt/.key for the allocator, routers and ControlNet service
    internal_tls_dir: str | None = None  # None: plaintext (--insecure-internal)

    def __post_init__(self) -> None:
        check_port(self.port, "port")
        check_port(self.metrics_port, "metrics_port")
        for name in ("allocator", "advertise"):
            value = getattr(self, name)
            if value is not None:
                check_address(value, name)
        if self.max_resident < 1:
            raise ValueError(f"max_resident: must be >= 1, got {self.max_resident}")
        if self.cuda_graphs is not None and self.cuda_graphs < 0:
            raise ValueError(f"cuda_graphs: must be >= 0, got {self.cuda_graphs}")
        if self.compile_mode is not None:
            check_compile_mode(self.compile_mode, "compile_mode")
        if not self.compile_backend:
            raise ValueError("compile_backend: must name a torch.compile backend, got ''")
        if self.edit_batch < 1:
            raise ValueError(f"edit_batch: must be >= 1, got {self.edit_batch}")
        if self.edit_batch_table is not None:  # read now: a bad table stops the start at once
            try:
                curves = load_batch_table(self.edit_batch_table)
            except BatchTableError as err:
                raise ValueError(f"edit_batch_table: {err}") from None
            object.__setattr__(self, "edit_batch_curves", curves)  # frozen: set once, here
        for name in ("edit_cache_bytes", "edit_cache_disk_bytes", "edit_cache_device_bytes"):
            check_byte_bound(name, getattr(self, name))
        if self.edit_cache_dir is not None and self.edit_cache_disk_bytes == 0:
            raise ValueError(
                f"edit_cache_disk_bytes: must be > 0 with a directory, got "
                f"{self.edit_cache_disk_bytes}"
            )
        if not -1.0 <= self.min_similarity <= 1.0:
            raise ValueError(f"min_similarity: must be in [-1, 1], got {self.min_similarity}")
        if not 0.0 <= self.score_sample <= 1.0:
            raise ValueError(f"score_sample: must be in [0, 1], got {self.score_sample}")


def model_sources(settings: WorkerSettings, profiles: ProfileSet) -> dict[str, str]:
    """Model name → source: every profile model as a tiny variant, or the given directories."""
    names = sorted({lv.model for lv in profiles.levels})
    if settings.model == "tiny":
        missing = [n for n in names if n not in TINY_VARIANTS]
        if missing:
            raise ValueError(f"model tiny: no tiny variant for {', '.join(missing)}")
        return {n: TINY_PREFIX + n for n in names}
    base = base_model_name(profiles)
    sources = {base: str(Path(settings.model))}
    for name, directory in settings.variants:
        if name not in names:
            raise ValueError(f"variant {name}: not a model of the profile ({', '.join(names)})")
        sources[name] = str(Path(directory))
    return sources


def base_model_name(profiles: ProfileSet) -> str:
    ac = sorted({lv.model for lv in profiles.levels if lv.strategy is Strategy.AC})
    if len(ac) == 1:
        return ac[0]
    return profiles.levels[0].model


def cache_rules(settings: WorkerSettings) -> tuple[dict[str, KRule], KRule]:
    """The similarity → K rule of each model (the profile's ``[models.X.cache]``) and the
    rule of the others (:data:`~argus.profiles.cache_evidence.DEFAULT_RULE`), every floor
    raised to at least ``min_similarity``."""
    rules = load_cache_rules(settings.profile or "default")
    floor = settings.min_similarity
    return {m: raised(r, floor) for m, r in rules.items()}, raised(DEFAULT_RULE, floor)


def raised(rule: KRule, floor: float) -> KRule:
    """``rule`` with every similarity floor at least ``floor`` (itself when none is below)."""
    if all(s >= floor for _, s in rule.floors):
        return rule
    floors = tuple((k, max(s, floor)) for k, s in rule.floors)
    return KRule(floors, source=f"{rule.source}; floors raised to >= {floor:g}")


def build_cache(settings: WorkerSettings, dim: int) -> Any:
    from argus.worker.approx_cache.cache import (
        ApproximateCache,
        EdgeVectorIndex,
        LatentStore,
        QdrantServerIndex,
    )

    root = Path(settings.cache_dir) if settings.cache_dir else _temp_dir()
    root.mkdir(parents=True, exist_ok=True)
    index: Any
    if settings.qdrant_url:
        index = QdrantServerIndex(settings.qdrant_url, settings.qdrant_collection, dim)
    else:
        index = EdgeVectorIndex(root / "qdrant-edge", dim)
    if settings.index_outage_file is not None:
        from argus.worker.approx_cache.vector_index import OutageSwitch

        index = OutageSwitch(index, settings.index_outage_file)
    store = LatentStore(root / "latents")
    rules, default_rule = cache_rules(settings)
    return ApproximateCache(
        index,
        store,
        max_entries=settings.cache_max_entries,
        max_bytes=settings.cache_max_bytes,
        rules=rules,
        default_rule=default_rule,
    )


def _temp_dir() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="argus-cache-"))


def load_settings_profiles(settings: WorkerSettings) -> ProfileSet:
    return load_profiles(settings.profile) if settings.profile else default_profiles()


def worker_class_of(settings: WorkerSettings, profiles: ProfileSet) -> str:
    """The worker class reported in heartbeats: the given one, checked, or the profile's first."""
    if settings.worker_class is None:
        return profiles.worker_classes[0]
    if settings.worker_class not in profiles.worker_classes:
        classes = ", ".join(profiles.worker_classes)
        raise ValueError(
            f"worker_class: {settings.worker_class!r} is not a worker class of the profile "
            f"({classes})"
        )
    return settings.worker_class


def load_internal_tls(settings: WorkerSettings) -> InternalTLS | None:
    """The worker's certificate (None: plaintext); TLSSetupError names a missing file."""
    if settings.internal_tls_dir is None:
        return None
    return InternalTLS.load(settings.internal_tls_dir, "worker")


def start_membership(
    settings: WorkerSettings,
    worker: Worker,
    port: int,
    profiles: ProfileSet,
    tls: InternalTLS | None = None,
) -> Membership | None:
    """Join the allocator in the background (None without one); the worker serves either way."""
    if settings.allocator is None:
        return None
    config = MembershipConfig()
    membership = Membership(
        worker,
        HeartbeatChannel(
            settings.allocator,
            timeout_s=config.rpc_timeout_s,
            max_reconnect_s=config.max_backoff_s,
            tls=tls,
        ),
        advertise=settings.advertise or default_advertise(settings.host, port),
        worker_class=worker_class_of(settings, profiles),
        config=config,
    )
    membership.start()
    return membership


def build_worker(
    settings: WorkerSettings,
    *,
    wait_for_model: bool = True,
    metrics: WorkerMetrics | None = None,
    tls: InternalTLS | None = None,
) -> Worker:
    profiles = load_settings_profiles(settings)
    sources = model_sources(settings, profiles)
    budget = (
        int(settings.memory_budget_gib * 2**30) if settings.memory_budget_gib is not None else None
    )
    registry = ModelRegistry(
        sources,
        device=settings.device,
        dtype=settings.dtype,
        scheduler=settings.scheduler,
        memory_budget_bytes=budget,
        max_resident=settings.max_resident,
        cuda_graphs=settings.cuda_graphs,
        on_load=metrics.observe_load if metrics is not None else None,
        on_capture=metrics.observe_capture if metrics is not None else None,
        on_capture_failure=metrics.observe_capture_failure if metrics is not None else None,
        compile_mode=settings.compile_mode,
        compile_backend=settings.compile_backend,
        serving_size=settings.default_size,
        on_compile=metrics.observe_compile if metrics is not None else None,
    )
    cache = encoder = None
    if settings.cache:
        from argus.embedding import PromptEmbedder

        encoder = PromptEmbedder(settings.encoder_dir, device=registry.device)
        cache = build_cache(settings, encoder.dim)
    config = WorkerConfig(
        worker_id=settings.worker_id,
        default_width=settings.default_size,
        default_height=settings.default_size,
        default_steps=settings.default_steps,
        max_queue=settings.max_queue,
        edit_batch=settings.edit_batch,
        decode_thread=settings.decode_thread,
        edit_batch_table=settings.edit_batch_curves,
    )
    edit_cache = build_edit_cache(settings, metrics)
    adapters = None
    if settings.adapters.enabled:
        adapters = WorkerAdapters(
            settings.adapters, device=registry.device, dtype=registry.dtype, tls=tls
        )
        adapters.start()
    worker = Worker(
        profiles,
        registry,
        cache=cache,
        encoder=encoder,
        config=config,
        level=settings.level,
        adapters=adapters,
        edit_cache=edit_cache,
        lane_events=metrics.lane if metrics is not None else None,
    )
    worker.configure(wait=wait_for_model)
    active = registry.active()
    if adapters is not None and active is not None:
        adapters.model_loaded(active)
    return worker


def check_byte_bound(name: str, value: object) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a count of bytes >= 0 or "auto"."""
    if value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: must be a count of bytes >= 0 or 'auto', got {value!r}")


def build_edit_cache(settings: WorkerSettings, metrics: WorkerMetrics | None) -> EditCache | None:
    """The activation cache of edits (None with ``edit_cache_bytes`` 0 and no directory). The
    host and disk tiers' "auto" bounds are sized now; the device tier's when the first edit
    meets it, on the model's device, once the model has loaded."""
    if settings.edit_cache_bytes == 0 and settings.edit_cache_dir is None:
        return None
    from argus.worker.editing.activation_store import (
        ActivationStore,
        DeviceTier,
        auto_disk_bytes,
        auto_host_bytes,
        resolve_bytes,
    )

    listener = metrics.edit_cache if metrics is not None else None
    directory = settings.edit_cache_dir
    host_bytes = resolve_bytes(settings.edit_cache_bytes, auto_host_bytes)
    disk_bytes = 0
    if directory is not None:
        disk_bytes = resolve_bytes(
            settings.edit_cache_disk_bytes, lambda: auto_disk_bytes(directory)
        )
    log.info("edit cache: host tier %d bytes, disk tier %d bytes", host_bytes, disk_bytes)
    store = ActivationStore(host_bytes, directory, disk_bytes, listener=listener)
    device_bytes = settings.edit_cache_device_bytes
    device = DeviceTier(None if device_bytes == "auto" else int(device_bytes), listener=listener)
    return EditCache(store, listener, device)


def build_score_sampler(settings: WorkerSettings, device: str) -> ScoreSampler | None:
    """The sampler of ``--score-sample`` (its scorer loads on its own thread), or None: off, or
    real models without ``--scorer`` (a random CLIP's scores of real images would make the
    router retrain its classifier on noise; logged)."""
    if settings.score_sample <= 0.0:
        return None
    if settings.scorer_dir is None and settings.model != "tiny":
        log.warning(
            "worker %s: --score-sample needs --scorer with real models; not scoring",
            settings.worker_id,
        )
        return None
    return ScoreSampler(lambda: load_scorer(settings.scorer_dir, device), settings.score_sample)


def start_warm_up(
    worker: Worker, loading: Future[Any], on_ready: Callable[[], None]
) -> threading.Thread:
    """Wait for the first model, run :meth:`Worker.warm_up`, then call ``on_ready``.

    Runs in a daemon thread so that a signal during a long warm-up does not hold the process;
    a failed load or warm-up is logged and the worker stays not ready (NOT_SERVING, not joined).
    """

    def run() -> None:
        try:
            loading.result()
            seconds = worker.warm_up()
        except Exception:
            log.exception("worker %s: load or warm-up failed; not ready", worker.config.worker_id)
            return
        log.info("worker %s: warm-up run took %.1f s", worker.config.worker_id, seconds)
        on_ready()

    thread = threading.Thread(target=run, name="warm-up", daemon=True)
    thread.start()
    return thread


def _on_ready(worker_id: str, servicer: Any, began: float) -> None:
    servicer.update_health()
    elapsed = time.monotonic() - began
    print(f"argus worker {worker_id} ready ({elapsed:.1f} s after start)", flush=True)


def serve(settings: WorkerSettings, *, ready: threading.Event | None = None) -> int:
    """Run a worker until SIGINT or SIGTERM; prints ``listening on HOST:PORT`` once bound.

    Prints ``ready`` once its first model is loaded and has run once (the warm-up); health says
    SERVING from then on. With ``settings.allocator`` the worker joins the cluster then, and
    follows the plan; on a signal it leaves the allocator first, then stops the server.
    """
    from argus.plumbing.grpc_server import start_metrics
    from argus.worker.service import create_server

    profiles = load_settings_profiles(settings)
    worker_class_of(settings, profiles)  # a bad class fails before any model loads
    tls = load_internal_tls(settings)  # a missing certificate too
    metrics = WorkerMetrics()
    worker = build_worker(settings, wait_for_model=False, metrics=metrics, tls=tls)
    scores = build_score_sampler(settings, str(worker.registry.device))
    server, port, servicer = create_server(
        worker,
        f"{settings.host}:{settings.port}",
        threads=settings.threads,
        metrics=metrics,
        tls=tls,
        scores=scores,
    )
    if settings.metrics_port is not None:
        start_metrics(settings.host, settings.metrics_port)
    began = time.monotonic()
    # health turns SERVING and the worker joins once the first model is loaded (in the
    # background) and has run once
    loading = worker.registry.activate(worker.level.model)
    server.start()
    print(f"argus worker {settings.worker_id} listening on {settings.host}:{port}", flush=True)
    start_warm_up(worker, loading, lambda: _on_ready(settings.worker_id, servicer, began))
    membership = start_membership(settings, worker, port, profiles, tls)
    try:
        wait_for_shutdown(ready)
    finally:
        if membership is not None:  # leave first: routers stop sending before the server stops
            membership.stop()
        server.stop(grace=5).wait()
        worker.close()
        if scores is not None:
            scores.close()
        servicer.update_health()
    return 0
