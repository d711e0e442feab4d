"""The level classifier: labels, prompt rules, metrics, training, artifacts.

Training tests run on a tiny random BERT (2 layers, 32 wide) with MiniLM's tokenizer; one
test reads the committed artifacts through the real all-MiniLM-L6-v2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from argus.classifier.embedding_cache import EmbeddingCache
from argus.classifier.evaluate import evaluate
from argus.classifier.labels import labels_from_table
from argus.classifier.model import (
    ArtifactError,
    Backbone,
    length_batches,
    load_artifact,
    read_config,
)
from argus.classifier.prompts import (
    EMPTY_PROMPT_LEVEL,
    InvalidPromptError,
    clean_prompt,
    decode_prompt,
    prepare_prompt,
)
from argus.classifier.serving import ClassifierSet, default_classifier_dir, load_classifier_set
from argus.classifier.train import (
    TrainConfig,
    save_trained,
    stratified_holdout,
    train_classifier,
)
from argus.contracts.quality import QualityTable
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.traces import default_prompt_trace, load_prompts
from argus.types import Strategy
from tests.classifier_factories import AC_LEVELS, lexical_table, make_tiny_bert
from tests.package_helpers import read_metrics

pytestmark = pytest.mark.unit


FAST = TrainConfig(max_tokens=64, c_grid=(0.3, 3.0, 30.0))


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="module")
def parti() -> list:
    return load_prompts(default_prompt_trace())


# ------------------------------------------------------------------------------------- labels


def brute_force_optimal(scores: np.ndarray, delta: float) -> list[int]:
    """The δ rule written out: the highest (fastest) index within δ of the row's best."""
    out = []
    for row in scores:
        best = max(row)
        out.append(max(j for j, s in enumerate(row) if s >= delta * best))
    return out


@pytest.mark.parametrize("delta", [0.9, 0.8, 1.0])
def test_labels_follow_the_delta_rule(delta: float) -> None:
    rng = np.random.default_rng(3)
    scores = rng.uniform(10.0, 22.0, size=(200, 6))
    table = QualityTable(Strategy.AC, AC_LEVELS, tuple(f"p{i}" for i in range(200)), scores, "t")
    data = labels_from_table(table, delta)
    assert data.labels.tolist() == brute_force_optimal(scores, delta)
    assert data.levels == AC_LEVELS and data.delta == delta


def test_labels_at_the_threshold_pick_the_faster_level() -> None:
    scores = np.array([[20.0, 18.0, 17.99], [20.0, 20.0, 20.0], [20.0, 17.0, 19.0]])
    table = QualityTable(Strategy.SM, ("a", "b", "c"), ("x", "y", "z"), scores, "t")
    assert labels_from_table(table, 0.9).labels.tolist() == [1, 2, 2]


def test_labels_drop_empty_and_repeated_prompts() -> None:
    scores = np.array([[20.0, 19.0], [20.0, 10.0], [20.0, 10.0], [20.0, 19.0]])
    table = QualityTable(Strategy.AC, ("a", "b"), ("cat", "  ", " cat ", "dog"), scores, "t")
    data = labels_from_table(table)
    assert data.prompts == ("cat", "dog")
    assert data.labels.tolist() == [1, 1]
    assert data.scores is not None and data.scores.shape == (2, 2)


# -------------------------------------------------------------------------------- prompt rules


def test_prompt_rules() -> None:
    assert prepare_prompt("  a red bus \n") == "a red bus"
    assert prepare_prompt("") is None
    assert prepare_prompt(" \t\n ") is None
    assert prepare_prompt("é".encode()) == "é"
    assert clean_prompt("abcdef", max_chars=3) == "abc"
    with pytest.raises(InvalidPromptError, match=r"not valid UTF-8: byte 0xff at offset 2"):
        decode_prompt(b"ab\xff\xfe")
    with pytest.raises(InvalidPromptError, match="surrogate U\\+DC80"):
        decode_prompt(b"ab\x80".decode("utf-8", "surrogateescape"))
    with pytest.raises(TypeError, match="int"):
        decode_prompt(42)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ metrics


def test_metrics_match_scikit_learn() -> None:
    from sklearn.metrics import confusion_matrix, f1_score

    rng = np.random.default_rng(0)
    truth = rng.integers(0, 5, size=300)
    predicted = np.where(rng.random(300) < 0.5, truth, rng.integers(0, 4, size=300))
    result = evaluate(truth, predicted, 6)
    assert result.accuracy == pytest.approx(np.mean(truth == predicted))
    assert result.macro_f1 == pytest.approx(f1_score(truth, predicted, average="macro"))
    expected = confusion_matrix(truth, predicted, labels=range(6))
    assert np.array_equal(np.array(result.confusion), expected)


