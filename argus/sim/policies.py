"""Serving policies for the simulator: Argus itself and the baselines of Argus §5.1.

Every policy implements :class:`~argus.sim.cluster.Policy`; :func:`make_policy` builds one by
name. Argus and PAC run the product's own control plane (``Allocator``, ``PromptScheduler``,
``StrategyMonitor``), not a copy of it.

* ``argus``: classifier → PASM → worker selection (Eq. 3), allocator every period, AC by
  default and SM while retrieval is slow or down (§4.6), with a 1.5× load margin in the plan
  right after a switch to SM.
* ``pac``: prompt-agnostic Argus: the same allocator and strategy switching, but no classifier
  and no ODA: each prompt's level is drawn from the load shares F alone.
* ``proteus``: SM only, prompt-agnostic accuracy scaling with the same solver (Eq. 1 without
  Argus's switching cost, as Proteus has none).
* ``clipper-ha`` / ``clipper-ht``: SDXL / Tiny-SD on every GPU, least-loaded routing.
* ``sommelier``: each GPU decides alone: with uniform routing it expects 1/N of the forecast
  load and runs the best SM level whose throughput covers it.
* ``nirvana``: AC on every GPU with each prompt's own K (from the classifier), uniform routing,
  no accuracy scaling beyond the prompt's K and no strategy switching.

``argus`` and ``nirvana`` take their per-prompt level from a :class:`Classifier`, chosen by
:func:`make_classifier`: :class:`TrainedClassifier` (the router's own trained model, loaded
from a ``classifiers/`` artifact; ``argus replay``'s default), :class:`OracleClassifier` (the
quality table's optimal level, an upper bound; the library default) or
:class:`NoisyOracleClassifier` with a stated accuracy (``noisy-oracle@0.85``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from argus.allocator.allocator import Allocator, AllocatorConfig
from argus.allocator.planner import PlannerConfig
from argus.allocator.predictor import LoadPredictor, LoadPredictorConfig
from argus.allocator.strategy import StrategyMonitor
from argus.router.admission import predicted_completion_s
from argus.router.routing import PlanRouter, RouterConfig
from argus.sim.cluster import Policy, SimContext
from argus.sim.quality import QualityTable
from argus.types import ClusterView, Strategy

if TYPE_CHECKING:
    from argus.classifier.serving import ClassifierSet


class Classifier(Protocol):
    """Predicts a request's optimal level index for a strategy."""

    label: str

    def reset(self, ctx: SimContext) -> None: ...

    def predict(self, strategy: Strategy, request: int) -> int: ...


class OracleClassifier:
    """The quality table's own optimal level: an upper bound for a trained classifier."""

    label = "oracle"

    def reset(self, ctx: SimContext) -> None:
        self._ctx = ctx

    def predict(self, strategy: Strategy, request: int) -> int:
        return self._ctx.optimal_level(strategy, request)


class NoisyOracleClassifier:
    """Right with probability ``accuracy``, otherwise a uniformly random other level."""

    def __init__(self, accuracy: float, seed: int = 0) -> None:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy: must be in [0, 1], got {accuracy}")
        self.accuracy = accuracy
        self.label = f"noisy-oracle@{accuracy:g}"
        self._seed = seed

    def reset(self, ctx: SimContext) -> None:
        self._ctx = ctx
        self._rng = random.Random(self._seed)
        self._count = {s: len(ctx.profiles.levels_for(s)) for s in Strategy}

    def predict(self, strategy: Strategy, request: int) -> int:
        true = self._ctx.optimal_level(strategy, request)
        if self._rng.random() < self.accuracy or self._count[strategy] < 2:
            return true
        other = self._rng.randrange(self._count[strategy] - 1)
        return other if other < true else other + 1


