"""Student encoders: MiniLM cut to its first layers, optionally distilled, under the heads.

Mechanics run on a tiny random BERT (2 layers, 32 wide); the committed default artifact is
checked against the classes pinned beside it, and loaded with the model hub switched off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from argus.classifier.distill import (
    PINNED_FILE,
    STUDENT_FILE,
    DistillConfig,
    distill_student,
    save_student,
)
from argus.classifier.embedding_cache import EncoderIdentity
from argus.classifier.labels import labels_from_table
from argus.classifier.model import ArtifactError, load_artifact, read_config
from argus.classifier.serving import default_classifier_dir, load_classifier_set
from argus.classifier.train import TrainConfig, save_trained, train_classifier
from argus.embedding import PromptEmbedder
from argus.types import Strategy
from tests.classifier_factories import lexical_table, make_tiny_bert

pytestmark = pytest.mark.unit


PROMPTS = ["a cat on a hat", "calligraphy of a clockwork orchestra", "", "blue moon, red star"]
FAST = TrainConfig(max_tokens=32, c_grid=(1.0,), layers=1)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="module")
def onnx_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="module")
def distilled(
    tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[float]]:
    """A 1-layer student of the tiny BERT distilled on lexical prompts: (file, cosines)."""
    texts = list(labels_from_table(lexical_table(60)).prompts)
    config = DistillConfig(layers=1, epochs=4, batch_size=8, lr=1e-3, max_tokens=32)
    result = distill_student(texts, config, encoder_dir=tiny_bert)
    path = tmp_path_factory.mktemp("student") / STUDENT_FILE
    return save_student(result, config, path), result.held_out_cosine


def full_model_layer_vectors(tiny_bert: Path, prompts: list[str], layer: int) -> np.ndarray:
    """Mean-pooled unit vectors of the full model's hidden state after ``layer`` layers."""
    import torch
    from transformers import AutoModel

    embedder = PromptEmbedder(tiny_bert, max_tokens=32)
    batch = {k: torch.from_numpy(v) for k, v in embedder.tokenize(prompts).items()}
    model = AutoModel.from_pretrained(tiny_bert, local_files_only=True).eval()
    with torch.inference_mode():
        hidden = model(**batch, output_hidden_states=True).hidden_states[layer]
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    out: np.ndarray = torch.nn.functional.normalize(pooled, dim=1).numpy()
    return out


