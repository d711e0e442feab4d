"""The classifier's encoder runtimes, the serving path's prompt-vector cache and the torch
thread setting.

Runtimes run on a tiny random BERT (fast) and, for class equality, on the committed
MiniLM artifacts. ONNX exports go to a temporary ``ARGUS_CACHE_DIR``.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from argus import embedding
from argus.classifier.model import (
    CLASSIFIERS_DIR,
    ArtifactError,
    Backbone,
    build_encoder,
    load_artifact,
    read_config,
    save_artifact,
)
from argus.classifier.serving import (
    SERVING_RUNTIME,
    ClassifierSet,
    PromptClassifier,
    RecentVectors,
    load_classifier_set,
    load_prompt_classifier,
    serving_runtime,
)
from argus.classifier.train import TrainConfig
from argus.embedding import PromptEmbedder, use_torch_threads
from argus.types import Strategy
from tests.classifier_factories import FakeEncoder, constant_classifier, make_tiny_bert

pytestmark = pytest.mark.unit


PROMPTS = [
    "a red bus",
    "a cat and a calligraphy and a mosaic",
    "x",
    "A photograph of an astronaut riding a horse on the moon, highly detailed, 8k",
    "the word 'ARGUS' written in gold leaf on a dark wooden sign",
    "",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("argus-cache")
        patch.setenv(embedding.CACHE_ENV, str(path))
        yield path


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    out: np.ndarray = np.sum(a * b, axis=1) / norms
    return out


# ------------------------------------------------------------------------------- runtimes


def test_prompts_are_tokenized_as_the_transformers_tokenizer_does(tiny_bert: Path) -> None:
    """The embedder calls the Rust tokenizer directly; its arrays are those of the
    transformers call it replaces, for one prompt and for batches padded to their longest,
    cut at max_tokens (11 here, so most of these are cut), empty and non-ASCII prompts too."""
    embedder = PromptEmbedder(tiny_bert, max_tokens=11)
    assert embedder._encoder is not None  # the direct path is the one under test
    prompts = [*PROMPTS, " ", "héllo wörld 東京 🚀 " * 3, "[CLS] [SEP] [PAD] x " * 9, "a" * 300]

    def transformers_call(batch: list[str]) -> dict[str, np.ndarray]:
        arrays = embedder.tokenizer(
            batch, padding=True, truncation=True, max_length=11, return_tensors="np"
        )
        return {name: np.asarray(arrays[name], dtype=np.int64) for name in arrays}

    batches = [[p] for p in prompts] + [prompts, prompts[::-1], prompts[2:5]]
    for batch in batches:
        ours, theirs = embedder.tokenize(batch), transformers_call(batch)
        assert ours.keys() == theirs.keys()
        for name, array in theirs.items():
            assert ours[name].dtype == np.int64
            np.testing.assert_array_equal(ours[name], array, err_msg=f"{name} of {batch}")


@pytest.mark.parametrize("runtime", ["onnx", "onnx-int8", "torch-int8"])
def test_runtimes_embed_like_torch_fp32(tiny_bert: Path, cache_dir: Path, runtime: str) -> None:
    reference = PromptEmbedder(tiny_bert, max_tokens=32).embed(PROMPTS)
    other = PromptEmbedder(tiny_bert, max_tokens=32, runtime=runtime)
    assert other.runtime == runtime
    vectors = other.embed(PROMPTS)
    assert vectors.shape == reference.shape and vectors.dtype == np.float32
    assert np.all(cosines(vectors, reference) >= 0.99)
    # a batch pads to its longest prompt: each prompt alone must give its own row
    alone = np.stack([other.embed_one(p) for p in PROMPTS])
    assert np.all(cosines(alone, vectors) >= 0.999)


def test_the_onnx_export_is_made_once_and_reused(
    tiny_bert: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exports: list[Path] = []
    real = embedding.export_onnx

    def counting(model: Any, path: Path, *, int8: bool) -> None:
        exports.append(path)
        real(model, path, int8=int8)

    monkeypatch.setattr(embedding, "export_onnx", counting)
    monkeypatch.setenv(embedding.CACHE_ENV, str(cache_dir / "fresh"))
    first = PromptEmbedder(tiny_bert, max_tokens=32, runtime="onnx").embed(PROMPTS)
    second = PromptEmbedder(tiny_bert, max_tokens=32, runtime="onnx").embed(PROMPTS)
    assert len(exports) == 1
    assert exports[0].parent == cache_dir / "fresh" / "onnx" and exports[0].is_file()
    np.testing.assert_array_equal(first, second)


def test_an_onnx_runtime_that_cannot_start_falls_back_to_torch(
    tiny_bert: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Path:
        raise RuntimeError("no exporter here")

    monkeypatch.setattr(embedding, "exported_model", broken)
    with caplog.at_level(logging.WARNING):
        encoder = build_encoder(tiny_bert, 32, runtime="onnx")
    assert isinstance(encoder, PromptEmbedder) and encoder.runtime == "torch"
    assert "no exporter here" in caplog.text
    with pytest.raises(ValueError, match="runtime"):
        PromptEmbedder(tiny_bert, runtime="tensorrt")
    with pytest.raises(ValueError, match="precision 'bf16' needs runtime 'torch'"):
        PromptEmbedder(tiny_bert, runtime="onnx", precision="bf16")


def test_the_serving_runtime_classifies_float32_heads_like_torch(cache_dir: Path) -> None:
    fp32_heads = CLASSIFIERS_DIR / "minilm-l2-logistic"  # the default student, float32
    torch_set = load_classifier_set(fp32_heads, runtime="torch")
    served = load_classifier_set(fp32_heads, runtime=SERVING_RUNTIME, threads=1)
    encoder = served.current(Strategy.AC).encoder
    assert getattr(encoder, "runtime", None) == SERVING_RUNTIME  # no silent fallback
    texts = [p for p in PROMPTS if p]
    expected, got = torch_set.infer_cleaned(texts), served.infer_cleaned(texts)
    for strategy in torch_set.strategies:
        np.testing.assert_array_equal(got[strategy].classes, expected[strategy].classes)
        np.testing.assert_array_equal(got[strategy].levels, expected[strategy].levels)
    reference = torch_set.current(Strategy.AC).encoder.embed(texts)
    assert np.all(cosines(encoder.embed(texts), reference) >= 0.99)


def test_the_router_serves_the_committed_int8_heads_on_their_own_runtime(
    cache_dir: Path,
) -> None:
    int8_heads = CLASSIFIERS_DIR / "minilm-logistic-int8"
    service = load_prompt_classifier(int8_heads)
    try:
        for strategy in service.classifiers.strategies:
            encoder = service.classifiers.current(strategy).encoder
            assert getattr(encoder, "runtime", None) == "onnx-int8"
        texts = [p for p in PROMPTS if p]
        expected = load_classifier_set(int8_heads).classes_cleaned(texts)  # its runtime
        for i, text in enumerate(texts):
            assert service.classify(text) == {s: int(c[i]) for s, c in expected.items()}
    finally:
        service.close()
    with pytest.raises(ArtifactError, match="field 'runtime'"):
        load_classifier_set(int8_heads, runtime="torch")


# ----------------------------------------------------------------------------------- threads


def test_torch_threads_are_set_once_not_per_call(
    tiny_bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(embedding, "_torch_threads", None)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    first = PromptEmbedder(tiny_bert, max_tokens=32, threads=1)
    second = PromptEmbedder(tiny_bert, max_tokens=32, threads=1)
    for _ in range(3):
        first.embed(PROMPTS)
        second.embed(PROMPTS[:2])
    assert calls == [1]
    assert use_torch_threads(1) == 1 and calls == [1]
    assert use_torch_threads(2) == 2 and calls == [1, 2]  # a deliberate change is applied
    with pytest.raises(ValueError, match="threads"):
        use_torch_threads(0)


# -------------------------------------------------------------------------------- the cache


def test_cached_vectors_equal_fresh_ones_and_the_encoder_sees_each_text_once() -> None:
    encoder = FakeEncoder()
    model = constant_classifier(1, encoder=encoder)
    recent = RecentVectors(max_entries=16)
    texts = ["a cat", "a dog", "a cat", "a bus"]
    first = recent.embed(model, texts)
    assert encoder.texts == ["a cat", "a dog", "a bus"]  # a text twice in a batch: once
    np.testing.assert_array_equal(first, encoder.embed(texts))
    encoder.texts.clear()
    again = recent.embed(model, ["a bus", "a cat", "a fox"])
    assert encoder.texts == ["a fox"]  # only the new text reached the encoder
    np.testing.assert_array_equal(again, encoder.embed(["a bus", "a cat", "a fox"]))
    stats = recent.stats()
    assert (stats.hits, stats.misses, stats.entries) == (2, 5, 4)


def test_the_cache_is_bounded_and_forgets_the_least_recently_used() -> None:
    encoder = FakeEncoder()
    model = constant_classifier(1, encoder=encoder)
    recent = RecentVectors(max_entries=3)
    recent.embed(model, ["a", "b", "c"])
    recent.embed(model, ["a"])  # a is now the most recent; b the least
    recent.embed(model, ["d"])
    assert recent.stats().entries == 3
    encoder.texts.clear()
    recent.embed(model, ["a", "c", "d"])
    assert encoder.texts == []
    recent.embed(model, ["b"])
    assert encoder.texts == ["b"]
    with pytest.raises(ValueError, match="max_entries"):
        RecentVectors(0)


def test_a_swapped_encoder_never_reads_the_old_encoders_vectors() -> None:
    recent = RecentVectors()
    encoders = [FakeEncoder() for _ in range(50)]
    for encoder in encoders:
        recent.embed(constant_classifier(1, encoder=encoder), ["a cat"])
        assert encoder.texts == ["a cat"]
    del encoders
    gc.collect()
    for _ in range(50):  # new encoders, some perhaps where the freed ones were
        encoder = FakeEncoder()
        recent.embed(constant_classifier(1, encoder=encoder), ["a cat"])
        assert encoder.texts == ["a cat"]


def test_the_prompt_classifier_answers_the_same_from_its_cache() -> None:
    encoder = FakeEncoder()
    from tests.classifier_factories import tolerance_classifier

    classifiers = ClassifierSet({Strategy.AC: tolerance_classifier(encoder=encoder)})
    service = PromptClassifier(classifiers, cache_entries=8)
    prompts = [f"prompt number {i}" for i in range(20)]
    try:
        uncached = {p: classifiers.classes_cleaned([p])[Strategy.AC][0] for p in prompts}
        first = [service.classify(p)[Strategy.AC] for p in prompts]
        encoder.texts.clear()
        second = [service.classify(p)[Strategy.AC] for p in prompts[-8:]]
        assert first == [uncached[p] for p in prompts]
        assert second == first[-8:]
        assert encoder.texts == []  # the last 8 were all in the cache
        stats = service.cache_stats()
        assert stats is not None and stats.entries == 8 and stats.hits == 8
    finally:
        service.close()
    without = PromptClassifier(classifiers, cache_entries=0)
    assert without.cache_stats() is None
    without.close()


# --------------------------------------------------------------- the export and its int8 layers


def _op_types(path: Path) -> list[str]:
    import onnx

    return [node.op_type for node in onnx.load(str(path)).graph.node]


def test_the_onnx_export_is_fused_and_int8_keeps_attention_in_float32(
    tiny_bert: Path, cache_dir: Path
) -> None:
    fp32 = PromptEmbedder(tiny_bert, max_tokens=32, runtime="onnx")
    int8 = PromptEmbedder(tiny_bert, max_tokens=32, runtime="onnx-int8")
    files = {p.name.split("-")[0] + ("-int8" if "int8" in p.name else ""): p for p in
             (cache_dir / "onnx").glob("*.onnx")}  # fmt: skip
    fused = _op_types(files["onnx"])
    # the tiny BERT has 2 layers: one fused attention and two layer norms each
    assert fused.count("Attention") == 2 and fused.count("SkipLayerNormalization") == 4
    quantised = _op_types(files["onnx-int8"])
    assert quantised.count("Attention") == 2  # Q, K, V and the scores stay float32
    # attention output, FFN in and FFN out per layer: int8 weights
    assert quantised.count("DynamicQuantizeMatMul") + quantised.count("MatMulInteger") == 6
    assert fp32.precision == "fp32" and int8.precision == "onnx-int8"  # on-disk cache keys


def test_an_int8_runtime_that_cannot_start_is_raised_not_replaced(
    tiny_bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Path:
        raise RuntimeError("no exporter here")

    monkeypatch.setattr(embedding, "exported_model", broken)
    with pytest.raises(RuntimeError, match="no exporter here"):
        build_encoder(tiny_bert, 32, runtime="onnx-int8")


# ------------------------------------------------------------- the runtime an artifact records


def _artifact(directory: Path, runtime: str | None) -> Path:
    """The tolerance classifier saved, its config.json's runtime set (None: removed)."""
    import json

    from tests.classifier_factories import tolerance_classifier

    save_artifact(directory, tolerance_classifier(), {})
    path = directory / "config.json"
    document = json.loads(path.read_text())
    assert document["runtime"] == "torch"  # what the factory's config says
    if runtime is None:
        del document["runtime"]
    else:
        document["runtime"] = runtime
    path.write_text(json.dumps(document))
    return directory


