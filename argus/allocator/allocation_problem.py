"""What the allocator's two programs share: the problem, the worker counts, naming workers.

Eq. 1 (:mod:`argus.allocator.paper_eq1`) and the joint program (:mod:`argus.allocator.joint`)
solve for the same thing, how many workers of each class run each level, from the same
inputs. Both start from a :class:`Problem` (the strategy's levels, the live workers, the load
served, the switching cost's weight, the utilisation caps), decide :class:`Counts` per
(worker class, level), and hand them to :func:`chosen_levels`, which names the workers
(keeping as many as it can at their level, then on their model, so a plan moves few workers).
:func:`rounded_switch_cost` is the switching cost both charge integer counts. Solver
backends live with each program: PuLP and HiGHS for Eq. 1, ``highspy`` for the joint one;
this module imports neither.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

from argus.types import Level, ProfileSet, Strategy, WorkerState


class InfeasiblePlanError(RuntimeError):
    """The backend found no solution (a bug or a backend limit: the program is always feasible)."""


@dataclass(frozen=True)
class Problem:
    """What a program plans from: Eq. 1's two formulations and the joint program read the
    same inputs, validated once by the program that builds them."""

    strategy: Strategy
    levels: tuple[Level, ...]
    profiles: ProfileSet
    live: tuple[WorkerState, ...]
    load_qpm: float
    served_qpm: float
    switch_cost_weight: float
    period_s: float
    caps: Mapping[tuple[str, str], float] = field(default_factory=dict)  # utilisation caps

    def throughput(self, worker_class: str, level: Level) -> float:
        """QPM one worker of ``worker_class`` may be planned for at ``level``: u · P_th."""
        cap = self.caps.get((worker_class, level.name), 1.0)
        return cap * self.profiles.profile(worker_class, level.name).throughput_qpm

    def load_cost(self, worker_class: str, model: str) -> float:
        """Objective charged for one worker of ``worker_class`` loading ``model``."""
        if self.switch_cost_weight == 0.0:
            return 0.0
        cost = self._load_costs.get((worker_class, model))
        if cost is None:
            same_model = [level for level in self.levels if level.model == model]
            load_time = max(
                self.profiles.profile(worker_class, lv.name).load_time_s for lv in same_model
            )
            value = max(lv.quality * self.throughput(worker_class, lv) for lv in same_model)
            cost = self.switch_cost_weight * load_time / self.period_s * value
            self._load_costs[worker_class, model] = cost
        return cost

    def family_load_cost(self, worker_class: str, model: str) -> float:
        """Objective charged for one worker of ``worker_class`` moving to ``model`` from
        another model of its family (:meth:`ProfileSet.family`): :meth:`load_cost` × the share
        of ``model``'s load it does not share with them (its UNet, within the SD-1.x family),
        the largest over the family's other models. :meth:`load_cost` without a family."""
        full = self.load_cost(worker_class, model)
        others = self.families.get(model, frozenset()) - {model}
        if not others:
            return full
        return full * max(self.profiles.load_share(model, other) for other in others)

    def move_cost(self, worker_class: str, model: str, held: str | None) -> float:
        """Objective charged for one worker holding ``held`` (None: nothing, a placement) that
        is given ``model``: nothing for its own model or a placement, the family's price
        within its family, else the whole load."""
        if held is None or held == model:
            return 0.0
        if held in self.families.get(model, frozenset()):
            return self.family_load_cost(worker_class, model)
        return self.load_cost(worker_class, model)

    @cached_property
    def families(self) -> dict[str, frozenset[str]]:
        """Each of the strategy's models → the strategy's models that share parts with it
        (itself included); a model sharing none is alone."""
        models = {level.model for level in self.levels}
        return {m: self.profiles.family(m) & models for m in models}

    @cached_property
    def _load_costs(self) -> dict[tuple[str, str], float]:
        """load_cost's answers so far: the program and the rounding ask for each again."""
        return {}

    @cached_property
    def _model_of_level(self) -> dict[str, str]:
        return {level.name: level.model for level in self.profiles.levels}

    def current_model(self, worker: WorkerState) -> str | None:
        """The model ``worker`` holds now (None: nothing loaded, or a level unknown here)."""
        return self._model_of_level.get(worker.level or "")

    @cached_property
    def worker_table(self) -> WorkerTable:
        """The live workers as arrays, for naming them (built once per problem)."""
        return _worker_table(self)

    @cached_property
    def holding(self) -> Counter[tuple[str, str | None]]:
        """Live workers per (class, model held); the switching cost's starting point."""
        return Counter((w.worker_class, self.current_model(w)) for w in self.live)


