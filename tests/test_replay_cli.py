import json

import pytest

from argus.cli.main import main

pytestmark = pytest.mark.unit


def replay(capsys, *args):
    code = main(["replay", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_writes_reports_for_every_policy(capsys, tmp_path):
    code, out, err = replay(
        capsys,
        "--trace",
        "poisson",
        "--duration",
        "3",
        "--policies",
        "argus,clipper-ht",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["policies"]) == {"argus", "clipper-ht"}
    assert "synthetic" in summary["description"]["quality"]
    assert (tmp_path / "per_minute.csv").exists() and (tmp_path / "timeseries.png").exists()
    assert "argus" in out and "clipper-ht" in out
    assert "SYNTHETIC" in out and "goodput" in out
    assert summary["description"]["admission"].startswith("on")
    argus = summary["policies"]["argus"]
    assert argus["requests"] == argus["admitted"] + argus["refused"]
    assert argus["quality_n"] == argus["goodput"]


def test_no_admission_queues_every_request(capsys, tmp_path):
    args = ["--trace", "poisson", "--duration", "2", "--scale", "2", "--policies", "clipper-ha"]
    code, _, err = replay(capsys, *args, "--no-admission", "--out", str(tmp_path))
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["description"]["admission"].startswith("off")
    assert summary["policies"]["clipper-ha"]["refused"] == 0
    code, _, err = replay(capsys, *args, "--out", str(tmp_path / "on"))
    assert code == 0, err
    summary = json.loads((tmp_path / "on" / "summary.json").read_text())
    assert summary["policies"]["clipper-ha"]["refused"] > 0  # 300 QPM on 8 SDXL GPUs


def test_faults_on_the_command_line(capsys, tmp_path):
    code, _, err = replay(
        capsys,
        "--trace",
        "poisson",
        "--duration",
        "3",
        "--policies",
        "argus",
        "--gpu-failure",
        "1:2:4",
        "--retrieval-fault",
        "0.5:1.5",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--policies", "argus,fastest"], "unknown policy 'fastest'"),
        (["--trace", "nonexistent.csv"], "nonexistent.csv"),
        (["--trace", "poisson", "--prompts", "/no/such/prompts.tsv"], "prompts.tsv"),
        (["--gpu-failure", "1:2"], "--gpu-failure"),
        (["--retrieval-fault", "a:b"], "not a number"),
        (["--gpus", "0"], "gpus"),
        (["--live", "127.0.0.1:1", "--no-admission"], "--no-admission does not apply"),
        (["--gpus", "v100=2"], "unknown GPU class 'v100'"),
        (["--gpus", "a100=x"], "expected N or CLASS=N"),
        (["--gpus", "a100=2,a100=2"], "given twice"),
        (["--gpus", "a100=0"], "needs >= 1 GPU"),
        (["--live", "127.0.0.1:1", "--save-trace", "t.csv"], "--save-trace does not apply"),
        (["--duration", "1", "--save-trace", "/no/such/dir/t.csv"], "cannot write the trace"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, args, needle):
    code, _, err = replay(capsys, "--out", str(tmp_path), *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert needle in err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("arrival_s\n", "empty"),
        ("arrival_s\n5.0\n2.0\n", "before"),
        ("arrival_s\n-1.0\n", "negative"),
        ("when,prompt\n1,a\n", "looked for arrival_s, timestamp, time, any case"),
    ],
)
def test_bad_trace_files(capsys, tmp_path, content, needle):
    trace = tmp_path / "trace.csv"
    trace.write_text(content)
    code, _, err = replay(capsys, "--trace", str(trace), "--out", str(tmp_path / "out"))
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert needle in err.lower()


def test_a_saved_trace_replays_the_same_run(capsys, tmp_path):
    """``--save-trace`` writes the workload replayed; ``--trace`` of that file gives every
    policy the same results, request for request, and the same workload description."""
    trace = tmp_path / "trace.csv"
    common = ("--policies", "argus,clipper-ht", "--seed", "4")
    first = tmp_path / "first"
    code, _, err = replay(
        capsys,
        *("--trace", "bursty", "--duration", "3", "--scale", "0.5", *common),
        *("--save-trace", str(trace), "--out", str(first)),
    )
    assert code == 0, err
    assert trace.read_text().startswith("# name: bursty\n")
    again = tmp_path / "again"
    code, _, err = replay(capsys, "--trace", str(trace), *common, "--out", str(again))
    assert code == 0, err
    saved, replayed = (json.loads((d / "summary.json").read_text()) for d in (first, again))
    assert replayed["policies"] == saved["policies"]
    assert replayed["description"]["trace"] == saved["description"]["trace"]
    assert (again / "per_minute.csv").read_text() == (first / "per_minute.csv").read_text()


def test_gpus_per_class(capsys, tmp_path):
    code, _, err = replay(
        capsys,
        "--trace",
        "poisson",
        "--duration",
        "2",
        "--gpus",
        "a100=2,h100=2",
        "--policies",
        "clipper-ha,sommelier",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["description"]["gpus"] == "a100=2,h100=2"
    assert "4 GPUs (a100=2, h100=2)" in summary["description"]["title"]
    assert float(summary["description"]["slo_s"]) == pytest.approx(12.6)  # A100's 3 x 4.2 s
    code, _, err = replay(
        capsys,
        *("--trace", "poisson", "--duration", "1", "--gpus", "3", "--policies", "clipper-ht"),
        *("--out", str(tmp_path)),
    )
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["description"]["gpus"] == "a100=3"  # a count: the profiles' first class


@pytest.mark.parametrize(
    "content",
    [
        "Time\n1700000000\n1700000030.5\n1700000075\n",
        "timestamp\n12\n42.5\n87\n",
        "TIMESTAMP\n2023-11-16 18:15:46\n2023-11-16 18:16:16.5\n2023-11-16 18:17:01\n",
        "arrival_s\n0\n30.5\n75\n",
    ],
)
def test_trace_files_with_any_arrival_column(capsys, tmp_path, content):
    trace = tmp_path / "trace.csv"
    trace.write_text(content)
    out_dir = tmp_path / "out"
    code, _, err = replay(
        capsys, "--trace", str(trace), "--policies", "clipper-ht", "--out", str(out_dir)
    )
    assert code == 0, err
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["policies"]["clipper-ht"]["requests"] == 3
    assert summary["policies"]["clipper-ht"]["offered_qpm"] == pytest.approx(3 / 1.25)
