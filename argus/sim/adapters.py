"""Adapters on requests: Katz's production statistics, and what they cost a request.

Katz (USENIX ATC '25, ``shared/papers/000_*.txt``) characterises a 20-day, 500k-request trace
of two production text-to-image services (§3). Nearly every request carries ControlNets and
LoRAs, and they change latency a lot. This module turns the published statistics into a seeded
sampler (for ``argus replay`` and the demo client) and into the extra seconds each request
costs under two workflows.

**The statistics** (:data:`KATZ_SERVICE_A`, :data:`KATZ_SERVICE_B`), as published:

* ControlNets and LoRAs per request: Table 1 (A: 30.5 % one ControlNet, 69.5 % two; LoRAs
  0.2 % none, 8.8 % one, 91 % two);
* ControlNet population and skew, §3.1: A offers 47 ControlNets and its top 5 take 98 % of
  the invocations; B offers 94 and its top 8 take 95 %;
* LoRA population and tail, §3.2: A uses 6,980 LoRAs of which 6,968 (99.8 %) each take less
  than 1 % of the invocations, so 12 take 1 % or more; B uses 7,463, 14 of them at ≥ 1 %.

**The fits**, the adapters' **names** and the workflows' **costs** (Katz's Eq. 1 for the
sequential workflow, Eq. 2 for its own; SDXL on H800) are explained in
``docs/control-plane-internals.md`` ("Adapters in the simulator"); :class:`AdapterCosts` cites
each number. ``python -m argus.sim.adapters`` prints the fitted parameters and the statistics
of a large sample against the targets; the tests check the same.

In the simulator (:mod:`argus.sim.cluster`) each request pays its own adapter seconds, while
policies plan with :func:`with_adapter_costs`: the profiles as they would be measured on such
traffic (each level's latency plus its mean adapter seconds).

One consequence worth knowing: BAL hides the LoRA fetch behind the first K = 10 steps, and an
AC level resuming at K ≥ 10 runs none of them, so approximate caching and BAL compete for the
same early steps; only queueing hides the fetch there.

This module is control plane: numpy only, no torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from argus.types import ProfileSet

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

CONTROLNET = "controlnet"
LORA = "lora"

# ControlNet names by popularity rank. The first eight are in both tiny catalogs
# (argus/worker/adapters/controlnet/models.py TINY_NAMES, sd15 and sdxl); then SD-1.5-only and
# SDXL-only ones; ranks past these get ``cn-<rank>``.
CONTROLNET_NAMES = (
    "canny",
    "depth",
    "openpose",
    "lineart",
    "softedge",
    "scribble",
    "tile",
    "normal",
    "mlsd",
    "seg",
    "shuffle",
    "inpaint",
    "recolor",
    "blur",
)
DEFAULT_SCALE = 1.0


@dataclass(frozen=True)
class AdapterMix:
    """The adapter statistics of one production service (Katz §3)."""

    name: str
    controlnet_counts: tuple[float, ...]
    """P(a request carries m ControlNets), m = 0, 1, 2, … (Table 1)."""

    lora_counts: tuple[float, ...]
    """P(a request carries n LoRAs), n = 0, 1, 2, … (Table 1)."""

    controlnet_population: int
    """Distinct ControlNets the service offers (§3.1)."""

    controlnet_top: int
    controlnet_top_share: float
    """The ``controlnet_top`` most popular take this share of invocations (§3.1)."""

    lora_population: int
    """Distinct LoRAs in the trace (§3.2)."""

    lora_popular: int
    """LoRAs that each take at least 1 % of the invocations (§3.2)."""

    def __post_init__(self) -> None:
        for label, counts in (("controlnet", self.controlnet_counts), ("lora", self.lora_counts)):
            if not math.isclose(sum(counts), 1.0, abs_tol=1e-9) or min(counts) < 0:
                raise ValueError(f"{self.name}: {label}_counts must be probabilities, {counts}")
            if len(counts) > 4:
                raise ValueError(f"{self.name}: at most 3 {label}s per request, got {counts}")
        if self.controlnet_population < len(self.controlnet_counts) - 1:
            raise ValueError(f"{self.name}: fewer ControlNets than a request draws")
        if not 0 < self.controlnet_top < self.controlnet_population:
            raise ValueError(f"{self.name}: controlnet_top {self.controlnet_top} out of range")
        if not 0 < self.lora_popular < self.lora_population:
            raise ValueError(f"{self.name}: lora_popular {self.lora_popular} out of range")


KATZ_SERVICE_A = AdapterMix(
    name="katz-a",
    controlnet_counts=(0.0, 0.305, 0.695),
    lora_counts=(0.002, 0.088, 0.91),
    controlnet_population=47,
    controlnet_top=5,
    controlnet_top_share=0.98,
    lora_population=6980,
    lora_popular=6980 - 6968,
)
KATZ_SERVICE_B = AdapterMix(
    name="katz-b",
    controlnet_counts=(0.019, 0.251, 0.699, 0.031),
    lora_counts=(0.072, 0.736, 0.192),
    controlnet_population=94,
    controlnet_top=8,
    controlnet_top_share=0.95,
    lora_population=7463,
    lora_popular=7463 - 7449,
)
MIXES = {mix.name: mix for mix in (KATZ_SERVICE_A, KATZ_SERVICE_B)}
LORA_HEAD_OFFSET = 1.0  # Zipf–Mandelbrot offset of the LoRA fit (see the module docstring)
POPULAR_SHARE = 0.01  # §3.2's threshold: "each account for less than 1% of invocations"


# -- popularity ------------------------------------------------------------------------------


def zipf_weights(population: int, exponent: float, offset: float = 0.0) -> FloatArray:
    """Normalised weights ∝ (rank + offset)^-exponent, rank 1 … population."""
    ranks = np.arange(1, population + 1, dtype=np.float64) + offset
    weights = ranks**-exponent
    normalised: FloatArray = weights / weights.sum()
    return normalised


def invocation_shares(weights: FloatArray, counts: Sequence[float]) -> FloatArray:
    """Each adapter's share of all invocations when a request with k adapters draws k distinct
    ones in turn, each with probability ∝ ``weights`` among those not yet drawn.

    Exact for up to three per request: the chance that adapter i is the r-th draw is
    p_i, p_i Σ_{j≠i} p_j/(1−p_j) and p_i Σ_{j≠l; j,l≠i} p_j p_l / ((1−p_j)(1−p_j−p_l)).
    """
    p = np.asarray(weights, dtype=np.float64)
    most = len(counts) - 1
    if most > 3:
        raise ValueError(f"at most 3 adapters per request, got counts {tuple(counts)}")
    by_draw = [p]
    if most >= 2:
        odds = p / (1.0 - p)
        by_draw.append(p * (odds.sum() - odds))
    if most >= 3:
        pj, pl = p[:, None], p[None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            pair = pj * pl / ((1.0 - pj) * (1.0 - pj - pl))
        np.fill_diagonal(pair, 0.0)
        by_draw.append(p * (pair.sum() - pair.sum(axis=1) - pair.sum(axis=0)))
    invoked = np.zeros_like(p)
    for k, chance in enumerate(counts):
        if k:
            invoked += chance * np.sum(by_draw[:k], axis=0)
    total = invoked.sum()
    shares: FloatArray = invoked / total if total > 0 else invoked
    return shares


@dataclass(frozen=True, eq=False)
class PopularityFit:
    """A fitted popularity: weights by rank (rank 1 first) and the invocation shares."""

    exponent: float
    offset: float
    weights: FloatArray = field(repr=False)
    shares: FloatArray = field(repr=False)


def _bisect(f: Callable[[float], float], lo: float, hi: float) -> float:
    """A root of ``f`` in [lo, hi], where f(lo) and f(hi) differ in sign."""
    f_lo = f(lo)
    if f_lo * f(hi) > 0:
        raise ValueError(f"no root in [{lo}, {hi}]")
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        f_mid = f(mid)
        if (f_mid > 0) == (f_lo > 0):
            lo, f_lo = mid, f_mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _fit(population: int, counts: Sequence[float], exponent: float, offset: float) -> PopularityFit:
    weights = zipf_weights(population, exponent, offset)
    return PopularityFit(exponent, offset, weights, invocation_shares(weights, counts))


def fit_controlnet_popularity(mix: AdapterMix) -> PopularityFit:
    """Zipf over the ControlNets whose top-k invocation share is the published one."""

    def excess(s: float) -> float:
        shares = _fit(mix.controlnet_population, mix.controlnet_counts, s, 0.0).shares
        return float(shares[: mix.controlnet_top].sum()) - mix.controlnet_top_share

    exponent = _bisect(excess, 0.01, 20.0)
    return _fit(mix.controlnet_population, mix.controlnet_counts, exponent, 0.0)


def fit_lora_popularity(mix: AdapterMix) -> PopularityFit:
    """Zipf–Mandelbrot over the LoRAs with ``lora_popular`` of them at ≥ 1 % (smaller root)."""
    k = mix.lora_popular

    def boundary(s: float) -> float:
        shares = _fit(mix.lora_population, mix.lora_counts, s, LORA_HEAD_OFFSET).shares
        return math.sqrt(shares[k - 1] * shares[k]) - POPULAR_SHARE

    # the boundary share rises with s, peaks, then falls as the head takes everything
    grid = np.linspace(0.2, 4.0, 39)
    values = [boundary(float(s)) for s in grid]
    peak = int(np.argmax(values))
    if values[peak] <= 0:
        raise ValueError(f"{mix.name}: no Zipf–Mandelbrot exponent gives {k} LoRAs at >= 1%")
    exponent = _bisect(boundary, float(grid[0]), float(grid[peak]))
    return _fit(mix.lora_population, mix.lora_counts, exponent, LORA_HEAD_OFFSET)


@dataclass(frozen=True, eq=False)
class Popularity:
    controlnets: PopularityFit
    loras: PopularityFit


@functools.cache
def popularity(mix: AdapterMix) -> Popularity:
    """The fitted popularity of ``mix`` (computed once per mix, a few milliseconds)."""
    return Popularity(fit_controlnet_popularity(mix), fit_lora_popularity(mix))


def controlnet_name(rank: int) -> str:
    """The name of the ControlNet of popularity rank ``rank`` (0-based)."""
    return CONTROLNET_NAMES[rank] if rank < len(CONTROLNET_NAMES) else f"cn-{rank + 1:03d}"


def lora_name(rank: int) -> str:
    """The name of the LoRA of popularity rank ``rank`` (0-based)."""
    return f"lora-{rank + 1:05d}"


# -- sampling --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class AdapterDraws:
    """The adapters of n requests as popularity ranks (0-based), -1 where a request has fewer.

    ``controlnets`` is (n, most ControlNets per request), ``loras`` (n, most LoRAs).
    """

    mix: AdapterMix
    controlnets: IntArray
    loras: IntArray

    def __len__(self) -> int:
        return int(self.controlnets.shape[0])

    @property
    def controlnet_count(self) -> IntArray:
        counts: IntArray = (self.controlnets >= 0).sum(axis=1)
        return counts

    @property
    def lora_count(self) -> IntArray:
        counts: IntArray = (self.loras >= 0).sum(axis=1)
        return counts

    def uncached_controlnets(self, cached: int) -> IntArray:
        """Per request, the ControlNets outside the ``cached`` most popular."""
        counts: IntArray = (self.controlnets >= cached).sum(axis=1)
        return counts

    def adapters(self, i: int) -> list[tuple[str, str, float]]:
        """Request ``i``'s adapters as (kind, name, scale), ControlNets first."""
        found = [
            (CONTROLNET, controlnet_name(int(r)), DEFAULT_SCALE)
            for r in self.controlnets[i]
            if r >= 0
        ]
        found += [(LORA, lora_name(int(r)), DEFAULT_SCALE) for r in self.loras[i] if r >= 0]
        return found