class TrainedClassifier:
    """A trained classifier artifact (``classifiers/<name>``), one model per strategy.

    Predicts once per unique prompt text and caches across runs: a replay of 500k requests
    over 1,600 prompts runs the encoder 1,600 times. Construction reads only the configs (a
    bad path fails at once, naming it); the weights and the encoder load at the first
    :meth:`reset`. Each table's levels must be the classifier's labels.
    """

    def __init__(self, directory: str | Path) -> None:
        from argus.classifier.serving import read_configs, strategy_dirs

        self.directory = Path(directory)
        self.configs = read_configs(self.directory)
        details = "; ".join(f"{s}: {c.describe()}" for s, c in self.configs.items())
        self.label = f"trained {self.directory.name} ({details})"
        self._models: ClassifierSet | None = None
        self._cache = {
            s: _PREDICTIONS.setdefault(artifact_key(path), {})
            for s, path in strategy_dirs(self.directory).items()
        }

    def prepare(self, quality: Mapping[Strategy, QualityTable]) -> None:
        """Check the labels against the tables and load the models; ValueError names why."""
        from argus.classifier.model import ArtifactError

        missing = [s for s in quality if s not in self.configs]
        if missing:
            raise ValueError(f"classifier {self.directory} has no model for {missing[0]}")
        for strategy, table in quality.items():
            if table.levels != self.configs[strategy].levels:
                raise ValueError(
                    f"classifier {self.directory}: {strategy} labels "
                    f"{', '.join(self.configs[strategy].levels)} differ from the quality "
                    f"table's levels {', '.join(table.levels)}"
                )
        try:
            self._load()
        except ArtifactError as exc:
            raise ValueError(str(exc)) from None

    def reset(self, ctx: SimContext) -> None:
        from argus.classifier.prompts import clean_prompt

        self.prepare(ctx.quality)
        self._ctx = ctx
        rows = np.unique(ctx.prompt_rows).tolist()
        texts = {s: [table.prompts[r] for r in rows] for s, table in ctx.quality.items()}
        todo = sorted({t for s, ts in texts.items() for t in ts if t not in self._cache[s]})
        if todo:  # one batched pass for every strategy (the encoder runs once per prompt)
            predicted = self._load().predict_cleaned([clean_prompt(t) for t in todo])
            for strategy in texts:
                self._cache[strategy].update(zip(todo, predicted[strategy].tolist(), strict=True))
        self._levels: dict[Strategy, npt.NDArray[np.int64]] = {}
        for strategy, table in ctx.quality.items():
            levels = np.zeros(len(table.prompts), dtype=np.int64)
            levels[rows] = [self._cache[strategy][t] for t in texts[strategy]]
            self._levels[strategy] = levels

    def _load(self) -> ClassifierSet:
        if self._models is None:
            from argus.classifier.serving import load_classifier_set

            self._models = load_classifier_set(self.directory)
        return self._models

    def predict(self, strategy: Strategy, request: int) -> int:
        return int(self._levels[strategy][self._ctx.prompt_rows[request]])


# Predictions of trained classifiers in this process, by artifact_key and prompt text: a
# second replay (or test) with the same artifact does not run the encoder again.
_PREDICTIONS: dict[str, dict[str, int]] = {}


def artifact_key(directory: Path) -> str:
    """SHA-256 of an artifact's config, label map and head; the config holds the encoder's."""
    import hashlib

    from argus.classifier.model import ArtifactError

    digest = hashlib.sha256()
    for name in ("config.json", "labels.json", "model.safetensors"):
        try:
            digest.update((directory / name).read_bytes())
        except OSError as exc:
            raise ArtifactError(f"{directory / name}: cannot read: {exc.strerror}") from None
    return digest.hexdigest()


def make_classifier(spec: str) -> Classifier:
    """A classifier by name: ``default`` (the committed ``classifiers/minilm-logistic``),
    ``oracle``, ``noisy-oracle@ACCURACY`` (a bare accuracy such as ``0.85`` works too), or a
    classifier directory. Bad specs raise ValueError quoting them."""
    text = spec.strip()
    if text == "oracle":
        return OracleClassifier()
    accuracy = text.removeprefix("noisy-oracle@")
    try:
        value = float(accuracy)
    except ValueError:
        if text.startswith("noisy-oracle@"):
            raise ValueError(f"classifier {spec!r}: {accuracy!r} is not an accuracy") from None
    else:
        return NoisyOracleClassifier(value)
    from argus.classifier.model import ArtifactError
    from argus.classifier.serving import default_classifier_dir

    directory = default_classifier_dir() if text == "default" else Path(text)
    try:
        return TrainedClassifier(directory)
    except ArtifactError as exc:
        raise ValueError(
            f"classifier {spec!r}: {exc} (expected default, oracle, noisy-oracle@ACCURACY "
            "or a classifier directory)"
        ) from None


