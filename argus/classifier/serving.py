"""The classifier as the router uses it: load, hot-swap, and batch concurrent prompts.

* :func:`load_classifier_set` reads one artifact per strategy (``<dir>/ac``, ``<dir>/sm``);
  :func:`load_prompt_classifier` wraps it for serving. Importing this module loads neither
  torch nor transformers; loading a classifier does.
* :class:`HotSwapModel` holds the current model of one strategy. A reader takes one
  reference per batch and uses it throughout; a swap replaces that reference in one step
  with a model that is already fully built. No request can see a half-loaded model, and a
  batch never mixes two models.
* :class:`ClassifierSet` predicts every strategy for a batch of prompts, with one encoder
  forward pass per distinct encoder (the committed AC and SM heads share frozen MiniLM):
  arg-max levels (the paper's planner), classes and calibrated probabilities (the joint
  planner), optionally through an on-disk embedding cache for replays.
* :func:`read_planning_classes` gives the allocator Q(v | c) of each strategy from the
  artifacts' ``calibration.json`` without loading a model, and :func:`classifier_key` the
  identity routers report, so the allocator sees when they classify with other artifacts.
* :class:`MicroBatcher` gathers concurrent callers from many threads into one forward pass:
  a batch closes at ``max_batch`` prompts or ``max_wait_s`` after its first prompt arrived,
  whichever comes first; each caller gets its own answer (or the batch's exception). At most
  ``max_pending`` prompts wait (more are refused with :class:`BatcherFull`), a caller that
  gave up is dropped from its batch, and :meth:`MicroBatcher.backlog_s` estimates how long a
  new prompt would wait, so the router can refuse before queueing what would miss its
  deadline in the classifier alone.
* :class:`PromptClassifier` puts them together: ``classify(prompt) -> {strategy: class}``,
  the class being a calibrated tolerance bin (or the arg-max level for an artifact without
  ``calibration.json``). Bad input is handled in the caller's thread, before batching, as
  :mod:`argus.classifier.prompts` documents (``InvalidPromptError`` for bytes that are not
  UTF-8, class or level 0 for empty prompts, truncation for long ones), so one caller's
  bad prompt never fails another caller's batch.
"""

from __future__ import annotations

import hashlib
import itertools
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from argus.classifier.calibration import CALIBRATION_FILE, softmax_t
from argus.classifier.embedding_cache import EmbeddingCache, EncoderIdentity
from argus.classifier.model import (
    CLASSIFIERS_DIR,
    CONFIG_FILE,
    DEFAULT_CLASSIFIER,
    ArtifactError,
    ClassifierConfig,
    LevelClassifier,
    artifact_key,
    load_artifact,
    read_class_quality,
    read_config,
)
from argus.classifier.prompts import (
    EMPTY_PROMPT_CLASS,
    EMPTY_PROMPT_LEVEL,
    clean_prompt,
    decode_prompt,
)
from argus.types import ClassQuality, Strategy

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
Float32Array = npt.NDArray[np.float32]
# The router's defaults, chosen by benchmarks/bench_classifier.py on a 2-core machine.
SERVING_RUNTIME = "onnx"
SERVING_THREADS = 1
SERVING_MAX_WAIT_S = 0.0
SERVING_CACHE_ENTRIES = 4096
M = TypeVar("M")
T = TypeVar("T")
R = TypeVar("R")


def default_classifier_dir() -> Path:
    """``classifiers/minilm-l2-logistic-int8`` of the repository (the committed default)."""
    return CLASSIFIERS_DIR / DEFAULT_CLASSIFIER


def strategy_dirs(directory: str | Path) -> dict[Strategy, Path]:
    """The artifact directory of each strategy under ``directory``.

    ``directory`` is either one artifact (it has ``config.json``) or holds one per strategy
    in ``ac/`` and ``sm/``. Reads only the configs; ``ArtifactError`` names what is missing.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"classifier directory {directory} does not exist")
    if (directory / CONFIG_FILE).is_file():
        return {read_config(directory).strategy: directory}
    found: dict[Strategy, Path] = {}
    for strategy in Strategy:
        candidate = directory / strategy.value.lower()
        if (candidate / CONFIG_FILE).is_file():
            config = read_config(candidate)
            if config.strategy is not strategy:
                raise ArtifactError(
                    f"{candidate}: holds a {config.strategy} classifier, expected {strategy}"
                )
            found[strategy] = candidate
    if not found:
        raise ArtifactError(
            f"{directory}: no classifier (expected {CONFIG_FILE}, or ac/ and sm/ subdirectories)"
        )
    return found


def read_configs(directory: str | Path) -> dict[Strategy, ClassifierConfig]:
    """The config of each strategy's artifact, without loading any weights."""
    return {s: read_config(path) for s, path in strategy_dirs(directory).items()}


