"""Serving policies for the simulator: Argus itself and the baselines of Argus §5.1.

Every policy implements :class:`~argus.sim.cluster.Policy`; :func:`make_policy` builds one by
name and rejects unknown names quoting them.

* ``argus``, ``argus-text``, ``argus-paper``, ``pac``, ``proteus``: one class,
  :class:`PlannedPolicy`, that runs the allocator's and the router's own code on the simulated
  clock; they differ only by configuration (:func:`argus.sim.planned.planned_policies` says
  how). With the realistic cache ``argus`` chooses among a level's workers by what their
  caches hold (:mod:`argus.router.cache_routing`); ``argus-text`` is Argus deciding from the
  prompt's text alone, Eq. 3 at the routed K whatever the caches hold (``argus`` before the
  router saw the caches). With the perfect cache the two are the same policy.
* ``clipper-ha`` / ``clipper-ht``: SDXL / Tiny-SD on every GPU, least-loaded routing.
* ``sommelier``: each GPU decides alone: with uniform routing it expects 1/N of the forecast
  load and runs the best SM level that carries it within a queue of one's utilisation cap.
* ``nirvana``: AC on every GPU, uniform routing, no accuracy scaling and no strategy switching.
  With the realistic cache every request goes at the largest K (NIRVANA's own ceiling) and
  its worker's cache and similarity rule decide the K it gets, as NIRVANA does; the perfect
  cache has no similarity to decide with, so there it stands in the prompt's optimal K from
  the classifier (as before caches were modelled, kept for comparison).

``argus`` (and ``argus-text``) look at the prompt through a classifier
(:mod:`argus.sim.classifiers`, chosen by :func:`make_classifier`); ``nirvana`` only with the
perfect cache.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import replace

from argus.allocator.config import StrategyChoice
from argus.allocator.planner import PlannerMode
from argus.allocator.predictor import LoadPredictor
from argus.allocator.queueing import CapSource, QueueModel
from argus.sim.classifiers import (  # noqa: F401  (re-exported)
    Classifier,
    NoisyOracleClassifier,
    OracleClassifier,
    TrainedClassifier,
    make_classifier,
)
from argus.sim.cluster import Policy, SimContext
from argus.sim.cluster_cache import CacheMode
from argus.sim.planned import PlannedPolicy, planned_policies
from argus.types import ClusterView, Strategy


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
        # the first live worker with the least predicted_completion_s, as min() would pick
        # it, written out: this runs for every request on every worker
        best, best_s = "", math.inf
        for worker_id, latency in self.latency.items():
            if worker_id in down:
                continue
            finish_s = (queues.get(worker_id, 0) + 1) * latency  # predicted_completion_s
            if finish_s < best_s:
                best, best_s = worker_id, finish_s
        if not best:
            raise RuntimeError(f"{self.name}: no live worker to route to")
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
        live = [w for w in self.ctx.worker_ids if w not in down] if down else self.ctx.worker_ids
        return live[self.rng.randrange(len(live))]


class SommelierPolicy(_Uniform):
    """Per-GPU accuracy scaling: each GPU sizes its level for its own 1/N of the load (uniform
    routing sends it that much), the best SM level that carries it on the GPU's own class: on
    a mixed cluster a fast GPU keeps a better level than a slow one.

    A level carries a share when the share fits under its throughput times the queueing cap
    of a pool of one worker, the cap the planned policies size their pools by
    (:class:`~argus.allocator.queueing.QueueModel`, measured on the simulator's service times
    by default). Sommelier plans each GPU alone (Argus §5.1), so its GPU is a queue of one,
    whose cap is lower than a shared pool's: the price of deciding per GPU. Sizing at a
    utilisation of 1 instead refused 11-24% of the requests at a steady 0.35-0.95 x capacity,
    where Argus §5.2 reports Sommelier doing well on SLO violations under a stable load.
    """

    name = "sommelier"

    def __init__(self, seed: int = 0, caps: CapSource = CapSource.MEASURED) -> None:
        super().__init__(seed)
        self.caps = CapSource(caps)

    def reset(self, ctx: SimContext) -> None:
        super().reset(ctx)
        self.load = LoadPredictor()
        self.levels = ctx.profiles.levels_for(Strategy.SM)
        self.assignment: dict[str, str] = {}
        caps = self.caps if ctx.service_spread is not None else CapSource.ANALYTIC
        self.queue = QueueModel(ctx.slo_s, caps=caps, spread=ctx.service_spread)
        classes = sorted(set(ctx.worker_classes.values()))
        self.queue.prepare([(c, level.name) for c in classes for level in self.levels], 1)

    def observe_arrival(self, now_s: float) -> None:
        self.load.observe(now_s)

    def replan(self, now_s: float, view: ClusterView) -> Mapping[str, str]:
        live = view.alive()
        share = self.load.forecast(now_s).qpm / max(1, len(live))
        self.assignment = {w.worker_id: self._level_for(w.worker_class, share) for w in live}
        return self.assignment

    def carries_qpm(self, worker_class: str, level: str) -> float:
        """The load one GPU of ``worker_class`` may be planned at ``level``: its throughput
        times the queueing cap of a pool of one."""
        profile = self.ctx.profiles.profile(worker_class, level)
        cap = self.queue.cap(worker_class, level, profile.latency_s, 1)
        return profile.throughput_qpm * cap

    def _level_for(self, worker_class: str, share_qpm: float) -> str:
        for level in self.levels:
            if self.carries_qpm(worker_class, level.name) >= share_qpm:
                return level.name
        return self.levels[-1].name

    def route(
        self, request: int, now_s: float, queues: Mapping[str, int], down: frozenset[str]
    ) -> tuple[str, str]:
        worker = self._pick(down)
        return worker, self.assignment.get(worker, self.levels[0].name)


class NirvanaPolicy(_Uniform):
    """AC on every GPU, uniform routing. Realistic cache: every request at the largest K, the
    ceiling, and each worker's cache and rule pick the K its neighbour allows (NIRVANA's own
    K selection; no classifier). Perfect cache: each prompt's own K from the classifier
    stands in for what its similarity would allow. The K depends on the prompt alone, so every
    GPU class serves the same levels."""

    name = "nirvana"

    def __init__(self, classifier: Classifier | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.classifier = classifier or OracleClassifier()

    def reset(self, ctx: SimContext) -> None:
        super().reset(ctx)
        self.levels = ctx.profiles.levels_for(Strategy.AC)
        self.by_similarity = ctx.cache == CacheMode.REALISTIC
        if not self.by_similarity:
            self.classifier.reset(ctx)
        # the level every worker holds: the ceiling when the cache decides, else K = 0
        self.held = self.levels[-1 if self.by_similarity else 0].name

    def replan(self, now_s: float, view: ClusterView) -> Mapping[str, str]:
        return {w.worker_id: self.held for w in view.alive()}

    def route(
        self, request: int, now_s: float, queues: Mapping[str, int], down: frozenset[str]
    ) -> tuple[str, str]:
        if self.by_similarity:
            return self._pick(down), self.held
        level = self.levels[self.classifier.predict_level(Strategy.AC, request)]
        return self._pick(down), level.name


BASELINES: dict[str, type[Policy]] = {
    "clipper-ha": ClipperHaPolicy,
    "clipper-ht": ClipperHtPolicy,
    "sommelier": SommelierPolicy,
    "nirvana": NirvanaPolicy,
}
PLANNED = planned_policies()
POLICIES: tuple[str, ...] = ("argus", "pac", "proteus", *BASELINES, "argus-paper")
"""The policies compared; ``argus replay`` runs all but ``argus-paper`` by default."""
VARIANTS: tuple[str, ...] = ("argus-text",)
"""Further names :func:`make_policy` knows: ``argus-text``, Argus deciding from the text
alone, blind to what the caches hold (to compare the cache-aware ``argus`` against)."""


def make_policy(
    name: str,
    *,
    classifier: Classifier | None = None,
    seed: int = 0,
    caps: str | None = None,
    strategy_choice: str | None = None,
) -> Policy:
    """Build a policy by name; unknown names raise ValueError quoting them.

    The planned policies (``argus``, ``argus-text``, ``argus-paper``, ``pac``, ``proteus``)
    are one class configured by :func:`argus.sim.planned.planned_policies`; the classifier
    matters to those that look at the prompt (Argus, and NIRVANA with the perfect cache).
    ``caps`` (``analytic`` or ``measured``) sets the queueing caps of every planned policy and
    of Sommelier's GPUs, ``strategy_choice`` (``ac-first`` or ``best``) that of the joint
    planner's policies that may run both strategies (argus and pac); None leaves a policy's
    own.
    """
    if name in PLANNED:
        config = PLANNED[name]
        control = config.control
        if caps is not None:
            control = replace(control, caps=CapSource(caps))
        both = set(control.strategies) == {Strategy.AC, Strategy.SM}
        if strategy_choice is not None and both and control.planner is PlannerMode.JOINT:
            control = replace(control, strategy_choice=StrategyChoice(strategy_choice))
        config = replace(config, control=control)
        return PlannedPolicy(name, config, classifier=classifier, seed=seed)
    cls = BASELINES.get(name)
    if cls is None:
        known = ", ".join((*POLICIES, *VARIANTS))
        raise ValueError(f"unknown policy {name!r}; known policies: {known}")
    if cls is NirvanaPolicy:
        return NirvanaPolicy(classifier=classifier, seed=seed)
    if cls is SommelierPolicy:
        return SommelierPolicy(seed=seed, caps=CapSource(caps or CapSource.MEASURED))
    if issubclass(cls, _Uniform):
        return cls(seed=seed)
    return cls()