@dataclass
class Counts:
    """Solver output before workers are named: per (class, level index)."""

    workers: Counter[tuple[str, int]]
    load: defaultdict[tuple[str, int], float]
    switch_cost: float = 0.0

    @classmethod
    def empty(cls) -> Counts:
        return cls(Counter(), defaultdict(float))


def rounded_switch_cost(problem: Problem, workers: Counter[tuple[str, int]]) -> float:
    """The switching cost the aggregated programs would charge for these counts (their
    model-load terms in :mod:`argus.allocator.paper_eq1` and :mod:`argus.allocator.joint`).

    Per class: each model needs ``max(0, on it − holding it)`` loads. Within a family (models
    sharing parts) a load may come from a worker leaving another member, at the family's
    price; the family's growth, ``max(0, Σ on − Σ holding)`` over its members, must be whole
    loads. Workers holding nothing are placed free, up to their number, each where it saves
    most (one at a time)."""
    if problem.switch_cost_weight == 0.0:
        return 0.0
    total = 0.0
    for c in {c for c, _ in workers}:
        on_model = Counter[str]()
        for (wc, v), count in workers.items():
            if wc == c:
                on_model[problem.levels[v].model] += count
        total += _class_switch_cost(problem, c, on_model)
    return total


def _class_switch_cost(problem: Problem, c: str, on_model: Counter[str]) -> float:
    holding = problem.holding
    loads = {m: max(0, k - holding[c, m]) for m, k in on_model.items()}
    loads = {m: n for m, n in loads.items() if n > 0}
    free = holding[c, None]
    if not loads or free >= sum(loads.values()):
        return 0.0
    families: dict[frozenset[str], int] = {}  # family → whole loads its growth needs
    for m in loads:
        family = problem.families.get(m, frozenset({m}))
        if family not in families:
            growth = sum(on_model[x] - holding[c, x] for x in family)
            families[family] = max(0, growth)
    full = {m: problem.load_cost(c, m) for m in loads}
    part = {m: problem.family_load_cost(c, m) for m in loads}
    if all(part[m] >= full[m] for m in loads):  # no cheaper move: waive the costliest loads
        total = 0.0
        for price, count in sorted(((full[m], n) for m, n in loads.items()), reverse=True):
            spared = min(free, count)
            free -= spared
            total += price * (count - spared)
        return total

    def cost(waived: Counter[str]) -> float:
        value = 0.0
        for family, growth in families.items():
            members = [m for m in loads if m in family]
            left = {m: loads[m] - waived[m] for m in members}
            whole = max(0, growth - sum(waived[m] for m in members))
            value += sum(part[m] * n for m, n in left.items())
            for m in sorted(members, key=lambda m: full[m] - part[m]):
                take = min(whole, left[m])
                value += (full[m] - part[m]) * take
                whole -= take
        return value

    waived = Counter[str]()
    best = cost(waived)
    for _ in range(free):
        trials = []
        for m in loads:
            if waived[m] < loads[m]:
                waived[m] += 1
                trials.append((cost(waived), m))
                waived[m] -= 1
        if not trials:
            break
        best, m = min(trials)
        waived[m] += 1
    return best


def assign_workers(problem: Problem, counts: Counts) -> dict[str, str]:
    """Name the workers (see :func:`chosen_levels`): worker id → level name."""
    chosen = chosen_levels(problem, counts)
    names = [level.name for level in problem.levels]
    table = problem.worker_table
    return dict(zip(table.ids, [names[v] for v in chosen.tolist()], strict=True))


