"""What an approximate-cache hit is worth given its evidence: the similarity of the neighbour.

NIRVANA (Agarwal et al., NSDI '24, arXiv 2312.04429) picks the step K it resumes from by how
similar the retrieved prompt is: the closer the neighbour, the more steps it may skip, and below
the lowest floor it resumes from nothing (a miss, generated in full). In Argus the routed
level's K is a CEILING; the similarity decides how much of it is used. One rule serves the
worker, the router, the allocator and the simulator, so it lives here, on the profiles floor
(numpy and the standard library only).

* :class:`KRule` — similarity floors per K; :meth:`KRule.allowed_step` is the rule.
* :class:`ReuseQuality` — a SYNTHETIC model of what a hit at (similarity, K) scores.
* :class:`SimilarityBins` — the rule's floors as bins, for a planner that counts hits by bin.

Sources and assumptions (read before trusting a number):

* NIRVANA's published similarity thresholds per K could not be retrieved here (the stored
  copies of the paper reachable from this project hold its abstract and introduction, not the
  K-selection text or its hit-rate-per-K figures), so :data:`DEFAULT_FLOORS` are ASSUMED. They
  are set on all-MiniLM-L6-v2's cosine scale, the encoder Argus embeds prompts with
  (:mod:`argus.embedding`), from neighbours measured among the PartiPrompts eval prompts: at
  0.95+ a near paraphrase ("…waited at the bottom" / "…waited at the top"), about 0.88 the same
  scene with an attribute changed, about 0.70 the same subject in another scene ("a tiger in a
  field" / "a yellow tiger with blue stripes"), about 0.55 a shared object only ("a man riding
  a horse" / "a horse in a field in Minecraft style"). Early steps fix the layout, so a small K
  tolerates a same-subject neighbour and K = 25 (half of N = 50) wants a near paraphrase.
  NIRVANA measures similarity with CLIP text embeddings, whose scale differs (unrelated prompts
  score higher there); that a floor chosen this way plays the role of NIRVANA's is an
  assumption. Every model's floors can be set in its profile (``[models.X.cache]``).
* :class:`ReuseQuality` is an assumption too (NIRVANA's quality-versus-K-and-similarity figures
  were not retrievable either): reusing k of N steps from a neighbour at cosine distance 1 − s
  loses ``penalty · (k / N) · (1 − s)`` of the prompt's best score on top of what level k costs
  it with an identical neighbour, which is today's per-(prompt, level) AC quality table. With
  ``penalty = 1`` a neighbour right at the default floor costs 3.5 % (K = 5 at 0.65, K = 25 at
  0.93) to 5.4 % (K = 15 at 0.82) of the best score: the floors sit where the extra loss is
  about the same small amount, as floors picked for quality would.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_FLOORS: tuple[tuple[int, float], ...] = (
    (5, 0.65),
    (10, 0.75),
    (15, 0.82),
    (20, 0.88),
    (25, 0.93),
)
"""(K, the least cosine similarity that may resume at K), ASSUMED (see the module docstring)."""

RULE_SOURCE = (
    "ASSUMED floors on all-MiniLM-L6-v2 cosine similarity (NIRVANA's published CLIP thresholds "
    "not retrievable here; argus/profiles/cache_evidence.py)"
)


@dataclass(frozen=True)
class KRule:
    """NIRVANA's similarity → K table: ``floors`` pairs each K with the least similarity that
    may resume there, K ascending, floors never falling as K grows. A similarity below the
    lowest floor resumes nowhere: a miss, served in full."""

    floors: tuple[tuple[int, float], ...] = DEFAULT_FLOORS
    source: str = RULE_SOURCE  # where the numbers come from, for reports

    def __post_init__(self) -> None:
        floors = tuple((int(k), float(s)) for k, s in self.floors)
        object.__setattr__(self, "floors", floors)
        if not floors:
            raise ValueError("floors: a rule needs at least one (K, similarity) pair")
        for k, s in floors:
            if k < 1:
                raise ValueError(f"floors: K must be >= 1, got {k}")
            if not -1.0 <= s <= 1.0:
                raise ValueError(f"floors: similarity for K={k} must be in [-1, 1], got {s}")
        steps = [k for k, _ in floors]
        if steps != sorted(set(steps)):
            raise ValueError(f"floors: K must be strictly ascending, got {steps}")
        for (k0, s0), (k1, s1) in itertools.pairwise(floors):
            if s1 < s0:
                raise ValueError(
                    f"floors: K={k1} may not need less similarity ({s1}) than K={k0} ({s0})"
                )

    @property
    def steps(self) -> tuple[int, ...]:
        """The K of the table, ascending."""
        return tuple(k for k, _ in self.floors)

    def floor_of(self, step: int) -> float | None:
        """The least similarity that may resume at ``step``: the floor of the smallest K of
        the table at or above it (a step between two K needs what the larger one needs);
        None above the table's largest K (never allowed)."""
        index = bisect.bisect_left(self.steps, step)
        return None if index == len(self.floors) else self.floors[index][1]

    def allowed_step(
        self, similarity: float, ceiling: int, cached_steps: Iterable[int] | None = None
    ) -> int:
        """The largest cached step at most ``ceiling`` that ``similarity`` allows; 0 means a
        miss, served in full. ``cached_steps``: the steps the cache keeps latents at (None:
        the table's K). A NaN similarity (no neighbour) is a miss."""
        if math.isnan(similarity):
            return 0
        candidates = self.steps if cached_steps is None else cached_steps
        best = 0
        for step in candidates:
            if 0 < step <= ceiling and step > best:
                floor = self.floor_of(step)
                if floor is not None and similarity >= floor:
                    best = step
        return best

    def bins(self) -> SimilarityBins:
        """The rule's floors as similarity bins (:class:`SimilarityBins`)."""
        return SimilarityBins(self)

    @classmethod
    def from_section(cls, section: Mapping[str, Any], where: str = "cache") -> KRule:
        """A rule from a profile's ``[models.X.cache]`` table: ``floors = { "5" = 0.65,
        "10" = 0.75, … }`` (K as keys, similarity floors as values). ``ValueError`` names the
        field (``where`` is the table's path)."""
        unknown = sorted(set(section) - {"floors"})
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown key (expected floors)")
        raw = section.get("floors")
        if not isinstance(raw, Mapping) or not raw:
            raise ValueError(f"{where}.floors: must be a table of K = similarity, got {raw!r}")
        pairs = []
        for key, value in raw.items():
            try:
                step = int(str(key))
            except ValueError:
                raise ValueError(f"{where}.floors.{key}: K must be an integer") from None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{where}.floors.{key}: must be a number, got {value!r}")
            pairs.append((step, float(value)))
        try:
            return cls(tuple(sorted(pairs)), source=f"profile {where}")
        except ValueError as exc:
            raise ValueError(f"{where}.{exc}") from None


