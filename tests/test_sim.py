"""The simulated cluster running the product's policies and the baselines."""

import json
import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pytest

from argus.allocator.config import StrategyChoice
from argus.contracts.plans import ReplanReason
from argus.profiles import default_profiles
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.router.admission import AdmissionRule, admit, predicted_completion_s
from argus.router.policy import Refused
from argus.sim.adapters import AdapterModel
from argus.sim.arrivals import bursty, poisson
from argus.sim.cluster import (
    Dispatch,
    GpuFailure,
    Policy,
    RetrievalFault,
    SimConfig,
    Simulation,
)
from argus.sim.planned import PlannedPolicy
from argus.sim.policies import (
    PLANNED,
    POLICIES,
    NoisyOracleClassifier,
    SommelierPolicy,
    make_policy,
)
from argus.sim.report import format_table, per_minute, summarise, write_reports
from argus.sim.workloads import Workload
from argus.types import ClusterView, Strategy, WorkerState

pytestmark = pytest.mark.unit


PROFILES = default_profiles()
LEVEL_NAMES = [level.name for level in PROFILES.levels]


def quality_for(workload):
    return {
        s: synthetic_quality_table(workload.prompts, s, [lv.name for lv in PROFILES.levels_for(s)])
        for s in Strategy
    }


def simulate(workload, policy, **config):
    sim = Simulation(PROFILES, quality_for(workload), workload, SimConfig(**config))
    return sim.run(make_policy(policy) if isinstance(policy, str) else policy)


def strategy_of(result):
    return np.array([PROFILES.levels[i].strategy.value for i in result.level])


@pytest.fixture(scope="module")
def light():
    return poisson(mean_qpm=40.0, duration_min=8, seed=1)


@pytest.fixture(scope="module")
def medium():
    """Above full-quality capacity (8 x 14.3 QPM): some prompts must be approximated."""
    return poisson(mean_qpm=120.0, duration_min=8, seed=2)


@pytest.fixture(scope="module")
def heavy():
    """Between full-quality capacity (8 x 14.3 QPM) and fastest-level capacity (8 x 27.9)."""
    return poisson(mean_qpm=150.0, duration_min=8, seed=2)


def test_light_load_is_served_at_full_quality_by_every_policy_that_can(light):
    # 40 QPM is 0.26 x capacity: Sommelier's queues of one carry SDXL only below that
    # (test_sommelier_sizes_each_gpu_as_a_queue_of_one)
    for name in ("argus", "pac", "proteus", "clipper-ha"):
        result = simulate(light, name)
        summary = summarise(result)
        assert summary.slo_violation_ratio < 0.02, name
        assert summary.relative_quality > 0.99, name


def test_argus_approximates_under_load_where_clipper_ha_falls_behind(heavy):
    argus = summarise(simulate(heavy, "argus"))
    clipper = summarise(simulate(heavy, "clipper-ha"))
    tiny = summarise(simulate(heavy, "clipper-ht"))
    # 150 QPM is far beyond 8 SDXL GPUs (114 QPM): admission refuses what cannot finish in
    # time, about 1 - 114 / 150 = 24% of the requests
    assert clipper.slo_violation_ratio > 0.2
    assert argus.slo_violation_ratio < clipper.slo_violation_ratio / 3
    assert argus.served_qpm > clipper.served_qpm
    assert tiny.slo_violation_ratio < 0.01  # Tiny-SD keeps up, at low quality


def test_prompt_awareness_beats_prompt_agnostic_routing(medium):
    argus = summarise(simulate(medium, "argus"))
    pac = summarise(simulate(medium, "pac"))
    assert argus.effective_quality > pac.effective_quality + 0.2
    assert argus.slo_violation_ratio < 0.05


def test_switching_cost_keeps_argus_from_reloading_models_like_proteus(heavy):
    wave = bursty(duration_min=20, low_qpm=60, high_qpm=170, period_min=5, seed=3)
    argus = simulate(wave, "argus")
    proteus = simulate(wave, "proteus")
    assert argus.model_switches < proteus.model_switches


class RecordingPolicy(PlannedPolicy):
    """The argus policy, recording every routing: (request, time, worker id, workers down)."""

    def __init__(self) -> None:
        super().__init__("argus", PLANNED["argus"])
        self.routes: list[tuple[int, float, str, frozenset[str]]] = []

    def decide(self, request: int, now_s: float, dispatch: Dispatch) -> tuple[str, str] | Refused:
        outcome = super().decide(request, now_s, dispatch)
        worker_id = "" if isinstance(outcome, Refused) else outcome[0]  # "": refused
        self.routes.append((request, now_s, worker_id, dispatch.down))
        return outcome


