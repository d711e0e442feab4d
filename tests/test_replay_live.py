"""``argus replay --live``: the load generator against an in-process cluster (real router, stub
workers), its records as the simulator's RunResult and reports, and the CLI's flags and errors.

No assertion depends on wall-clock time: the generator's own unit tests run on a fake clock
and a fake stub; the cluster tests only count outcomes.
"""

from __future__ import annotations

import csv
import json
import socket
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from argus.cli.main import main
from argus.plumbing import rpc
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.sim.arrivals import poisson
from argus.sim.report import summarise, write_reports
from argus.sim.workloads import Workload
from argus.tools.live import (
    NOT_SENT,
    LiveConfig,
    LiveError,
    LoadGenerator,
    open_channel,
    replay_live,
    to_run_result,
    write_requests,
)
from argus.types import Strategy
from tests.router_cluster import PROFILES, Cluster

pytestmark = pytest.mark.integration


router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")

SLO_S = 12.6  # the simulator's: 3 × SDXL on an A100 in the default profiles


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    yield made
    made.close()


def quality_for(workload: Workload) -> dict[Strategy, Any]:
    return {
        s: synthetic_quality_table(
            workload.prompts, s, [lv.name for lv in PROFILES.levels_for(s)], seed=0
        )
        for s in Strategy
    }


def live(address: str, workload: Workload, **fields: Any) -> Any:
    fields.setdefault("speedup", 20.0)
    config = LiveConfig(address=address, run_id="t", **fields)
    channel = open_channel(address)
    try:
        return replay_live(workload, PROFILES, quality_for(workload), config, channel)
    finally:
        channel.close()


def short_trace() -> Workload:
    return poisson(600.0, 0.05, seed=1)  # about 30 requests in 3 s of trace time


# -- against a running router ---------------------------------------------------------------


