"""Planning and simulating with the real switch cost (issue 35, item 3): a move within the
SD-1.x family loads only the UNet, a move across families the whole model; the allocator's
switching term and the simulator charge the same; profiles without parts load whole."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping

import pytest

from argus.allocator.allocation_problem import Problem, rounded_switch_cost
from argus.allocator.joint import JointSolver
from argus.allocator.paper_eq1 import highs_solver, solve, solve_per_worker
from argus.profiles import ProfileError, load_profiles, parse_profiles
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.sim.arrivals import poisson
from argus.sim.cluster import Policy, SimConfig, Simulation
from argus.types import ClassQuality, ClusterView, ProfileSet, Strategy, WorkerState

pytestmark = pytest.mark.unit

PROFILES = load_profiles("default")
WHOLE = load_profiles("default:monolithic")
SM = PROFILES.levels_for(Strategy.SM)
UNET_SHARE = {"sd-1.4": 0.8061, "small-sd": 0.7782, "tiny-sd": 0.6296, "sd-1.5": 0.8061}


def problem(profiles: ProfileSet, live: tuple[WorkerState, ...], weight: float = 1.0) -> Problem:
    return Problem(Strategy.SM, SM, profiles, live, 100.0, 100.0, weight, 60.0)


def on(level: str, n: int = 1, prefix: str = "w") -> tuple[WorkerState, ...]:
    return tuple(WorkerState(f"{prefix}{level}{i}", "a100", True, level) for i in range(n))


def test_the_profile_prices_a_within_family_switch_at_the_unet() -> None:
    for model, share in UNET_SHARE.items():
        held = "sd-1.4" if model == "sd-1.5" else "sd-1.5"
        assert PROFILES.load_share(model, held) == pytest.approx(share)
    assert PROFILES.family("tiny-sd") == {"sd-1.4", "sd-1.5", "small-sd", "tiny-sd"}
    assert PROFILES.family("sdxl") == {"sdxl"}
    # seconds: SD-1.5 → SD-1.4 is the UNet's 4.48 of the whole 5.56 s
    assert PROFILES.switch_load_s("a100", "sm-sd-1.4", "sd-1.5") == pytest.approx(5.56 * 0.8061)
    # across families, from nothing, and without parts: the whole load
    for held in ("sdxl", "sd-2.0", None):
        assert PROFILES.switch_load_s("a100", "sm-sd-1.4", held) == pytest.approx(5.56)
    assert WHOLE.switch_load_s("a100", "sm-sd-1.4", "sd-1.5") == pytest.approx(5.56)
    assert PROFILES.switch_load_s("a100", "sm-sd-1.5", "sd-1.5") == 0.0


def test_the_allocator_prices_a_move_by_what_the_target_worker_would_load() -> None:
    live = on("sm-sd-1.5") + on("sm-sd-xl")
    priced = problem(PROFILES, live)
    whole = priced.load_cost("a100", "sd-1.4")
    assert priced.move_cost("a100", "sd-1.4", "sd-1.5") == pytest.approx(whole * 0.8061)
    assert priced.move_cost("a100", "sd-1.4", "sdxl") == pytest.approx(whole)
    assert priced.move_cost("a100", "sd-1.4", None) == 0.0  # placing an idle worker
    assert problem(WHOLE, live).move_cost("a100", "sd-1.4", "sd-1.5") == pytest.approx(whole)


def levels(*names: str) -> list[int]:
    return [next(v for v, lv in enumerate(SM) if lv.name == n) for n in names]


def counts(*names: str) -> Counter[tuple[str, int]]:
    return Counter(("a100", v) for v in levels(*names))


def test_the_rounded_switching_cost_charges_the_unet_within_a_family() -> None:
    live = on("sm-sd-1.5", 2)
    priced, whole = problem(PROFILES, live), problem(WHOLE, live)
    full = priced.load_cost("a100", "sd-1.4")
    within = counts("sm-sd-1.5", "sm-sd-1.4")
    assert rounded_switch_cost(priced, within) == pytest.approx(full * 0.8061)
    assert rounded_switch_cost(whole, within) == pytest.approx(full)
    across = counts("sm-sd-1.5", "sm-sd-2.0")
    assert rounded_switch_cost(priced, across) == pytest.approx(priced.load_cost("a100", "sd-2.0"))
    # the family grows by one (an SDXL worker joins it): one whole load, one UNet
    live = on("sm-sd-1.5") + on("sm-sd-xl")
    grown = counts("sm-sd-1.4", "sm-tiny-sd")
    expected = min(
        priced.load_cost("a100", "sd-1.4") + priced.family_load_cost("a100", "tiny-sd"),
        priced.family_load_cost("a100", "sd-1.4") + priced.load_cost("a100", "tiny-sd"),
    )
    assert rounded_switch_cost(problem(PROFILES, live), grown) == pytest.approx(expected)
    # an idle worker is placed free, as the family's whole load; the other move is a UNet
    live = (*on("sm-sd-1.5"), WorkerState("idle", "a100"))
    both = counts("sm-sd-1.4", "sm-sd-1.4")
    placed = problem(PROFILES, live)
    assert rounded_switch_cost(placed, both) == pytest.approx(
        placed.family_load_cost("a100", "sd-1.4")
    )


@pytest.mark.parametrize("seed", range(8))
def test_the_counting_program_prices_moves_as_the_per_worker_program(seed: int) -> None:
    """Eq. 1 counting workers (with the family rows) and the literal per-worker program (each
    worker priced by what it holds) reach the same optimum on the parted default profile."""
    rng = random.Random(3500 + seed)
    names = [lv.name for lv in SM]
    held = [*names, None]  # None: an idle worker, placed free
    live = tuple(WorkerState(f"w{i}", "a100", True, rng.choice(held)) for i in range(7))
    view = ClusterView(live)
    load = rng.uniform(0.3, 1.3) * 7 * 60.0 / 2.18
    weight = rng.uniform(2.0, 20.0)
    exact = highs_solver(rel_gap=1e-9)
    fast = solve(PROFILES, Strategy.SM, view, load, switch_cost_weight=weight, backend=exact)
    reference = solve_per_worker(
        PROFILES, Strategy.SM, view, load, switch_cost_weight=weight, backend=exact
    )
    assert fast.objective == pytest.approx(reference.objective, rel=1e-6, abs=1e-6)


def test_cheaper_moves_let_the_joint_program_follow_the_load() -> None:
    """Four workers on Tiny-SD under a light load: SD-1.5's quality is worth its UNet's load
    but not a whole pipeline's, so with per-part prices the joint program moves two workers
    there and with the monolith's it moves none."""
    names = tuple(lv.name for lv in SM)
    rows = tuple(tuple(lv.quality for lv in SM) for _ in names)
    prior = tuple(1.0 / len(names) for _ in names)
    quality = ClassQuality(Strategy.SM, names, rows, prior, "level averages")
    live = ClusterView(on("sm-tiny-sd", 4))
    moved = {}
    for label, profiles in (("parts", PROFILES), ("whole", WHOLE)):
        solver = JointSolver(
            profiles, Strategy.SM, live, 40.0, quality, prior, switch_cost_weight=1.0
        )
        allocation = solver.solve({}).allocation
        moved[label] = dict(zip(names, allocation.workers_per_level, strict=True))
    assert moved["parts"]["sm-sd-1.5"] == 2
    assert moved["whole"]["sm-tiny-sd"] == 4