def _distinct(
    rng: np.random.Generator, weights: FloatArray, counts: IntArray, most: int
) -> IntArray:
    """Per request, ``counts[i]`` distinct ranks drawn in turn ∝ ``weights`` (no repeats)."""
    ranks = np.full((counts.size, most), -1, dtype=np.int64)
    population = weights.size
    for column in range(most):
        rows = np.flatnonzero(counts > column)
        picks = rng.choice(population, size=rows.size, p=weights)
        # a repeat is drawn again: rejection gives exactly p_i / (1 - Σ drawn) per request
        while rows.size:
            clash = (ranks[rows, :column] == picks[:, None]).any(axis=1)
            if not clash.any():
                break
            picks[clash] = rng.choice(population, size=int(clash.sum()), p=weights)
        ranks[rows, column] = picks
    return ranks


def draw_adapters(
    count: int,
    rng: np.random.Generator,
    mix: AdapterMix = KATZ_SERVICE_A,
    *,
    controlnets: int | None = None,
) -> AdapterDraws:
    """The adapters of ``count`` requests, seeded by ``rng``.

    ``controlnets`` keeps only the that many most popular ControlNets (their weights
    renormalised): a client whose service has fewer ControlNets than the production one.
    """
    fit = popularity(mix)
    cn_weights = fit.controlnets.weights
    if controlnets is not None:
        most = len(mix.controlnet_counts) - 1
        if not most <= controlnets:
            raise ValueError(f"controlnets: need at least {most}, got {controlnets}")
        cn_weights = cn_weights[:controlnets] / cn_weights[:controlnets].sum()
    cn_counts = rng.choice(len(mix.controlnet_counts), size=count, p=mix.controlnet_counts)
    lora_counts = rng.choice(len(mix.lora_counts), size=count, p=mix.lora_counts)
    return AdapterDraws(
        mix,
        _distinct(rng, cn_weights, cn_counts, len(mix.controlnet_counts) - 1),
        _distinct(rng, fit.loras.weights, lora_counts, len(mix.lora_counts) - 1),
    )


