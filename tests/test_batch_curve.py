"""Measured latency-per-batch curves (argus/profiles/batch_curve.py): the bound is the knee of
the throughput curve at the expected mask ratio, the table round-trips through its TOML, bad
files are refused naming the field, and a worker started with a table batches each model and
size up to its knee, one at a time where the table has nothing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from argus.profiles.batch_curve import (
    BatchCurve,
    BatchTable,
    BatchTableError,
    CurvePoint,
    dump_batch_table,
    load_batch_table,
)
from tests.test_edit_lane import Steps, edit, lane_worker
from tests.worker_factories import default_profiles, torch_threads


def curve(model: str = "sdxl", size: int = 64, **steps_s: dict[int, float]) -> BatchCurve:
    """A curve from {"m010": {b: seconds}, ...} (ratio in hundredths)."""
    points = [
        CurvePoint(b, int(name[1:]) / 100, seconds)
        for name, by_batch in steps_s.items()
        for b, seconds in by_batch.items()
    ]
    return BatchCurve(model, size, size, tuple(points), steps=10)


@pytest.mark.unit
def test_the_bound_is_the_knee_of_the_throughput_curve() -> None:
    # edits a second-step: b=1 10, b=2 18 (+80%), b=4 26.7 (+48%), b=8 28.6 (+7%: past the knee)
    knee = curve(m010={1: 0.100, 2: 0.111, 4: 0.150, 8: 0.280})
    assert knee.bound(0.11) == 4
    assert knee.bound(0.11, min_gain=0.05) == 8
    assert knee.bound(0.11, min_gain=1.0) == 1
    # a second ratio: the expected ratio picks the measured one at or above it
    two = curve(m010={1: 0.1, 2: 0.11, 4: 0.15}, m100={1: 0.2, 2: 0.4, 4: 0.8})
    assert two.bound(0.05) == 4 and two.bound(0.5) == 1 and two.bound(1.5) == 1


@pytest.mark.unit
def test_a_step_is_read_off_the_points_between_and_beyond_them() -> None:
    measured = curve(m010={1: 1.0, 2: 1.2, 4: 1.6}, m100={1: 2.0, 2: 2.6, 4: 3.6})
    assert measured.step_s(2, 0.2) == pytest.approx(1.2)  # a point: its own time
    assert measured.step_s(1, 0.55) == pytest.approx(1.5)  # halfway between the ratios
    assert measured.step_s(3, 0.3) == pytest.approx(1.4)  # halfway between sizes 2 and 4
    assert measured.step_s(1, 0.01) == pytest.approx(1.0)  # below 0.1: the nearest ratio's
    assert measured.step_s(8, 8.0) == pytest.approx(3.6 + 4 * 0.5)  # 2 → 4 extended to 8
    assert measured.step_s(0, 0.0) == 0.0


@pytest.mark.unit
def test_the_table_bound_is_capped_and_one_where_nothing_was_measured() -> None:
    table = BatchTable((curve(m010={1: 0.1, 2: 0.11, 4: 0.15}),))
    assert table.bound("sdxl", 64, 64, cap=8) == 4
    assert table.bound("sdxl", 64, 64, cap=2) == 2
    assert table.bound("sdxl", 128, 128, cap=8) == 1  # another size
    assert table.bound("sd-1.5", 64, 64, cap=8) == 1  # another model


@pytest.mark.unit
def test_the_table_round_trips_and_fits_the_cost_model(tmp_path: Path) -> None:
    written = curve(m010={1: 0.1, 2: 0.11, 4: 0.15}, m100={1: 0.2, 2: 0.38, 4: 0.75})
    path = tmp_path / "table.toml"
    path.write_text(dump_batch_table([written], 'bench "x"', "cpu"))
    table = load_batch_table(path)
    assert table.curves == (written,) and table.source == 'bench "x"'
    fitted = written.cost_model()
    assert 0.9 < fitted.r2 <= 1.0 and fitted.per_mask_s > 0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("source = 'x'\n", "no [[curve]]"),
        ("[[curve]]\nmodel = 'a'\nwidth = 64\nheight = 64\npoints = []\n", "points: none"),
        ("[[curve]]\nmodel = 'a'\nwidth = 64\nheight = 64\npoints = [[0, 0.1, 0.1]]\n", "batch"),
        ("[[curve]]\nmodel = 'a'\nwidth = 64\nheight = 64\npoints = [[1, 1.5, 0.1]]\n", "ratio"),
        ("[[curve]]\nmodel = 'a'\nwidth = 64\nheight = 64\npoints = [[1, 0.1, -1]]\n", "second"),
        ("[[curve]]\nmodel = 'a'\nheight = 64\npoints = [[1, 0.1, 0.1]]\n", "width"),
        ("[[curve]\n", "line 1"),
    ],
)
def test_a_bad_table_is_refused_naming_the_field(tmp_path: Path, text: str, names: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(BatchTableError, match=r"bad\.toml") as refused:
        load_batch_table(path)
    assert names in str(refused.value)


@pytest.mark.integration
@pytest.mark.parametrize(("size", "bound"), [(64, 2), (32, 1)])
def test_a_worker_batches_each_size_up_to_its_measured_knee(size: int, bound: int) -> None:
    """The table measures the worker's model at 64 px with its knee at 2: four edits at once
    run at most two together; at 32 px, which the table lacks, one at a time."""
    table = BatchTable((curve(m010={1: 0.1, 2: 0.12, 4: 0.23}),))
    model = default_profiles().levels[0].model
    assert table.curves[0].model == model
    steps = Steps()
    with torch_threads(1):
        worker = lane_worker(steps, edit_batch=8, edit_batch_table=table)
        try:
            calls = [edit(0.5, seed=s, steps=5, size=size) for s in range(4)]
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(worker.generate, calls))
        finally:
            worker.close()
    assert all(a.steps_run == 5 for a in answers)
    assert max(steps.rows) == bound


@pytest.mark.unit
def test_the_router_prices_edits_with_the_tables_fit_for_its_base_model(tmp_path: Path) -> None:
    """``argus router --edit-batch-table``: the fit of the profile's base model's curve at
    --default-size, else the first curve's; a bad table is a ValueError naming the file."""
    import argparse

    from argus.cli.router import edit_cost_model

    model = default_profiles().levels[0].model
    other = curve("other", m010={1: 0.1, 2: 0.2, 4: 0.4}, m100={1: 1.0, 2: 2.0, 4: 4.0})
    own = curve(model, m010={1: 0.1, 2: 0.11, 4: 0.15}, m100={1: 0.2, 2: 0.38, 4: 0.75})
    path = tmp_path / "table.toml"
    path.write_text(dump_batch_table([other, own], "test", "cpu"))
    args = argparse.Namespace(edit_batch_table=str(path), profile=None, default_size=64)
    assert edit_cost_model(args) == own.cost_model()
    args.default_size = 128  # no curve at that size: the first one's
    assert edit_cost_model(args) == other.cost_model()
    args.edit_batch_table = str(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match=r"missing\.toml"):
        edit_cost_model(args)
    assert edit_cost_model(argparse.Namespace(edit_batch_table=None)) is None


