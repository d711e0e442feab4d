"""benchmarks/bench_refusal_floor.py: every server design it compares refuses every request of
a small burst with Argus's retry hint (a design that answered otherwise would measure
something else), and the router's own servers are reached through its real core: they
refuse because its admission does, after the core was filled. Nothing about timing is
checked."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.benchmark_modules import benchmark_module

pytestmark = pytest.mark.integration


@pytest.fixture
def floor() -> Iterator[Any]:
    with benchmark_module("bench_refusal_floor") as module:
        yield module


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark needs 2 CPUs")
def test_every_design_refuses_a_small_burst_with_the_hint(
    floor: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    before = os.sched_getaffinity(0)
    results = floor.main(["--requests", "12", "--rounds", "1", "--grpc-channels", "2"])
    assert os.sched_getaffinity(0) == before  # it pinned its load generator, then gave back
    printed = capsys.readouterr().out
    assert set(results) == set(floor.SERVERS)
    for kind, rounds in results.items():
        (figures,) = rounds
        assert figures["refused"] == 12, (kind, figures["others"])
        assert kind in printed


def test_the_core_behind_the_router_servers_refuses_as_overloaded(floor: Any) -> None:
    from argus.contracts.router_api import RouterRequest
    from argus.router.values import Refusal, RouterError

    core = floor.refusing_core()
    try:
        with pytest.raises(RouterError) as refused:
            core.generate(RouterRequest(prompt="one more", seed=1, deadline_ms=floor.DEADLINE_MS))
        assert refused.value.kind is Refusal.OVERLOADED
    finally:
        core.close()  # its silent workers fail the filler calls still waiting


def test_an_unknown_design_is_named(floor: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        floor.main(["--servers", "grpc-sync,nginx"])
    assert "--servers: unknown ['nginx']" in capsys.readouterr().err