def test_failed_gpus_serve_nothing_while_down_and_requests_are_retried(heavy):
    # at 125 s requests are queued on the GPUs that fail (at 120 s none happen to be)
    failure = GpuFailure(start_s=125.0, end_s=300.0, count=4)
    policy = RecordingPolicy()
    result = simulate(heavy, policy, faults=(failure,))
    # the requests queued on the failed GPUs are routed a second time, at the failure, to a
    # GPU still up; there they are served (or refused, when their SLO no longer fits)
    routes: dict[int, list[tuple[float, str, frozenset[str]]]] = {}
    for request, now_s, worker_id, down in policy.routes:
        routes.setdefault(request, []).append((now_s, worker_id, down))
    retried = {i: r for i, r in routes.items() if len(r) > 1}
    assert retried, "no request was routed again after the GPUs failed"
    failed = {"w4", "w5", "w6", "w7"}
    for i, ((_, first, _), (again_s, second, down), *more) in retried.items():
        assert not more, f"request {i} routed {len(more) + 2} times"
        assert again_s == failure.start_s
        assert down == failed and first in failed and second not in failed
        assert result.refused[i] or result.worker[i] == int(second.removeprefix("w"))
    assert (~result.refused[list(retried)]).any()
    finished_while_down = (
        (result.finish_s > failure.start_s + 1.0)
        & (result.arrivals_s >= failure.start_s)
        & (result.arrivals_s < failure.end_s)
    )
    assert set(result.worker[finished_while_down]) <= {0, 1, 2, 3}
    admitted = ~result.refused
    assert (result.finish_s[admitted] >= result.arrivals_s[admitted]).all()
    assert (result.level[admitted] >= 0).all()  # every admitted request was served somewhere
    assert np.isnan(result.finish_s[result.refused]).all()
    assert (result.level[result.refused] == -1).all()


def test_retrieval_outage_takes_argus_off_cached_levels_until_probes_are_healthy(medium):
    outage = RetrievalFault(start_s=120.0, end_s=240.0)
    policy = make_policy("argus")
    result = simulate(medium, policy, faults=(outage,))
    cached = np.array(
        [
            PROFILES.levels[i].strategy is Strategy.AC and PROFILES.levels[i].skip_steps > 0
            for i in result.level
        ]
    )
    before = (result.arrivals_s > 60.0) & (result.arrivals_s < 120.0)
    during = (result.arrivals_s > 125.0) & (result.arrivals_s < 240.0)
    assert cached[before].sum() >= 5  # Argus was using the cache when it failed
    assert cached[during].sum() == 0  # and stopped at once
    assert result.strategy_switches >= 1
    assert policy.control.retrieval_healthy()  # probes saw retrieval recover


def test_nirvana_does_not_switch_and_pays_for_the_outage(light):
    outage = RetrievalFault(start_s=60.0, end_s=300.0)
    result = simulate(light, "nirvana", faults=(outage,))
    during = (result.arrivals_s > 60.0) & (result.arrivals_s < 300.0) & ~result.refused
    assert (strategy_of(result)[during] == "AC").all()
    # every request in the outage fell back to a full generation (K = 0)
    assert (result.level[during] == LEVEL_NAMES.index("ac-k0")).all()


def test_slow_retrieval_adds_latency_to_cached_levels(light):
    slow = RetrievalFault(start_s=0.0, end_s=1e9, extra_s=0.3)
    fast = simulate(light, "nirvana", jitter=0.0)
    slowed = simulate(light, "nirvana", jitter=0.0, faults=(slow,))
    cached = np.array([PROFILES.levels[i].skip_steps > 0 for i in fast.level])
    latency = lambda r: r.finish_s - r.arrivals_s  # noqa: E731
    assert latency(slowed)[cached].mean() > latency(fast)[cached].mean() + 0.25


def test_runs_are_deterministic(light):
    a = simulate(light, "argus", seed=5)
    b = simulate(light, "argus", seed=5)
    assert np.array_equal(a.finish_s, b.finish_s) and np.array_equal(a.level, b.level)


def test_noisy_oracle_lowers_quality(medium):
    exact = summarise(simulate(medium, "argus"))
    noisy = summarise(simulate(medium, make_policy("argus", classifier=NoisyOracleClassifier(0.3))))
    assert noisy.effective_quality < exact.effective_quality


def test_unknown_policy_is_quoted():
    with pytest.raises(ValueError, match="'fastest'"):
        make_policy("fastest")
    assert set(POLICIES) == {
        "argus",
        "pac",
        "proteus",
        "clipper-ha",
        "clipper-ht",
        "sommelier",
        "nirvana",
        "argus-paper",
    }


