"""The supervisor's restart policy, on a fake cluster and a fake clock."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from argus.plumbing.supervision import GaveUp, RestartPolicy, Supervisor

pytestmark = pytest.mark.unit


class FakeCluster:
    def __init__(self, names: Iterable[str]) -> None:
        self.alive = dict.fromkeys(names, True)
        self.restarted: list[str] = []

    def kill(self, name: str) -> None:
        self.alive[name] = False

    def dead(self) -> list[tuple[str, int | None]]:
        return [(name, -9) for name, up in self.alive.items() if not up]

    def restart(self, name: str) -> None:
        self.alive[name] = True
        self.restarted.append(name)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_its_cap_and_gives_up_at_the_limit() -> None:
    policy = RestartPolicy(initial_s=1.0, factor=2.0, max_s=5.0, max_deaths=5)
    assert [policy.delay_s(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, None]


@pytest.mark.parametrize(
    "field, value",
    [("initial_s", -1.0), ("factor", 0.5), ("max_s", 0.1), ("max_deaths", 0), ("window_s", 0.0)],
)
def test_a_bad_policy_names_its_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RestartPolicy(**{field: value})  # type: ignore[arg-type]


def test_a_dead_part_is_restarted_after_its_backoff_and_only_it() -> None:
    cluster, clock = FakeCluster(["allocator", "worker-0", "worker-1"]), Clock()
    said: list[str] = []
    supervisor = Supervisor(cluster, RestartPolicy(initial_s=2.0), clock=clock, say=said.append)
    supervisor.check()
    assert cluster.restarted == []
    cluster.kill("worker-1")
    supervisor.check()
    assert cluster.restarted == [], "restarted before its backoff"
    assert "worker-1 exited with code -9" in said[0]
    clock.now = 1.9
    supervisor.check()
    assert cluster.restarted == []
    clock.now = 2.0
    supervisor.check()
    assert cluster.restarted == ["worker-1"]
    assert supervisor.restarts == 1


def test_a_part_that_keeps_dying_is_given_up_on_by_name() -> None:
    cluster, clock = FakeCluster(["router", "worker-0"]), Clock()
    policy = RestartPolicy(initial_s=1.0, factor=1.0, max_deaths=3, window_s=60.0)
    supervisor = Supervisor(cluster, policy, clock=clock, say=lambda _: None)
    for _ in range(2):
        cluster.kill("worker-0")
        supervisor.check()
        clock.now += 1.0
        supervisor.check()
    assert cluster.restarted == ["worker-0", "worker-0"]
    cluster.kill("worker-0")
    with pytest.raises(GaveUp, match="worker-0 died 3 times"):
        supervisor.check()


def test_deaths_outside_the_window_are_forgiven() -> None:
    cluster, clock = FakeCluster(["worker-0"]), Clock()
    policy = RestartPolicy(initial_s=1.0, factor=1.0, max_deaths=2, window_s=10.0)
    supervisor = Supervisor(cluster, policy, clock=clock, say=lambda _: None)
    for _ in range(4):  # one death every 20 s: never two within 10 s
        cluster.kill("worker-0")
        supervisor.check()
        clock.now += 1.0
        supervisor.check()
        clock.now += 19.0
    assert cluster.restarted == ["worker-0"] * 4


def test_the_thread_reports_giving_up() -> None:
    cluster = FakeCluster(["controlnet"])
    supervisor = Supervisor(
        cluster, RestartPolicy(max_deaths=1), interval_s=0.01, say=lambda _: None
    )
    cluster.kill("controlnet")
    supervisor.start()
    assert supervisor.failed.wait(10.0)
    assert supervisor.failure is not None and supervisor.failure.name == "controlnet"
    supervisor.stop()
