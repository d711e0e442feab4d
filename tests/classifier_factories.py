"""Builders for classifier tests: a tiny random BERT, fake encoders, labelled prompt sets."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from argus.classifier.labels import LabelledPrompts
from argus.classifier.model import (
    Backbone,
    ClassifierConfig,
    LevelClassifier,
    LinearHead,
)
from argus.contracts.quality import QualityTable
from argus.types import Strategy

AC_LEVELS = ("ac-k0", "ac-k5", "ac-k10", "ac-k15", "ac-k20", "ac-k25")


def make_tiny_bert(directory: Path, seed: int = 0) -> Path:
    """A 2-layer, 32-wide BERT with seeded random weights and all-MiniLM-L6-v2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from argus.embedding import default_encoder_dir

    tokenizer = AutoTokenizer.from_pretrained(default_encoder_dir(), local_files_only=True)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# Two vocabularies: prompts made of EASY words tolerate the fastest level, HARD ones only the
# slowest. A classifier that reads words (even through a random encoder) can learn this.
EASY = [
    "cat",
    "dog",
    "sun",
    "tree",
    "ball",
    "cup",
    "hat",
    "red",
    "blue",
    "box",
    "car",
    "bird",
    "fish",
    "moon",
    "star",
    "leaf",
]
HARD = [
    "calligraphy",
    "reflection",
    "symmetry",
    "crowd",
    "typography",
    "hands",
    "chessboard",
    "orchestra",
    "mosaic",
    "embroidery",
    "labyrinth",
    "clockwork",
    "kaleidoscope",
    "tapestry",
    "filigree",
    "origami",
]


def lexical_table(n: int = 240, seed: int = 0, levels: Sequence[str] = AC_LEVELS) -> QualityTable:
    """A quality table whose optimal level is a function of the prompt's words.

    Half the prompts are three EASY words (score flat across levels: the fastest level is
    optimal), half three HARD words (the score collapses past the slowest level).
    """
    rng = np.random.default_rng(seed)
    prompts: list[str] = []
    rows: list[list[float]] = []
    flat = [21.0 - 0.1 * j for j in range(len(levels))]
    steep = [21.0] + [15.0 - 0.1 * j for j in range(1, len(levels))]
    while len(prompts) < n:
        hard = len(prompts) % 2 == 1
        words = rng.choice(HARD if hard else EASY, size=3, replace=False)
        text = "a " + " and ".join(words)
        if text in prompts:
            continue
        prompts.append(text)
        rows.append(steep if hard else flat)
    return QualityTable(Strategy.AC, tuple(levels), tuple(prompts), np.array(rows), "lexical test")


class FakeEncoder:
    """Deterministic vectors from a hash of the text; counts calls; optionally not ready."""

    def __init__(self, dim: int = 8, max_tokens: int = 64, ready: bool = True) -> None:
        self.dim = dim
        self.max_tokens = max_tokens
        self.ready = ready
        self.calls = 0
        self.texts: list[str] = []
        self._lock = threading.Lock()

    def embed(self, prompts: Sequence[str]) -> np.ndarray:
        if not self.ready:
            raise AssertionError("a request reached a half-loaded encoder")
        with self._lock:
            self.calls += 1
            self.texts.extend(prompts)
        out = np.empty((len(prompts), self.dim), dtype=np.float32)
        for i, text in enumerate(prompts):
            rng = np.random.default_rng(zlib.crc32(text.encode("utf-8")))
            vector = rng.standard_normal(self.dim)
            out[i] = vector / np.linalg.norm(vector)
        return out


def constant_classifier(
    level: int,
    *,
    strategy: Strategy = Strategy.AC,
    levels: Sequence[str] = AC_LEVELS,
    encoder: FakeEncoder | None = None,
) -> LevelClassifier:
    """A classifier on a fake encoder that predicts ``level`` for every prompt."""
    encoder = encoder or FakeEncoder()
    bias = np.full(len(levels), -5.0, dtype=np.float32)
    bias[level] = 5.0
    config = ClassifierConfig(
        strategy=strategy,
        levels=tuple(levels),
        backbone=Backbone.LOGISTIC,
        encoder="fake",
        encoder_sha256="",
        hidden_size=encoder.dim,
        max_tokens=encoder.max_tokens,
        delta=0.9,
        seed=0,
        labels_source="test",
    )
    weight = np.zeros((len(levels), encoder.dim), dtype=np.float32)
    return LevelClassifier(config, encoder, LinearHead(weight, bias))


def labelled(prompts: Sequence[str], labels: Sequence[int]) -> LabelledPrompts:
    return LabelledPrompts(
        strategy=Strategy.AC,
        levels=AC_LEVELS,
        prompts=tuple(prompts),
        labels=np.array(labels, dtype=np.int64),
        scores=None,
        source="test",
        delta=0.9,
    )


def tolerance_classifier(
    *,
    temperature: float = 1.0,
    encoder: FakeEncoder | None = None,
    levels: Sequence[str] = AC_LEVELS,
    encoder_sha256: str = "",
) -> LevelClassifier:
    """A classifier on a fake encoder whose logits grow along the levels with the vector's
    first coordinate, calibrated with equal-count classes over 600 probe prompts and
    made-up scores (level ``v`` of class ``c`` loses ``(n - 1 - c) · v / n`` points)."""
    from argus.classifier.calibration import (
        Calibration,
        CalibrationFit,
        class_edges,
        measure_class_quality,
    )

    encoder = encoder or FakeEncoder()
    n = len(levels)
    weight = np.zeros((n, encoder.dim), dtype=np.float32)
    weight[:, 0] = 4.0 * (np.arange(n) - (n - 1) / 2.0)
    config = ClassifierConfig(
        strategy=Strategy.AC,
        levels=tuple(levels),
        backbone=Backbone.LOGISTIC,
        encoder="fake",
        encoder_sha256=encoder_sha256,
        hidden_size=encoder.dim,
        max_tokens=encoder.max_tokens,
        delta=0.9,
        seed=0,
        labels_source="test",
    )
    head = LinearHead(weight, np.zeros(n, dtype=np.float32))
    plain = LevelClassifier(config, encoder, head)
    probes = plain.embed([f"probe {i}" for i in range(600)])
    from argus.classifier.calibration import softmax_t, tolerance_scores

    tolerance = tolerance_scores(softmax_t(head.logits(probes), temperature))
    edges = class_edges(tolerance, n)
    classes = np.searchsorted(np.array(edges), tolerance, side="left")
    scores = np.array([[20.0 - (n - 1 - c) * v / n for v in range(n)] for c in classes])
    stats = measure_class_quality(classes, scores, n)
    calibration = Calibration(
        Strategy.AC,
        tuple(levels),
        temperature,
        edges,
        len(classes),
        stats.counts,
        stats,
        "test",
        CalibrationFit(1.0, 1.0, 0.1, 0.1),
    )
    return LevelClassifier(config, encoder, head, calibration)
