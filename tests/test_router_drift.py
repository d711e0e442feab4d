"""Drift retraining in a running router: workers' scores fall, the router retrains, swaps the
classifier while serving, counts it, and the allocator plans with the new Q(v | c)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from argus.classifier.drift import DriftConfig
from argus.classifier.labels import LabelledPrompts
from argus.classifier.model import LevelClassifier
from argus.classifier.serving import ClassifierSet, PromptClassifier
from argus.contracts.routers import class_quality_to_pb, router_report_from_pb
from argus.contracts.wire import FieldError
from argus.plumbing import rpc
from argus.router.app import StatsReporter, build_drift
from argus.router.drift import DriftSettings, RouterDrift
from argus.router.metrics import RouterMetrics
from argus.types import ClassQuality, Strategy
from tests.classifier_factories import AC_LEVELS, FakeEncoder, tolerance_classifier
from tests.router_cluster import PROFILES, TIMEOUT, Cluster, StubWorker, router_pb2, worker_pb2

pytestmark = pytest.mark.integration


allocator_pb2: Any = rpc.load("allocator_pb2")

HIGH, LOW = 20.0, 15.0  # the workers' scores before and after the drift
DRIFT_AFTER = 30  # requests scored HIGH before the scores fall
DEADLINE_S = 600.0


class Stream:
    """The drifted prompt stream's scores, in the order the workers serve requests."""

    def __init__(self) -> None:
        self.served = 0
        self.lock = threading.Lock()

    def next(self) -> float:
        with self.lock:
            self.served += 1
            return HIGH if self.served <= DRIFT_AFTER else LOW


class ScoringWorker(StubWorker):
    """A stub worker whose replies carry scores, as ``argus worker --score-sample 1`` would:
    the served image's, and the same prompt's at another level (a prompt seen at two levels,
    so it gets a label), a little lower."""

    stream = Stream()

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        reply = super().Generate(request, context)
        score = self.stream.next()
        other = "ac-k25" if request.level == "ac-k0" else "ac-k0"
        reply.scores.extend(
            [
                worker_pb2.QualityScore(prompt=request.prompt, level=request.level, score=score),
                worker_pb2.QualityScore(prompt=request.prompt, level=other, score=score - 0.5),
            ]
        )
        # what the worker's cache holds rides on replies too: other requests' prompt vectors
        reply.cache_log_id = "log-1"
        reply.cache_events_last = 1
        reply.cache_events.add().insert.CopyFrom(
            worker_pb2.CacheInsert(entry_id="e1", tag="t", embedding=[0.6, 0.8])
        )
        return reply


class BlockingTrain:
    """A ``train`` function that waits until the test lets it finish, so the swap happens
    while requests are in flight; returns a new calibrated model on a fresh encoder."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.data: LabelledPrompts | None = None

    def __call__(self, data: LabelledPrompts) -> LevelClassifier:
        self.data = data
        self.started.set()
        self.release.wait(TIMEOUT)
        return tolerance_classifier(encoder=FakeEncoder(), temperature=2.0)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    ScoringWorker.stream = Stream()
    made = Cluster()
    made.worker_type = ScoringWorker
    try:
        yield made
    finally:
        made.close()


def start(cluster: Cluster, train: BlockingTrain) -> tuple[Any, RouterDrift, CollectorRegistry]:
    cluster.add_worker("w1")
    cluster.add_worker("w2")
    classifiers = ClassifierSet({Strategy.AC: tolerance_classifier()})
    registry = CollectorRegistry()
    metrics = RouterMetrics(PROFILES, registry=registry)
    settings = DriftSettings(DriftConfig(window=10, history=2, min_history=2), min_examples=20)
    drift = build_drift(settings, classifiers, PROFILES, metrics, train)
    assert drift is not None
    classifier = PromptClassifier(classifiers, max_wait_s=0.0)
    stub = cluster.router(classifier=classifier, metrics=metrics, drift=drift)
    return stub, drift, registry


def generate(stub: Any, i: int) -> Any:
    """One request; its deadline is long because the fake clock stands still, so admission
    counts every request in flight as queued for a profile's full latency."""
    request = router_pb2.RouterGenerateRequest(request_id=f"r{i}", prompt=f"a bus number {i}")
    return stub.Generate(request, timeout=DEADLINE_S)