def test_reports_are_written(tmp_path, light):
    results = [simulate(light, name) for name in ("argus", "clipper-ht")]
    summaries = write_reports(results, tmp_path, description={"title": "t", "quality": "q"})
    document = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "requests",
        "served_qpm",
        "offered_qpm",
        "admitted",
        "admitted_qpm",
        "refused",
        "refused_qpm",
        "goodput",
        "goodput_qpm",
        "effective_quality",
        "relative_quality",
        "quality_n",
        "slo_violation_ratio",
        "slo_violation_ratio_admitted",
        "model_switches",
        "utilisation",
    ):
        assert key in document["policies"]["argus"]
    header = (tmp_path / "per_minute.csv").read_text().splitlines()[0].split(",")
    for column in ("admitted_qpm", "refused_qpm", "goodput_qpm", "quality_n"):
        assert column in header
    rows = (tmp_path / "per_minute.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * len(per_minute(results[0]).offered_qpm)
    assert (tmp_path / "timeseries.png").read_bytes()[:4] == b"\x89PNG"
    assert summaries[0].offered_qpm == pytest.approx(40.0, rel=0.1)
    series = per_minute(results[0])
    assert series.model_switches.sum() == results[0].model_switches  # all loads begin in-trace
    assert series.plan_changes.sum() == results[0].plan_changes
    assert ((series.utilisation >= 0) & (series.utilisation <= 1)).all()
    busy = sum(results[0].busy_by_minute_s)
    assert busy == pytest.approx(results[0].busy_s)


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="gpus"):
        SimConfig(gpus=0)
    with pytest.raises(ValueError, match="faults"):
        SimConfig(faults=(GpuFailure(10.0, 5.0, 1),))
    with pytest.raises(ValueError, match="faults"):
        SimConfig(gpus=2, faults=(GpuFailure(0.0, 5.0, 3),))
    assert math.isinf(RetrievalFault(0.0, 1.0).extra_s)


class _Reasons(PlannedPolicy):
    """Argus, remembering why each plan it installed was made."""

    def reset(self, ctx):
        super().reset(ctx)
        self.reasons = []

    def _install(self, view):
        if self.control.current.version != self._installed:
            self.reasons.append((self._now, self.control.current.reason))
        super()._install(view)


def test_bursts_trigger_replans_so_argus_keeps_up():
    wave = bursty(duration_min=30, seed=4)  # 60 QPM with 3-minute bursts of 180 QPM
    argus = _Reasons("argus", make_policy("argus").config)
    result = simulate(wave, argus)
    clipper = summarise(simulate(wave, "clipper-ha"))
    early = {ReplanReason.LOAD_SURGE, ReplanReason.BACKLOG}
    # the first minute's surge is the start (a plan made for no load): count the bursts'
    assert any(reason in early for t, reason in argus.reasons if t > 60.0)
    assert summarise(result).slo_violation_ratio < 0.1
    assert clipper.slo_violation_ratio > 0.2  # late or refused

    control = replace(argus.config.control, backlog_replan_per_worker=1e9, surge_factor=1e9)
    ticks_only = _Reasons("argus", replace(argus.config, control=control))
    simulate(wave, ticks_only)
    assert not any(reason in early for t, reason in ticks_only.reasons if t > 60.0)


class _MoveOneWorker(Policy):
    """Every worker at SDXL; at t = 60 s worker w0 is moved to Tiny-SD; routes to w0 first."""

    name = "move-one"

    def __init__(self, background: bool) -> None:
        self.background_loads = background

    def reset(self, ctx):
        self.ctx = ctx

    def replan(self, now_s, view):
        tiny = now_s >= 60.0
        return {
            w.worker_id: "sm-tiny-sd" if tiny and w.worker_id == "w0" else "sm-sd-xl"
            for w in view.alive()
        }

    def route(
        self, request: int, now_s: float, queues: Mapping[str, int], down: frozenset[str]
    ) -> tuple[str, str]:
        return "w0", ("sm-tiny-sd" if now_s >= 60.0 else "sm-sd-xl")


def test_background_loads_keep_the_old_model_serving():
    workload = poisson(mean_qpm=60.0, duration_min=2, seed=9)
    # every request goes to w0, more than SDXL serves in time: admission would refuse some
    fg = simulate(
        workload, _MoveOneWorker(background=False), jitter=0.0, period_s=60.0, admission=False
    )
    bg = simulate(
        workload, _MoveOneWorker(background=True), jitter=0.0, period_s=60.0, admission=False
    )
    load = PROFILES.profile("a100", "sm-tiny-sd").load_time_s
    first = int(np.argmax(workload.arrivals_s >= 60.0))  # first request after the move
    assert PROFILES.levels[bg.level[first]].name == "sm-sd-xl"  # served by SDXL meanwhile
    assert fg.finish_s[first] >= 60.0 + load  # the foreground load delayed it
    later = workload.arrivals_s >= 60.0 + load + 5.0
    assert {PROFILES.levels[i].name for i in bg.level[later]} == {"sm-tiny-sd"}
    assert fg.model_switches == bg.model_switches


class _Scripted(Policy):
    """One worker: SDXL, then at each scripted time the next level, with background loads."""

    name = "scripted"
    background_loads = True

    def __init__(self, script: list[tuple[float, str]]) -> None:
        self.script = script

    def reset(self, ctx):
        self.ctx, self.todo, self.level = ctx, list(self.script), "sm-sd-xl"

    def next_timer(self):
        return self.todo[0][0] if self.todo else None

    def replan(self, now_s, view):
        while self.todo and self.todo[0][0] <= now_s:
            self.level = self.todo.pop(0)[1]
        return {w.worker_id: self.level for w in view.alive()}

    def route(self, request, now_s, queues, down):
        return "w0", self.level