class HotSwapModel(Generic[M]):
    """The current model of one strategy, replaced atomically by :meth:`swap`.

    The model and its version live in one tuple, so one attribute read gives a consistent
    pair; assignments of a reference are atomic in Python. Swaps are serialised.
    """

    def __init__(self, model: M) -> None:
        self._slot: tuple[M, int] = (model, 0)
        self._swap_lock = threading.Lock()

    @property
    def current(self) -> M:
        return self._slot[0]

    def snapshot(self) -> tuple[M, int]:
        """(model, version) read together."""
        return self._slot

    @property
    def version(self) -> int:
        return self._slot[1]

    def swap(self, model: M) -> int:
        """Make ``model`` (fully built) the current one; returns its version."""
        with self._swap_lock:
            version = self._slot[1] + 1
            self._slot = (model, version)
            return version


@dataclass(frozen=True)
class VectorCacheStats:
    """Counters of a :class:`RecentVectors` since it started."""

    hits: int  # texts asked for whose vector was in the cache
    misses: int  # texts asked for whose vector was not (a text twice in a call counts twice)
    entries: int  # vectors held now
    max_entries: int  # the bound


class RecentVectors:
    """The encoder vectors of recently classified texts, by content: a bounded LRU.

    Keyed by the encoder (a serial number this cache gives each encoder object, never
    reused) and the text as the encoder sees it (cleaned and cut), so a hot-swapped head
    reuses the vectors of its unchanged encoder and a swapped encoder never reads another's.
    Thread-safe; the encoder runs outside the lock.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries: must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, str], Float32Array] = OrderedDict()
        # each encoder's serial number, never reused (an id() is, once its object is gone)
        self._serials: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next_serial = itertools.count()
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def _serial(self, encoder: Any) -> int:
        serial = self._serials.get(encoder)
        if serial is None:
            serial = self._serials[encoder] = next(self._next_serial)
        return serial

    def embed(
        self,
        model: LevelClassifier,
        texts: Sequence[str],
        progress: Callable[[int, int], None] | None = None,
    ) -> Float32Array:
        """``model``'s vectors of ``texts``: cached rows as they are, the others embedded
        (in one call) and kept, evicting the least recently used beyond the bound."""
        encoder = model.encoder
        out = np.empty((len(texts), encoder.dim), dtype=np.float32)
        missing: dict[str, list[int]] = {}
        with self._lock:
            serial = self._serial(encoder)
            for i, text in enumerate(texts):
                vector = self._entries.get((serial, text))
                if vector is not None:
                    self._entries.move_to_end((serial, text))
                    out[i] = vector
                else:
                    missing.setdefault(text, []).append(i)
            self._hits += len(texts) - sum(len(rows) for rows in missing.values())
            self._misses += sum(len(rows) for rows in missing.values())
        if not missing:
            return out
        fresh = model.embed(list(missing), progress)
        with self._lock:
            for (text, rows), vector in zip(missing.items(), fresh, strict=True):
                out[rows] = vector
                kept = vector.copy()
                kept.setflags(write=False)
                self._entries[(serial, text)] = kept
                self._entries.move_to_end((serial, text))
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return out

    def stats(self) -> VectorCacheStats:
        with self._lock:
            return VectorCacheStats(self._hits, self._misses, len(self._entries), self.max_entries)

    def clear(self) -> None:
        """Forget every vector (the counters stay)."""
        with self._lock:
            self._entries.clear()


@dataclass(frozen=True, eq=False)
class Inference:
    """What one strategy's classifier says about a batch of prompts (one row per prompt)."""

    levels: IntArray  # arg-max level (EMPTY_PROMPT_LEVEL for empty prompts)
    classes: IntArray  # class: tolerance bin with a calibration, else the arg-max level
    probabilities: FloatArray  # calibrated [prompts, levels]; one-hot at level 0 when empty
    has_classes: bool  # True when ``classes`` are tolerance bins


