"""Scheduling edits in simulation (issue 33, items 3 and 4): the edit cost model's fit, step-level
continuous batching, the balancers on hand-made snapshots and a tiny ``argus evaluate
--workload edits`` run."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from argus.cli.main import main
from argus.profiles.edit_cost import CostModelError, EditCostModel, fit_cost_model
from argus.router.edit_balance import (
    EditJob,
    LeastRequestsBalancer,
    LeastTokensBalancer,
    MaskAwareBalancer,
    RoundRobinBalancer,
    WorkerEdit,
    WorkerSnapshot,
    make_balancer,
    predict_finish_s,
)
from argus.sim.edits import (
    EditCluster,
    EditOutcome,
    EditRequest,
    EditWorkloadConfig,
    lru_hit_rate,
    make_edit_workload,
)
from argus.worker.editing.scheduler import BatchEntry, ContinuousBatch

pytestmark = pytest.mark.unit

MODEL = EditCostModel(base_s=0.05, per_edit_s=0.02, per_mask_s=0.3)
CPU_TABLE = Path(__file__).resolve().parent.parent / "argus/profiles/edit-batching-cpu.toml"


# --- the cost model -------------------------------------------------------------------------


def test_fit_recovers_known_coefficients() -> None:
    points = [(b, s, MODEL.step_s(b, s)) for b in (1, 2, 4, 8) for s in (0.1 * b, 0.5 * b, 1.0 * b)]
    fitted = fit_cost_model(points, "exact")
    assert fitted.base_s == pytest.approx(0.05, abs=1e-9)
    assert fitted.per_edit_s == pytest.approx(0.02, abs=1e-9)
    assert fitted.per_mask_s == pytest.approx(0.3, abs=1e-9)
    assert fitted.r2 == pytest.approx(1.0)


def test_fit_with_noise_is_close_and_reports_r2_below_one() -> None:
    rng = np.random.default_rng(3)
    points = []
    for b in (1, 2, 3, 4, 6, 8):
        for m in (0.05, 0.1, 0.2, 0.5, 1.0):
            points.append((b, b * m, MODEL.step_s(b, b * m) * (1 + 0.01 * rng.standard_normal())))
    fitted = fit_cost_model(points)
    assert fitted.per_mask_s == pytest.approx(0.3, rel=0.05)
    assert fitted.per_edit_s + fitted.base_s == pytest.approx(0.07, rel=0.1)
    assert 0.98 < fitted.r2 < 1.0


def test_fit_refuses_too_few_points_and_never_goes_negative() -> None:
    with pytest.raises(CostModelError, match="at least 3"):
        fit_cost_model([(1, 0.1, 1.0), (2, 0.2, 2.0)])
    # cost falls with batch size in these points: p would be negative; it is dropped instead
    fitted = fit_cost_model([(1, 0.5, 1.0), (2, 0.5, 0.9), (4, 0.5, 0.8), (4, 2.0, 1.5)])
    assert min(fitted.base_s, fitted.per_edit_s, fitted.per_mask_s) >= 0


# --- continuous batching --------------------------------------------------------------------


def entry(key: int, steps: int = 3, ratio: float = 0.1, group: str = "g") -> BatchEntry:
    return BatchEntry(key, steps, ratio, group)


def test_join_admits_at_boundaries_up_to_the_bound_and_finished_requests_leave() -> None:
    batch = ContinuousBatch(bound=2)
    for key in range(3):
        batch.submit(entry(key, steps=2 + key))
    assert len(batch) == 0  # nothing runs before a boundary
    assert [r.entry.key for r in batch.join()] == [0, 1]
    assert [e.key for e in batch.waiting] == [2]
    batch.submit(entry(3))
    assert len(batch) == 2  # a submit mid-step does not join
    assert batch.step() == []
    assert batch.join() == []  # still full
    finished = batch.step()
    assert [r.entry.key for r in finished] == [0]  # 2 steps run: it leaves
    assert [r.entry.key for r in batch.join()] == [2]  # first come first, up to the bound
    assert [r.entry.key for r in batch.running] == [1, 2]
    assert [r.steps_left for r in batch.running] == [1, 4]
    assert [e.key for e in batch.waiting] == [3]


def test_effective_ratio_is_fixed_at_joining_and_prices_the_batch() -> None:
    batch = ContinuousBatch(bound=4)
    batch.submit(entry(0, ratio=0.1))
    batch.submit(entry(1, ratio=0.2))
    batch.join(lambda e: 1.0 if e.key == 0 else e.mask_ratio)  # 0 misses, 1 hits
    assert batch.mask_sum() == pytest.approx(1.2)


def test_leave_frees_a_slot_at_the_next_boundary_and_groups_do_not_mix() -> None:
    batch = ContinuousBatch(bound=2)
    batch.submit(entry(0))
    batch.submit(entry(1, group="other"))
    batch.submit(entry(2))
    assert [r.entry.key for r in batch.join()] == [0, 2]  # 1 is of another group
    assert batch.leave(0) and not batch.leave(0)
    assert batch.join() == []  # 1 still cannot join 2's batch
    batch.step(), batch.step(), batch.step()
    assert [r.entry.key for r in batch.join()] == [1]  # the batch drained
    assert batch.leave(1) and batch.idle()
    with pytest.raises(ValueError, match="bound"):
        ContinuousBatch(0)


def test_static_batching_admits_only_into_a_drained_batch() -> None:
    batch = ContinuousBatch(bound=3, static=True)
    batch.submit(entry(0, steps=1))
    batch.submit(entry(1, steps=3))
    assert [r.entry.key for r in batch.join()] == [0, 1]  # an empty batch fills, up to 3
    batch.submit(entry(2, steps=1))
    batch.step()  # 0 leaves: a slot is free, but the batch still runs
    assert batch.join() == [] and [e.key for e in batch.waiting] == [2]
    batch.step(), batch.step()  # 1 leaves: drained
    assert [r.entry.key for r in batch.join()] == [2]


def test_static_batching_in_the_simulator_waits_for_the_batch_continuous_joins_at_a_step() -> None:
    requests = [EditRequest(0, 0.0, 0.5, None, steps=4), EditRequest(1, 0.01, 0.5, None, steps=2)]
    step = MODEL.step_s(1, 1.0)  # no template: full runs
    pair = MODEL.step_s(2, 2.0)

    def run(static: bool) -> list[EditOutcome]:
        cluster = EditCluster(MODEL, RoundRobinBalancer(), workers=1, bound=4, static=static)
        return cluster.run(requests)

    static, continuous = run(True), run(False)
    assert static[1].joined_s == pytest.approx(4 * step)  # after the first's 4 steps alone
    assert static[1].finished_s == pytest.approx(6 * step)
    assert continuous[1].joined_s == pytest.approx(step)  # at the first step's end
    assert continuous[1].finished_s == pytest.approx(step + 2 * pair)
    assert continuous[0].finished_s == pytest.approx(2 * step + 2 * pair)


def test_bound_one_serves_one_at_a_time_in_arrival_order() -> None:
    requests = [
        EditRequest(0, 0.0, 0.3, None, steps=4),
        EditRequest(1, 0.1, 0.2, None, steps=3),
        EditRequest(2, 0.15, 0.9, None, steps=5),
        EditRequest(3, 10.0, 0.5, None, steps=2),
    ]
    outcomes = EditCluster(MODEL, RoundRobinBalancer(), workers=1, bound=1).run(requests)
    free = 0.0
    for request, outcome in zip(requests, outcomes, strict=True):
        start = max(request.arrival_s, free)
        free = start + request.steps * MODEL.step_s(1, 1.0)  # no template: a full run
        assert outcome.joined_s == pytest.approx(start)
        assert outcome.finished_s == pytest.approx(free)


def test_a_template_misses_once_then_hits_on_the_same_worker() -> None:
    requests = [EditRequest(i, 10.0 * i, 0.1, 7, steps=2) for i in range(3)]
    outcomes = EditCluster(MODEL, RoundRobinBalancer(), workers=1, bound=4).run(requests)
    assert [o.hit for o in outcomes] == [False, True, True]
    assert outcomes[0].latency_s == pytest.approx(2 * MODEL.step_s(1, 1.0))
    assert outcomes[1].latency_s == pytest.approx(2 * MODEL.step_s(1, 0.1))


def test_batching_shortens_the_wait_against_one_at_a_time() -> None:
    requests = make_edit_workload(EditWorkloadConfig(rate_per_s=0.8, duration_s=120.0), 5)

    def mean_latency(bound: int) -> float:
        out = EditCluster(MODEL, RoundRobinBalancer(), workers=1, bound=bound).run(requests)
        return float(np.mean([o.latency_s for o in out]))

    assert mean_latency(8) < mean_latency(1)


# --- the balancers --------------------------------------------------------------------------


def running(ratio: float, steps_left: int, template: int | None = None) -> WorkerEdit:
    return WorkerEdit(EditJob(ratio, 50, template), steps_left, ratio)


def waiting(ratio: float, template: int | None = None, steps: int = 50) -> WorkerEdit:
    return WorkerEdit(EditJob(ratio, steps, template), steps)


def test_each_balancer_on_a_hand_made_snapshot() -> None:
    workers = [
        WorkerSnapshot(running=(running(0.05, 10), running(0.05, 10)), bound=4),  # 2 small
        WorkerSnapshot(running=(running(0.9, 40),), bound=4),  # 1 large
        WorkerSnapshot(running=(running(0.1, 5), running(0.1, 5), running(0.1, 5)), bound=4),
    ]
    job = EditJob(0.1, 50, template=None)
    assert LeastRequestsBalancer().choose(job, workers) == 1  # fewest edits
    assert LeastTokensBalancer().choose(job, workers) == 0  # fewest masked tokens
    robin = RoundRobinBalancer()
    assert [robin.choose(job, workers) for _ in range(4)] == [0, 1, 2, 0]
    # predicted completion: worker 2's three edits finish in 5 steps; worker 1 runs 40 more
    finishes = [predict_finish_s(job, w, MODEL) for w in workers]
    assert MaskAwareBalancer(MODEL).choose(job, workers) == int(np.argmin(finishes))
    assert MaskAwareBalancer(MODEL).choose(job, workers) != 1


def test_prediction_on_an_idle_worker_is_the_run_alone() -> None:
    idle = WorkerSnapshot(templates=frozenset({3}), bound=8)
    assert predict_finish_s(EditJob(0.2, 50, 3), idle, MODEL) == pytest.approx(
        MODEL.alone_s(0.2, 50)
    )
    assert predict_finish_s(EditJob(0.2, 50, 4), idle, MODEL) == pytest.approx(
        MODEL.alone_s(1.0, 50)
    )  # a miss runs in full


def test_mask_aware_prefers_the_template_holder_unless_its_queue_makes_it_later() -> None:
    job = EditJob(0.1, 50, template=9)
    holder = WorkerSnapshot(templates=frozenset({9}), bound=1)
    other = WorkerSnapshot(bound=1)
    assert MaskAwareBalancer(MODEL).choose(job, [other, holder]) == 1
    blind = make_balancer("mask-only", MODEL)  # the ablation sees no records: a tie, first wins
    assert blind.choose(job, [other, holder]) == 0
    assert LeastRequestsBalancer().choose(job, [other, holder]) == 0  # blind to the record
    busy_holder = WorkerSnapshot(
        running=(running(1.0, 50),),
        waiting=(waiting(1.0), waiting(1.0)),
        templates=frozenset({9}),
        bound=1,
    )
    assert MaskAwareBalancer(MODEL).choose(job, [other, busy_holder]) == 0
    # a queued miss of the same template records it before the new edit joins: a hit then
    recorder = WorkerSnapshot(
        running=(running(1.0, 2, template=9),), bound=1, step_left_s=MODEL.step_s(1, 1.0)
    )  # its step in progress just began: 2 steps to run
    alone_after = 2 * MODEL.step_s(1, 1.0) + MODEL.alone_s(0.1, 50)
    assert predict_finish_s(job, recorder, MODEL) == pytest.approx(alone_after)


def test_unknown_balancer_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'fastest'"):
        make_balancer("fastest", MODEL)


def test_workload_has_the_papers_mask_mean_and_a_zipf_head() -> None:
    config = EditWorkloadConfig(rate_per_s=50.0, duration_s=200.0)
    requests = make_edit_workload(config, 1)
    ratios = np.array([r.mask_ratio for r in requests])
    assert ratios.mean() == pytest.approx(0.11, abs=0.01)
    templates = np.array([r.template for r in requests])
    assert np.mean(templates == 0) == pytest.approx(1 / np.sum(1 / np.arange(1, 971)), abs=0.02)
    mixed = make_edit_workload(EditWorkloadConfig(50.0, 100.0, text_to_image_share=0.3), 2)
    generations = [r for r in mixed if r.template is None]
    assert len(generations) / len(mixed) == pytest.approx(0.3, abs=0.03)
    assert all(r.mask_ratio == 1.0 for r in generations)


def test_lru_hit_rate_matches_a_simulated_lru() -> None:
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, 201)
    draws = rng.choice(200, size=40_000, p=weights / weights.sum())
    held: dict[int, None] = {}
    hits = 0
    for template in draws:
        if template in held:
            hits += 1
            del held[template]
        elif len(held) >= 20:
            del held[next(iter(held))]
        held[template] = None
    assert hits / draws.size == pytest.approx(lru_hit_rate(200, 1.0, 20), abs=0.02)
    assert lru_hit_rate(200, 1.0, 200) == 1.0 and lru_hit_rate(200, 1.0, 0) == 0.0


# --- argus evaluate --workload edits --------------------------------------------------------


def test_tiny_edits_evaluation_writes_p95_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "edits"
    code = main(
        [
            "evaluate",
            "--workload",
            "edits",
            "--balancers",
            "mask-aware,least-requests",
            "--loads",
            "0.5,0.9",
            "--seeds",
            "2",
            "--duration",
            "3",
            "--gpus",
            "2",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    with (out / "aggregate.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["load"], r["balancer"]) for r in rows} == {
        (load, b) for load in ("0.5", "0.9") for b in ("mask-aware", "least-requests")
    }
    p95 = [c for c in rows[0] if "p95" in c and c.endswith("_mean")]
    assert "latency_p95_s_mean" in p95
    assert all(float(r["latency_p95_s_mean"]) > 0 for r in rows)
    assert (out / "paired.csv").exists() and (out / "summary.json").exists()
    printed = capsys.readouterr().out
    assert "SYNTHETIC" in printed and "mask-aware" in printed


def test_edits_evaluation_pairs_continuous_with_static_batching(tmp_path: Path) -> None:
    out = tmp_path / "batching"
    args = ["evaluate", "--workload", "edits", "--balancers", "least-requests", "--gpus", "1"]
    args += ["--batching", "continuous,static", "--batch-bound", "4", "--edit-steps", "8"]
    args += ["--loads", "0.33", "--seeds", "3", "--duration", "20", "--out", str(out), "--quiet"]
    # priced by the CPU curve of SD-1.5's UNet, as benchmarks/bench_edit_serving.py runs it
    args += ["--edit-batch-table", str(CPU_TABLE), "--edit-curve", "sd15-arch"]
    assert main(args) == 0
    with (out / "aggregate.csv").open() as handle:
        p95 = {r["batching"]: float(r["latency_p95_s_mean"]) for r in csv.DictReader(handle)}
    with (out / "batching.csv").open() as handle:
        (paired,) = list(csv.DictReader(handle))
    assert (paired["balancer"], paired["other"], paired["seeds"]) == (
        "least-requests",
        "static",
        "3",
    )
    # static batching makes edits wait for whole batches: continuous's tail is shorter
    assert p95["continuous"] < p95["static"]
    assert float(paired["p95_reduction_mean"]) == pytest.approx(
        1 - p95["continuous"] / p95["static"], abs=0.05
    )
    assert float(paired["p95_reduction_mean"]) > 0.1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--batching", "dynamic"], "'dynamic'"),
        (["--edit-steps", "0"], "steps"),
        (["--balancers", "fastest"], "'fastest'"),
        (["--gpus", "A100=4"], "A100=4"),
        (["--cache-templates", "-1"], "cache_templates"),
    ],
)
def test_bad_edits_settings_exit_2_naming_them(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["evaluate", "--workload", "edits", "--quiet", "--out", str(tmp_path), *args])
    assert code == 2
    assert needle in capsys.readouterr().err