def test_a_student_runs_the_first_layers_on_every_runtime(
    tiny_bert: Path, onnx_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARGUS_CACHE_DIR", str(onnx_cache))
    first_layer = full_model_layer_vectors(tiny_bert, PROMPTS, 1)
    full = PromptEmbedder(tiny_bert, max_tokens=32, runtime="onnx").embed(PROMPTS)
    for runtime in ("torch", "onnx"):  # onnx after the full export: its own cached file
        student = PromptEmbedder(tiny_bert, max_tokens=32, layers=1, runtime=runtime)
        vectors = student.embed(PROMPTS)
        assert np.allclose(vectors, first_layer, atol=1e-5), runtime
        assert np.abs(vectors - full).max() > 1e-3, runtime  # not the full encoder
    with pytest.raises(ValueError, match=r"layers: the encoder at .* has 2 layers, got 3"):
        PromptEmbedder(tiny_bert, layers=3)
    with pytest.raises(ValueError, match="needs its layer count"):
        PromptEmbedder(tiny_bert, layer_weights=tiny_bert / "model.safetensors")


def test_distilling_brings_the_student_closer_to_the_teacher(
    tiny_bert: Path,
    distilled: tuple[Path, list[float]],
    onnx_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, cosines = distilled
    assert max(cosines[1:]) > cosines[0]  # held-out cosine: truncated, then after each epoch
    monkeypatch.setenv("ARGUS_CACHE_DIR", str(onnx_cache))
    truncated = PromptEmbedder(tiny_bert, max_tokens=32, layers=1).embed(PROMPTS)
    torch_student = PromptEmbedder(tiny_bert, max_tokens=32, layers=1, layer_weights=path)
    onnx_student = PromptEmbedder(
        tiny_bert, max_tokens=32, layers=1, layer_weights=path, runtime="onnx"
    )
    vectors = torch_student.embed(PROMPTS)
    assert np.abs(vectors - truncated).max() > 1e-3  # the file's weights are used
    assert np.allclose(onnx_student.embed(PROMPTS), vectors, atol=1e-5)  # and exported


def test_student_artifact_round_trips_and_refuses_a_wrong_layer_count_or_digest(
    tiny_bert: Path, distilled: tuple[Path, list[float]], tmp_path: Path
) -> None:
    weights = Path(str(tmp_path / STUDENT_FILE))
    weights.write_bytes(distilled[0].read_bytes())
    data = labels_from_table(lexical_table(60))
    config = TrainConfig(max_tokens=32, c_grid=(1.0,), layers=1, student_weights=weights)
    result = train_classifier(data, config, encoder_dir=tiny_bert)
    directory = save_trained(result, tmp_path / "ac")
    written = json.loads((directory / "config.json").read_text())
    assert written["layers"] == 1 and written["student_weights"] == "../student.safetensors"
    loaded = load_artifact(directory)
    assert loaded.config == read_config(directory)
    assert np.array_equal(loaded.predict(PROMPTS), result.classifier.predict(PROMPTS))
    # on-disk vector caches key a student's vectors apart from the full encoder's
    identity = EncoderIdentity.of(loaded)
    assert identity is not None and identity.sha256 != loaded.config.encoder_sha256

    def edited(**fields: object) -> Path:
        copy = tmp_path / f"edit-{len(list(tmp_path.iterdir()))}" / "ac"
        copy.mkdir(parents=True)
        for file in directory.iterdir():
            (copy / file.name).write_bytes(file.read_bytes())
        (copy.parent / STUDENT_FILE).write_bytes(weights.read_bytes())
        (copy / "config.json").write_text(json.dumps(written | fields))
        return copy

    with pytest.raises(ArtifactError, match=r"'layers' is 2, but .* holds the weights of 1"):
        load_artifact(edited(layers=2))
    with pytest.raises(ArtifactError, match=r"'student_sha256'.* is not the file"):
        load_artifact(edited(student_sha256="0" * 64))
    with pytest.raises(ArtifactError, match="'layers' is missing"):
        load_artifact(_without(edited(), "layers"))
    truncated = _without(edited(layers=3), "student_weights", "student_sha256")
    with pytest.raises(ArtifactError, match=r"'layers' is 3, but the encoder .* has 2 layers"):
        load_artifact(truncated)


def _without(directory: Path, *fields: str) -> Path:
    """``directory`` with ``fields`` removed from its config.json."""
    path = directory / "config.json"
    document = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in document.items() if k not in fields}))
    return directory


# ------------------------------------------------------------------- the committed student


def pinned() -> dict[str, Any]:
    document: dict[str, Any] = json.loads((default_classifier_dir() / PINNED_FILE).read_text())
    return document


def test_the_default_student_classifies_as_pinned() -> None:
    """Classes and levels of a handful of prompts equal those saved with the artifact."""
    expected = pinned()
    assert read_config(default_classifier_dir() / "ac").layers == expected["layers"]
    classifiers = load_classifier_set(default_classifier_dir())
    for strategy in (Strategy.AC, Strategy.SM):
        got = expected[strategy.value]
        assert classifiers.classes(expected["prompts"])[strategy].tolist() == got["classes"]
        assert classifiers.predict(expected["prompts"])[strategy].tolist() == got["levels"]


def test_the_default_student_loads_with_the_hub_off(tmp_path: Path) -> None:
    """A fresh process, every Hugging Face cache and the network switched off."""
    code = (
        "import json, sys\n"
        "from argus.classifier.serving import default_classifier_dir, load_classifier_set\n"
        "prompts = json.loads(sys.argv[1])\n"
        "classes = load_classifier_set(default_classifier_dir()).classes(prompts)\n"
        "print(json.dumps({str(s): c.tolist() for s, c in classes.items()}))\n"
    )
    expected = pinned()
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "ARGUS_CACHE_DIR": str(tmp_path / "argus"),  # the ONNX export is made afresh
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(expected["prompts"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    classes = json.loads(done.stdout.strip().splitlines()[-1])
    assert classes == {s: expected[s]["classes"] for s in ("AC", "SM")}