def test_falling_scores_retrain_and_swap_the_classifier_while_serving(cluster: Cluster) -> None:
    train = BlockingTrain()
    stub, drift, registry = start(cluster, train)
    holder = drift.classifiers.holders[Strategy.AC]
    before = holder.current

    # the stream falls after DRIFT_AFTER requests; a window closes every 5 requests
    for i in range(DRIFT_AFTER + 10):
        reply = generate(stub, i)
        # other requests' prompts stay in the router, as scores or as cached vectors
        assert not reply.worker_response.scores
        assert not reply.worker_response.cache_events and not reply.worker_response.cache_log_id
    assert train.started.wait(TIMEOUT), f"no retrain started: {drift.stats()}"
    assert train.data is not None and len(train.data) >= 20

    # requests keep being answered while the retrain runs and across the swap
    with ThreadPoolExecutor(4) as pool:
        during = [pool.submit(generate, stub, 1000 + i) for i in range(20)]
        train.release.set()
        after = [pool.submit(generate, stub, 2000 + i) for i in range(20)]
        replies = [f.result(TIMEOUT) for f in during + after]
    assert drift.wait(TIMEOUT)
    assert len(replies) == 40 and all(r.png for r in replies)

    assert holder.version == 1 and holder.current is not before
    assert registry.get_sample_value("argus_router_classifier_retrains_total") == 1.0
    stats = drift.stats()
    assert stats.retrains == 1 and stats.drifts >= 1 and stats.failures == 0
    generate(stub, 3000)  # classified by the new model
    assert holder.current.encoder.calls > 0  # type: ignore[attr-defined]

    # the router's next report carries the new Q and a key naming the retrain; the allocator
    # plans AC's classes with that Q from then on
    key, quality = drift.report("base")
    assert key == "base+retrained:ac1" and [q.strategy for q in quality] == [Strategy.AC]
    control = cluster.allocator.control
    assert control.class_quality(Strategy.AC) != quality[0]
    reporter = StatsReporter(
        cluster.core, cluster.client, cluster.clock, classifier_key="base", drift=drift
    )
    reporter.report_once()
    assert control.class_quality(Strategy.AC) == quality[0]
    assert control.classifier_key == "base+retrained:ac1"


def test_steady_scores_do_not_retrain(cluster: Cluster) -> None:
    ScoringWorker.stream = Stream()
    ScoringWorker.stream.served = -10_000  # every request scores HIGH
    train = BlockingTrain()
    stub, drift, registry = start(cluster, train)
    for i in range(60):
        generate(stub, i)
    assert drift.stats().windows >= 10 and drift.stats().drifts == 0
    assert not train.started.is_set() and drift.classifiers.holders[Strategy.AC].version == 0
    assert drift.report("base") == ("base", [])
    assert registry.get_sample_value("argus_router_classifier_retrains_total") == 0.0


def quality_table(levels: tuple[str, ...] = AC_LEVELS) -> ClassQuality:
    n = len(levels)
    rows = tuple(tuple(1.0 - 0.05 * v * (n - c) / n for v in range(n)) for c in range(n))
    return ClassQuality(Strategy.AC, levels, rows, (1.0 / n,) * n, "test")