# -- costs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterCosts:
    """What adapters add to a request, from Katz's measurements (SDXL; H800 unless said)."""

    steps: int = 50
    """Denoising steps N of the profiled levels (Argus §5.1; Katz §9.1 uses 50 too)."""

    controlnet_sequential_fraction: float = 1.6 / 2.9
    """Sequential workflow: each ControlNet adds this fraction of the base compute (§3.1,
    Fig. 2: one ControlNet takes SDXL from 2.9 s to 4.5 s; more add up, §3.4)."""

    controlnet_service_fraction: float = 0.0225
    """ControlNet-as-a-Service: what each ControlNet still adds, as a fraction of the base
    compute (sync overhead). §9.3 measures 1.42× against Gustafson's ideal 1.45× with one
    ControlNet and 2.2× against 2.35× with three, i.e. 2.1 % and 6.8 % over the ideal (the
    base alone); a line through the origin fits 2.25 % per ControlNet."""

    controlnet_load_s: float = 3.84
    """Loading one ControlNet that is not resident: 3 GiB (§3.1) at the ≈ 800 MiB/s §3.2
    measures for fetching LoRAs from the remote cache (derived, not measured in the paper)."""

    controlnet_cached: int = 5
    """ControlNets resident on the GPUs, the most popular first: top 5 suffice for service A
    (§3.1, Fig. 6); both workflows get the same residency."""

    lora_sequential_s: tuple[float, ...] = (0.0, 0.8 * 2.9, 1.1 * 2.9)
    """Sequential workflow: loading and PEFT create-and-replace patching of 0, 1, 2 LoRAs
    (§9.4, Fig. 16-right: +80 % with one LoRA of 341 MiB, 2.1× with two, over 2.9 s). More
    LoRAs add the last step again."""

    lora_fetch_s: float = 0.5
    """BAL workflow: fetching a request's LoRAs from the remote cache. One LoRA takes about
    0.5 s (§3.2: two, ≈ 800 MiB, take "more than one second" one after the other); BAL loads
    them in parallel processes (§8), so a request's LoRAs take about one fetch (assumed). That
    fits §6's observation that loading mostly finishes within the first K = 10 steps (0.58 s
    on H800, 0.84 s on A100)."""

    lora_patch_s: float = 0.115
    """BAL workflow: in-place patching and what remains of the loading, per LoRA (§9.4:
    "reducing the LoRA loading and patching overhead to 230 ms" with two LoRAs)."""

    bal_bound_steps: int = 10
    """BAL's asynchrony bound K: LoRAs load during the first K steps, then the UNet waits for
    them (§6: profiled K = 10)."""

    def lora_sequential(self, count: IntArray) -> FloatArray:
        table = np.asarray(self.lora_sequential_s, dtype=np.float64)
        last = len(table) - 1
        step = table[last] - table[last - 1]
        capped = np.minimum(count, last)
        seconds: FloatArray = table[capped] + np.maximum(count - last, 0) * step
        return seconds


