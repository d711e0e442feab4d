"""Prompt embeddings kept on disk by content, so trace replays embed each prompt once.

A replay of a day of traffic classifies the same few thousand prompts again in every run; the
encoder is the only slow part. :class:`EmbeddingCache` keeps the vectors of every text it has
embedded, keyed by

* the **encoder identity** (:class:`EncoderIdentity`: its reference, the SHA-256 of its
  weights, its token limit, width and precision): one file per identity, so vectors of two
  encoders (or of one encoder cut at another token limit) never mix;
* the **SHA-256 of the text** as given to the encoder (callers clean and cut it first).

Layout: ``<cache dir>/<identity key>.safetensors``, one file per encoder identity, holding
``text_sha256`` (uint8 ``[n, 32]``) and ``vectors`` (float32 ``[n, dim]``): row ``i`` of
``vectors`` is the vector of the text whose hash is row ``i`` of ``text_sha256``. The file's
metadata repeats the format and the identity, checked on read. No pickle.

The cache directory is ``$ARGUS_CACHE_DIR/embeddings`` when ``ARGUS_CACHE_DIR`` is set, else
``~/.cache/argus/embeddings``.

Failure is never fatal: a file that cannot be read, has the wrong shape, the wrong metadata
or non-finite numbers is ignored (and replaced at the next write); a write that fails leaves
the vectors computed and returned. Writers merge what is on disk with their new rows, write
a private temporary file and rename it over the old one, so concurrent writers never leave a
torn file (one may drop the other's newest rows, which are then computed again next time).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from argus.classifier.model import Encoder, embed_many

if TYPE_CHECKING:
    from argus.classifier.model import LevelClassifier

Float32Array = npt.NDArray[np.float32]

CACHE_ENV = "ARGUS_CACHE_DIR"
CACHE_FORMAT = "argus-embedding-cache v1"
HASH_BYTES = 32  # SHA-256


def default_cache_dir() -> Path:
    """``$ARGUS_CACHE_DIR/embeddings``, else ``~/.cache/argus/embeddings``."""
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "argus"
    return base / "embeddings"


@dataclass(frozen=True)
class EncoderIdentity:
    """What makes two encoders give the same vector for the same text."""

    reference: str  # the encoder's name or directory, for people reading the file
    sha256: str  # SHA-256 of its weights (ClassifierConfig.vectors_sha256: a student's too)
    max_tokens: int  # input limit: a different cut is a different vector
    dim: int  # width of its vectors
    precision: str = "fp32"  # bf16 vectors differ from fp32 ones in the third decimal

    def __post_init__(self) -> None:
        if not self.sha256:
            raise ValueError("sha256: an encoder without a weights hash cannot be cached")
        if self.max_tokens < 1 or self.dim < 1:
            raise ValueError(f"max_tokens and dim must be >= 1, got {self.max_tokens}, {self.dim}")

    @classmethod
    def of(cls, classifier: LevelClassifier) -> EncoderIdentity | None:
        """The identity of a classifier's encoder; ``None`` when its weights' hash is not
        known (a fine-tuned encoder not yet saved, a test's fake)."""
        config = classifier.config
        if not config.vectors_sha256:
            return None
        return cls.of_encoder(config.encoder, config.vectors_sha256, classifier.encoder)

    @classmethod
    def of_encoder(cls, reference: str, sha256: str, encoder: Encoder) -> EncoderIdentity:
        """The identity of ``encoder``, loaded from ``reference`` with weights of ``sha256``:
        training keys its vectors as serving does, so each reuses the other's."""
        return cls(
            reference=reference,
            sha256=sha256,
            max_tokens=encoder.max_tokens,
            dim=encoder.dim,
            precision=str(getattr(encoder, "precision", "fp32")),
        )

    def metadata(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def key(self) -> str:
        """File stem: a digest of every field."""
        return hashlib.sha256(self.metadata().encode("utf-8")).hexdigest()[:32]


def text_sha256(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class EmbeddingCache:
    """Embeds texts through an encoder, reusing the vectors kept in ``directory``."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path_for(self, identity: EncoderIdentity) -> Path:
        return self.directory / f"{identity.key()}.safetensors"

    def load(self, identity: EncoderIdentity) -> dict[bytes, Float32Array]:
        """The cached vectors of ``identity`` by text hash; empty when the file is missing
        or unusable (never raises)."""
        path = self.path_for(identity)
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="numpy") as handle:
                metadata = handle.metadata() or {}
                hashes = handle.get_tensor("text_sha256")
                vectors = handle.get_tensor("vectors")
        except Exception:  # missing, truncated, not safetensors, wrong keys: start afresh
            return {}
        if (
            metadata.get("format") != CACHE_FORMAT
            or metadata.get("identity") != identity.metadata()
            or hashes.dtype != np.uint8
            or vectors.dtype != np.float32
            or hashes.ndim != 2
            or hashes.shape[1] != HASH_BYTES
            or vectors.shape != (hashes.shape[0], identity.dim)
            or not np.all(np.isfinite(vectors))
        ):
            return {}
        return {bytes(h): vectors[i] for i, h in enumerate(hashes)}

    def embed(
        self,
        encoder: Encoder,
        identity: EncoderIdentity,
        texts: Sequence[str],
        progress: Callable[[int, int], None] | None = None,
    ) -> Float32Array:
        """Vectors of ``texts`` in their order: cached ones read, each missing distinct text
        embedded once and stored. ``progress(done, total)`` counts distinct texts: once with
        the cached ones done, then after each forward pass (not called when all are cached)."""
        if encoder.dim != identity.dim or encoder.max_tokens != identity.max_tokens:
            raise ValueError(
                f"the encoder (dim {encoder.dim}, {encoder.max_tokens} tokens) does not match "
                f"its identity (dim {identity.dim}, {identity.max_tokens} tokens)"
            )
        keys = [text_sha256(t) for t in texts]
        known = self.load(identity)
        missing: dict[bytes, str] = {}
        for key, text in zip(keys, texts, strict=True):
            if key not in known:
                missing.setdefault(key, text)
        if missing:
            cached = len(set(keys)) - len(missing)

            def forward(done: int, _count: int) -> None:
                if progress is not None:
                    progress(cached + done, cached + len(missing))

            forward(0, len(missing))
            order = list(missing)
            fresh = embed_many(encoder, [missing[k] for k in order], forward)
            new = dict(zip(order, fresh, strict=True))
            known.update(new)
            self._store(identity, new)
        out = np.zeros((len(texts), identity.dim), dtype=np.float32)
        for i, key in enumerate(keys):
            out[i] = known[key]
        return out

    def _store(self, identity: EncoderIdentity, new: dict[bytes, Float32Array]) -> None:
        """Merge ``new`` into the file on disk (re-read now: another writer may have added
        rows) and replace it atomically; errors are swallowed (the cache is an optimisation)."""
        from safetensors.numpy import save_file

        path = self.path_for(identity)
        temporary: str | None = None
        try:
            merged = self.load(identity)
            merged.update(new)
            hashes = np.frombuffer(b"".join(merged), dtype=np.uint8).reshape(-1, HASH_BYTES)
            vectors = np.stack(list(merged.values())).astype(np.float32, copy=False)
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(
                prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent
            )
            os.close(handle)
            save_file(
                {"text_sha256": np.ascontiguousarray(hashes), "vectors": vectors},
                temporary,
                metadata={"format": CACHE_FORMAT, "identity": identity.metadata()},
            )
            os.replace(temporary, path)
            temporary = None
        except Exception:  # a full disk or a read-only cache must not stop a replay
            pass
        finally:
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