def test_an_artifact_records_its_runtime_and_refuses_one_computing_other_vectors(
    tmp_path: Path,
) -> None:
    int8 = _artifact(tmp_path / "int8", "onnx-int8")
    assert read_config(int8).runtime == "onnx-int8"
    assert serving_runtime(read_config(int8)) == "onnx-int8"
    for other in ("torch", "onnx", "torch-int8"):
        with pytest.raises(ArtifactError, match=r"config\.json: field 'runtime'.*onnx-int8"):
            load_artifact(int8, runtime=other)
    old = _artifact(tmp_path / "old", None)  # written before the field existed
    assert read_config(old).runtime == "torch"
    assert serving_runtime(read_config(old)) == SERVING_RUNTIME
    with pytest.raises(ArtifactError, match="field 'runtime'"):
        load_artifact(old, runtime="onnx-int8")
    bad = _artifact(tmp_path / "bad", "tensorrt")
    with pytest.raises(ArtifactError, match=r"config\.json: field 'runtime'.*tensorrt"):
        load_artifact(bad)
    with pytest.raises(ValueError, match="runtime"):
        TrainConfig(runtime="tensorrt")
    with pytest.raises(ValueError, match="runtime: finetune trains in torch"):
        TrainConfig(runtime="onnx-int8", backbone=Backbone.FINETUNE)