@dataclass(frozen=True)
class WorkerTable:
    """The live workers as arrays, in the order of their ids: what naming them reads."""

    ids: tuple[str, ...]
    classes: tuple[str, ...]  # the worker classes present, sorted
    worker_class: npt.NDArray[np.int64]  # index into ``classes``
    at_level: npt.NDArray[np.int64]  # index of its level among the strategy's, else -1
    has_level: npt.NDArray[np.bool_]  # it reported a level (of any strategy)
    holds: npt.NDArray[np.int64]  # index of its model among the strategy's models, else -1
    level_model: npt.NDArray[np.int64]  # [v]: the model index of level v


def _worker_table(problem: Problem) -> WorkerTable:
    live = sorted(problem.live, key=lambda w: w.worker_id)
    classes = tuple(sorted({w.worker_class for w in live}))
    class_of = {name: i for i, name in enumerate(classes)}
    level_of = {level.name: v for v, level in enumerate(problem.levels)}
    model_of = {name: m for m, name in enumerate(sorted({lv.model for lv in problem.levels}))}
    held = [problem.current_model(w) for w in live]
    return WorkerTable(
        ids=tuple(w.worker_id for w in live),
        classes=classes,
        worker_class=np.array([class_of[w.worker_class] for w in live], dtype=np.int64),
        at_level=np.array([level_of.get(w.level or "", -1) for w in live], dtype=np.int64),
        has_level=np.array([w.level is not None for w in live], dtype=np.bool_),
        holds=np.array([model_of.get(m, -1) if m else -1 for m in held], dtype=np.int64),
        level_model=np.array([model_of[lv.model] for lv in problem.levels], dtype=np.int64),
    )


IN_TURN_UP_TO = 64  # workers up to which chosen_levels names them one at a time


def chosen_levels(problem: Problem, counts: Counts) -> npt.NDArray[np.int64]:
    """The level index of each live worker, in the order of their ids.

    Workers take slots in the order of their ids, each pass as if one worker at a time took
    the first level it fits with a slot of its class left: 1. a worker already at a level
    with slots stays (no change at all); 2. one holding the model of a level with slots
    changes only K (no reload); 3. anyone left fills the remaining slots, best level first;
    4. spares carry no load and take the best level of the model they hold (headroom where
    quality is highest, no reload), else the best level. Within a pass the workers that fit
    the same levels fill them in turn, so each pass is a ranking in numpy, without a Python
    step per worker (at 4,096 workers that step was most of a solve). Up to
    ``IN_TURN_UP_TO`` workers the passes run one worker at a time instead
    (:func:`_chosen_in_turn`, the same levels): there numpy's calls cost more than the steps.
    """
    table = problem.worker_table
    n_levels = len(problem.levels)
    size = len(table.ids)
    class_of = {name: i for i, name in enumerate(table.classes)}
    slots = np.zeros((len(table.classes), n_levels), dtype=np.int64)
    for (name, v), count in counts.workers.items():
        if name in class_of and count > 0:
            slots[class_of[name], v] = count
    if size <= IN_TURN_UP_TO:
        return np.array(_chosen_in_turn(table, slots.tolist()), dtype=np.int64)
    return _chosen_ranked(table, slots)


