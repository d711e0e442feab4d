"""The parts of a worker's models, shared between models by the hash of their weights.

Variants of one family carry identical parts: SD-1.4, SD-1.5 and their distilled small and
tiny versions share CLIP ViT-L/14 and the VAE, and differ only in the UNet (LegoDiffusion
§2-§3 builds its sharing on the same observation). A worker that holds two of them needs one
copy of the shared parts, and a switch between them needs only the other UNet.

A part is identified by its *digest*: SHA-256 over its weights, never its name, so two
checkpoints that name their text encoders differently but carry the same tensors share one
copy, and two that carry the same name but other weights do not. :func:`module_digest` hashes
a module's state dict (names, dtypes, shapes and bytes, in key order); :func:`tokenizer_digest`
a tokenizer's class and vocabulary. :func:`source_digests` computes a source's digests once per
process: for a diffusers directory from the files of each part's folder (read, not loaded);
for a tiny variant from a CPU build of its seeded parts.

:class:`ComponentStore` holds the resident parts by digest and which models use each; the
model registry (:mod:`argus.worker.models.registry`) assembles pipelines from it, loads only the
parts it lacks, and counts each part's bytes once in its memory guard. The store is not
thread-safe: the registry's lock guards it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from argus.contracts.worker_control import ComponentInfo
from argus.worker.models.sources import (
    build_tiny_part,
    check_pipeline_dir,
    is_tiny,
    pipeline_dir_parts,
    tiny_spec,
    tiny_tokenizer,
)


def module_digest(module: torch.nn.Module) -> str:
    """SHA-256 over a module's state dict: each tensor's name, dtype, shape and bytes, in key
    order (so equal weights give one digest whatever the module's name or device)."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 over a tokenizer's class, length limit and vocabulary."""
    vocab = sorted(tokenizer.get_vocab().items())
    text = json.dumps([type(tokenizer).__name__, tokenizer.model_max_length, vocab])
    return hashlib.sha256(text.encode()).hexdigest()


def part_digest(part: Any) -> str:
    """The digest of a loaded part: a module's weights or a tokenizer's vocabulary."""
    if isinstance(part, torch.nn.Module):
        return module_digest(part)
    return tokenizer_digest(part)


def folder_digest(folder: Path) -> str:
    """SHA-256 over the files of a part's folder (relative names and bytes, in name order)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


@functools.cache
def source_digests(source: str) -> dict[str, str]:
    """Part name → digest for every shared part of ``source``, computed once per process.

    A tiny variant's parts are built on the CPU and hashed (their weights are a function of
    their seeds, so the digest never changes); a directory's parts are hashed from their
    folders' files. Callers must not mutate the returned dict.
    """
    if is_tiny(source):
        spec = tiny_spec(source)
        tokenizer = tiny_tokenizer()
        return {part: part_digest(build_tiny_part(spec, part, tokenizer)) for part in spec.parts}
    root = Path(source)
    check_pipeline_dir(root)
    return {part: folder_digest(root / part) for part in pipeline_dir_parts(root)}


def part_bytes(part: Any) -> int:
    """Bytes of a part's parameters on its device (0 for a tokenizer), as
    :meth:`~argus.worker.models.pipelines.DiffusionModel.parameter_bytes` and the estimates
    count."""
    if not isinstance(part, torch.nn.Module):
        return 0
    return sum(p.numel() * p.element_size() for p in part.parameters())


@dataclass
class Component:
    """One resident part: its value (a module or a tokenizer) and who uses it."""

    digest: str
    part: str  # the part name it was first loaded as ("unet", "text_encoder", ...)
    value: Any
    bytes: int
    load_s: float  # how long its load took
    users: set[str] = field(default_factory=set)  # the models assembled with it


class ComponentStore:
    """Resident parts by digest; a part leaves when the last model using it is released."""

    def __init__(self) -> None:
        self._parts: dict[str, Component] = {}

    def get(self, digest: str) -> Component | None:
        return self._parts.get(digest)

    def add(self, component: Component) -> None:
        if component.digest in self._parts:
            raise ValueError(f"part {component.digest[:12]} is already resident")
        self._parts[component.digest] = component

    def use(self, digest: str, model: str) -> Any:
        """The resident part's value, now counted as used by ``model``."""
        component = self._parts[digest]
        component.users.add(model)
        return component.value

    def release(self, model: str) -> list[Component]:
        """Stop counting ``model`` as a user; returns the parts that left (no user left)."""
        left = []
        for digest, component in list(self._parts.items()):
            component.users.discard(model)
            if not component.users:
                left.append(self._parts.pop(digest))
        return left

    def missing_bytes(self, digests: dict[str, str], estimates: dict[str, int]) -> int:
        """Bytes a model with these part digests would add: the estimates of the parts that
        are not resident."""
        return sum(
            estimates.get(part, 0) for part, digest in digests.items() if digest not in self._parts
        )

    def bytes(self) -> int:
        """Bytes of every resident part, each counted once however many models share it."""
        return sum(c.bytes for c in self._parts.values())

    def infos(self) -> list[ComponentInfo]:
        return [
            ComponentInfo(
                digest=c.digest,
                part=c.part,
                bytes=c.bytes,
                load_s=c.load_s,
                models=tuple(sorted(c.users)),
            )
            for c in sorted(self._parts.values(), key=lambda c: (c.part, c.digest))
        ]