def test_reported_quality_is_checked_against_the_profile() -> None:
    table = quality_table()
    good = class_quality_to_pb(table)
    parsed = router_report_from_pb(
        allocator_pb2.RouterReport(router_id="r", class_quality=[good]), PROFILES
    )
    assert parsed.class_quality == (table,)

    wrong_levels = class_quality_to_pb(table)
    wrong_levels.levels[0] = "sm-x"
    short = class_quality_to_pb(table)
    del short.quality[-1]
    negative = class_quality_to_pb(table)
    negative.prior[2] = -1.0
    for bad, field in (
        (wrong_levels, "class_quality[0].levels"),
        (short, "class_quality[0].quality"),
        (negative, "class_quality[0].prior[2]"),
    ):
        with pytest.raises(FieldError, match=field.replace("[", r"\[").replace("]", r"\]")):
            router_report_from_pb(
                allocator_pb2.RouterReport(router_id="r", class_quality=[bad]), PROFILES
            )


def test_drift_flags_map_to_the_router_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import argus.router.app as router_app
    from argus.cli.main import main

    seen: list[Any] = []

    def serve(settings: Any) -> int:
        seen.append(settings)
        return 0

    monkeypatch.setattr(router_app, "serve", serve)
    base = ["router", "--allocator", "127.0.0.1:1", "--insecure-internal"]
    assert main(base) == 0
    assert seen[-1].drift == DriftSettings()  # on by default, retraining
    argv = [*base, "--drift-window", "50", "--no-drift-retrain", "--drift-min-labels", "7"]
    assert main([*argv, "--drift-tolerance", "0.1"]) == 0
    drift = seen[-1].drift
    assert (drift.monitor.window, drift.monitor.tolerance) == (50, 0.1)
    assert (drift.retrain, drift.min_examples) == (False, 7)
    assert main([*base, "--drift-window", "0"]) == 0 and seen[-1].drift is None


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["router", "--insecure-internal", "--allocator", "127.0.0.1:1", "--drift-window", "-1"],
            "--drift-window",
        ),
        (
            [
                "router",
                "--insecure-internal",
                "--allocator",
                "127.0.0.1:1",
                "--drift-tolerance",
                "1.5",
            ],
            "tolerance",
        ),
        (
            [
                "router",
                "--insecure-internal",
                "--allocator",
                "127.0.0.1:1",
                "--drift-min-labels",
                "0",
            ],
            "min_examples",
        ),
        (["worker", "--insecure-internal", "--score-sample", "2"], "--score-sample"),
    ],
)
def test_bad_drift_flags_are_refused(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from argus.cli.main import main

    assert main(argv) == 2
    assert needle in capsys.readouterr().err


class Score:
    def __init__(self, prompt: str, level: str, score: float) -> None:
        self.prompt, self.level, self.score = prompt, level, score


def retrain_directly(serving_sha: str, trained_sha: str) -> tuple[LevelClassifier, Any]:
    """Feed a drifting stream straight to a RouterDrift; returns the serving model before the
    swap and the holder."""
    serving = tolerance_classifier(encoder=FakeEncoder(), encoder_sha256=serving_sha)
    classifiers = ClassifierSet({Strategy.AC: serving})

    def train(data: LabelledPrompts) -> LevelClassifier:
        return tolerance_classifier(encoder=FakeEncoder(), encoder_sha256=trained_sha)

    settings = DriftSettings(DriftConfig(window=4, history=2, min_history=2), min_examples=4)
    drift = RouterDrift(classifiers, PROFILES, train, settings)
    for i in range(12):
        value = HIGH if i < 8 else LOW
        drift.observe([Score(f"p{i}", "ac-k0", value), Score(f"p{i}", "ac-k10", value - 1)])
    assert drift.wait(TIMEOUT) and drift.stats().retrains == 1, drift.stats()
    return serving, classifiers.holders[Strategy.AC]


def test_a_retrained_head_on_the_same_encoder_weights_serves_on_the_serving_encoder() -> None:
    serving, holder = retrain_directly("same-weights", "same-weights")
    assert holder.version == 1 and holder.current is not serving
    assert holder.current.encoder is serving.encoder  # ONNX in the router, cache still valid
    serving, holder = retrain_directly("serving-weights", "other-weights")
    assert holder.current.encoder is not serving.encoder