def test_a_background_load_begun_again_serves_only_after_its_own_load_time():
    """Tiny-SD is asked for at 20 s, given up at 21 s and asked for again at 22 s: the first
    load's event (at 22.91 s) must not cut the second short (ready at 24.91 s)."""
    load = PROFILES.profile("a100", "sm-tiny-sd").load_time_s
    assert 21.0 < 20.0 + load < 22.0 + load - 1.0
    script = [(20.0, "sm-tiny-sd"), (21.0, "sm-sd-xl"), (22.0, "sm-tiny-sd")]
    between, after = 20.0 + load + 0.5, 22.0 + load + 0.5
    workload = Workload(
        "reload", np.array([between, after]), poisson(60.0, 1.0, seed=0).prompts, "test"
    )
    result = simulate(workload, _Scripted(script), gpus=1, jitter=0.0, period_s=600.0)
    served = [PROFILES.levels[i].name for i in result.level]
    assert served == ["sm-sd-xl", "sm-tiny-sd"]
    assert result.loads == 2  # SDXL at start, Tiny-SD once; the cancelled load completed none
    assert result.load_s == pytest.approx(PROFILES.profile("a100", "sm-sd-xl").load_time_s + load)


def test_every_policy_pays_the_profiles_load_time_for_each_model_it_loads():
    """One physics for every policy: each load it completes costs the profile's time for what
    it loads (the level's load_time_s, or within a family its UNet's share of it), the first
    loads and the reloads after a GPU failure included (Clipper's and NIRVANA's only ones); a
    policy that stops while loading counts the load as busy GPU time."""
    workload = poisson(mean_qpm=150.0, duration_min=4, seed=5)
    models = [None, *{lv.model for lv in PROFILES.levels}]
    times = {
        PROFILES.switch_load_s(c, lv.name, held)
        for c in PROFILES.worker_classes
        for lv in PROFILES.levels
        for held in models
        if held != lv.model
    }
    for name in POLICIES:
        policy = make_policy(name)
        result = simulate(workload, policy, faults=(GpuFailure(60.0, 120.0, 2),))
        assert result.loads >= 8 + 2, name  # 8 first loads, 2 after the failure
        assert min(times) * result.loads <= result.load_s <= max(times) * result.loads, name
        if not policy.background_loads:
            assert result.busy_s >= result.load_s, name


# -- admission ------------------------------------------------------------------------------


class _AllTo(Policy):
    """Every worker at ``level``; every request to ``worker`` (a deliberately bad router)."""

    name = "all-to"

    def __init__(self, level: str = "sm-sd-xl", worker: str = "w0") -> None:
        self.level, self.worker = level, worker

    def reset(self, ctx):
        self.ctx = ctx

    def replan(self, now_s, view):
        return {w.worker_id: self.level for w in view.alive()}

    def route(
        self, request: int, now_s: float, queues: Mapping[str, int], down: frozenset[str]
    ) -> tuple[str, str]:
        return self.worker, self.level


def burst(count: int, at_s: float = 20.0, gap_s: float = 0.0) -> Workload:
    """``count`` requests from ``at_s`` (after the first model loads), ``gap_s`` apart."""
    arrivals = at_s + gap_s * np.arange(count)
    return Workload("burst", arrivals, poisson(60.0, 1.0, seed=0).prompts, "test")


def test_admission_refuses_what_cannot_finish_and_admitted_requests_meet_the_slo():
    workload = burst(60, gap_s=0.25)  # 240 QPM on 2 SDXL GPUs (29 QPM): deep overload
    result = simulate(workload, "clipper-ha", gpus=2, jitter=0.0)
    admitted, refused = ~result.refused, result.refused
    assert admitted.sum() + refused.sum() == len(workload)
    assert refused.sum() > len(workload) / 2
    latency = result.finish_s[admitted] - result.arrivals_s[admitted]
    assert (latency <= result.slo_s + 1e-9).all()  # everything admitted finishes in time
    assert not result.late.any()
    assert (result.violated == refused).all()  # a refused request counts as a violation
    assert np.isnan(result.finish_s[refused]).all() and np.isnan(result.score[refused]).all()
    assert (result.worker[refused] == -1).all() and (result.level[refused] == -1).all()
    # refused requests use no worker time: busy time is the loads plus the admitted services
    sdxl = PROFILES.profile("a100", "sm-sd-xl")
    assert result.busy_s == pytest.approx(2 * sdxl.load_time_s + admitted.sum() * sdxl.latency_s)

    queued = simulate(workload, "clipper-ha", gpus=2, jitter=0.0, admission=False)
    assert not queued.refused.any()
    assert queued.violated.sum() > refused.sum()  # without admission the queue makes more late


