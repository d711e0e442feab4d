"""Calibration of the classifier: temperature, tolerance classes, Q(v | c), calibration.json,
the fixed prompt split in training, classes in serving, and the embedding cache."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from argus.classifier.calibration import (
    CALIBRATION_FILE,
    CalibrationError,
    class_edges,
    classes_of_scores,
    expected_calibration_error,
    fit_temperature,
    measure_class_quality,
    negative_log_likelihood,
    read_calibration,
    shrunk_class_means,
    softmax_t,
)
from argus.classifier.embedding_cache import (
    CACHE_ENV,
    EmbeddingCache,
    EncoderIdentity,
    default_cache_dir,
)
from argus.classifier.labels import labels_from_table
from argus.classifier.model import (
    ArtifactError,
    load_artifact,
    read_artifact_calibration,
    read_class_quality,
)
from argus.classifier.prompts import EMPTY_PROMPT_CLASS
from argus.classifier.serving import (
    ClassifierSet,
    PromptClassifier,
    classifier_key,
    default_classifier_dir,
    read_planning_classes,
)
from argus.classifier.train import TrainConfig, save_trained, train_classifier
from argus.contracts.quality import QualityTable
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.prompt_split import PromptSet, prompt_set
from argus.traces import default_prompt_trace, load_prompts
from argus.types import ClassQuality, Strategy
from tests.classifier_factories import (
    AC_LEVELS,
    FakeEncoder,
    constant_classifier,
    make_tiny_bert,
    tolerance_classifier,
)

pytestmark = pytest.mark.unit


FAST = TrainConfig(max_tokens=32, c_grid=(0.3, 3.0))


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="module")
def synthetic_table() -> QualityTable:
    records = load_prompts(default_prompt_trace())[:400]
    return synthetic_quality_table(records, Strategy.AC, list(AC_LEVELS), seed=0)


@pytest.fixture(scope="module")
def trained(tiny_bert: Path, synthetic_table: QualityTable):
    return train_classifier(labels_from_table(synthetic_table), FAST, encoder_dir=tiny_bert)


# ---------------------------------------------------------------------------- temperature


def overconfident(n: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Labels drawn from softmax(z); logits 4·z: a model four times too sure of itself."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 1.0, size=(n, 5))
    p = softmax_t(z)
    labels = np.array([rng.choice(5, p=row) for row in p])
    return 4.0 * z, labels


def test_temperature_scaling_fixes_an_overconfident_model() -> None:
    logits, labels = overconfident()
    temperature = fit_temperature(logits, labels)
    assert temperature == pytest.approx(4.0, rel=0.15)
    before = negative_log_likelihood(logits, labels)
    after = negative_log_likelihood(logits, labels, temperature)
    assert after < before - 0.1
    for other in (1.0, 0.8 * temperature, 1.25 * temperature):  # it is the minimum
        assert after <= negative_log_likelihood(logits, labels, other)
    ece_before = expected_calibration_error(softmax_t(logits), labels)
    ece_after = expected_calibration_error(softmax_t(logits, temperature), labels)
    assert ece_after < 0.5 * ece_before
    assert fit_temperature(logits, labels) == temperature  # deterministic
    assert fit_temperature(logits[:0], labels[:0]) == 1.0


def test_expected_calibration_error_by_hand() -> None:
    probabilities = np.array([[0.9, 0.1], [0.9, 0.1], [0.3, 0.7], [0.4, 0.6]])
    labels = np.array([0, 1, 1, 1])
    # bin (0.8667, 0.9333]: confidence 0.9, accuracy 0.5; bin (0.6667, 0.7333]: 0.7 vs 1;
    # bin (0.5333, 0.6]: 0.6 vs 1
    expected = (2 * 0.4 + 0.3 + 0.4) / 4
    assert expected_calibration_error(probabilities, labels) == pytest.approx(expected)


# -------------------------------------------------------------------------------- classes


@pytest.mark.parametrize("n_classes", [1, 2, 4, 6])
def test_equal_count_edges_are_increasing_and_classes_ordered(n_classes: int) -> None:
    scores = np.random.default_rng(2).gamma(2.0, 1.0, size=600)
    edges = class_edges(scores, n_classes)
    assert len(edges) == n_classes - 1
    assert all(a < b for a, b in itertools.pairwise(edges))
    classes = classes_of_scores(scores, edges)
    assert np.bincount(classes, minlength=n_classes).tolist() == [600 // n_classes] * n_classes
    order = np.argsort(scores)
    assert np.all(np.diff(classes[order]) >= 0)  # a more tolerant prompt never gets a lower class


def test_ties_leave_no_class_empty_when_the_scores_allow_it() -> None:
    scores = np.array([0.0] * 50 + [1.0] * 3 + [2.0] * 30 + [3.0] + [4.0] * 10 + [5.0] * 6)
    edges = class_edges(scores, 6)
    assert all(a < b for a, b in itertools.pairwise(edges))
    counts = np.bincount(classes_of_scores(scores, edges), minlength=6)
    assert counts.tolist() == [50, 3, 30, 1, 10, 6]  # six values, six classes: one each
    few = class_edges(np.array([1.0] * 10 + [2.0] * 10 + [3.0] * 10), 6)
    assert all(a <= b for a, b in itertools.pairwise(few))
    counts = np.bincount(classes_of_scores(np.array([1.0, 2.0, 3.0]), few), minlength=6)
    assert sorted(counts.tolist()) == [0, 0, 0, 1, 1, 1]
    same = class_edges(np.full(20, 0.7), 4)
    assert classes_of_scores(np.full(20, 0.7), same).tolist() == [0] * 20


def test_class_quality_by_hand_and_an_empty_class_borrows_its_neighbour() -> None:
    # no spread within a class: nothing to shrink, the class means are kept as they are
    classes = np.array([0, 0, 2, 2])
    scores = np.array(
        [[21.0, 11.0, 9.0], [21.0, 11.0, 9.0], [19.0, 19.0, 18.0], [19.0, 19.0, 18.0]]
    )
    stats = measure_class_quality(classes, scores, 3)
    assert stats.counts == (2, 0, 2)
    assert stats.best_mean == pytest.approx(20.0)
    assert stats.mean_score[0] == pytest.approx((21.0, 11.0, 9.0))
    assert stats.quality[2] == pytest.approx((0.95, 0.95, 0.9))
    assert stats.quality[1] == stats.quality[0]  # empty: the less tolerant neighbour on a tie


def test_trained_classes_are_ordered_by_tolerance(trained) -> None:
    calibration = trained.classifier.calibration
    assert calibration is not None and calibration.stats is not None
    n = len(AC_LEVELS)
    assert sum(calibration.counts) == len(trained.split.calibration)
    assert min(calibration.counts) >= len(trained.split.calibration) // n - 1
    quality = np.array(calibration.stats.quality)
    # a more tolerant class keeps more of its quality at the fastest level
    assert quality[-1, -1] > quality[0, -1]
    assert calibration.stats.best_mean == pytest.approx(
        trained.data.scores[trained.split.calibration, 0].mean()
    )


# ---------------------------------------------------------------- the fixed split in training


def test_training_uses_each_prompt_for_its_set_only(trained) -> None:
    data, split = trained.data, trained.split
    purposes = {
        PromptSet.TRAIN: np.concatenate([split.fit, split.val]),
        PromptSet.CALIBRATION: split.calibration,
        PromptSet.EVAL: split.test,
    }
    seen: set[str] = set()
    for which, rows in purposes.items():
        texts = {data.prompts[i] for i in rows.tolist()}
        assert not texts & seen
        seen |= texts
        assert all(prompt_set(data.split_keys[i]) is which for i in rows.tolist())
    assert len(seen) == len(data)
    assert not set(split.fit.tolist()) & set(split.val.tolist())
    metrics = trained.metrics_json()
    assert metrics["split"]["train"] == len(purposes[PromptSet.TRAIN])
    assert metrics["split"]["calibration"] == len(split.calibration)
    assert sum(metrics["classes"]["calibration_counts"]) == len(split.calibration)
    assert metrics["calibration"]["calibration"]["prompts"] == len(split.calibration)
    assert metrics["eval"]["n"] == metrics["split"]["eval"] == len(split.test)


def test_weights_depend_on_train_labels_only(tiny_bert: Path, trained) -> None:
    data, split = trained.data, trained.split
    shuffled = data.labels.copy()
    held = np.concatenate([split.calibration, split.test])
    shuffled[held] = (shuffled[held] + 3) % len(AC_LEVELS)
    other = train_classifier(replace(data, labels=shuffled), FAST, encoder_dir=tiny_bert)
    assert np.array_equal(other.classifier.head.weight, trained.classifier.head.weight)
    assert np.array_equal(other.classifier.head.bias, trained.classifier.head.bias)
    assert other.selection == trained.selection
    assert other.classifier.temperature != trained.classifier.temperature  # calibration moved
    changed = data.labels.copy()
    changed[split.fit[:20]] = (changed[split.fit[:20]] + 3) % len(AC_LEVELS)
    moved = train_classifier(replace(data, labels=changed), FAST, encoder_dir=tiny_bert)
    assert not np.array_equal(moved.classifier.head.weight, trained.classifier.head.weight)


def test_calibration_depends_on_calibration_prompts_only(tiny_bert: Path, trained) -> None:
    data, split = trained.data, trained.split
    assert data.scores is not None
    scores = data.scores.copy()
    scores[split.test] *= 0.5
    labels = data.labels.copy()
    labels[split.test] = 0
    other = train_classifier(
        replace(data, labels=labels, scores=scores), FAST, encoder_dir=tiny_bert
    )
    assert other.classifier.calibration == trained.classifier.calibration


def test_prompts_whose_copies_fall_in_two_sets_are_left_out() -> None:
    assert prompt_set("cat") is not prompt_set(" cat")  # the same prompt after cleaning
    scores = np.array([[20.0, 19.0]] * 3)
    table = QualityTable(Strategy.AC, ("a", "b"), ("cat", " cat", "box"), scores, "t")
    data = labels_from_table(table)
    assert data.prompts == ("box",) and data.split_keys == ("box",)


# ------------------------------------------------------------------------- calibration.json


@pytest.fixture
def artifact(tmp_path: Path, trained) -> Path:
    return save_trained(trained, tmp_path / "clf" / "ac")


def test_calibration_json_round_trips(artifact: Path, trained) -> None:
    calibration = read_calibration(artifact / CALIBRATION_FILE)
    assert calibration == trained.classifier.calibration
    loaded = load_artifact(artifact)
    assert loaded.calibration == calibration
    prompts = [*list(trained.data.prompts[:40]), "", " "]
    assert np.array_equal(loaded.classes(prompts), trained.classifier.classes(prompts))
    quality = read_class_quality(artifact)
    assert isinstance(quality, ClassQuality)
    assert quality.levels == AC_LEVELS and quality.strategy is Strategy.AC
    assert quality.quality == calibration.stats.quality
    assert sum(quality.prior) == pytest.approx(1.0)
    assert str(artifact) in quality.source and "SYNTHETIC" in quality.source
    assert read_planning_classes(artifact.parent).class_quality == {Strategy.AC: quality}


def _rewrite(path: Path, change) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(format="argus-classifier-calibration v0"), "format"),
        (lambda d: d.update(temperature=-1.0), "temperature"),
        (lambda d: d.update(temperature="hot"), "temperature"),
        (lambda d: d.update(edges=list(reversed(d["edges"]))), "edges"),
        (lambda d: d.update(edges=d["edges"][:-1]), "edges"),
        (lambda d: d.pop("counts"), "counts"),
        (lambda d: d["counts"].__setitem__(0, d["counts"][0] + 1), "counts"),
        (lambda d: d["quality"][2].pop(), "quality"),
        (lambda d: d["quality"][1].__setitem__(0, -0.5), "quality[1][0]"),
        (lambda d: d.update(prior=[1.0] + [0.0] * 5), "prior"),
        (lambda d: d["fit"].update(ece_after="low"), "fit.ece_after"),
        (lambda d: d.update(strategy="XX"), "strategy"),
        (lambda d: d.update(levels=["x"] * 6), "levels"),
        (lambda d: d.update(strategy="SM"), "strategy"),
    ],
)
def test_bad_calibration_files_name_the_file_and_field(artifact: Path, change, field) -> None:
    path = artifact / CALIBRATION_FILE
    _rewrite(path, change)
    with pytest.raises(ArtifactError, match=rf"calibration\.json: field '{_escape(field)}'"):
        read_class_quality(artifact)
    with pytest.raises(ArtifactError, match=r"calibration\.json"):
        load_artifact(artifact)


def _escape(field: str) -> str:
    return field.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")


def test_unreadable_calibration_file(artifact: Path) -> None:
    (artifact / CALIBRATION_FILE).write_text("{not json")
    with pytest.raises(ArtifactError, match=r"calibration\.json: cannot read"):
        read_artifact_calibration(artifact)
    with pytest.raises(CalibrationError, match=r"calibration\.json: missing"):
        read_calibration(artifact / "nowhere" / CALIBRATION_FILE)


def test_artifact_without_calibration_keeps_the_old_behaviour(artifact: Path, trained) -> None:
    (artifact / CALIBRATION_FILE).unlink()
    loaded = load_artifact(artifact)
    assert loaded.calibration is None and not loaded.has_classes
    prompts = list(trained.data.prompts[:40])
    assert np.array_equal(loaded.classes(prompts), loaded.predict(prompts))
    # no calibration: temperature 1, the head's own softmax, whose argmax is the prediction
    assert loaded.temperature == 1.0
    probabilities = loaded.calibrated_probabilities_of_vectors(loaded.embed(prompts))
    assert np.allclose(probabilities.sum(axis=1), 1.0)
    assert np.array_equal(probabilities.argmax(axis=1), loaded.predict(prompts))
    with pytest.raises(ArtifactError, match=r"no calibration\.json"):
        read_class_quality(artifact)
    served = PromptClassifier(ClassifierSet({Strategy.AC: loaded}), max_wait_s=0.0)
    try:
        assert not served.has_classes(Strategy.AC)
        assert [served.classify(p)[Strategy.AC] for p in prompts] == loaded.predict(
            prompts
        ).tolist()
    finally:
        served.close()


def test_saving_without_calibration_removes_a_stale_file(artifact: Path, trained) -> None:
    bare = replace(trained)
    bare.classifier = type(trained.classifier)(
        trained.classifier.config, trained.classifier.encoder, trained.classifier.head
    )
    save_trained(bare, artifact)
    assert not (artifact / CALIBRATION_FILE).exists()


# ---------------------------------------------------------------------------------- serving


def test_classify_returns_classes_when_calibrated() -> None:
    encoder = FakeEncoder()
    calibrated = tolerance_classifier(temperature=2.0, encoder=encoder)
    plain = constant_classifier(
        3, strategy=Strategy.SM, levels=("a", "b", "c", "d"), encoder=encoder
    )
    classifiers = ClassifierSet({Strategy.AC: calibrated, Strategy.SM: plain})
    prompts = [f"prompt number {i}" for i in range(200)]
    vectors = encoder.embed(prompts)
    expected = calibrated.calibration.classes_of_logits(calibrated.head.logits(vectors))
    levels = calibrated.predict_vectors(vectors)
    assert not np.array_equal(expected, levels)  # classes are not the arg-max level
    assert set(expected.tolist()) == set(range(len(AC_LEVELS)))
    served = PromptClassifier(classifiers, max_batch=16, max_wait_s=0.001)
    try:
        assert served.has_classes(Strategy.AC) and not served.has_classes(Strategy.SM)
        answers = [served.classify(p) for p in prompts]
        assert [a[Strategy.AC] for a in answers] == expected.tolist()
        assert [a[Strategy.SM] for a in answers] == [3] * len(prompts)
        assert served.classify("  ") == {Strategy.AC: EMPTY_PROMPT_CLASS, Strategy.SM: 0}
    finally:
        served.close()
    inferred = classifiers.infer_cleaned([*prompts[:5], None])
    ac = inferred[Strategy.AC]
    assert ac.levels.tolist() == [*levels[:5].tolist(), 0]
    assert ac.classes.tolist() == [*expected[:5].tolist(), EMPTY_PROMPT_CLASS]
    assert np.allclose(ac.probabilities.sum(axis=1), 1.0) and ac.probabilities[5, 0] == 1.0
    assert np.allclose(ac.probabilities[:5], softmax_t(calibrated.head.logits(vectors[:5]), 2.0))
    assert classifiers.predict_cleaned(prompts)[Strategy.AC].tolist() == levels.tolist()
    assert classifiers.classes_cleaned(prompts)[Strategy.AC].tolist() == expected.tolist()
    quality = classifiers.class_quality(Strategy.AC)
    assert quality.quality[0][-1] < quality.quality[-1][-1]
    with pytest.raises(ValueError, match="no calibration"):
        classifiers.class_quality(Strategy.SM)


def test_calibration_of_other_levels_is_refused() -> None:
    calibrated = tolerance_classifier()
    with pytest.raises(ValueError, match="calibration is for"):
        type(calibrated)(
            replace(calibrated.config, levels=("a",) * 6),
            calibrated.encoder,
            calibrated.head,
            calibrated.calibration,
        )


def test_reading_class_quality_loads_no_model() -> None:
    code = (
        "import sys\n"
        "from argus.classifier.serving import read_planning_classes\n"
        "q = read_planning_classes().class_quality\n"
        "print(sorted(s.value for s in q), 'torch' in sys.modules, 'safetensors' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "['AC', 'SM'] False False"


@pytest.fixture
def committed_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(default_classifier_dir(), tmp_path / "copy"))


def test_the_allocator_prices_calibrated_strategies_and_the_rest_by_level(
    committed_copy: Path,
) -> None:
    planning = read_planning_classes(committed_copy)
    assert set(planning.class_quality) == {Strategy.AC, Strategy.SM}
    assert planning.by_level == () and planning.directory == committed_copy
    (committed_copy / "sm" / CALIBRATION_FILE).unlink()  # the router classifies SM by level
    planning = read_planning_classes(committed_copy)
    assert list(planning.class_quality) == [Strategy.AC] and planning.by_level == (Strategy.SM,)


def test_a_calibration_without_quality_cannot_be_priced(committed_copy: Path) -> None:
    _rewrite(committed_copy / "ac" / CALIBRATION_FILE, lambda d: d.update(quality=None))
    with pytest.raises(ArtifactError, match=r"ac/calibration\.json: field 'quality'"):
        read_planning_classes(committed_copy)


def test_the_classifier_key_follows_what_classifies_not_where_it_lies(
    committed_copy: Path,
) -> None:
    key = classifier_key(committed_copy)
    assert key == classifier_key() and len(key) == 16
    _rewrite(committed_copy / "sm" / "metrics.json", lambda d: d.update(note="reported only"))
    assert classifier_key(committed_copy) == key
    _rewrite(committed_copy / "sm" / CALIBRATION_FILE, lambda d: d.update(temperature=9.0))
    assert classifier_key(committed_copy) != key  # other classes
    (committed_copy / "sm" / CALIBRATION_FILE).unlink()  # SM classified by arg-max level
    assert classifier_key(committed_copy) != key


def test_committed_artifacts_have_calibrated_classes() -> None:
    qualities = read_planning_classes(default_classifier_dir()).class_quality
    for strategy, quality in qualities.items():
        metrics = json.loads(
            (default_classifier_dir() / strategy.value.lower() / "metrics.json").read_text()
        )
        assert metrics["labels"]["synthetic"] is True and "SYNTHETIC" in quality.source
        assert min(quality.prior) > 0.1
        table = np.array(quality.quality)
        assert table[-1, -1] > table[0, -1] + 0.05  # the most tolerant class loses least
        assert np.all(np.diff(table[:, -1]) > -0.02)  # and the order roughly holds between


# ---------------------------------------------------------------------------- embedding cache


IDENTITY = EncoderIdentity("fake", "ab" * 32, max_tokens=64, dim=8)


def test_cache_returns_identical_vectors_and_embeds_each_text_once(tmp_path: Path) -> None:
    texts = ["a red bus", "a cat", "a red bus", "ünïcödé", "a cat", "x" * 300]
    encoder = FakeEncoder()
    progress: list[tuple[int, int]] = []
    cache = EmbeddingCache(tmp_path)
    first = cache.embed(encoder, IDENTITY, texts, lambda d, t: progress.append((d, t)))
    assert np.array_equal(first, FakeEncoder().embed(texts))
    assert sorted(encoder.texts) == sorted(set(texts))  # each distinct text once
    assert progress[0] == (0, 4) and progress[-1] == (4, 4)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(progress))
    again = FakeEncoder()
    second = EmbeddingCache(tmp_path).embed(again, IDENTITY, [*texts, "new"])
    assert again.texts == ["new"]  # the rest came from disk
    assert np.array_equal(second[: len(texts)], first)
    other = FakeEncoder(max_tokens=32)
    EmbeddingCache(tmp_path).embed(other, replace(IDENTITY, max_tokens=32), texts)
    assert sorted(other.texts) == sorted(set(texts))  # another token limit, another file
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


def test_a_corrupt_cache_is_ignored_and_rebuilt(tmp_path: Path) -> None:
    cache = EmbeddingCache(tmp_path)
    texts = ["a", "b", "c"]
    cache.embed(FakeEncoder(), IDENTITY, texts)
    path = cache.path_for(IDENTITY)
    for garbage in (b"", b"\x00" * 7, path.read_bytes()[:-20], b"not safetensors at all" * 10):
        path.write_bytes(garbage)
        encoder = FakeEncoder()
        vectors = cache.embed(encoder, IDENTITY, texts)
        assert np.array_equal(vectors, FakeEncoder().embed(texts))
        assert sorted(encoder.texts) == texts  # recomputed
        assert len(cache.load(IDENTITY)) == 3  # and written again, whole
    assert not list(tmp_path.glob("*.tmp"))


def test_cache_survives_concurrent_writers(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            texts = [f"text {index} {j}" for j in range(30)] + ["shared"]
            vectors = EmbeddingCache(tmp_path).embed(FakeEncoder(), IDENTITY, texts)
            assert np.array_equal(vectors, FakeEncoder().embed(texts))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stored = EmbeddingCache(tmp_path).load(IDENTITY)
    assert 31 <= len(stored) <= 6 * 30 + 1  # a valid file; a racing writer may drop rows
    assert not list(tmp_path.glob("*.tmp"))


def test_cache_directory_comes_from_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert default_cache_dir() == tmp_path / "embeddings"
    monkeypatch.delenv(CACHE_ENV)
    assert default_cache_dir() == Path.home() / ".cache" / "argus" / "embeddings"


def test_classifier_set_embeds_through_the_cache(tmp_path: Path) -> None:
    encoder = FakeEncoder()
    keyed = tolerance_classifier(encoder=encoder, encoder_sha256="cd" * 32)
    classifiers = ClassifierSet({Strategy.AC: keyed})
    texts: list[str | None] = ["one", "two", None, "one"]
    cache = EmbeddingCache(tmp_path)
    expected = classifiers.infer_cleaned(texts)[Strategy.AC]
    before = len(encoder.texts)
    cached = classifiers.infer_cleaned(texts, cache=cache)[Strategy.AC]
    assert sorted(encoder.texts[before:]) == ["one", "two"]  # each distinct text once
    again = classifiers.infer_cleaned(texts, cache=cache)[Strategy.AC]
    assert len(encoder.texts) == before + 2  # the second pass read the disk only
    for result in (cached, again):
        assert np.array_equal(result.classes, expected.classes)
        assert np.array_equal(result.levels, expected.levels)
        assert np.array_equal(result.probabilities, expected.probabilities)
    identity = EncoderIdentity.of(keyed)
    assert identity is not None and len(cache.load(identity)) == 2
    assert EncoderIdentity.of(constant_classifier(0)) is None  # no weights hash: never cached


def test_class_means_are_shrunk_by_how_little_the_sample_tells_them_apart() -> None:
    """A class whose best-level mean or drop differs from the others' by noise alone falls to
    the mean over all prompts; a drop far apart is kept; fewer prompts shrink more."""
    rng = np.random.default_rng(7)
    classes = np.repeat([0, 1, 2], 40)
    noise = rng.normal(0.0, 1.0, (120, 2))
    # the best level: no class effect at all; the drop to level 1: classes 5 apart
    scores = noise + np.stack([np.zeros(120), -5.0 * classes], axis=1)
    scores[:, 1] += scores[:, 0]  # a prompt's scores move together
    raw = np.array([scores[classes == c].mean(axis=0) for c in range(3)])
    grand = scores.mean(axis=0)
    shrunk = shrunk_class_means(classes, scores, 3)
    assert np.abs(shrunk[:, 0] - grand[0]).max() < 0.5 * np.abs(raw[:, 0] - grand[0]).max()
    assert shrunk[:, 1] - shrunk[:, 0] == pytest.approx(raw[:, 1] - raw[:, 0], abs=0.01)

    # the same class effect on the drop, measured on 3 prompts instead of 40, keeps less of
    # its distance from the mean drop
    def kept(count: int) -> float:
        chosen = np.concatenate([np.arange(40), 40 + np.arange(count), np.arange(80, 120)])
        table = scores[chosen].copy()
        table[classes[chosen] == 1, 1] -= 1.0
        means = shrunk_class_means(classes[chosen], table, 3)
        drop = table[:, 1] - table[:, 0]
        raw_drop = drop[classes[chosen] == 1].mean()
        return float((means[1, 1] - means[1, 0] - drop.mean()) / (raw_drop - drop.mean()))

    assert 0.0 <= kept(3) < kept(40) <= 1.0
    # an empty class is the means over all prompts; one class alone is its own mean
    lone = shrunk_class_means(np.zeros(5, dtype=np.int64), scores[:5], 3)
    assert lone[0] == pytest.approx(scores[:5].mean(axis=0))
    assert lone[1] == pytest.approx(scores[:5].mean(axis=0))