def test_downstream_quality_by_hand() -> None:
    scores = np.array([[20.0, 19.0, 10.0], [20.0, 12.0, 11.0]])
    truth = np.array([1, 0])
    result = evaluate(truth, np.array([2, 0]), 3, scores=scores, delta=0.9)
    quality = result.quality
    assert quality is not None
    assert quality.classifier == pytest.approx((10.0 + 20.0) / 2)
    assert quality.oracle == pytest.approx((19.0 + 20.0) / 2)
    assert quality.random == pytest.approx(scores.mean())
    assert quality.slowest == pytest.approx(20.0)
    assert quality.within_delta == pytest.approx(0.5)
    assert quality.faster_than_optimal == pytest.approx(0.5)
    assert quality.slower_than_optimal == 0.0
    gap = (quality.classifier - quality.random) / (quality.oracle - quality.random)
    assert quality.gap_closed == pytest.approx(gap)


# ----------------------------------------------------------------------------------- training


def test_validation_slice_is_stratified_disjoint_and_seeded() -> None:
    labels = np.repeat(np.arange(4), [100, 40, 20, 2])
    kept, held = stratified_holdout(labels, 7, 0.15)
    assert sorted(np.concatenate([kept, held]).tolist()) == list(range(len(labels)))
    assert np.bincount(labels[held], minlength=4).tolist() == [15, 6, 3, 0]
    again = stratified_holdout(labels, 7, 0.15)
    assert np.array_equal(again[1], held) and np.array_equal(again[0], kept)
    assert not np.array_equal(stratified_holdout(labels, 8, 0.15)[1], held)


def test_logistic_learns_the_lexical_rule_and_is_reproducible(tiny_bert: Path) -> None:
    data = labels_from_table(lexical_table())
    first = train_classifier(data, FAST, encoder_dir=tiny_bert)
    second = train_classifier(data, FAST, encoder_dir=tiny_bert)
    assert np.array_equal(first.classifier.head.weight, second.classifier.head.weight)
    assert np.array_equal(first.classifier.head.bias, second.classifier.head.bias)
    test = first.evaluations["eval"]
    assert test.accuracy >= 0.9
    assert test.quality is not None and test.quality.gap_closed > 0.8
    assert first.selection["criterion"] == "validation log-loss"