WORKFLOWS = ("katz", "sequential")


@dataclass(frozen=True)
class AdapterModel:
    """Which adapters requests carry (``mix``) and how a worker serves them (``workflow``):
    ``katz`` is Argus's (ControlNet-as-a-Service in parallel, BAL LoRA; Katz Eq. 2),
    ``sequential`` the naive pipeline of Katz Eq. 1 (diffusers' own)."""

    workflow: str = "katz"
    mix: AdapterMix = KATZ_SERVICE_A
    costs: AdapterCosts = AdapterCosts()

    def __post_init__(self) -> None:
        if self.workflow not in WORKFLOWS:
            raise ValueError(
                f"adapter workflow {self.workflow!r}: expected one of {', '.join(WORKFLOWS)}"
            )

    def describe(self) -> str:
        fit = popularity(self.mix)
        served = {
            "katz": "ControlNet-as-a-Service in parallel + bounded async LoRA loading (Eq. 2)",
            "sequential": "sequential ControlNets + load-then-patch LoRAs (Eq. 1)",
        }[self.workflow]
        return (
            f"{self.workflow}: Katz {self.mix.name} mix (Table 1 counts; "
            f"{self.mix.controlnet_population} ControlNets, Zipf s={fit.controlnets.exponent:.2f}, "
            f"top {self.mix.controlnet_top} = {self.mix.controlnet_top_share:.0%}; "
            f"{self.mix.lora_population:,} LoRAs, Zipf-Mandelbrot "
            f"s={fit.loras.exponent:.2f} q={fit.loras.offset:g}); served with {served}; "
            f"top {self.costs.controlnet_cached} ControlNets resident"
        )


