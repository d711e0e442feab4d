"""Workers score a sample of their images off the request path and send the scores on later
replies (argus.worker.scoring)."""

from __future__ import annotations

import io
import math
import random
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from PIL import Image

from argus.contracts.generate import CacheOutcome, GenerateResult
from argus.plumbing import rpc
from argus.types import Strategy
from argus.worker.scoring import ScoreSampler, tiny_scorer
from argus.worker.service import WorkerServicer

pytestmark = pytest.mark.unit


worker_pb2: Any = rpc.load("worker_pb2")
TIMEOUT = 10.0


def png(colour: tuple[int, int, int] = (200, 10, 10), size: int = 32) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="PNG")
    return out.getvalue()


class FakeScorer:
    """Scores an image by its first pixel's red value; optionally waits for ``gate``."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.calls = 0

    def score(self, prompt: str, images: Sequence[Any]) -> list[float]:
        if self.gate is not None:
            self.gate.wait(TIMEOUT)
        self.calls += 1
        return [float(image.getpixel((0, 0))[0]) for image in images]


def test_rate_draws_the_sample_and_scores_arrive_in_order() -> None:
    sampler = ScoreSampler(FakeScorer(), 0.5, rng=random.Random(3), max_queue=200)
    try:
        queued = [sampler.offer(f"p{i}", "ac-k0", png((i, 0, 0)), f"r{i}") for i in range(200)]
        assert sampler.wait_idle(TIMEOUT)
        scores = sampler.take()
        assert 70 <= sum(queued) <= 130  # about half, drawn by the seeded generator
        assert [s.request_id for s in scores] == [f"r{i}" for i, q in enumerate(queued) if q]
        assert all(s.score == float(int(s.prompt[1:])) for s in scores)
        assert sampler.take() == []  # taken once
        stats = sampler.stats()
        assert (stats.offered, stats.sampled, stats.scored) == (200, sum(queued), sum(queued))
    finally:
        sampler.close()


def test_rate_zero_scores_nothing() -> None:
    scorer = FakeScorer()
    sampler = ScoreSampler(scorer, 0.0)
    try:
        assert not any(sampler.offer("p", "ac-k0", png()) for _ in range(50))
        assert sampler.wait_idle(TIMEOUT) and scorer.calls == 0 and sampler.take() == []
    finally:
        sampler.close()


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    gate = threading.Event()
    sampler = ScoreSampler(FakeScorer(gate), 1.0, max_queue=2)
    try:
        # one image is taken by the scoring thread (held at the gate), two wait, the rest drop
        results = [sampler.offer(f"p{i}", "ac-k0", png()) for i in range(10)]
        assert results.count(True) <= 3 and sampler.stats().dropped == results.count(False)
        assert sampler.stats().dropped >= 7
        gate.set()
        assert sampler.wait_idle(TIMEOUT)
        assert len(sampler.take()) == results.count(True)
    finally:
        gate.set()
        sampler.close()


def test_bad_images_are_counted_and_old_scores_expire() -> None:
    sampler = ScoreSampler(FakeScorer(), 1.0, max_done=3)
    try:
        sampler.offer("p", "ac-k0", b"not a png")
        for i in range(5):
            sampler.offer(f"p{i}", "ac-k5", png((i, 0, 0)))
        assert sampler.wait_idle(TIMEOUT)
        stats = sampler.stats()
        assert stats.failed == 1 and stats.scored == 5 and stats.expired == 2
        assert [s.prompt for s in sampler.take()] == ["p2", "p3", "p4"]  # the newest kept
    finally:
        sampler.close()


def test_bad_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="rate"):
        ScoreSampler(FakeScorer(), 1.5)


class FakeWorker:
    """The engine as the servicer calls it: every request served at its level at once."""

    class config:  # mirrors Worker.config, the one attribute the servicer reads
        worker_id = "w1"

    def generate(self, call: Any, token: Any = None) -> GenerateResult:
        red = int(call.prompt.rsplit(" ", 1)[-1])
        return GenerateResult(
            request_id=call.request_id,
            png=png((red, 0, 0)),
            level=call.level or "ac-k0",
            strategy=Strategy.AC,
            model="tiny",
            scheduler="euler",
            steps_run=4,
            start_step=0,
            cache=CacheOutcome.NOT_USED,
        )


class FakeContext:
    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, callback: Any) -> bool:
        return True


CONTEXT: Any = FakeContext()


def test_a_score_rides_on_a_later_reply() -> None:
    sampler = ScoreSampler(FakeScorer(), 1.0)
    servicer = WorkerServicer(FakeWorker(), health_servicer=None, scores=sampler)  # type: ignore[arg-type]
    try:
        first = worker_pb2.GenerateRequest(request_id="r1", prompt="a bus 42", level="ac-k10")
        reply = servicer.Generate(first, CONTEXT)
        assert reply.png and not reply.scores  # scoring runs after the reply
        assert sampler.wait_idle(TIMEOUT)
        second = worker_pb2.GenerateRequest(request_id="r2", prompt="a bus 7", level="ac-k0")
        reply = servicer.Generate(second, CONTEXT)
        assert [(s.prompt, s.level, s.score, s.request_id) for s in reply.scores] == [
            ("a bus 42", "ac-k10", 42.0, "r1")
        ]
    finally:
        sampler.close()


def test_the_tiny_scorer_scores_images() -> None:
    scorer = tiny_scorer()
    red, blue = (
        Image.open(io.BytesIO(png(c, 64))).convert("RGB") for c in ((250, 0, 0), (0, 0, 250))
    )
    scores = scorer.score("a red square", [red, blue])
    assert len(scores) == 2 and all(math.isfinite(s) for s in scores)
    assert all(s > 0 for s in scores)  # as PickScore's: the drift rule assumes positive scores
    assert scores[0] != scores[1]
    assert tiny_scorer().score("a red square", [red]) == pytest.approx(scores[:1])  # seeded


def test_the_scorer_loads_on_the_scoring_thread_and_a_failed_load_only_counts() -> None:
    loaded_on: list[str] = []

    def load() -> FakeScorer:
        loaded_on.append(threading.current_thread().name)
        return FakeScorer()

    sampler = ScoreSampler(load, 1.0)
    try:
        sampler.offer("p", "ac-k0", png((9, 0, 0)))
        assert sampler.wait_idle(TIMEOUT)
        assert loaded_on == ["argus-scoring"] and [s.score for s in sampler.take()] == [9.0]
    finally:
        sampler.close()

    def broken() -> FakeScorer:
        raise OSError("no such directory")

    sampler = ScoreSampler(broken, 1.0)
    try:
        assert sampler.offer("p", "ac-k0", png())  # the request path never sees the failure
        assert sampler.wait_idle(TIMEOUT)
        assert sampler.stats().failed == 1 and sampler.take() == []
    finally:
        sampler.close()


def test_real_models_are_scored_only_with_a_real_scorer(caplog: pytest.LogCaptureFixture) -> None:
    from argus.worker.app import WorkerSettings, build_score_sampler

    assert build_score_sampler(WorkerSettings(score_sample=0.0), "cpu") is None
    real = WorkerSettings(model="/models/sdxl", score_sample=0.05)
    assert build_score_sampler(real, "cpu") is None
    assert "--score-sample needs --scorer" in caplog.text
    for settings in (
        WorkerSettings(score_sample=0.05),  # tiny models: the tiny random CLIP
        WorkerSettings(model="/models/sdxl", score_sample=0.05, scorer_dir="/models/pickscore"),
    ):
        sampler = build_score_sampler(settings, "cpu")
        assert sampler is not None and sampler.rate == 0.05
        sampler.close()
    with pytest.raises(ValueError, match="score_sample"):
        WorkerSettings(score_sample=-0.1)