@pytest.mark.unit
def test_the_edit_evaluation_prices_steps_with_a_chosen_measured_curve(tmp_path: Path) -> None:
    """``argus evaluate --workload edits --edit-batch-table FILE [--edit-curve MODEL]``."""
    import argparse

    from argus.cli.edit_evaluate import measured_cost

    first = curve("first", m010={1: 0.1, 2: 0.2, 4: 0.4}, m100={1: 1.0, 2: 2.0, 4: 4.0})
    second = curve("second", m010={1: 0.1, 2: 0.11, 4: 0.15}, m100={1: 0.2, 2: 0.38, 4: 0.75})
    path = tmp_path / "table.toml"
    path.write_text(dump_batch_table([first, second], "test", "cpu"))
    args = argparse.Namespace(edit_batch_table=str(path), edit_curve=None)
    assert measured_cost(args) == {"model": first.cost_model()}
    args.edit_curve = "second"
    assert measured_cost(args) == {"model": second.cost_model()}
    args.edit_curve = "third"
    with pytest.raises(ValueError, match=r"--edit-curve.*first, second"):
        measured_cost(args)
    assert measured_cost(argparse.Namespace(edit_batch_table=None, edit_curve=None)) == {}
    with pytest.raises(ValueError, match="--edit-curve: needs --edit-batch-table"):
        measured_cost(argparse.Namespace(edit_batch_table=None, edit_curve="first"))


@pytest.mark.unit
def test_a_worker_refuses_a_bad_table_at_start_naming_the_flag(tmp_path: Path) -> None:
    from argus.worker.app import WorkerSettings

    with pytest.raises(ValueError, match=r"edit_batch_table: .*missing\.toml"):
        WorkerSettings(edit_batch=2, edit_batch_table=str(tmp_path / "missing.toml"))
    table = Path(__file__).resolve().parent.parent / "argus/profiles/edit-batching-cpu.toml"
    assert WorkerSettings(edit_batch=4, edit_batch_table=str(table)).edit_batch == 4


@pytest.mark.unit
def test_the_shipped_gpu_table_bounds_the_full_size_models_it_measured() -> None:
    """The H200 table (benchmarks/bench_edit_cost.py --device cuda) names the worker's own
    model names at their native sizes, so a GPU worker reading it bounds them; a size it did
    not measure keeps one at a time."""
    path = Path(__file__).resolve().parent.parent / "argus/profiles/edit-batching-h200.toml"
    table = load_batch_table(path)
    assert "H200" in table.device
    assert table.bound("sdxl", 1024, 1024, cap=8) == 4
    assert table.bound("sd-1.5", 512, 512, cap=8) == 4
    assert table.bound("sd-1.5", 512, 512, cap=2) == 2
    assert table.bound("sdxl", 512, 512, cap=8) == 1