class ClassifierSet:
    """One hot-swappable :class:`LevelClassifier` per strategy."""

    def __init__(self, classifiers: Mapping[Strategy, LevelClassifier]) -> None:
        if not classifiers:
            raise ValueError("a classifier set needs at least one strategy")
        for strategy, classifier in classifiers.items():
            if classifier.strategy is not strategy:
                raise ValueError(f"the {strategy} slot holds a {classifier.strategy} classifier")
        self.holders = {s: HotSwapModel(c) for s, c in classifiers.items()}

    @property
    def strategies(self) -> tuple[Strategy, ...]:
        return tuple(self.holders)

    def current(self, strategy: Strategy) -> LevelClassifier:
        return self.holders[strategy].current

    def has_classes(self, strategy: Strategy) -> bool:
        """True when the current model of ``strategy`` outputs tolerance classes."""
        return self.current(strategy).has_classes

    def class_quality(self, strategy: Strategy) -> ClassQuality:
        """Q(v | c) of the current model of ``strategy``; ``ValueError`` without calibration."""
        return self.current(strategy).class_quality()

    def infer_cleaned(
        self,
        texts: Sequence[str | None],
        *,
        cache: EmbeddingCache | None = None,
        progress: Callable[[int, int], None] | None = None,
        recent: RecentVectors | None = None,
    ) -> dict[Strategy, Inference]:
        """Levels, classes and calibrated probabilities per strategy for decoded, stripped
        texts (``None``: empty prompt).

        Takes each strategy's model once, embeds once per distinct (encoder, character cut)
        and applies every head. With ``cache``, vectors of encoders whose weights' hash is
        known are read from and kept in it (:mod:`argus.classifier.embedding_cache`); with
        ``recent`` (the serving path's in-memory LRU), vectors are read from and kept there
        first. ``progress(done, total)`` reports the embedding.
        """
        models = {s: holder.current for s, holder in self.holders.items()}
        vectors: dict[tuple[int, int], Float32Array] = {}
        rows = [i for i, text in enumerate(texts) if text is not None]
        out: dict[Strategy, Inference] = {}
        for strategy, model in models.items():
            n = len(model.levels)
            levels = np.full(len(texts), EMPTY_PROMPT_LEVEL, dtype=np.int64)
            classes = np.full(len(texts), EMPTY_PROMPT_CLASS, dtype=np.int64)
            probabilities = np.zeros((len(texts), n), dtype=np.float64)
            probabilities[:, EMPTY_PROMPT_LEVEL] = 1.0
            if rows:
                key = (id(model.encoder), model.config.max_chars)
                if key not in vectors:
                    cut = [clean_prompt(texts[i] or "", max_chars=key[1]) or "" for i in rows]
                    vectors[key] = _embed(model, cut, cache, progress, recent)
                logits = model.head.logits(vectors[key])
                levels[rows] = np.argmax(logits, axis=1)
                probabilities[rows] = softmax_t(logits, model.temperature)
                if model.calibration is None:
                    classes[rows] = levels[rows]
                else:
                    classes[rows] = model.calibration.classes_of_logits(logits)
            out[strategy] = Inference(levels, classes, probabilities, model.has_classes)
        return out

    def predict_cleaned(
        self,
        texts: Sequence[str | None],
        *,
        cache: EmbeddingCache | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[Strategy, IntArray]:
        """Arg-max levels per strategy (what the paper's planner routes by); see
        :meth:`infer_cleaned`."""
        inferred = self.infer_cleaned(texts, cache=cache, progress=progress)
        return {s: result.levels for s, result in inferred.items()}

    def classes_cleaned(
        self,
        texts: Sequence[str | None],
        *,
        cache: EmbeddingCache | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[Strategy, IntArray]:
        """Classes per strategy (tolerance bins where calibrated, arg-max levels elsewhere;
        ``EMPTY_PROMPT_CLASS`` for empty prompts); see :meth:`infer_cleaned`."""
        inferred = self.infer_cleaned(texts, cache=cache, progress=progress)
        return {s: result.classes for s, result in inferred.items()}

    def predict(self, prompts: Sequence[str | bytes]) -> dict[Strategy, IntArray]:
        """Levels per strategy; raises ``InvalidPromptError`` for the first bad prompt."""
        return self.predict_cleaned([clean_prompt(decode_prompt(p)) for p in prompts])

    def classes(self, prompts: Sequence[str | bytes]) -> dict[Strategy, IntArray]:
        """Classes per strategy; raises ``InvalidPromptError`` for the first bad prompt."""
        return self.classes_cleaned([clean_prompt(decode_prompt(p)) for p in prompts])


def _embed(
    model: LevelClassifier,
    texts: list[str],
    cache: EmbeddingCache | None,
    progress: Callable[[int, int], None] | None,
    recent: RecentVectors | None = None,
) -> Float32Array:
    """The model's vectors of ``texts``: through ``recent`` when given, else through
    ``cache`` when its encoder can be keyed."""
    if recent is not None:
        return recent.embed(model, texts, progress)
    if cache is not None:
        identity = EncoderIdentity.of(model)
        if identity is not None:
            return cache.embed(model.encoder, identity, texts, progress)
    return model.embed(texts, progress)


def classifier_key(directory: str | Path | None = None) -> str:
    """A short identity of the artifacts under ``directory`` (default: the committed one):
    equal for two directories whose every strategy classifies alike (same config, labels,
    head and calibration; see :func:`~argus.classifier.model.artifact_key`), wherever they
    are. The router reports it and the allocator compares it with its own."""
    directory = Path(directory) if directory is not None else default_classifier_dir()
    digest = hashlib.sha256()
    for strategy, path in sorted(strategy_dirs(directory).items()):
        digest.update(f"{strategy.value}={artifact_key(path)};".encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class PlanningClasses:
    """What the allocator plans with from the routers' classifier, read without a model.

    The allocator must price exactly the classes the router sends: a strategy whose artifact
    has a ``calibration.json`` is classified into tolerance bins, planned with their Q(v | c);
    one without (an artifact from before calibration) is classified by arg-max level, which
    the planner prices with the level averages.
    """

    directory: Path
    key: str  # classifier_key: what a router using the same artifacts reports
    class_quality: Mapping[Strategy, ClassQuality]  # calibrated strategies: Q(v | c)
    by_level: tuple[Strategy, ...]  # strategies without calibration.json: level averages


def read_planning_classes(directory: str | Path | None = None) -> PlanningClasses:
    """:class:`PlanningClasses` of the artifacts under ``directory`` (default: the committed
    one). ``ArtifactError`` names the file and field of a ``calibration.json`` that the router
    would refuse too, or one whose Q(v | c) was never measured (its classes cannot be priced)."""
    directory = Path(directory) if directory is not None else default_classifier_dir()
    quality: dict[Strategy, ClassQuality] = {}
    by_level: list[Strategy] = []
    for strategy, path in strategy_dirs(directory).items():
        if (path / CALIBRATION_FILE).exists():
            quality[strategy] = read_class_quality(path)
        else:
            by_level.append(strategy)
    return PlanningClasses(directory, classifier_key(directory), quality, tuple(by_level))


def load_classifier_set(
    directory: str | Path | None = None,
    *,
    precision: str = "fp32",
    runtime: str | None = None,
    threads: int | None = None,
) -> ClassifierSet:
    """Load every strategy's artifact under ``directory`` (default: the committed one).

    ``precision="bf16"`` trades exact agreement with the float32 evaluation (99.9% of
    predictions match on PartiPrompts) for speed on CPUs with native bf16. ``runtime`` and
    ``threads`` choose how the encoder runs (:class:`argus.embedding.PromptEmbedder`);
    ``runtime`` ``None``: each artifact's own (``ArtifactError`` for one that computes other
    vectors than an artifact's head was fitted on).
    """
    directory = Path(directory) if directory is not None else default_classifier_dir()
    return ClassifierSet(
        {
            s: load_artifact(path, precision=precision, runtime=runtime, threads=threads)
            for s, path in strategy_dirs(directory).items()
        }
    )


def serving_runtime(config: ClassifierConfig) -> str:
    """The runtime the router runs an artifact's encoder on: :data:`SERVING_RUNTIME` for
    heads fitted on float32 vectors (it computes the same ones, faster), else the artifact's
    own (an int8 head is only served on the encoder it was fitted on)."""
    from argus.embedding import vectors_of

    same = vectors_of(config.runtime) == vectors_of(SERVING_RUNTIME)
    return SERVING_RUNTIME if same else config.runtime


# ---------------------------------------------------------------------------------------------
# Micro-batching


class BatcherClosed(RuntimeError):
    """The micro-batcher was closed before this prompt ran."""


class BatcherFull(RuntimeError):
    """``max_pending`` prompts are already waiting for the classifier; retry later."""


@dataclass(frozen=True)
class BatcherStats:
    """Counters of a :class:`MicroBatcher` since it started."""

    batches: int  # forward passes run
    items: int  # prompts answered, successfully or not
    largest_batch: int  # most prompts in one forward pass
    failed_batches: int  # forward passes that raised (every caller got the exception)


class _Stop:
    pass


_STOP = _Stop()


class MicroBatcher(Generic[T, R]):
    """Gathers items submitted from many threads into batches for ``run_batch``.

    ``run_batch(items)`` must return one result per item, in order. A batch closes when it
    holds ``max_batch`` items or ``max_wait_s`` after its first item arrived; a lone caller
    therefore waits at most ``max_wait_s`` extra. One background thread runs the batches.

    The queue is bounded: with ``max_pending`` items waiting, :meth:`submit` raises
    :class:`BatcherFull` at once. A caller whose wait times out cancels its item, which is
    then left out of its batch (nobody would read the answer).
    """

    def __init__(
        self,
        run_batch: Callable[[list[T]], Sequence[R]],
        *,
        max_batch: int = 32,
        max_wait_s: float = 0.002,
        max_pending: int = 1024,
        name: str = "argus-classifier-batcher",
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        if not max_wait_s >= 0.0:
            raise ValueError(f"max_wait_s: must be >= 0, got {max_wait_s}")
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        self._run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_pending = max_pending
        self._queue: queue.SimpleQueue[tuple[T, Future[R]] | _Stop] = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()  # also guards the backlog counters below
        self._pending = 0  # items submitted and not yet taken into a batch
        self._running = False  # a batch is being run
        self._batch_s = 0.0  # moving average of one batch's run time, seconds (0: none yet)
        self._batches = self._items = self._largest = self._failed = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> Future[R]:
        """Queue ``item``; the future resolves to its result."""
        future: Future[R] = Future()
        with self._close_lock:
            if self._closed:
                raise BatcherClosed("the classifier's micro-batcher is closed")
            if self._pending >= self.max_pending:
                raise BatcherFull(f"classifier busy: {self._pending} prompts waiting")
            self._pending += 1
            self._queue.put((item, future))
        return future

    def __call__(self, item: T, timeout: float | None = None) -> R:
        """Submit and wait for the result (re-raises the batch's exception); on a timeout
        the item is cancelled, so its batch skips it if it has not started."""
        future = self.submit(item)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def backlog_s(self) -> float:
        """Seconds a prompt submitted now would wait for its answer, estimated from the
        prompts waiting and the recent batches' run time (0 before the first batch): the
        batch running now, the full batches ahead, and its own."""
        with self._close_lock:
            batches = self._pending // self.max_batch + 1 + int(self._running)
            return batches * self._batch_s

    def stats(self) -> BatcherStats:
        return BatcherStats(self._batches, self._items, self._largest, self._failed)

    def close(self, timeout: float | None = None) -> None:
        """Stop taking items, answer the queued ones, stop the thread."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout)

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if isinstance(first, _Stop):
                break
            self._took(1)
            batch = [first]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch:
                remaining = deadline - time.monotonic()
                try:
                    if remaining > 0:
                        entry = self._queue.get(timeout=remaining)
                    else:  # the wait is over: take only what is already queued
                        entry = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(entry, _Stop):
                    stopping = True
                    break
                self._took(1)
                batch.append(entry)
            began = time.monotonic()
            self._run(batch)
            with self._close_lock:
                self._running = False
                took = time.monotonic() - began
                self._batch_s = took if not self._batch_s else 0.8 * self._batch_s + 0.2 * took

    def _took(self, count: int) -> None:
        with self._close_lock:
            self._pending -= count
            self._running = True

    def _run(self, batch: list[tuple[T, Future[R]]]) -> None:
        live = [(item, future) for item, future in batch if future.set_running_or_notify_cancel()]
        if not live:
            return
        self._batches += 1
        self._items += len(live)
        self._largest = max(self._largest, len(live))
        try:
            results = list(self._run_batch([item for item, _ in live]))
            if len(results) != len(live):
                raise RuntimeError(f"batch of {len(live)} returned {len(results)} results")
        except BaseException as exc:  # every caller of the batch gets the error
            self._failed += 1
            for _, future in live:
                future.set_exception(exc)
            return
        for (_, future), result in zip(live, results, strict=True):
            future.set_result(result)


class PromptClassifier:
    """Router-facing: ``classify(prompt) -> {strategy: class}``, thread-safe, batched.

    A strategy whose artifact has a calibration answers with the prompt's *class* (a bin of
    its calibrated tolerance, 0 = least tolerant; see :mod:`argus.classifier.calibration`),
    which the joint planner's PASM rows are indexed by; a strategy without one answers with
    its arg-max level, as before calibration existed. :meth:`has_classes` says which.

    Prompt handling (see :mod:`argus.classifier.prompts`): bytes that are not UTF-8 and lone
    surrogates raise ``InvalidPromptError`` in the caller's thread; empty and whitespace-only
    prompts get ``EMPTY_PROMPT_CLASS`` (= ``EMPTY_PROMPT_LEVEL``, 0) without touching the
    model; long prompts are cut and truncated to the encoder's limit.
    """

    def __init__(
        self,
        classifiers: ClassifierSet,
        *,
        max_batch: int = 32,
        max_wait_s: float = SERVING_MAX_WAIT_S,
        max_pending: int = 1024,
        cache_entries: int = SERVING_CACHE_ENTRIES,
    ) -> None:
        self.classifiers = classifiers
        self.recent = RecentVectors(cache_entries) if cache_entries > 0 else None
        self._batcher: MicroBatcher[str, dict[Strategy, int]] = MicroBatcher(
            self._run_batch, max_batch=max_batch, max_wait_s=max_wait_s, max_pending=max_pending
        )

    def _run_batch(self, texts: list[str]) -> list[dict[Strategy, int]]:
        inferred = self.classifiers.infer_cleaned(list(texts), recent=self.recent)
        classes = {s: result.classes.tolist() for s, result in inferred.items()}
        return [{s: column[i] for s, column in classes.items()} for i in range(len(texts))]

    def has_classes(self, strategy: Strategy) -> bool:
        """True when :meth:`classify` answers ``strategy`` with a tolerance class, False when
        with an arg-max level (no calibration in the artifact)."""
        return self.classifiers.has_classes(strategy)

    def classify(self, prompt: str | bytes, timeout: float | None = None) -> dict[Strategy, int]:
        """Each strategy's class for ``prompt`` (its level where there is no calibration)."""
        text = clean_prompt(decode_prompt(prompt))
        if text is None:
            return {s: EMPTY_PROMPT_CLASS for s in self.classifiers.strategies}
        return self._batcher(text, timeout)

    def stats(self) -> BatcherStats:
        return self._batcher.stats()

    def backlog_s(self) -> float:
        """Seconds a prompt classified now would wait (:meth:`MicroBatcher.backlog_s`)."""
        return self._batcher.backlog_s()

    def cache_stats(self) -> VectorCacheStats | None:
        """The prompt-vector cache's counters; ``None`` when built without one."""
        return None if self.recent is None else self.recent.stats()

    def close(self) -> None:
        self._batcher.close()


def load_prompt_classifier(
    directory: str | Path | None = None,
    *,
    max_batch: int = 32,
    max_wait_s: float = SERVING_MAX_WAIT_S,
    precision: str = "fp32",
    runtime: str | None = None,
    threads: int = SERVING_THREADS,
    cache_entries: int = SERVING_CACHE_ENTRIES,
) -> PromptClassifier:
    """The router's loader: the artifacts under ``directory`` behind a micro-batcher, the
    encoder on ``runtime`` (``None``: :func:`serving_runtime` of each artifact; float32 ONNX
    falls back to torch if it cannot start) with ``threads`` intra-op threads, and an LRU of
    ``cache_entries`` prompt vectors (0: none)."""
    directory = Path(directory) if directory is not None else default_classifier_dir()
    classifiers = {}
    for strategy, path in strategy_dirs(directory).items():
        chosen = runtime if runtime is not None else serving_runtime(read_config(path))
        if precision != "fp32":
            chosen = "torch"  # bf16 autocast exists in torch only
        classifiers[strategy] = load_artifact(
            path, precision=precision, runtime=chosen, threads=threads
        )
    return PromptClassifier(
        ClassifierSet(classifiers),
        max_batch=max_batch,
        max_wait_s=max_wait_s,
        cache_entries=cache_entries,
    )
