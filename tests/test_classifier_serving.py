"""Serving the classifier: micro-batching, atomic hot-swap, bad prompts."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from argus.classifier.labels import labels_from_table
from argus.classifier.prompts import EMPTY_PROMPT_LEVEL, InvalidPromptError
from argus.classifier.serving import (
    BatcherClosed,
    ClassifierSet,
    HotSwapModel,
    MicroBatcher,
    PromptClassifier,
    load_prompt_classifier,
)
from argus.classifier.train import TrainConfig, save_trained, train_classifier
from argus.types import Strategy
from tests.classifier_factories import (
    FakeEncoder,
    constant_classifier,
    lexical_table,
    make_tiny_bert,
)

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------ micro-batcher


def test_every_caller_gets_its_own_answer_from_shared_batches() -> None:
    release = threading.Event()
    sizes: list[int] = []

    def run_batch(items: list[int]) -> list[int]:
        sizes.append(len(items))
        release.wait()  # the first batch holds the thread until every caller has submitted
        return [item * item for item in items]

    batcher: MicroBatcher[int, int] = MicroBatcher(run_batch, max_batch=8, max_wait_s=0.01)
    results: dict[int, int] = {}
    submitted = threading.Barrier(41)

    def caller(item: int) -> None:
        future = batcher.submit(item)
        submitted.wait()
        results[item] = future.result(timeout=30)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(40)]
    for thread in threads:
        thread.start()
    submitted.wait()
    release.set()
    for thread in threads:
        thread.join()
    batcher.close()
    assert results == {i: i * i for i in range(40)}
    assert sum(sizes) == 40
    assert max(sizes) == 8  # 39 callers queued behind the first batch: full batches
    assert all(size <= 8 for size in sizes)
    stats = batcher.stats()
    assert stats.items == 40 and stats.batches == len(sizes) and stats.largest_batch == 8


def test_a_failing_batch_fails_its_callers_only() -> None:
    def run_batch(items: list[str]) -> list[str]:
        if "boom" in items:
            raise RuntimeError("encoder exploded")
        return [item.upper() for item in items]

    batcher: MicroBatcher[str, str] = MicroBatcher(run_batch, max_batch=4, max_wait_s=0.0)
    with pytest.raises(RuntimeError, match="encoder exploded"):
        batcher("boom", timeout=10)
    assert batcher("ok", timeout=10) == "OK"
    assert batcher.stats().failed_batches == 1
    batcher.close()
    with pytest.raises(BatcherClosed):
        batcher.submit("late")


def test_a_batch_with_the_wrong_number_of_results_is_an_error() -> None:
    batcher: MicroBatcher[int, int] = MicroBatcher(lambda items: [], max_batch=2)
    with pytest.raises(RuntimeError, match="returned 0 results"):
        batcher(1, timeout=10)
    batcher.close()


# ----------------------------------------------------------------------------------- hot swap


def test_hot_swap_is_atomic_under_concurrent_prediction() -> None:
    """Every batch comes from one model, old or new, never a mix; versions only go up."""
    encoder = FakeEncoder()
    models = [constant_classifier(1, encoder=encoder), constant_classifier(4, encoder=encoder)]
    models_sm = [
        constant_classifier(0, strategy=Strategy.SM, levels=("a", "b", "c"), encoder=encoder),
        constant_classifier(2, strategy=Strategy.SM, levels=("a", "b", "c"), encoder=encoder),
    ]
    classifiers = ClassifierSet({Strategy.AC: models[0], Strategy.SM: models_sm[0]})
    stop = threading.Event()
    seen: list[tuple[int, ...]] = []
    errors: list[BaseException] = []

    def predictor() -> None:
        texts: list[str | None] = [f"prompt {i}" for i in range(6)] + [None]
        try:
            while not stop.is_set():
                levels = classifiers.predict_cleaned(texts)
                seen.append(tuple(levels[Strategy.AC][:6].tolist()))
                assert levels[Strategy.AC][6] == EMPTY_PROMPT_LEVEL
                assert set(levels[Strategy.SM][:6].tolist()) <= {0, 2}
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=predictor) for _ in range(4)]
    for thread in threads:
        thread.start()
    versions = [classifiers.holders[Strategy.AC].swap(models[i % 2]) for i in range(1, 301)]
    for i in range(1, 301):
        classifiers.holders[Strategy.SM].swap(models_sm[i % 2])
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors
    assert versions == list(range(1, 301))
    assert seen and all(batch in {(1,) * 6, (4,) * 6} for batch in seen)


def test_hot_swap_snapshot_pairs_model_and_version() -> None:
    holder = HotSwapModel("a")
    assert holder.snapshot() == ("a", 0)
    assert holder.swap("b") == 1
    assert holder.snapshot() == ("b", 1) and holder.current == "b" and holder.version == 1


# ---------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> PromptClassifier:
    """A PromptClassifier over a logistic head on a tiny random BERT, loaded from disk."""
    root = tmp_path_factory.mktemp("served")
    encoder = make_tiny_bert(root / "bert")
    result = train_classifier(
        labels_from_table(lexical_table()),
        TrainConfig(max_tokens=32, c_grid=(3.0,)),
        encoder_dir=encoder,
    )
    save_trained(result, root / "classifier" / "ac")
    classifier = load_prompt_classifier(root / "classifier", max_batch=16, max_wait_s=0.001)
    yield classifier
    classifier.close()


def test_empty_and_whitespace_prompts_get_the_slowest_level(served: PromptClassifier) -> None:
    for prompt in ("", "   ", "\n\t \r\n", b"", b"  \n"):
        assert served.classify(prompt) == {Strategy.AC: EMPTY_PROMPT_LEVEL}


def test_a_megabyte_prompt_is_truncated_not_refused(served: PromptClassifier) -> None:
    unit = "a calligraphy and a cat and a orchestra "
    huge = unit * (1_000_000 // len(unit) + 1)
    assert len(huge) >= 1_000_000
    head = unit * 20  # longer than the encoder's 32 tokens
    expected = served.classify(head)
    assert served.classify(huge) == expected
    assert served.classify(huge.encode("utf-8")) == expected
    assert served.classify("   " * 300_000 + head) == expected  # leading blanks are stripped


def test_non_utf8_bytes_are_a_clear_error(served: PromptClassifier) -> None:
    with pytest.raises(InvalidPromptError, match=r"not valid UTF-8: byte 0xc3 at offset 5"):
        served.classify(b"a cat\xc3(")
    with pytest.raises(InvalidPromptError, match="lone surrogate"):
        served.classify("a cat \udcff")
    with pytest.raises(TypeError, match="str or bytes"):
        served.classify(None)  # type: ignore[arg-type]


def test_bad_prompts_do_not_disturb_concurrent_callers(served: PromptClassifier) -> None:
    prompts = [f"a {w} and a cat" for w in ("mosaic", "sun", "tapestry", "moon")] * 5
    expected = [served.classify(p)[Strategy.AC] for p in prompts]
    answers: dict[int, object] = {}

    def caller(i: int) -> None:
        try:
            if i % 2:
                served.classify(b"\xff" * i)
            answers[i] = served.classify(prompts[i])[Strategy.AC]
        except InvalidPromptError as exc:
            answers[i] = exc

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, answer in answers.items():
        if i % 2:
            assert isinstance(answer, InvalidPromptError)
        else:
            assert answer == expected[i]


def test_concurrent_callers_match_one_by_one_predictions(served: PromptClassifier) -> None:
    prompts = [f"a {a} and a {b}" for a in ("cat", "mosaic", "sun") for b in ("origami", "cup")]
    model = served.classifiers.current(Strategy.AC)
    assert model.has_classes and served.has_classes(Strategy.AC)
    expected = model.classes(prompts).tolist()
    got: dict[int, int] = {}

    def caller(i: int) -> None:
        got[i] = served.classify(prompts[i], timeout=30)[Strategy.AC]

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [got[i] for i in range(len(prompts))] == expected


def test_classifier_set_shares_one_encoder_pass() -> None:
    encoder = FakeEncoder()
    classifiers = ClassifierSet(
        {
            Strategy.AC: constant_classifier(3, encoder=encoder),
            Strategy.SM: constant_classifier(
                1, strategy=Strategy.SM, levels=("a", "b"), encoder=encoder
            ),
        }
    )
    levels = classifiers.predict(["x", "y", " "])
    assert levels[Strategy.AC].tolist() == [3, 3, 0]
    assert levels[Strategy.SM].tolist() == [1, 1, 0]
    assert encoder.calls == 1 and encoder.texts == ["x", "y"]


def test_loader_rejects_a_mismatched_slot(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds a SM classifier"):
        ClassifierSet({Strategy.AC: constant_classifier(0, strategy=Strategy.SM, levels=("a",))})
    assert np.array_equal(constant_classifier(2).predict(["a", ""]), [2, 0])
