"""What the approximate caches have been finding: lookups by similarity bin per AC level.

A request routed to an AC level looks its prompt up in its worker's cache; the nearest cached
prompt's similarity falls in one bin of the model's rule
(:class:`~argus.profiles.cache_evidence.SimilarityBins`; bin 0 is a miss, NaN — no neighbour —
included). :class:`CacheOutlook` counts those lookups per level and bin, with the sum of the
similarities seen in each bin, so a planner knows both how often a level misses and how close
its hits really are. It is plain counts (no rule, no profile), so the simulator, the allocator
and, later, a router's report can all carry it; :mod:`argus.allocator.cache_plan` turns it
into the service times and quality the plan uses.

Counts are floats: :meth:`CacheOutlook.decayed` ages old evidence away (the caches warm, and
what they find changes as they do), and :meth:`CacheOutlook.plus` adds a newer batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BinCounts:
    """One level's lookups: ``counts[b]`` lookups fell in bin b, their similarities summing to
    ``similarity_sums[b]`` (a NaN similarity, a cold cache, counts in bin 0 and adds nothing)."""

    counts: tuple[float, ...]
    similarity_sums: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.similarity_sums) or not self.counts:
            raise ValueError(
                f"counts and similarity_sums: need the same number (>= 1) of bins, got "
                f"{len(self.counts)} and {len(self.similarity_sums)}"
            )
        if any(not math.isfinite(c) or c < 0.0 for c in self.counts):
            raise ValueError(f"counts: must be finite and >= 0, got {self.counts}")

    @property
    def total(self) -> float:
        return sum(self.counts)

    def mean_similarity(self, index: int) -> float | None:
        """The mean similarity of bin ``index``'s lookups (None: none there)."""
        count = self.counts[index]
        return self.similarity_sums[index] / count if count > 0.0 else None


@dataclass(frozen=True)
class CacheOutlook:
    """Lookups per AC level name (see the module docstring); empty: no evidence yet."""

    levels: Mapping[str, BinCounts] = field(default_factory=dict)

    @classmethod
    def of_lookups(
        cls, lookups: Iterable[tuple[str, int, float]], bins: Mapping[str, int]
    ) -> CacheOutlook:
        """Counts from ``(level name, bin index, similarity)`` lookups; ``bins`` gives each
        level's number of bins (its model's rule's floors plus one)."""
        counts: dict[str, list[float]] = {}
        sums: dict[str, list[float]] = {}
        for level, index, similarity in lookups:
            size = bins[level]
            if not 0 <= index < size:
                raise ValueError(f"bin: level {level!r} has {size} bins, got bin {index}")
            counts.setdefault(level, [0.0] * size)[index] += 1.0
            row = sums.setdefault(level, [0.0] * size)
            if not math.isnan(similarity):
                row[index] += similarity
        return cls({name: BinCounts(tuple(c), tuple(sums[name])) for name, c in counts.items()})

    def decayed(self, keep: float) -> CacheOutlook:
        """This evidence weighing ``keep`` (in [0, 1]) of what it did."""
        if not 0.0 <= keep <= 1.0:
            raise ValueError(f"keep: must be in [0, 1], got {keep}")
        return CacheOutlook(
            {
                name: BinCounts(
                    tuple(c * keep for c in row.counts),
                    tuple(s * keep for s in row.similarity_sums),
                )
                for name, row in self.levels.items()
            }
        )

    def plus(self, newer: CacheOutlook) -> CacheOutlook:
        """This evidence and ``newer``'s together (a level's bins must agree)."""
        merged = dict(self.levels)
        for name, row in newer.levels.items():
            old = merged.get(name)
            if old is None:
                merged[name] = row
                continue
            if len(old.counts) != len(row.counts):
                raise ValueError(
                    f"levels[{name!r}]: {len(row.counts)} bins, expected {len(old.counts)}"
                )
            merged[name] = BinCounts(
                tuple(a + b for a, b in zip(old.counts, row.counts, strict=True)),
                tuple(a + b for a, b in zip(old.similarity_sums, row.similarity_sums, strict=True)),
            )
        return CacheOutlook(merged)