class _Planned(Policy):
    """Shared body of the policies that follow the Argus allocator's plans.

    The allocator (``Allocator``), the strategy monitor (``StrategyMonitor``) and the router
    (``PlanRouter``) are the product's own; this class only wires them to the simulator.
    """

    prompt_aware = True
    switches_strategy = True
    background_loads = True  # a strategy switch keeps SDXL serving while small models load
    fixed_strategy = Strategy.AC
    switch_cost_weight = 1.0
    switch_margin = 1.5
    spill_fraction_of_slo = 0.5  # spill off a level whose best worker would take longer
    backlog_replan_per_worker = 2.0  # re-plan at once when queues exceed this per live worker
    min_replan_interval_s = 10.0  # ... but not more often than this

    def __init__(self, classifier: Classifier | None = None, seed: int = 0) -> None:
        self.classifier = classifier or OracleClassifier()
        self._seed = seed

    def reset(self, ctx: SimContext) -> None:
        self.ctx = ctx
        self.classifier.reset(ctx)
        planner = PlannerConfig(switch_cost_weight=self.switch_cost_weight)
        forecast = LoadPredictorConfig(partial_min_s=self.min_replan_interval_s)
        self.allocator = Allocator(
            ctx.profiles, AllocatorConfig(planner=planner, forecast=forecast)
        )
        self.monitor = StrategyMonitor(start=self.fixed_strategy)
        spill = self.spill_fraction_of_slo * ctx.slo_s if self.spill_fraction_of_slo else None
        self.router = PlanRouter(
            ctx.profiles,
            random.Random(self._seed),
            RouterConfig(
                prompt_aware=self.prompt_aware,
                spill_after_s=spill,
                backlog_replan_per_worker=self.backlog_replan_per_worker,
                min_replan_interval_s=self.min_replan_interval_s,
            ),
        )
        self._timer: float | None = None
        self._strategy = self.fixed_strategy
        self._margin_until = -1.0
        self.strategy_switches = 0

    def observe_arrival(self, now_s: float) -> None:
        self.allocator.observe_arrival(now_s)

    def observe_retrieval(self, now_s: float, latency_s: float | None) -> None:
        if not self.switches_strategy:
            return
        self.monitor.observe(now_s, latency_s)
        if self.monitor.decide(now_s) is Strategy.SM and self._strategy is Strategy.AC:
            self._timer = now_s  # retrieval is failing: re-plan at once without AC

    def next_timer(self) -> float | None:
        return self._timer

    def replan(self, now_s: float, view: ClusterView) -> Mapping[str, str]:
        allowed = self._allowed_strategies(now_s)
        margin = self.switch_margin if now_s < self._margin_until else 1.0
        plan = self.allocator.plan_best(
            now_s, view, allowed, prefer=self._strategy, load_margin=margin
        )
        if plan.strategy is not self._strategy:
            self.strategy_switches += 1
            self._strategy = plan.strategy
        self.router.install(plan, {w.worker_id: w.worker_class for w in view.workers}, now_s)
        return plan.allocation.assignment

    def _allowed_strategies(self, now_s: float) -> tuple[Strategy, ...]:
        """Both strategies while retrieval is healthy, SM alone while it is not (§4.6)."""
        self._timer = None
        if not self.switches_strategy:
            return (self.fixed_strategy,)
        if self.monitor.strategy is Strategy.SM:
            self.monitor.observe(now_s, self.ctx.probe_retrieval(now_s))
        if self.monitor.decide(now_s) is Strategy.AC:
            return (Strategy.AC, Strategy.SM)
        if self._strategy is Strategy.AC:  # forced off AC: cover the reload (§4.6)
            self._margin_until = now_s + self.allocator.config.planner.period_s
        self._timer = now_s + self.monitor.config.probe_interval_s
        return (Strategy.SM,)

    def route(
        self, request: int, now_s: float, queues: Mapping[str, int], down: frozenset[str]
    ) -> tuple[str, str]:
        if self._timer is None and self.router.wants_replan(now_s, queues, down):
            self._timer = now_s  # queues are building: re-plan before the next arrival
        optimal = 0
        if self.prompt_aware:
            for strategy in (Strategy.AC, Strategy.SM):
                level = self.classifier.predict(strategy, request)
                self.allocator.observe_classification(strategy, level)
                self.router.observe(strategy, level)
                if strategy is self._strategy:
                    optimal = level
        decision = self.router.route(optimal, queues, down)
        return decision.worker_id, self.router.level_name(decision.served_level)


class ArgusPolicy(_Planned):
    name = "argus"


class PacPolicy(_Planned):
    name = "pac"
    prompt_aware = False
    switch_cost_weight = 0.0


class ProteusPolicy(_Planned):
    name = "proteus"
    background_loads = False
    prompt_aware = False
    switches_strategy = False
    fixed_strategy = Strategy.SM
    switch_cost_weight = 0.0