def test_served_requests_match_what_the_workers_answered(cluster: Cluster, tmp_path: Path) -> None:
    cluster.add_worker("w1")
    cluster.add_worker("w2")
    address = cluster.start_router()
    workload = short_trace()
    result = live(address, workload)

    c = result.counts
    assert c.total == len(workload) == len(result.records)
    assert c.sent == c.served + c.rejected + c.failed
    assert c.dropped == 0 and c.failed == 0
    calls = {call.request_id: (w, call) for w, s in cluster.workers.items() for call in s.calls}
    assert c.served == len(calls) > 0
    levels = {lv.name for lv in PROFILES.levels}
    for r in result.records:
        if r.status == "OK":
            worker_id, call = calls[r.request_id]
            assert (r.worker_id, r.level) == (worker_id, call.level)
            assert r.level in levels and r.classified_level in levels
            assert call.prompt == workload.prompt(r.index).prompt
            assert r.strategy in ("AC", "SM")
        else:
            assert r.status == "RESOURCE_EXHAUSTED"  # admission, when a queue builds up

    run = result.run
    assert run.policy == "live" and run.slo_s == pytest.approx(SLO_S)
    ok = np.array([r.status == "OK" for r in result.records])
    assert np.all(run.level[ok] >= 0) and np.all(run.worker[ok] >= 0)
    assert np.all(run.score[ok] > 0.0) and np.all(run.relative[ok] <= 1.0)
    assert run.gpus == len({r.worker_id for r in result.records if r.status == "OK"})

    summaries = write_reports([run], tmp_path, description=result.describe())
    write_requests(result, tmp_path / "requests.csv")
    summary = json.loads((tmp_path / "summary.json").read_text())
    live_summary = summary["policies"]["live"]
    assert live_summary["requests"] == c.total
    assert summary["description"]["sent"] == str(c.sent)
    assert summary["description"]["served"] == str(c.served)
    with (tmp_path / "per_minute.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sum(float(row["offered_qpm"]) for row in rows) == c.total
    assert sum(float(row["served_qpm"]) for row in rows) <= c.served
    never_served = c.rejected + c.failed + c.dropped
    assert summaries[0].slo_violation_ratio == pytest.approx((never_served + c.late) / c.total)
    with (tmp_path / "requests.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == c.total
    assert (tmp_path / "timeseries.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("fail", "fields", "status", "worker_calls"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, {}, "RESOURCE_EXHAUSTED", True),  # worker full
        # admission: a 1 ms deadline cannot be met even on an idle worker, so the router
        # refuses it before classifying, with DEADLINE_EXCEEDED (no retry can help)
        (None, {"slo_s": 0.001, "max_lag_s": 60.0}, "DEADLINE_EXCEEDED", False),
        ("no worker", {}, "UNAVAILABLE", False),
    ],
)
def test_requests_that_are_not_served_count_as_drops(
    cluster: Cluster, fail: Any, fields: dict[str, Any], status: str, worker_calls: bool
) -> None:
    if fail != "no worker":
        cluster.add_worker("w1", fail)
    address = cluster.start_router()
    workload = poisson(600.0, 0.02, seed=2)  # about 12 requests
    result = live(address, workload, **fields)

    assert result.statuses() == {status: len(workload)}
    c = result.counts
    assert c.served == 0 and c.sent == len(workload)
    assert (c.rejected if status == "RESOURCE_EXHAUSTED" else c.failed) == len(workload)
    calls = sum(len(w.calls) for w in cluster.workers.values())
    if worker_calls:  # admission may refuse some before the worker when its queue builds
        assert 0 < calls <= len(workload)
    else:
        assert calls == 0
    summary = summarise(result.run)
    assert summary.requests == len(workload)
    assert summary.slo_violation_ratio == 1.0
    assert summary.served_qpm == 0.0 and summary.effective_quality == 0.0


def test_unreachable_router_is_one_error() -> None:
    with pytest.raises(LiveError, match="cannot reach the router"):
        open_channel(f"127.0.0.1:{closed_port()}")


# -- the generator on a fake clock and a fake stub ------------------------------------------


class FakeCall:
    """A Generate future the test completes: OK with a fixed answer."""

    def __init__(self, request: Any, metadata: Any) -> None:
        self.request = request
        self.metadata = metadata
        self.callbacks: list[Any] = []
        self.done = False

    def add_done_callback(self, callback: Any) -> None:
        if self.done:
            callback(self)
        else:
            self.callbacks.append(callback)

    def finish(self) -> None:
        self.done = True
        for callback in self.callbacks:
            callback(self)

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def exception(self) -> Any:
        return None

    def result(self) -> Any:
        return router_pb2.RouterGenerateResponse(
            request_id=self.request.request_id,
            level="ac-k10",
            level_index=2,
            strategy=1,
            worker_id="w0",
            classified_level="ac-k10",
            plan_version=1,
        )


class FakeStub:
    """``Generate.future`` holds its calls until ``release``; later ones answer at once."""

    def __init__(self) -> None:
        self.Generate = self
        self.calls: list[FakeCall] = []
        self.hold = True

    def future(self, request: Any, timeout: float, metadata: Any) -> FakeCall:
        call = FakeCall(request, metadata)
        call.done = not self.hold
        self.calls.append(call)
        return call

    def release(self) -> None:
        self.hold = False
        for call in self.calls:
            if not call.done:
                call.finish()


class FakeTime:
    """A clock that ``sleep`` moves (the first sleep by ``overshoot_s`` more); each sleep lets
    the stub's held calls answer."""

    def __init__(self, stub: FakeStub, overshoot_s: float = 0.0) -> None:
        self.now = 0.0
        self.stub = stub
        self.overshoot_s = overshoot_s

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + self.overshoot_s
        self.overshoot_s = 0.0
        self.stub.release()


def test_outstanding_calls_are_bounded_and_the_rest_dropped() -> None:
    workload = Workload("w", np.array([0.0] * 6 + [10.0] * 2), poisson(60, 1).prompts, "test")
    stub = FakeStub()
    fake = FakeTime(stub)
    config = LiveConfig(
        address="x:1", speedup=1.0, max_outstanding=2, run_id="r", auth_token="sesame"
    )
    records, _ = LoadGenerator(
        stub, workload, config, SLO_S, clock=fake.clock, sleep=fake.sleep
    ).run()

    assert [r.status for r in records] == ["OK"] * 2 + [NOT_SENT] * 4 + ["OK"] * 2
    assert all("2 calls outstanding" in r.detail for r in records[2:6])
    sent = [call.request for call in stub.calls]
    assert [q.request_id for q in sent] == ["r-0", "r-1", "r-6", "r-7"]
    assert [q.seed for q in sent] == [0, 1, 6, 7]
    assert all(q.deadline_ms == 12600 for q in sent)
    assert all(not q.HasField("steps") and not q.HasField("width") for q in sent)
    assert all(call.metadata == (("authorization", "Bearer sesame"),) for call in stub.calls)
    assert records[0].latency_s == pytest.approx(10.0)  # answered when the clock moved

    run = to_run_result(
        records,
        profiles=PROFILES,
        quality=quality_for(workload),
        slo_s=SLO_S,
        speedup=1.0,
        wall_s=10.0,
    )
    table = quality_for(workload)[Strategy.AC]
    row = 7 % len(table.prompts)
    assert run.score[7] == pytest.approx(table.scores[row, table.level_index("ac-k10")])
    assert run.finish_s[2] > run.duration_s  # a drop never finishes within the run
    assert list(run.violated) == [False] * 2 + [True] * 4 + [False] * 2


def test_a_sender_that_falls_behind_drops_rather_than_sends_late() -> None:
    workload = Workload("w", np.array([0.0, 1.0, 40.0]), poisson(60, 1).prompts, "test")
    stub = FakeStub()
    fake = FakeTime(stub, overshoot_s=30.0)  # the first wait oversleeps by 30 s
    config = LiveConfig(address="x:1", speedup=1.0, run_id="r")
    records, _ = LoadGenerator(
        stub, workload, config, SLO_S, clock=fake.clock, sleep=fake.sleep
    ).run()
    assert [r.status for r in records] == ["OK", NOT_SENT, "OK"]
    assert "late" in records[1].detail


# -- the command line -----------------------------------------------------------------------


def replay(capsys: Any, *args: str) -> tuple[int, str, str]:
    code = main(["replay", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_live_writes_the_simulators_reports(
    cluster: Cluster, capsys: Any, tmp_path: Path
) -> None:
    cluster.add_worker("w1")
    address = cluster.start_router()
    args = ["--live", address, "--trace", "poisson", "--duration", "0.05", "--scale", "4"]
    code, out, err = replay(capsys, *args, "--speedup", "30", "--out", str(tmp_path))
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["policies"]) == {"live"}
    described = summary["description"]
    assert described["live"] == address
    assert "synthetic" in described["quality"]
    assert int(described["sent"]) == summary["policies"]["live"]["requests"] > 0
    assert int(described["sent"]) == sum(
        int(described[k]) for k in ("served", "rejected", "failed")
    )
    assert (tmp_path / "per_minute.csv").exists() and (tmp_path / "timeseries.png").exists()
    assert (tmp_path / "requests.csv").exists()
    assert out.splitlines()[2].startswith("live ")
    assert "SYNTHETIC" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--live", "127.0.0.1:1", "--policies", "argus"], "--policies does not apply"),
        (["--live", "127.0.0.1:1", "--gpu-failure", "1:2:1"], "--gpu-failure"),
        (["--live", "127.0.0.1:1", "--gpus", "4"], "--gpus"),
        (["--live", "127.0.0.1:1", "--classifier", "oracle"], "--classifier"),
        (["--speedup", "10"], "--speedup needs --live"),
        (["--limit", "5"], "--limit needs --live"),
        (["--live", "nowhere"], "HOST:PORT"),
        (["--live", "127.0.0.1:1", "--auth-token-file", "/no/such/token"], "/no/such/token"),
        (["--live", "127.0.0.1:1", "--speedup", "0"], "speedup"),
    ],
)
def test_cli_flags_of_the_wrong_mode_exit_2(
    capsys: Any, tmp_path: Path, args: list[str], needle: str
) -> None:
    code, _, err = replay(capsys, "--trace", "poisson", "--duration", "1", *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert needle in err


def test_cli_unreachable_router_exits_2(capsys: Any, tmp_path: Path) -> None:
    address = f"127.0.0.1:{closed_port()}"
    code, _, err = replay(
        capsys, "--live", address, "--trace", "poisson", "--duration", "0.1", "--out", str(tmp_path)
    )
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "cannot reach the router" in err and address in err


class TokenRouter(router_pb2_grpc.RouterServicer):  # type: ignore[misc]
    """A router that serves only calls with ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self.token = token

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        if ("authorization", f"Bearer {self.token}") not in context.invocation_metadata():
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong")
        return router_pb2.RouterGenerateResponse(
            request_id=request.request_id, level="ac-k0", strategy=1, worker_id="w0"
        )


@pytest.fixture
def token_router() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    router_pb2_grpc.add_RouterServicer_to_server(TokenRouter("sesame"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.mark.parametrize(("token", "code"), [("sesame\n", 0), ("wrong", 2)])
def test_cli_sends_the_bearer_token(
    token_router: str, capsys: Any, tmp_path: Path, token: str, code: int
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(token)
    got, _, err = replay(
        capsys,
        "--live", token_router, "--trace", "poisson", "--duration", "0.02", "--speedup", "30",
        "--auth-token-file", str(token_file), "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert got == code, err
    if code:
        assert "UNAUTHENTICATED" in err and len(err.strip().splitlines()) == 1


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