def test_training_embeds_through_the_cache_that_serving_reads(
    tiny_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = labels_from_table(lexical_table())
    plain = train_classifier(data, FAST, encoder_dir=tiny_bert)
    cache = EmbeddingCache(tmp_path)
    cached = train_classifier(data, FAST, encoder_dir=tiny_bert, cache=cache)
    assert np.array_equal(cached.classifier.head.weight, plain.classifier.head.weight)
    expected = plain.classifier.predict(data.prompts)

    def embed_again(texts: list[str]) -> None:
        raise AssertionError(f"the encoder ran again on {texts[:2]}")

    monkeypatch.setattr(cached.classifier.encoder, "embed", embed_again)
    again = train_classifier(data, FAST, encoder_dir=tiny_bert, cache=cache)
    assert np.array_equal(again.classifier.head.weight, plain.classifier.head.weight)
    served = ClassifierSet({data.strategy: again.classifier}).infer_cleaned(
        list(data.prompts), cache=cache
    )
    assert np.array_equal(served[data.strategy].levels, expected)


def test_trained_classifier_beats_random_on_a_synthetic_table(tiny_bert: Path, parti) -> None:
    table = synthetic_quality_table(parti[:600], Strategy.SM, ["s0", "s1", "s2", "s3"], seed=0)
    result = train_classifier(labels_from_table(table), FAST, encoder_dir=tiny_bert)
    quality = result.evaluations["eval"].quality
    assert quality is not None
    assert quality.classifier > quality.random + 1.0
    assert quality.gap_closed > 0.5
    assert result.metrics_json()["labels"]["synthetic"] is True


def test_finetuning_is_reproducible_from_a_seed(tiny_bert: Path) -> None:
    import torch

    data = labels_from_table(lexical_table(80))
    config = TrainConfig(
        backbone=Backbone.FINETUNE, epochs=2, batch_size=16, max_tokens=32, c_grid=(1.0,)
    )
    runs = [train_classifier(data, config, encoder_dir=tiny_bert) for _ in range(2)]
    other = train_classifier(data, replace(config, seed=1), encoder_dir=tiny_bert)
    states = [run.classifier.encoder.model.state_dict() for run in (*runs, other)]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not all(torch.equal(states[0][k], states[2][k]) for k in states[0])
    assert np.array_equal(runs[0].classifier.head.weight, runs[1].classifier.head.weight)
    prompts = list(data.prompts[:20])
    assert np.array_equal(runs[0].classifier.predict(prompts), runs[1].classifier.predict(prompts))
    assert runs[0].selection["log_loss_by_epoch"] == runs[1].selection["log_loss_by_epoch"]


# ---------------------------------------------------------------------------------- artifacts


def test_logistic_artifact_round_trips(tiny_bert: Path, tmp_path: Path) -> None:
    data = labels_from_table(lexical_table())
    result = train_classifier(data, FAST, encoder_dir=tiny_bert)
    directory = save_trained(result, tmp_path / "ac")
    assert sorted(p.name for p in directory.iterdir()) == [
        "calibration.json",
        "config.json",
        "labels.json",
        "metrics.json",
        "model.safetensors",
    ]
    loaded = load_artifact(directory)
    assert loaded.config == result.classifier.config
    assert np.array_equal(loaded.head.weight, result.classifier.head.weight)
    prompts = [*data.prompts[:30], "", "  ", "a cat and a calligraphy"]
    assert np.array_equal(loaded.predict(prompts), result.classifier.predict(prompts))
    assert read_metrics(directory)["eval"]["accuracy"] == result.evaluations["eval"].accuracy
    labels = json.loads((directory / "labels.json").read_text())
    assert labels["labels"] == {str(i): name for i, name in enumerate(AC_LEVELS)}


def test_finetuned_artifact_round_trips(tiny_bert: Path, tmp_path: Path) -> None:
    data = labels_from_table(lexical_table(60))
    config = TrainConfig(backbone=Backbone.FINETUNE, epochs=1, max_tokens=32, c_grid=(1.0,))
    result = train_classifier(data, config, encoder_dir=tiny_bert)
    directory = save_trained(result, tmp_path / "ac")
    assert (directory / "encoder" / "model.safetensors").is_file()
    assert read_config(directory).encoder == "encoder"
    loaded = load_artifact(directory)
    prompts = list(data.prompts)
    assert np.array_equal(loaded.predict(prompts), result.classifier.predict(prompts))
    vectors = loaded.embed(prompts[:5])
    assert np.allclose(vectors, result.classifier.embed(prompts[:5]), atol=1e-6)


def test_loading_refuses_a_different_encoder(tiny_bert: Path, tmp_path: Path) -> None:
    data = labels_from_table(lexical_table(60))
    config = TrainConfig(backbone=Backbone.FINETUNE, epochs=1, max_tokens=32, c_grid=(1.0,))
    directory = save_trained(train_classifier(data, config, encoder_dir=tiny_bert), tmp_path / "a")
    make_tiny_bert(directory / "encoder", seed=5)  # other weights, same shapes
    with pytest.raises(ArtifactError, match="not the one this head was trained on"):
        load_artifact(directory)
    for file in (directory / "encoder").iterdir():
        file.unlink()
    (directory / "encoder").rmdir()
    with pytest.raises(ArtifactError, match="run argus train-classifier"):
        load_artifact(directory)


def test_broken_artifacts_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"config\.json: missing"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text('{"format": "something else"}')
    with pytest.raises(ArtifactError, match=r"config\.json: format 'something else'"):
        read_config(tmp_path)
    with pytest.raises(ArtifactError, match="does not exist"):
        load_classifier_set(tmp_path / "nowhere")


def test_committed_artifacts_load_and_beat_random() -> None:
    """The default artifacts through the real all-MiniLM-L6-v2, on a handful of prompts."""
    directory = default_classifier_dir()
    classifiers = load_classifier_set(directory)
    assert set(classifiers.strategies) == {Strategy.AC, Strategy.SM}
    prompts = ["a red bus", "a photo of a cat", "", "a crowded street market at dusk, oil"]
    levels = classifiers.predict(prompts)
    for strategy, predicted in levels.items():
        assert predicted.shape == (4,)
        assert predicted[2] == EMPTY_PROMPT_LEVEL
        one_by_one = [int(classifiers.current(strategy).predict([p])[0]) for p in prompts]
        assert predicted.tolist() == one_by_one
        metrics = read_metrics(directory / strategy.value.lower())
        assert metrics["labels"]["synthetic"] is True
        quality = metrics["eval"]["quality"]
        assert quality["classifier"] > quality["random"] + 1.0
        majority = max(metrics["labels"]["level_counts"]) / metrics["labels"]["prompts"]
        assert metrics["eval"]["accuracy"] > majority


def test_router_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import argus.classifier.serving, argus.classifier.drift, argus.classifier.train\n"
        "import argus.sim.policies\n"
        "from argus.sim.policies import make_classifier\n"
        "make_classifier('default')\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules, 'sklearn' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False False False"


def test_length_batches_cover_every_prompt_within_the_budget() -> None:
    rng = np.random.default_rng(1)
    texts = ["x" * int(n) for n in rng.integers(1, 400, size=300)]
    batches = length_batches(texts, budget=1024, most=64)
    assert sorted(i for batch in batches for i in batch) == list(range(300))
    for batch in batches:
        widths = [len(texts[i]) for i in batch]
        assert widths == sorted(widths) and 1 <= len(batch) <= 64
        assert len(batch) == 1 or len(batch) * max(widths) <= 1024
    assert length_batches(["y" * 5000], budget=1024) == [[0]]  # one prompt at least


def test_bf16_encoder_is_close_to_fp32(tiny_bert: Path) -> None:
    from argus.embedding import PromptEmbedder

    prompts = ["a red bus", "a cat and a calligraphy and a mosaic", "x"]
    fp32 = PromptEmbedder(tiny_bert, max_tokens=32).embed(prompts)
    bf16 = PromptEmbedder(tiny_bert, max_tokens=32, precision="bf16").embed(prompts)
    assert bf16.dtype == np.float32
    assert np.all(np.sum(fp32 * bf16, axis=1) > 0.99)
    with pytest.raises(ValueError, match="precision"):
        PromptEmbedder(tiny_bert, precision="fp8")