class _MoveTo(Policy):
    """Every worker on SD-1.5, then at 30 s on ``target`` (foreground loads)."""

    name = "move"
    background_loads = False

    def __init__(self, target: str) -> None:
        self.target = target

    def reset(self, ctx):  # type: ignore[no-untyped-def]
        self.ctx = ctx

    def replan(self, now_s, view):  # type: ignore[no-untyped-def]
        level = self.target if now_s >= 30.0 else "sm-sd-1.5"
        return {w.worker_id: level for w in view.alive()}

    def route(self, request, now_s, queues: Mapping[str, int], down):  # type: ignore[no-untyped-def]
        return "w0", (self.target if now_s >= 30.0 else "sm-sd-1.5")


def simulate(profiles: ProfileSet, target: str) -> tuple[float, float]:
    """Seconds of the move's load on the one worker, and the share of requests that waited
    on a load."""
    workload = poisson(mean_qpm=20.0, duration_min=1, seed=3)
    tables = {
        s: synthetic_quality_table(workload.prompts, s, [lv.name for lv in profiles.levels_for(s)])
        for s in Strategy
    }
    config = SimConfig(gpus=1, jitter=0.0, period_s=30.0)
    result = Simulation(profiles, tables, workload, config).run(_MoveTo(target))
    first = profiles.switch_load_s("a100", "sm-sd-1.5", None)
    assert result.loads == 2
    return result.load_s - first, float(result.load_waits.mean())


def test_the_simulator_charges_the_unet_within_a_family_and_the_whole_across() -> None:
    within, waits = simulate(PROFILES, "sm-sd-1.4")
    assert within == pytest.approx(5.56 * 0.8061)
    assert simulate(WHOLE, "sm-sd-1.4")[0] == pytest.approx(5.56)
    assert simulate(PROFILES, "sm-sd-2.0")[0] == pytest.approx(7.0)
    assert 0.0 < waits < 1.0  # the requests queued behind the loads waited, not the others


def test_a_profile_whose_parts_do_not_add_up_is_refused() -> None:
    document = {
        "worker_classes": ["a100"],
        "levels": [
            {
                "name": "sm-a",
                "strategy": "SM",
                "model": "a",
                "quality": 1.0,
                "profiles": {"a100": {"latency_s": 1.0, "load_time_s": 1.0, "gpu_memory_gib": 1}},
            }
        ],
        "models": {"a": {"parts": {"unet": {"id": "u", "share": 0.5}}}},
    }
    with pytest.raises(ProfileError, match=r"models\.a\.parts: the shares must sum to 1"):
        parse_profiles(document)
    document["models"] = {"b": {"parts": {"unet": {"id": "u", "share": 1.0}}}}
    with pytest.raises(ProfileError, match=r"models\.b: 'b' is not the model of any level"):
        parse_profiles(document)