def _chosen_ranked(table: WorkerTable, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """:func:`chosen_levels`'s passes as rankings in numpy; ``slots[class, level]`` are the
    workers each takes (used up)."""
    size, n_levels = len(table.ids), slots.shape[1]
    chosen = np.full(size, -1, dtype=np.int64)
    worker_class, at_level, holds = table.worker_class, table.at_level, table.holds
    # 1. keep the level: the group is (class, level), one level to fill
    _fill(chosen, slots, worker_class, at_level, at_level[:, None] == np.arange(n_levels))
    # 2. keep the model: the group is (class, model), its levels in order
    _fill(chosen, slots, worker_class, holds, holds[:, None] == table.level_model[None, :])
    # 3. anywhere: the group is the class, every level in order
    anywhere = np.zeros(size, dtype=np.int64)
    _fill(chosen, slots, worker_class, anywhere, np.ones((size, n_levels), dtype=np.bool_))
    # 4. spares: the best level of the model held, else the best level
    models = int(table.level_model.max()) + 1 if n_levels else 0
    first_on_model = np.array(
        [int(np.flatnonzero(table.level_model == m)[0]) for m in range(models)], dtype=np.int64
    )
    spare = np.where(holds >= 0, first_on_model[np.maximum(holds, 0)], 0)
    result: npt.NDArray[np.int64] = np.where(chosen >= 0, chosen, spare)
    return result


def _chosen_in_turn(table: WorkerTable, slots: list[list[int]]) -> list[int]:
    """:func:`chosen_levels`'s passes as the docstring tells them, one worker at a time in
    the order of their ids; ``slots[class][level]`` are the workers each takes (used up)."""
    size = len(table.ids)
    worker_class = table.worker_class.tolist()
    at_level = table.at_level.tolist()
    holds = table.holds.tolist()
    level_model = table.level_model.tolist()
    levels = range(len(level_model))
    chosen = [-1] * size

    def take(i: int, fits: Sequence[int]) -> None:
        left = slots[worker_class[i]]
        for v in fits:
            if left[v] > 0:
                left[v] -= 1
                chosen[i] = v
                return

    models = range(max(level_model, default=-1) + 1)
    on_model = [[v for v in levels if level_model[v] == m] for m in models]
    for i in range(size):  # 1. keep the level
        if at_level[i] >= 0:
            take(i, (at_level[i],))
    for i in range(size):  # 2. keep the model
        if chosen[i] < 0 and holds[i] >= 0:
            take(i, on_model[holds[i]])
    for i in range(size):  # 3. anywhere
        if chosen[i] < 0:
            take(i, levels)
    for i in range(size):  # 4. spares
        if chosen[i] < 0:
            chosen[i] = on_model[holds[i]][0] if holds[i] >= 0 else 0
    return chosen


def moved_workers(problem: Problem, chosen: npt.NDArray[np.int64]) -> int:
    """Workers that reported a level and are given another."""
    table = problem.worker_table
    return int((table.has_level & (table.at_level != chosen)).sum())


def _fill(
    chosen: npt.NDArray[np.int64],
    slots: npt.NDArray[np.int64],
    worker_class: npt.NDArray[np.int64],
    group: npt.NDArray[np.int64],
    fits: npt.NDArray[np.bool_],
) -> None:
    """One pass of :func:`assign_workers`: the workers without a level yet (``chosen`` -1)
    whose ``group`` is not -1 take, in their order, the levels ``fits`` marks for them, each
    level's slots of their class in level order, until the slots run out. Workers of one
    (class, group) fit the same levels, so the r-th of them takes the level whose run of
    slots covers r. Updates ``chosen`` and ``slots`` in place."""
    waiting = np.flatnonzero((chosen < 0) & (group >= 0))
    if waiting.size == 0:
        return
    key = worker_class[waiting] * (int(group.max()) + 1) + group[waiting]
    order = np.argsort(key, kind="stable")  # by group, the workers' own order inside
    waiting, key = waiting[order], key[order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    starts = np.repeat(first, np.diff(np.r_[first, key.size]))
    rank = np.arange(key.size) - starts  # place in its group's queue
    leaders = waiting[first]  # one worker per group: the group's class and levels
    runs = np.where(fits[leaders], slots[worker_class[leaders]], 0)  # [group, level]
    ends = np.cumsum(runs, axis=1)
    group_of = np.repeat(np.arange(first.size), np.diff(np.r_[first, key.size]))
    level = (ends[group_of] <= rank[:, None]).sum(axis=1)  # first level whose run covers r
    placed = level < runs.shape[1]
    chosen[waiting[placed]] = level[placed]
    taken = np.zeros_like(slots)
    np.add.at(taken, (worker_class[waiting[placed]], level[placed]), 1)
    slots -= taken