ADAPTER_CHOICES = ("katz", "sequential", "none")


def adapter_model_by_name(name: str) -> AdapterModel | None:
    """``argus replay --adapters``: ``katz``, ``sequential`` or ``none`` (no adapters)."""
    key = name.strip().lower()
    if key == "none":
        return None
    if key in WORKFLOWS:
        return AdapterModel(workflow=key)
    raise ValueError(f"--adapters: expected one of {', '.join(ADAPTER_CHOICES)}, got {name!r}")


@dataclass(frozen=True, eq=False)
class AdapterCost:
    """Per request, the seconds adapters add at one level: ``fixed_s`` always, plus what of
    ``hideable_s`` the request's wait in the worker's queue does not hide (see
    :meth:`seconds`)."""

    fixed_s: FloatArray
    hideable_s: FloatArray

    def seconds(self, wait_s: float | FloatArray = 0.0) -> FloatArray:
        """Added seconds when each request waited ``wait_s`` before its denoising began."""
        added: FloatArray = self.fixed_s + np.maximum(self.hideable_s - wait_s, 0.0)
        return added


def adapter_cost(
    model: AdapterModel, draws: AdapterDraws, latency_s: float, skip_steps: int
) -> AdapterCost:
    """What adapters add to each request served at a level of ``latency_s`` (profiled,
    adapters excluded) that skips ``skip_steps`` of the N steps (AC's K; 0 for SM).

    ``katz``: each ControlNet adds ``controlnet_service_fraction`` × latency; each LoRA its
    patching, plus the fetch that neither the queue wait nor the steps before BAL's bound hide:
    BAL starts loading when the request arrives (§6) and overlaps the first K = 10 steps, but
    an AC level resuming at K ≥ 10 runs none of them, so there only the wait can hide it.
    ``sequential``: each ControlNet adds ``controlnet_sequential_fraction`` × latency; LoRAs
    add the measured load-and-patch seconds, all on the critical path. Both pay a load for
    every ControlNet outside the resident set.
    """
    costs = model.costs
    if not 0 <= skip_steps < costs.steps:
        raise ValueError(f"skip_steps {skip_steps} outside [0, {costs.steps})")
    controlnets = draws.controlnet_count.astype(np.float64)
    loras = draws.lora_count
    loading = draws.uncached_controlnets(costs.controlnet_cached) * costs.controlnet_load_s
    if model.workflow == "sequential":
        compute = costs.controlnet_sequential_fraction * controlnets * latency_s
        fixed: FloatArray = compute + loading + costs.lora_sequential(loras)
        return AdapterCost(fixed, np.zeros_like(fixed))
    step_s = latency_s / (costs.steps - skip_steps)
    window_s = max(0, costs.bal_bound_steps - skip_steps) * step_s
    compute = costs.controlnet_service_fraction * controlnets * latency_s
    fixed = compute + loading + loras * costs.lora_patch_s
    fetch = np.where(loras > 0, costs.lora_fetch_s, 0.0)
    hideable: FloatArray = np.maximum(fetch - window_s, 0.0)
    return AdapterCost(fixed, hideable)


