import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from argus.cli.main import COMMANDS, OneLineParser, load_command, main

pytestmark = pytest.mark.unit


def run_plan(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_the_contract(capsys):
    code, out, err = run_plan(
        capsys, "--workers", "8", "--load", "150", "--histogram", "10,20,30,20,10,10"
    )
    assert code == 0, err
    plan = json.loads(out)
    for key in (
        "levels",
        "workers_per_level",
        "load_share",
        "pasm",
        "objective",
        "shortfall_qpm",
        "moved_workers",
        "solve_ms",
    ):
        assert key in plan
    assert plan["levels"] == ["ac-k0", "ac-k5", "ac-k10", "ac-k15", "ac-k20", "ac-k25"]
    assert sum(plan["workers_per_level"].values()) == 8
    assert sum(plan["load_share"].values()) == pytest.approx(150.0)
    for row in plan["pasm"].values():
        assert sum(row.values()) == pytest.approx(1.0)
    assert plan["shortfall_qpm"] == 0


def test_workers_by_class_and_sm(capsys):
    code, out, _ = run_plan(
        capsys, "--strategy", "sm", "--workers-by-class", "a100=4,h100=4", "--load", "600"
    )
    plan = json.loads(out)
    assert code == 0
    assert plan["levels"][0] == "sm-sd-xl"
    assert plan["shortfall_qpm"] > 0 and plan["saturated"]
    assert sum(plan["workers_per_level"].values()) == 8


def test_current_plan_round_trip_with_switching_cost(capsys, tmp_path):
    _, out, _ = run_plan(capsys, "--strategy", "SM", "--workers", "8", "--load", "150")
    current = tmp_path / "plan.json"
    current.write_text(out)
    code, out, _ = run_plan(
        capsys,
        "--strategy",
        "SM",
        "--workers",
        "8",
        "--load",
        "145",
        "--current-plan",
        str(current),
        "--switch-cost",
        "1000",
    )
    assert code == 0
    assert json.loads(out)["moved_workers"] == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--load", "100", "--histogram", "1,2,3"], "--histogram: expected 6 values"),
        (["--load", "100", "--histogram", "1,-2,3,1,1,1"], "--histogram: value 1"),
        (["--load", "100", "--histogram", "a,b"], "--histogram"),
        (["--load", "100", "--strategy", "XX"], "unknown strategy 'XX'"),
        (["--load", "-5"], "--load"),
        (["--load", "100", "--workers-by-class", "tpu=3"], "unknown class 'tpu'"),
        (["--load", "100", "--profiles", "/nonexistent.toml"], "cannot read"),
        (["--load", "100", "--current-plan", "/nonexistent.json"], "--current-plan"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, needle):
    code, out, err = run_plan(capsys, *args)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert needle in err


def test_argparse_errors_are_one_line_too():
    result = subprocess.run(
        [sys.executable, "-m", "argus", "plan", "--workers", "x", "--load", "1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1


def test_plan_does_not_import_torch():
    code = (
        "import sys; from argus.cli.main import main; import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['plan', '--load', '10'])\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_unknown_command(capsys):
    """Exit 2 with one line that quotes the unknown name and lists every known command."""
    with pytest.raises(SystemExit) as info:
        main(["bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "unknown command 'bogus'; choose from " in err
    known = err.split("choose from ", 1)[1].split(", ")
    assert known == list(COMMANDS)


# -- command-line hygiene --------------------------------------------------------------------


def test_abbreviated_options_are_refused(capsys):
    """``--worker 3`` once ran as ``--workers 3``; an abbreviation is now an unknown option."""
    with pytest.raises(SystemExit) as info:
        main(["up", "--worker", "3"])
    assert info.value.code == 2
    assert "unrecognized arguments: --worker 3" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_no_command_takes_abbreviations(name):
    parser = OneLineParser(prog=f"argus {name}")
    load_command(name).add_arguments(parser)
    for action in parser._actions:
        action.required = False  # only the option's spelling is under test
    long_options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for option in long_options:
        prefix = option[:-1]
        if prefix not in long_options and prefix != "--":
            assert parser.parse_known_args([prefix])[1] == [prefix], (name, prefix)


LONG = "x" * 100_000


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--load", "1", "--histogram", LONG],  # a CLIError quoting the value
        ["plan", "--load", LONG],  # an argparse error quoting it
        ["plan", "--load", "1", LONG],  # an unrecognized argument
        [LONG],  # an unknown command
    ],
)
def test_errors_quote_long_values_cut_short(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err) < 400, err[:400]
    assert "characters]" in err


def test_client_lines_quote_long_prompts_cut_short(tmp_path, capsys):
    import grpc

    from argus.cli.client import send_prompts
    from argus.tools.client import RequestFailed

    class Refusing:
        def generate(self, prompt, **options):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "prompt: too long", None)

    assert send_prompts(Refusing(), [LONG], tmp_path, count=1, concurrency=1) == 1
    line = capsys.readouterr().out
    assert len(line) < 400
    assert json.loads(line)["prompt"].startswith("x" * 80 + "… [100,000 characters]")


class FakeCluster:
    """Stands in for :class:`LocalCluster` in ``argus up``: writes to its workdir like the
    real one, starts nothing."""

    workdirs: ClassVar[list[Path]] = []
    specs: ClassVar[list[Any]] = []

    def __init__(self, spec):
        self.spec = spec
        FakeCluster.specs.append(spec)
        self.router = "127.0.0.1:1"
        self.router_http = "" if spec.router_http_port is None else "http://127.0.0.1:2/v1"
        (spec.workdir / "logs").mkdir(parents=True, exist_ok=True)
        (spec.workdir / "logs" / "router.log").write_text("listening on 127.0.0.1:1\n")
        FakeCluster.workdirs.append(spec.workdir)

    def start(self, on_ready=None):
        if on_ready is not None:
            on_ready("cluster", 0.0)

    def stop(self):
        return {"router": 0}

    def dead(self):
        return []


@pytest.fixture
def fake_cluster(monkeypatch, tmp_path):
    import tempfile

    import argus.tools.local_cluster

    monkeypatch.setattr(argus.tools.local_cluster, "LocalCluster", FakeCluster)
    monkeypatch.setattr(argus.tools.local_cluster, "describe", lambda cluster: [])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    FakeCluster.workdirs = []
    return FakeCluster


def test_up_removes_its_temporary_workdir(fake_cluster, tmp_path, capsys):
    assert main(["up", "--port", "0", "--exit-after-demo"]) == 0
    [workdir] = fake_cluster.workdirs
    assert workdir.name.startswith("argus-up-") and workdir.parent == tmp_path / "tmp"
    assert not workdir.exists()
    assert "removed on exit" in capsys.readouterr().out


def test_up_prints_the_http_url_unless_turned_off(fake_cluster, capsys):
    assert main(["up", "--port", "0", "--exit-after-demo"]) == 0
    assert fake_cluster.specs[-1].router_http_port == 0
    assert "router http on http://127.0.0.1:2/v1" in capsys.readouterr().out
    assert main(["up", "--port", "0", "--exit-after-demo", "--http-port", "-1"]) == 0
    assert fake_cluster.specs[-1].router_http_port is None
    assert "router http on" not in capsys.readouterr().out


def test_up_gives_the_workers_real_model_directories(fake_cluster, tmp_path):
    model, small = tmp_path / "sdxl", tmp_path / "tiny-sd"
    argv = ["up", "--port", "0", "--exit-after-demo", "--model", str(model)]
    assert main([*argv, "--variant", f"sm-tiny-sd={small}"]) == 0
    assert fake_cluster.specs[-1].worker_args == (
        "--model",
        str(model),
        "--variant",
        f"sm-tiny-sd={small}",
    )
    assert main(["up", "--port", "0", "--exit-after-demo"]) == 0
    assert fake_cluster.specs[-1].worker_args == ()  # the tiny default


def test_up_keeps_a_given_workdir(fake_cluster, tmp_path):
    workdir = tmp_path / "mine"
    assert main(["up", "--port", "0", "--exit-after-demo", "--workdir", str(workdir)]) == 0
    assert fake_cluster.workdirs == [workdir]
    assert (workdir / "logs" / "router.log").exists()


def test_a_client_with_retries_follows_the_routers_hint_and_says_how_many_it_took(
    tmp_path, capsys, monkeypatch
):
    import grpc

    from argus.cli.client import send_prompts
    from argus.tools.client import RequestFailed

    class Response:
        png = b"png"

    class BusyTwice:
        def __init__(self):
            self.calls = 0

        def generate(self, prompt, **options):
            self.calls += 1
            if self.calls == 1:
                raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 250)
            if self.calls == 2:
                raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed", None)
            return Response()

    import argus.tools.client

    monkeypatch.setattr(argus.tools.client, "summary", lambda response, path: {"out": str(path)})
    pauses = []
    client = BusyTwice()
    failed = send_prompts(
        client, ["a fox"], tmp_path, count=1, concurrency=1, retries=3, sleep=pauses.append
    )
    assert failed == 0 and client.calls == 3
    assert pauses == [0.25, 1.0]  # the hint, then the pause of a request without one
    assert json.loads(capsys.readouterr().out)["retries"] == 2
    assert (tmp_path / "0000.png").read_bytes() == b"png"


def test_a_client_without_retries_reports_the_refusal_and_does_not_send_again(tmp_path, capsys):
    import grpc

    from argus.cli.client import send_prompts
    from argus.tools.client import RequestFailed

    class Busy:
        calls = 0

        def generate(self, prompt, **options):
            Busy.calls += 1
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 250)

    assert send_prompts(Busy(), ["a fox"], tmp_path, count=1, concurrency=1) == 1
    assert Busy.calls == 1
    assert json.loads(capsys.readouterr().out)["retry_after_ms"] == 250


@pytest.mark.parametrize(
    ("command", "module"),
    [
        (["worker", "--allocator", "127.0.0.1:1", "--insecure-internal"], "argus.worker.app"),
        (["controlnet", "--insecure-internal"], "argus.worker.adapters.controlnet.app"),
    ],
)
def test_torch_processes_let_openmp_threads_sleep_unless_told_otherwise(command, module):
    # the process reports what it found when it first imports the serving module, and stops
    code = (
        "import os, sys\n"
        "class Spy:\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name == {module!r}:\n"
        "            print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules, flush=True)\n"
        "            os._exit(0)\n"
        "sys.meta_path.insert(0, Spy())\n"
        "from argus.cli.main import main\n"
        f"main({command!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.stdout.split()[:2] == ["PASSIVE", "False"], done.stdout + done.stderr
    told = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
    )
    assert told.stdout.split()[:1] == ["ACTIVE"], told.stdout + told.stderr


@pytest.mark.parametrize("command", ["worker", "controlnet"])
@pytest.mark.parametrize("nice", ["20", "-1"])
def test_compute_commands_refuse_a_nice_value_outside_0_to_19(command, nice, capsys):
    assert main([command, "--nice", nice]) == 2
    assert f"--nice: {nice} outside 0..19" in capsys.readouterr().err


def test_the_allocators_planner_flags_are_checked_and_named(capsys):
    assert main(["allocator", "--insecure-internal", "--slo-s", "-1"]) == 2
    assert "--slo-s: must be a finite number > 0, got -1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["allocator", "--planner", "greedy"])
    assert exited.value.code == 2 and "--planner" in capsys.readouterr().err


def test_argus_up_passes_edit_batching_to_the_workers_and_the_router() -> None:
    """``argus up --edit-batch 4 --edit-balancer mask-aware``: the workers get --edit-batch, the
    router both; defaults pass nothing; a bad value is refused naming the flag."""
    import argparse

    from argus.cli.main import CLIError
    from argus.cli.up import _edit_args

    args = argparse.Namespace(edit_batch=4, edit_balancer="mask-aware")
    assert _edit_args(args, "worker") == ("--edit-batch", "4")
    assert _edit_args(args, "router") == ("--edit-batch", "4", "--edit-balancer", "mask-aware")
    plain = argparse.Namespace(edit_batch=1, edit_balancer="plan")
    assert _edit_args(plain, "worker") == () and _edit_args(plain, "router") == ()
    with pytest.raises(CLIError, match="--edit-batch"):
        _edit_args(argparse.Namespace(edit_batch=0, edit_balancer="plan"), "worker")
    with pytest.raises(CLIError, match=r"--edit-balancer.*fastest"):
        _edit_args(argparse.Namespace(edit_batch=2, edit_balancer="fastest"), "router")
