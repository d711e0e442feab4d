"""What an AC level is really worth when its cache misses: the planner's view of the evidence.

An AC level's K is a ceiling. A request routed there resumes at the step its neighbour's
similarity allows (:meth:`~argus.profiles.cache_evidence.KRule.allowed_step`), and at none on
a miss, when it is generated in full after the search. Planning every level as a hit at its K
overstates its capacity (a miss costs the K = 0 time) and its speed-up, so at high load the
plan overcommits exactly the levels the caches fail. :class:`CachePlanner` turns a
:class:`~argus.contracts.cache_outlook.CacheOutlook` (lookups per level and similarity bin)
into the two inputs the allocator's program already takes, keeping its shape:

* :meth:`CachePlanner.profiles`: each AC level's latency becomes the expectation over bins,
  Σ_b P(b | v) · t(step of bin b under v's ceiling), a miss costing the model's K = 0
  latency plus the search (``lookup_s``); its throughput scales inversely, so capacity and
  the queueing caps count the misses;
* :meth:`CachePlanner.quality`: Q(v | c) becomes Σ_b P(b | v) · (Q(level of b's step | c) −
  the reuse loss at the bin's typical similarity), the loss from
  :class:`~argus.profiles.cache_evidence.ReuseQuality` (SYNTHETIC) on the class's best score.

P(b | v) is a Dirichlet estimate with a pseudo-count prior. The similarity of a prompt's
nearest cached neighbour depends on the cache and the prompt, not on the ceiling the prompt was
routed at, so a level's prior is the pooled evidence of every level (``prior_lookups`` pseudo
lookups): a level planned around for a while borrows what the others see instead of being
written off; with no evidence at all the pool is uniform over the bins (a miss one time in
``len(bins)``, hits spread over every K), so a cold start neither assumes a perfect cache nor
plans AC away before a single lookup. A bin's typical similarity is the mean of its lookups,
the bin's middle before any.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from argus.contracts.cache_outlook import CacheOutlook
from argus.profiles.cache_evidence import DEFAULT_RULE, KRule, ReuseQuality, SimilarityBins
from argus.types import ClassQuality, Level, ProfileSet, Strategy


@dataclass(frozen=True)
class CachePlanner:
    """Evidence → planned AC service times and quality (see the module docstring)."""

    rules: Mapping[str, KRule] = field(default_factory=dict)
    """Model → its similarity → K rule; a model not named uses the default rule."""

    reuse: ReuseQuality = field(default_factory=ReuseQuality)
    """What a hit at (similarity, K) loses (SYNTHETIC)."""

    lookup_s: float = 0.0
    """Seconds a miss spends searching before its full generation."""

    prior_lookups: float = 20.0
    """Pseudo lookups of the pooled evidence each level starts from (and of the uniform prior
    the pool starts from): about one planning period of one level's lookups at low load."""

    half_life_s: float = 120.0
    """Lookups weigh half as much this much later: the caches warm, and what they find
    changes as they do (two planning periods of the default)."""

    def merged(self, outlook: CacheOutlook, newer: CacheOutlook, elapsed_s: float) -> CacheOutlook:
        """``outlook`` aged by ``elapsed_s`` plus the ``newer`` lookups."""
        keep = 0.5 ** (max(elapsed_s, 0.0) / self.half_life_s)
        return outlook.decayed(keep).plus(newer)

    def __post_init__(self) -> None:
        if self.lookup_s < 0.0:
            raise ValueError(f"lookup_s: must be >= 0, got {self.lookup_s}")
        if not self.prior_lookups > 0.0:
            raise ValueError(f"prior_lookups: must be > 0, got {self.prior_lookups}")
        if not self.half_life_s > 0.0:
            raise ValueError(f"half_life_s: must be > 0, got {self.half_life_s}")

    def rule(self, model: str) -> KRule:
        return self.rules.get(model, DEFAULT_RULE)

    def bins(self, level: Level) -> SimilarityBins:
        return self.rule(level.model).bins()

    def bin_counts(self, profiles: ProfileSet) -> dict[str, int]:
        """AC level name → its number of bins (for :meth:`CacheOutlook.of_lookups`)."""
        return {level.name: len(self.bins(level)) for level in profiles.levels_for(Strategy.AC)}

    # -- the estimate ------------------------------------------------------------------------

    def probabilities(self, outlook: CacheOutlook, level: Level) -> tuple[float, ...]:
        """P(bin | level): the level's lookups plus ``prior_lookups`` of the pooled ones."""
        size = len(self.bins(level))
        pooled = [self.prior_lookups / size] * size
        for row in outlook.levels.values():
            if len(row.counts) == size:
                pooled = [p + c for p, c in zip(pooled, row.counts, strict=True)]
        total = sum(pooled)
        own = outlook.levels.get(level.name)
        counts = own.counts if own is not None and len(own.counts) == size else (0.0,) * size
        weights = [c + self.prior_lookups * p / total for c, p in zip(counts, pooled, strict=True)]
        norm = sum(weights)
        return tuple(w / norm for w in weights)

    def typical_similarity(self, outlook: CacheOutlook, level: Level, index: int) -> float:
        """The similarity bin ``index`` is priced at: its lookups' mean over every level, the
        bin's middle when none fell there (1 for the top bin's upper edge)."""
        bins = self.bins(level)
        count = total = 0.0
        for row in outlook.levels.values():
            if len(row.counts) == len(bins):
                count += row.counts[index]
                total += row.similarity_sums[index]
        if count > 0.0:
            return total / count
        high = bins.edges[index] if index < len(bins.edges) else 1.0
        return (bins.lower(index) + high) / 2.0

    def outcomes(
        self, outlook: CacheOutlook, level: Level, steps: Sequence[int]
    ) -> list[tuple[float, int, float]]:
        """(P(b), the step bin b resumes at under ``level``'s ceiling, its typical similarity)
        for every bin; ``steps``: the K the model's AC levels resume at."""
        rule = self.rule(level.model)
        found = []
        for index, p in enumerate(self.probabilities(outlook, level)):
            similarity = self.typical_similarity(outlook, level, index)
            step = 0 if index == 0 else rule.allowed_step(similarity, level.skip_steps, steps)
            found.append((p, step, similarity))
        return found

    # -- what the plan uses ------------------------------------------------------------------

    def profiles(self, profiles: ProfileSet, outlook: CacheOutlook) -> ProfileSet:
        """``profiles`` with each AC level of K > 0 at its expected latency over the bins on
        every class (a miss: the model's K = 0 latency plus ``lookup_s``), its throughput
        scaled inversely. Other levels, load times and memory are kept."""
        table = dict(profiles.table)
        for by_step in profiles.ac_levels_by_model().values():
            full = by_step.get(0)
            if full is None:
                continue  # no full level to miss to: nothing to price a miss with
            steps = sorted(by_step)
            for level in by_step.values():
                if level.skip_steps == 0:
                    continue
                outcomes = self.outcomes(outlook, level, steps)
                for worker_class in profiles.worker_classes:
                    entry = profiles.table.get((worker_class, level.name))
                    if entry is None:
                        continue
                    expected = 0.0
                    for p, step, _ in outcomes:
                        served = profiles.profile(worker_class, by_step[step].name).latency_s
                        expected += p * (served + (self.lookup_s if step == 0 else 0.0))
                    factor = expected / entry.latency_s
                    table[(worker_class, level.name)] = replace(
                        entry, latency_s=expected, throughput_qpm=entry.throughput_qpm / factor
                    )
        return replace(profiles, table=table)

    def quality(
        self, profiles: ProfileSet, quality: ClassQuality, outlook: CacheOutlook
    ) -> ClassQuality:
        """Q(v | c) of the AC strategy as an expectation over the bins of level v (see the
        module docstring); a level of K = 0 keeps its row entries."""
        index = {name: i for i, name in enumerate(quality.levels)}
        by_name = {level.name: level for level in profiles.levels_for(Strategy.AC)}
        models = profiles.ac_levels_by_model()
        rows = [list(row) for row in quality.quality]
        for v, name in enumerate(quality.levels):
            level = by_name.get(name)
            if level is None or level.skip_steps == 0:
                continue
            by_step = models[level.model]
            if 0 not in by_step:
                continue
            outcomes = self.outcomes(outlook, level, sorted(by_step))
            for c, row in enumerate(quality.quality):
                best = max(row)
                expected = 0.0
                for p, step, similarity in outcomes:
                    at_step = row[index[by_step[step].name]]
                    expected += p * self.reuse.score(at_step, best, similarity, step)
                rows[c][v] = expected
        return replace(quality, quality=tuple(tuple(row) for row in rows))