def with_adapter_costs(
    profiles: ProfileSet, model: AdapterModel, draws: AdapterDraws
) -> ProfileSet:
    """The profiles a deployment would measure with this adapter mix on its requests: each
    level's latency plus the mean seconds its adapters add (no queue wait), throughput scaled
    to match (batch size 1). Policies plan with these; the simulator serves with the base
    latencies plus each request's own adapter seconds, so nothing is counted twice."""
    by_level = {level.name: level for level in profiles.levels}
    table = {}
    for (worker_class, name), profile in profiles.table.items():
        level = by_level[name]
        added = float(
            adapter_cost(model, draws, profile.latency_s, level.skip_steps).seconds().mean()
        )
        latency = profile.latency_s + added
        table[(worker_class, name)] = replace(
            profile,
            latency_s=latency,
            throughput_qpm=profile.throughput_qpm * profile.latency_s / latency,
        )
    return replace(profiles, table=table, source=f"{profiles.source} + adapters ({model.workflow})")


# -- the check -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixCheck:
    """Statistics of a sample of requests, beside the targets they should match."""

    requests: int
    controlnet_counts: tuple[float, ...]
    lora_counts: tuple[float, ...]
    controlnet_top_share: float
    controlnets_used: int
    loras_used: int
    loras_popular: int  # LoRAs with >= 1 % of the sample's LoRA invocations
    lora_tail_share: float  # invocations of LoRAs under 1 %