DEFAULT_RULE = KRule()


@dataclass(frozen=True)
class ReuseQuality:
    """SYNTHETIC: the score of an image resumed at step ``step`` of ``total_steps`` from a
    neighbour of cosine similarity ``similarity`` (see the module docstring): the score the
    prompt gets at that step with an identical neighbour, less ``penalty · (step /
    total_steps) · (1 − similarity)`` of its best score. At similarity 1, or at step 0 (a full
    generation), it is the table's score unchanged."""

    penalty: float = 1.0
    total_steps: int = 50

    def __post_init__(self) -> None:
        if not (math.isfinite(self.penalty) and self.penalty >= 0.0):
            raise ValueError(f"penalty: must be >= 0, got {self.penalty}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps: must be >= 1, got {self.total_steps}")

    def loss(self, similarity: float, step: int) -> float:
        """The share of the best score lost to the neighbour's difference (0 when identical)."""
        distance = 1.0 - min(max(similarity, 0.0), 1.0)
        return self.penalty * (step / self.total_steps) * distance

    def score(self, at_step: float, best: float, similarity: float, step: int) -> float:
        """The score of the image: ``at_step`` (the table's score at ``step``) less the loss,
        never below a thousandth of ``best`` (scores stay positive for the δ rule's ratios)."""
        return max(at_step - self.loss(similarity, step) * best, 1e-3 * best)


@dataclass(frozen=True)
class SimilarityBins:
    """Similarity in as many bins as the rule has floors, plus one below them all: bin 0 is a
    miss, bin i (1 … n) allows K up to the i-th K of the table. A planner that counts the
    requests it expects per bin knows the K each would really get, whatever its ceiling."""

    rule: KRule

    def __len__(self) -> int:
        return len(self.rule.floors) + 1

    @property
    def edges(self) -> tuple[float, ...]:
        """The lower edges of bins 1 … n (the rule's floors)."""
        return tuple(s for _, s in self.rule.floors)

    def index(self, similarity: float) -> int:
        """The bin of ``similarity`` (0 for NaN: no neighbour)."""
        if math.isnan(similarity):
            return 0
        return bisect.bisect_right(self.edges, similarity)

    def max_step(self, index: int) -> int:
        """The largest K a neighbour in bin ``index`` allows (0: the miss bin)."""
        return 0 if index == 0 else self.rule.floors[index - 1][0]

    def lower(self, index: int) -> float:
        """The least similarity of bin ``index`` (−1 for the miss bin): what a planner pricing
        the bin's quality may count on."""
        return -1.0 if index == 0 else self.edges[index - 1]

    def labels(self) -> tuple[str, ...]:
        """``miss (< 0.65)``, ``K<=5 [0.65, 0.75)``, …, one per bin."""
        edges = self.edges
        out = [f"miss (< {edges[0]:g})"]
        for i, (step, low) in enumerate(self.rule.floors):
            high = f"{edges[i + 1]:g})" if i + 1 < len(edges) else "1]"
            out.append(f"K<={step} [{low:g}, {high}")
        return tuple(out)