def test_training_on_an_int8_runtime_records_it_and_serves_on_it(
    tiny_bert: Path, cache_dir: Path, tmp_path: Path
) -> None:
    from argus.classifier.labels import labels_from_table
    from argus.classifier.train import save_trained, train_classifier
    from tests.classifier_factories import lexical_table

    data = labels_from_table(lexical_table(120))
    result = train_classifier(
        data, TrainConfig(runtime="onnx-int8", max_tokens=32), encoder_dir=tiny_bert
    )
    directory = save_trained(result, tmp_path / "ac")
    assert read_config(directory).runtime == "onnx-int8"
    loaded = load_artifact(directory)
    assert getattr(loaded.encoder, "runtime", None) == "onnx-int8"
    texts = [p for p in PROMPTS if p]
    np.testing.assert_array_equal(loaded.predict(texts), result.classifier.predict(texts))


@pytest.mark.parametrize("runtime", ["onnx-int8", "torch-int8"])
def test_an_int8_vector_does_not_depend_on_the_prompts_batched_with_it(
    tiny_bert: Path, cache_dir: Path, runtime: str
) -> None:
    encoder = PromptEmbedder(tiny_bert, max_tokens=32, runtime=runtime)
    alone = np.stack([encoder.embed_one(p) for p in PROMPTS])
    for batch in (PROMPTS, PROMPTS[::-1], [*PROMPTS[2:], "a much longer prompt " * 4]):
        rows = {p: i for i, p in enumerate(PROMPTS)}
        vectors = encoder.embed(batch)
        for prompt, vector in zip(batch, vectors, strict=True):
            if prompt in rows:
                np.testing.assert_array_equal(vector, alone[rows[prompt]])