def test_admission_predicts_queue_plus_one_times_the_planned_latency():
    # 10 requests at one instant, all to w0: request k finds k ahead of it and is admitted
    # while (k + 1) x t_proc fits in the SLO (12.6 s = 3 x 4.2 s, the SDXL latency)
    result = simulate(burst(10), _AllTo("sm-sd-xl"), gpus=2, jitter=0.0)
    assert result.refused.tolist() == [False] * 3 + [True] * 7
    tiny = simulate(burst(10), _AllTo("sm-tiny-sd"), gpus=2, jitter=0.0)
    fits = int(result.slo_s // PROFILES.profile("a100", "sm-tiny-sd").latency_s)
    assert (~tiny.refused).sum() == fits == 5
    # with adapters the router's t_proc is the planned latency, adapters' mean seconds included
    katz = AdapterModel("katz")
    sim = Simulation(
        PROFILES,
        quality_for(burst(10)),
        burst(10),
        SimConfig(gpus=2, jitter=0.0, adapters=katz),
    )
    planned = sim.plan_profiles.profile("a100", "sm-sd-xl").latency_s
    assert planned > 4.2
    with_adapters = sim.run(_AllTo("sm-sd-xl"))
    assert (~with_adapters.refused).sum() == int(sim.slo_s // planned) == 2


def test_predicted_completion_is_the_schedulers_score():
    assert predicted_completion_s(0, 4.2) == pytest.approx(4.2)
    assert predicted_completion_s(2, 4.2) == pytest.approx(12.6)
    assert admit(predicted_completion_s(2, 4.0), budget_s=12.0).admitted
    assert not admit(predicted_completion_s(3, 4.0), budget_s=12.0).admitted


def test_summary_counts_add_up_and_every_mean_says_over_how_many():
    workload = burst(60, gap_s=0.25)
    result = simulate(workload, "clipper-ha", gpus=2, jitter=0.0)
    summary = summarise(result)
    assert summary.requests == len(workload) == summary.admitted + summary.refused
    assert summary.refused == int(result.refused.sum()) > 0
    assert summary.goodput == summary.quality_n == int(result.good.sum())
    late = int(result.late.sum())
    assert summary.slo_violation_ratio == pytest.approx((late + summary.refused) / len(workload))
    assert summary.slo_violation_ratio_admitted == pytest.approx(late / summary.admitted)
    good = result.good
    assert summary.effective_quality == pytest.approx(result.score[good].mean())
    minutes = result.duration_s / 60.0
    assert summary.goodput_qpm == pytest.approx(summary.goodput / minutes)
    assert summary.refused_qpm == pytest.approx(summary.refused / minutes)
    series = per_minute(result)
    assert (series.offered_qpm == series.admitted_qpm + series.refused_qpm).all()
    assert series.refused_qpm.sum() == summary.refused
    assert series.goodput_qpm.sum() == series.quality_n.sum() == summary.goodput
    table = format_table([summary])
    assert f"({summary.refused:,})" in table and f"of {summary.admitted:,}" in table
    assert f"{summary.quality_n:,}" in table and "SYNTHETIC" in table
    assert "SYNTHETIC" not in format_table([summary], synthetic_quality=False)


def test_quality_means_are_zero_over_zero_requests_when_nothing_meets_the_slo():
    result = simulate(burst(5), _AllTo("sm-sd-xl"), gpus=2, jitter=0.0, slo_factor=0.5)
    summary = summarise(result)
    assert summary.refused == 5 and summary.quality_n == 0
    assert summary.effective_quality == 0.0 and summary.slo_violation_ratio == 1.0
    assert summary.slo_violation_ratio_admitted == 0.0  # nothing admitted, nothing late
    assert " - " in format_table([summary])  # no mean printed over no requests


# -- heterogeneous GPU classes ----------------------------------------------------------------


def sparse(count: int, every_s: float = 20.0, first_s: float = 20.0) -> Workload:
    """Requests far enough apart that each finds its worker idle."""
    return burst(count, at_s=first_s, gap_s=every_s)


def test_each_worker_is_served_at_its_own_class_latency():
    config = {"gpus": 2, "worker_class": "a100", "gpus_by_class": (("a100", 1), ("h100", 1))}
    for worker, worker_class in (("w0", "a100"), ("w1", "h100")):
        result = simulate(sparse(4), _AllTo("sm-sd-xl", worker), jitter=0.0, **config)
        latency = result.finish_s - result.arrivals_s
        expected = PROFILES.profile(worker_class, "sm-sd-xl").latency_s
        assert latency == pytest.approx([expected] * 4)
        assert result.worker_classes == ("a100", "h100")
        assert result.slo_s == pytest.approx(3 * 4.2)  # the slowest class's best latency


def test_model_loads_take_the_load_time_of_the_workers_class():
    table = dict(PROFILES.table)
    for level in PROFILES.levels:
        key = ("h100", level.name)
        table[key] = replace(table[key], load_time_s=3.0)
    profiles = replace(PROFILES, table=table)
    workload = burst(1, at_s=0.5)  # arrives while the first model loads
    for worker, load in (("w0", PROFILES.profile("a100", "sm-sd-xl").load_time_s), ("w1", 3.0)):
        sim = Simulation(
            profiles,
            quality_for(workload),
            workload,
            SimConfig.with_classes({"a100": 1, "h100": 1}, jitter=0.0),
        )
        result = sim.run(_AllTo("sm-sd-xl", worker))
        worker_class = result.worker_classes[int(worker[1])]
        latency = profiles.profile(worker_class, "sm-sd-xl").latency_s
        assert result.finish_s[0] == pytest.approx(load + latency)


class _Recorder(_AllTo):
    """Records what the simulator shows the policy."""

    def reset(self, ctx):
        super().reset(ctx)
        self.classes = dict(ctx.worker_classes)
        self.views = []

    def replan(self, now_s, view):
        self.views.append({w.worker_id: w.worker_class for w in view.workers})
        return super().replan(now_s, view)


def test_policies_see_every_workers_class():
    policy = _Recorder()
    config = SimConfig.with_classes({"h100": 2, "a100": 1}, jitter=0.0)
    assert (config.gpus, config.worker_class) == (3, "h100")
    result = Simulation(PROFILES, quality_for(sparse(3)), sparse(3), config).run(policy)
    expected = {"w0": "h100", "w1": "h100", "w2": "a100"}
    assert policy.classes == expected
    assert policy.views and all(view == expected for view in policy.views)
    assert result.slo_s == pytest.approx(3 * PROFILES.best_latency_s("a100"))
    only_fast = simulate(sparse(2), "clipper-ha", **{"gpus": 2, "worker_class": "h100"})
    assert only_fast.slo_s == pytest.approx(3 * PROFILES.best_latency_s("h100"))


def test_clipper_sends_more_work_to_the_faster_class():
    mixed = SimConfig.with_classes({"a100": 2, "h100": 2}, jitter=0.0)
    light = sparse(5)
    result = Simulation(PROFILES, quality_for(light), light, mixed).run(make_policy("clipper-ha"))
    assert set(result.worker[~result.refused]) <= {2, 3}  # an idle H100 finishes first
    heavy = poisson(mean_qpm=60.0, duration_min=4, seed=3)
    result = Simulation(PROFILES, quality_for(heavy), heavy, mixed).run(make_policy("clipper-ha"))
    served = result.worker[~result.refused]
    on_h100 = np.isin(served, [2, 3]).sum()
    on_a100 = np.isin(served, [0, 1]).sum()
    assert on_a100 > 0 and on_h100 > 1.5 * on_a100  # H100s are twice as fast


def test_sommelier_sizes_each_gpu_by_its_own_class():
    workload = poisson(mean_qpm=24.0, duration_min=4, seed=5)  # 12 QPM per GPU
    policy = make_policy("sommelier")
    config = SimConfig.with_classes({"a100": 1, "h100": 1})
    Simulation(PROFILES, quality_for(workload), workload, config).run(policy)
    assert isinstance(policy, SommelierPolicy)
    sm = [level.name for level in PROFILES.levels_for(Strategy.SM)]
    a100, h100 = policy.assignment["w0"], policy.assignment["w1"]
    assert sm.index(h100) < sm.index(a100)  # the H100 keeps a better (slower) level
    assert policy.carries_qpm("h100", h100) >= 12.0
    assert policy.carries_qpm("a100", a100) >= 12.0
    assert policy.carries_qpm("a100", h100) < 12.0


def test_sommelier_sizes_each_gpu_as_a_queue_of_one():
    """Each GPU plans its level under a queue of one's utilisation cap, so a steady load
    below capacity is served on time (Argus §5.2: Sommelier does well under a stable load);
    sized at utilisation 1, it refused or answered late 19% of this load."""
    steady = poisson(mean_qpm=110.0, duration_min=8, seed=2)  # 0.7 x capacity
    policy = make_policy("sommelier")
    summary = summarise(Simulation(PROFILES, quality_for(steady), steady).run(policy))
    assert summary.slo_violation_ratio < 0.05
    assert isinstance(policy, SommelierPolicy)
    share = 110.0 / 8
    for level in set(policy.assignment.values()):  # each GPU's level stays under its cap
        profile = PROFILES.profile("a100", level)
        cap = policy.queue.cap("a100", level, profile.latency_s, 1)
        assert cap < 1.0
        assert profile.throughput_qpm * cap == pytest.approx(policy.carries_qpm("a100", level))
    assert min(policy.carries_qpm("a100", lv) for lv in policy.assignment.values()) > 0.9 * share
    # at a very low load (0.1 x, where Argus Fig. 17 has every scaling system at its
    # largest model) every GPU keeps SDXL
    quiet = poisson(mean_qpm=16.0, duration_min=8, seed=2)
    assert summarise(simulate(quiet, "sommelier")).relative_quality > 0.99


def test_bad_gpu_classes_are_named():
    with pytest.raises(ValueError, match="gpus: 8 differs"):
        SimConfig(gpus_by_class=(("a100", 2),))
    with pytest.raises(ValueError, match="h100 must have >= 1"):
        SimConfig.with_classes({"a100": 2, "h100": 0})
    with pytest.raises(ValueError, match="first class"):
        SimConfig(gpus=2, worker_class="h100", gpus_by_class=(("a100", 2),))
    with pytest.raises(ValueError, match="'v100' has no profiles"):
        simulate(sparse(1), "clipper-ha", **{"gpus": 1, "worker_class": "v100"})


def test_admission_predicts_with_the_chosen_workers_class():
    config = SimConfig.with_classes({"a100": 1, "h100": 1}, jitter=0.0)
    sim = Simulation(PROFILES, quality_for(burst(10)), burst(10), config)
    to_h100 = sim.run(_AllTo("sm-sd-xl", "w1"))
    fits = int(round(sim.slo_s / PROFILES.profile("h100", "sm-sd-xl").latency_s, 9))
    assert (~to_h100.refused).sum() == fits == 6  # (k + 1) x 2.1 s within 12.6 s
    assert (~sim.run(_AllTo("sm-sd-xl", "w0")).refused).sum() == 3


def test_admission_on_a_quantile_keeps_admitted_requests_on_time_under_overload():
    """Katz's adapters spread service times; admitting on the mean let about a tenth of the
    admitted requests in late at 1.5 × capacity, the quantile keeps it to a few percent and
    the workers as busy. Argus runs AC here (``ac-first``): with the choice of strategy it
    takes SM at this load, whose Tiny-SD adapter tail the rule's normal model does not cover
    (8.9% of admitted late; the README's load sweep says so), which is not this test's point."""
    wave = poisson(mean_qpm=230.0, duration_min=6, seed=3)
    katz = AdapterModel("katz")
    argus = PLANNED["argus"]
    ac_first = replace(
        argus, control=replace(argus.control, strategy_choice=StrategyChoice.AC_FIRST)
    )
    quantile = simulate(wave, PlannedPolicy("argus", ac_first), adapters=katz)
    on_mean = simulate(
        wave,
        PlannedPolicy("argus", ac_first),
        adapters=katz,
        admission_rule=AdmissionRule(service_scv=0.0, confidence=0.5),
    )
    late_share = summarise(quantile).slo_violation_ratio_admitted
    assert late_share < 0.03
    assert summarise(on_mean).slo_violation_ratio_admitted > 2 * late_share
    assert summarise(quantile).goodput_qpm >= 0.97 * summarise(on_mean).goodput_qpm


def test_the_simulation_runs_the_allocators_and_the_routers_own_code(monkeypatch, light):
    """Not a copy: the planned policies call the allocator's control, planner and queue model
    and the router's decision (early admission, routing, admission), so changing any of them
    changes the run."""
    import argus.allocator.allocator as allocator_module
    from argus.allocator.control import AllocatorControl
    from argus.allocator.queueing import QueueModel
    from argus.router.policy import RouterPolicy
    from argus.router.routing import PlanRouter

    calls: dict[str, int] = {}

    def counted(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            key = f"{getattr(owner, '__name__', '')}.{name}"
            calls[key] = calls.get(key, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in (
        (AllocatorControl, "heartbeat"),
        (AllocatorControl, "report_router"),
        (AllocatorControl, "tick"),
        (allocator_module, "make_plan"),
        (PlanRouter, "route"),
        (PlanRouter, "install"),
        (RouterPolicy, "admit_early"),
        (RouterPolicy, "route"),
    ):
        counted(owner, name)
    before = summarise(simulate(light, "argus"))
    assert {key.rpartition(".")[2] for key in calls} == {
        "heartbeat",
        "report_router",
        "tick",
        "make_plan",
        "route",
        "install",
        "admit_early",
    }
    assert calls["RouterPolicy.admit_early"] == before.requests  # every request, first
    assert calls["RouterPolicy.route"] == before.requests - before.refused_early
    assert calls["PlanRouter.route"] == calls["RouterPolicy.route"]

    monkeypatch.setattr(QueueModel, "cap", lambda self, g, level, service_s, servers: 0.25)
    squeezed = summarise(simulate(light, "argus"))  # caps a quarter: faster levels planned
    assert squeezed.effective_quality < before.effective_quality

    monkeypatch.setattr(AdmissionRule, "completion_s", lambda self, *args: math.inf)
    assert summarise(simulate(light, "argus")).admitted == 0


# -- views and heartbeats built once per change -----------------------------------------------


def test_a_workers_view_follows_its_queue_level_and_liveness() -> None:
    """The simulator keeps each worker's WorkerState between views; every change shows."""
    from argus.sim.cluster import _Worker

    worker = _Worker("w0", "a100")
    first = worker.current_state()
    assert worker.current_state() is first  # nothing changed: the same value again
    worker.finishes.append((1.0, 0, 0.0))
    assert worker.current_state().queue_length == 1
    worker.level = "sm-sd-xl"
    assert worker.current_state().level == "sm-sd-xl"
    worker.alive = False
    assert worker.current_state() == WorkerState("w0", "a100", False, "sm-sd-xl", 1)


def test_planned_heartbeats_carry_each_workers_latest_state() -> None:
    """A heartbeat is sent again as it was only while the worker's state is unchanged."""
    from argus.sim.cluster import SimContext
    from argus.sim.service_times import SimServiceSpread

    workload = poisson(mean_qpm=40.0, duration_min=1, seed=1)
    policy = make_policy("pac")
    policy.reset(
        SimContext(
            PROFILES,
            ("w0", "w1"),
            "a100",
            quality_for(workload),  # type: ignore[no-untyped-call]
            np.zeros(len(workload), dtype=np.int64),
            np.random.default_rng(0),
            lambda now: 0.05,
            30.0,
            service_spread=SimServiceSpread.of(PROFILES, 0.0, None),
        )
    )
    assert isinstance(policy, PlannedPolicy)
    for now, queue, level in [(0, 0, None), (1, 4, None), (2, 4, None), (3, 0, "sm-sd-xl")]:
        view = ClusterView(
            (WorkerState("w0", "a100", True, level, queue), WorkerState("w1", "a100"))
        )
        policy.replan(float(now), view)
        member = policy.control._members.get("w0")
        assert member is not None
        assert (member.report.queue_length, member.report.level) == (queue, level)
        assert member.last_seen_s == now


def test_the_routers_early_refusals_are_simulated_and_counted():
    """Beyond what the fastest levels can serve, the planned policies refuse part of the
    overload before classifying it, as the live router does; the counts say how many."""
    overload = poisson(mean_qpm=400.0, duration_min=4, seed=5)
    argus = summarise(simulate(overload, "argus"))
    assert 0 < argus.refused_early <= argus.refused
    baseline = summarise(simulate(overload, "clipper-ha"))  # not planned: admitted when routed
    assert baseline.refused > 0 and baseline.refused_early == 0


def test_a_worker_loading_in_the_background_is_priced_at_the_level_it_still_serves():
    """Requests sent to w0 while Tiny-SD loads in the background are served at SDXL. The
    router must price them at SDXL, or it admits a queue as long as Tiny-SD would serve in
    time, which SDXL serves late."""
    load = PROFILES.profile("a100", "sm-tiny-sd").load_time_s
    workload = burst(12, at_s=60.0, gap_s=0.9 * load / 11)  # a burst while w0 loads
    arrivals = workload.arrivals_s
    run = simulate(workload, _MoveOneWorker(background=True), jitter=0.0, period_s=60.0)
    admitted = ~run.refused
    assert 0 < admitted.sum() < len(arrivals)
    assert {PROFILES.levels[i].name for i in run.level[admitted]} == {"sm-sd-xl"}
    late = run.finish_s[admitted] - arrivals[admitted] > run.slo_s
    assert not late.any()


# -- late binding -----------------------------------------------------------------------------


def test_late_binding_lets_the_first_free_worker_of_the_level_take_a_held_request():
    """Every request is routed to w0 (a bad router); with late binding (one request a worker)
    the held one goes to the idle w1 of the same level at once, so four fit the SLO instead
    of three and none waits behind w0's queue."""
    early = simulate(burst(10), _AllTo("sm-sd-xl"), gpus=2, jitter=0.0)
    late = simulate(burst(10), _AllTo("sm-sd-xl"), gpus=2, jitter=0.0, late_binding_window=1)
    sdxl = PROFILES.profile("a100", "sm-sd-xl").latency_s
    assert early.worker.tolist()[:3] == [0, 0, 0] and (~early.refused).sum() == 3
    assert late.worker.tolist()[:4] == [0, 1, 0, 1] and (~late.refused).sum() == 4
    latency = late.finish_s[:4] - late.arrivals_s[:4]
    assert latency == pytest.approx([sdxl, sdxl, 2 * sdxl, 2 * sdxl])
    assert late.refused_held == 0 and not late.late.any()


def test_late_binding_refuses_held_requests_their_worker_can_no_longer_finish_in_time():
    """The router believes SDXL takes half its 4.2 s, so it admits six requests on w0 (six
    × 2.1 s fit the 12.6 s SLO). Queued at the worker when routed, the last three are served
    late; held by the router, each is predicted again as w0 answers and refused once it can
    no longer finish in time, and none is late."""

    def run(window: int):
        workload = burst(6)
        config = SimConfig(gpus=1, jitter=0.0, late_binding_window=window)
        sim = Simulation(PROFILES, quality_for(workload), workload, config)
        table = {k: replace(v, latency_s=v.latency_s / 2) for k, v in PROFILES.table.items()}
        sim.plan_profiles = replace(PROFILES, table=table)  # what the router believes
        return sim.run(_AllTo("sm-sd-xl"))

    queued, held = run(0), run(1)
    assert (~queued.refused).sum() == 6 and queued.late.tolist() == [False] * 3 + [True] * 3
    assert held.refused.tolist() == [False] * 3 + [True] * 3 and held.refused_held == 3
    assert not held.late.any()


def test_the_late_binding_window_is_checked():
    with pytest.raises(ValueError, match="late_binding_window"):
        SimConfig(late_binding_window=-1)


def test_the_planned_policies_hold_requests_by_their_router_policy():
    policy = make_policy("argus")
    result = simulate(burst(40, gap_s=0.5), policy, gpus=2, late_binding_window=2)
    assert policy.binder is not None and policy.binder is policy.decider.binder
    assert len(policy.binder) == 0  # every held request was sent or refused by the end
    assert (~result.refused).sum() > 0