class _Static(Policy):
    """Every GPU at one level chosen up front; routes to the live worker that would finish the
    request first, ``(queue + 1) × latency`` on the worker's class: the least-loaded worker
    when every GPU is of one class, and a fast GPU takes a longer queue than a slow one."""

    level_index = 0  # index into the SM levels

    def reset(self, ctx: SimContext) -> None:
        self.ctx = ctx
        self.level = ctx.profiles.levels_for(Strategy.SM)[self.level_index].name
        self.latency = {
            worker_id: ctx.profiles.profile(ctx.worker_classes[worker_id], self.level).latency_s
            for worker_id in ctx.worker_ids
        }

    def replan(self, now_s: float, view: ClusterView) -> Mapping[str, str]:
        return {w.worker_id: self.level for w in view.alive()}

    def route(
        self, request: int, now_s: float, queues: Mapping[str, int], down: frozenset[str]
    ) -> tuple[str, str]:
        live = [w for w in self.ctx.worker_ids if w not in down]
        latency = self.latency
        best = min(live, key=lambda w: predicted_completion_s(queues.get(w, 0), latency[w]))
        return best, self.level


class ClipperHaPolicy(_Static):
    name = "clipper-ha"
    level_index = 0


class ClipperHtPolicy(_Static):
    name = "clipper-ht"
    level_index = -1


class _Uniform(Policy):
    """Uniform random routing over live workers (the baselines without a central router)."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed

    def reset(self, ctx: SimContext) -> None:
        self.ctx = ctx
        self.rng = random.Random(self._seed)

    def _pick(self, down: frozenset[str]) -> str:
        live = [w for w in self.ctx.worker_ids if w not in down]
        return live[self.rng.randrange(len(live))]


class SommelierPolicy(_Uniform):
    """Per-GPU accuracy scaling: each GPU sizes its level for its own 1/N of the load (uniform
    routing sends it that much), the best SM level whose throughput on the GPU's own class
    covers it: on a mixed cluster a fast GPU keeps a better level than a slow one."""

    name = "sommelier"

    def reset(self, ctx: SimContext) -> None:
        super().reset(ctx)
        self.load = LoadPredictor()
        self.levels = ctx.profiles.levels_for(Strategy.SM)
        self.assignment: dict[str, str] = {}

    def observe_arrival(self, now_s: float) -> None:
        self.load.observe(now_s)

    def replan(self, now_s: float, view: ClusterView) -> Mapping[str, str]:
        live = view.alive()
        share = self.load.forecast(now_s).qpm / max(1, len(live))
        self.assignment = {w.worker_id: self._level_for(w.worker_class, share) for w in live}
        return self.assignment

    def _level_for(self, worker_class: str, share_qpm: float) -> str:
        for level in self.levels:
            if self.ctx.profiles.profile(worker_class, level.name).throughput_qpm >= share_qpm:
                return level.name
        return self.levels[-1].name

    def route(
        self, request: int, now_s: float, queues: Mapping[str, int], down: frozenset[str]
    ) -> tuple[str, str]:
        worker = self._pick(down)
        return worker, self.assignment.get(worker, self.levels[0].name)


class NirvanaPolicy(_Uniform):
    """AC with each prompt's own K on every GPU, uniform routing. The K depends on the prompt
    alone (quality does not depend on the GPU), so every class serves the same levels."""

    name = "nirvana"

    def __init__(self, classifier: Classifier | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.classifier = classifier or OracleClassifier()

    def reset(self, ctx: SimContext) -> None:
        super().reset(ctx)
        self.classifier.reset(ctx)
        self.levels = ctx.profiles.levels_for(Strategy.AC)

    def replan(self, now_s: float, view: ClusterView) -> Mapping[str, str]:
        return {w.worker_id: self.levels[0].name for w in view.alive()}

    def route(
        self, request: int, now_s: float, queues: Mapping[str, int], down: frozenset[str]
    ) -> tuple[str, str]:
        level = self.levels[self.classifier.predict(Strategy.AC, request)]
        return self._pick(down), level.name


POLICIES: dict[str, type[Policy]] = {
    "argus": ArgusPolicy,
    "pac": PacPolicy,
    "proteus": ProteusPolicy,
    "clipper-ha": ClipperHaPolicy,
    "clipper-ht": ClipperHtPolicy,
    "sommelier": SommelierPolicy,
    "nirvana": NirvanaPolicy,
}


def make_policy(name: str, *, classifier: Classifier | None = None, seed: int = 0) -> Policy:
    """Build a policy by name; unknown names raise ValueError quoting them."""
    cls = POLICIES.get(name)
    if cls is None:
        known = ", ".join(POLICIES)
        raise ValueError(f"unknown policy {name!r}; known policies: {known}")
    if cls in (ArgusPolicy, NirvanaPolicy):
        return cls(classifier=classifier, seed=seed)
    if issubclass(cls, (_Planned, _Uniform)):
        return cls(seed=seed)
    return cls()