def check_mix(mix: AdapterMix = KATZ_SERVICE_A, requests: int = 200_000, seed: int = 0) -> MixCheck:
    """Draw ``requests`` requests and measure what the paper reports."""
    draws = draw_adapters(requests, np.random.default_rng(seed), mix)
    cn = draws.controlnets[draws.controlnets >= 0]
    lora = draws.loras[draws.loras >= 0]
    cn_hits = np.bincount(cn, minlength=mix.controlnet_population)
    lora_hits = np.bincount(lora, minlength=mix.lora_population)
    lora_share = lora_hits / max(lora.size, 1)

    def distribution(counts: IntArray, size: int) -> tuple[float, ...]:
        return tuple(float(x) for x in np.bincount(counts, minlength=size) / requests)

    return MixCheck(
        requests=requests,
        controlnet_counts=distribution(draws.controlnet_count, len(mix.controlnet_counts)),
        lora_counts=distribution(draws.lora_count, len(mix.lora_counts)),
        controlnet_top_share=float(np.sort(cn_hits)[::-1][: mix.controlnet_top].sum() / cn.size),
        controlnets_used=int(np.count_nonzero(cn_hits)),
        loras_used=int(np.count_nonzero(lora_hits)),
        loras_popular=int(np.count_nonzero(lora_share >= POPULAR_SHARE)),
        lora_tail_share=float(lora_share[lora_share < POPULAR_SHARE].sum()),
    )


def report(mix: AdapterMix = KATZ_SERVICE_A, requests: int = 200_000, seed: int = 0) -> str:
    """The fit and a sample's statistics against Katz's figures, as text."""
    fit = popularity(mix)
    got = check_mix(mix, requests, seed)

    def pct(values: Sequence[float]) -> str:
        return " / ".join(f"{v:.1%}" for v in values)

    lines = [
        f"{mix.name}: {requests:,} sampled requests (seed {seed})",
        f"  ControlNets per request 0/1/2/…: {pct(got.controlnet_counts)}"
        f"  (Table 1: {pct(mix.controlnet_counts)})",
        f"  LoRAs per request 0/1/2/…:       {pct(got.lora_counts)}"
        f"  (Table 1: {pct(mix.lora_counts)})",
        f"  ControlNet popularity: Zipf s = {fit.controlnets.exponent:.3f} over "
        f"{mix.controlnet_population}; top {mix.controlnet_top} take "
        f"{got.controlnet_top_share:.1%} (§3.1: {mix.controlnet_top_share:.0%}); "
        f"{got.controlnets_used} used",
        f"  LoRA popularity: Zipf-Mandelbrot s = {fit.loras.exponent:.3f}, q = "
        f"{fit.loras.offset:g} over {mix.lora_population:,}; {got.loras_popular} at >= 1% "
        f"(§3.2: {mix.lora_popular}); LoRAs under 1% take {got.lora_tail_share:.1%}; "
        f"{got.loras_used:,} distinct LoRAs drawn",
        f"  exact shares of the fit: top {mix.controlnet_top} ControlNets "
        f"{fit.controlnets.shares[: mix.controlnet_top].sum():.2%}, "
        f"LoRAs at >= 1% {int((fit.loras.shares >= POPULAR_SHARE).sum())}",
    ]
    return "\n".join(lines)


def cost_table(model: AdapterModel, latency_s: float = 4.2) -> str:
    """Mean added seconds per request at each K of a level of ``latency_s`` with no queue."""
    draws = draw_adapters(50_000, np.random.default_rng(0), model.mix)
    rows = [f"{model.workflow}: seconds added at a {latency_s:g} s level, no queue wait"]
    for k in (0, 5, 10, 15, 20, 25):
        scaled = latency_s * (model.costs.steps - k) / model.costs.steps
        added = adapter_cost(model, draws, scaled, k).seconds()
        p99 = float(np.quantile(added, 0.99))
        rows.append(f"  K={k:>2} ({scaled:.2f} s): mean +{added.mean():.2f} s, p99 +{p99:.2f} s")
    return "\n".join(rows)


if __name__ == "__main__":
    for each in MIXES.values():
        print(report(each))
    for workflow in WORKFLOWS:
        print(cost_table(AdapterModel(workflow=workflow)))
