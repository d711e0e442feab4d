"""The LoRA files Argus reads, and the reader its loader processes run.

Format: **safetensors only** (a pickle can run code; it is never opened), in the key layout
that diffusers' ``StableDiffusionPipeline.save_lora_weights`` writes for PEFT LoRAs::

    unet.<module path>.lora_A.weight   [r, in]           or [r, in, kh, kw]   (Linear / Conv2d)
    unet.<module path>.lora_B.weight   [out, r]          or [out, r, 1, 1]
    unet.<module path>.alpha           scalar, optional  (kohya-style network alpha)

``<module path>`` is the module's name inside the UNet (``down_blocks.1.attentions.0.
transformer_blocks.0.attn1.to_q``). The patch is ``W += scale · (alpha / r) · B @ A``, where
``alpha`` comes from, in order of precedence:

1. a per-module ``unet.<module>.alpha`` tensor in the file;
2. the PEFT ``LoraConfig`` that diffusers stores (≥ 0.34) as JSON under the safetensors
   metadata key ``lora_adapter_metadata``, its fields prefixed with ``unet.``:
   ``unet.alpha_pattern`` (module-name patterns, matched the way PEFT matches them), then
   ``unet.lora_alpha``; ``unet.use_rslora`` makes the factor ``alpha / √r``;
3. otherwise ``alpha = r`` (factor 1), diffusers' convention for files without alphas.

``r`` is always the tensor's rank (``lora_A.shape[0]``); a ``rank_pattern`` in the metadata must
agree with the shapes for PEFT to load the file at all, so it adds nothing here.

Refused, with a message naming the first offending key: text-encoder LoRAs
(``text_encoder.*``, ``text_encoder_2.*``: the prompt is encoded before step 0, so they cannot
be loaded asynchronously and are out of scope), kohya-format keys (``lora_unet_*``: convert
them with diffusers first), DoRA (``lora_magnitude_vector``, ``use_dora``), LoRA biases
(``lora_B.bias``), a ``lora_A`` without its ``lora_B`` and the reverse, ranks that disagree,
dtypes other than F16/BF16/F32/F64, and any header or offset the safetensors format does not
allow. Whether the modules and shapes fit a given UNet is checked later, against that UNet
(:func:`argus.worker.adapters.lora.patch.check_fits`).

:func:`read_file` runs inside a loader process (``share=True``): it parses and checks the
header, then reads the file's whole data section with one ``readinto`` straight into a buffer
in shared memory (torch's shared storage, as ``share_memory_()`` makes), which the parent
process receives without a copy, as a :class:`SharedRead`. With ``share=False`` it reads into
ordinary memory, in the calling process. Tensors are views into that buffer
(:func:`tensor_view`).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import struct
import time
from dataclasses import dataclass
from typing import Any, cast

import torch

UNET_PREFIX = "unet."
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
DTYPES: dict[str, torch.dtype] = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_UNET_KEY = re.compile(
    r"^unet\.(?P<module>[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)\."
    r"(?P<part>lora_A\.weight|lora_B\.weight|alpha)$"
)
_TEXT_PREFIXES = ("text_encoder.", "text_encoder_2.", "te.", "te1.", "te2.")


class FormatProblem(ValueError):
    """The file is not a LoRA this module reads; the message says why (no adapter name yet)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: its key, dtype name, shape and byte range in the data section."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class ModuleEntry:
    """One patched module as the file describes it.

    ``alpha`` is the alpha from the metadata or the rank; ``alpha_tensor`` (when present)
    overrides it with the value stored in the file, read once the data is in memory.
    """

    module: str  # path inside the UNet
    down: TensorEntry  # lora_A: [r, in] or [r, in, kh, kw]
    up: TensorEntry  # lora_B: [out, r] or [out, r, 1, 1]
    alpha: float
    alpha_tensor: TensorEntry | None
    rslora: bool  # factor alpha / √r instead of alpha / r

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass(frozen=True)
class LoraLayout:
    """A checked header: the modules to patch and where the data section lies in the file."""

    modules: tuple[ModuleEntry, ...]  # sorted by module path
    data_start: int  # file offset of the data section
    data_bytes: int  # length of the data section
    alpha_source: str  # "keys", "metadata" or "rank": where the alphas come from


@dataclass(frozen=True)
class SharedRead:
    """What a loader process sends back: the layout and the data section in shared memory."""

    layout: LoraLayout
    data: torch.Tensor  # uint8, data_bytes long; shared memory when read by a loader process
    read_s: float  # seconds spent parsing, checking and reading in the loader


@dataclass(frozen=True)
class ReadFailure:
    """A read that failed; ``kind`` is "format" (the file is at fault) or "io"."""

    kind: str
    message: str


# -- the header --------------------------------------------------------------------------------


def read_header(handle: io.BufferedIOBase, size: int) -> tuple[dict[str, Any], int]:
    """The parsed JSON header of a safetensors file and the offset of its data section."""
    if size < 8:
        raise FormatProblem(f"not a safetensors file ({size} bytes)")
    (length,) = struct.unpack("<Q", handle.read(8))
    if length < 2 or length > MAX_HEADER_BYTES or 8 + length > size:
        raise FormatProblem(f"not a safetensors file (header length {length}, file {size} bytes)")
    raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatProblem(f"not a safetensors file (header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise FormatProblem("not a safetensors file (header is not a JSON object)")
    return header, 8 + length


def _tensor_entry(key: str, value: Any, data_bytes: int) -> TensorEntry:
    if not isinstance(value, dict):
        raise FormatProblem(f"{key}: header entry is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in DTYPES:
        known = ", ".join(DTYPES)
        raise FormatProblem(f"{key}: dtype {dtype!r} not supported (expected one of {known})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise FormatProblem(f"{key}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise FormatProblem(f"{key}: data offsets {offsets!r} outside the data section")
    begin, end = offsets
    if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
        raise FormatProblem(f"{key}: {end - begin} bytes do not hold {dtype} {shape}")
    return TensorEntry(key, dtype, tuple(shape), begin, end)


def _check_no_overlap(entries: list[TensorEntry]) -> None:
    last_end, last_key = 0, ""
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin < last_end:
            raise FormatProblem(f"{entry.key}: data overlaps {last_key}")
        last_end, last_key = max(last_end, entry.end), entry.key


# -- the LoRA layout ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _AlphaConfig:
    """The alpha part of a PEFT LoraConfig stored in the file's metadata."""

    alpha: float | None
    patterns: tuple[tuple[str, float], ...]
    rslora: bool

    def alpha_for(self, module: str) -> float | None:
        for pattern, value in self.patterns:
            # PEFT's rule: the pattern must match the module path or a dotted suffix of it
            if re.match(rf"(.*\.)?({pattern})$", module):
                return value
        return self.alpha


def _alpha_config(metadata: Any) -> _AlphaConfig:
    if metadata is None:
        return _AlphaConfig(None, (), False)
    if not isinstance(metadata, dict):
        raise FormatProblem("__metadata__ is not an object")
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return _AlphaConfig(None, (), False)
    try:
        config = json.loads(raw)
    except (TypeError, json.JSONDecodeError) as err:
        raise FormatProblem(f"metadata {METADATA_KEY} is not JSON: {err}") from None
    if not isinstance(config, dict):
        raise FormatProblem(f"metadata {METADATA_KEY} is not a JSON object")
    if config.get("unet.use_dora"):
        raise FormatProblem("DoRA adapters (use_dora) are not supported")
    alpha = config.get("unet.lora_alpha")
    if alpha is not None and not _is_number(alpha):
        raise FormatProblem(f"metadata unet.lora_alpha {alpha!r} is not a number")
    patterns = config.get("unet.alpha_pattern") or {}
    if not isinstance(patterns, dict) or not all(_is_number(v) for v in patterns.values()):
        raise FormatProblem(f"metadata unet.alpha_pattern {patterns!r} is not a name → number map")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as err:
            raise FormatProblem(f"metadata unet.alpha_pattern {pattern!r}: {err}") from None
    return _AlphaConfig(
        None if alpha is None else float(alpha),
        tuple((str(p), float(v)) for p, v in patterns.items()),
        bool(config.get("unet.use_rslora", False)),
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _split_keys(entries: dict[str, TensorEntry]) -> dict[str, dict[str, TensorEntry]]:
    """Module path → {"lora_A.weight" | "lora_B.weight" | "alpha": entry}; refuses other keys."""
    modules: dict[str, dict[str, TensorEntry]] = {}
    for key in sorted(entries):
        if key.startswith(_TEXT_PREFIXES):
            raise FormatProblem(
                f"{key}: text-encoder LoRAs are not supported (the prompt is encoded before "
                "the first step, so only UNet LoRAs can be loaded while denoising runs)"
            )
        if key.startswith(("lora_unet_", "lora_te")):
            raise FormatProblem(
                f"{key}: a kohya-format key; convert the file to the diffusers layout "
                "(unet.<module>.lora_A/lora_B.weight) first"
            )
        match = _UNET_KEY.match(key)
        if match is None:
            raise FormatProblem(
                f"{key}: unsupported key (expected unet.<module>.lora_A.weight, "
                "unet.<module>.lora_B.weight or unet.<module>.alpha, as diffusers writes them)"
            )
        modules.setdefault(match["module"], {})[match["part"]] = entries[key]
    if not modules:
        raise FormatProblem("no UNet LoRA weights (no unet.*.lora_A.weight keys)")
    return modules


def _module_entry(module: str, parts: dict[str, TensorEntry], alphas: _AlphaConfig) -> ModuleEntry:
    down, up = parts.get("lora_A.weight"), parts.get("lora_B.weight")
    if down is None or up is None:
        present = next(iter(parts.values())).key
        missing = "lora_A" if down is None else "lora_B"
        raise FormatProblem(f"{present}: no matching {missing}.weight for this module")
    if len(down.shape) not in (2, 4) or len(up.shape) != len(down.shape):
        raise FormatProblem(
            f"{down.key}: lora_A {list(down.shape)} and lora_B {list(up.shape)} are not a "
            "Linear (2-D) or Conv2d (4-D) pair"
        )
    if 0 in down.shape or 0 in up.shape:
        raise FormatProblem(f"{down.key}: empty lora_A {list(down.shape)} or lora_B")
    rank = down.shape[0]
    if up.shape[1] != rank:
        raise FormatProblem(f"{up.key}: rank {up.shape[1]} does not match lora_A's rank {rank}")
    if len(up.shape) == 4 and up.shape[2:] != (1, 1):
        raise FormatProblem(f"{up.key}: a Conv2d lora_B must be 1×1, got {list(up.shape)}")
    alpha_tensor = parts.get("alpha")
    if alpha_tensor is not None and math.prod(alpha_tensor.shape) != 1:
        raise FormatProblem(f"{alpha_tensor.key}: alpha must hold one number")
    alpha = alphas.alpha_for(module)
    return ModuleEntry(
        module=module,
        down=down,
        up=up,
        alpha=float(rank) if alpha is None else alpha,
        alpha_tensor=alpha_tensor,
        rslora=alphas.rslora,
    )


def parse_layout(header: dict[str, Any], data_start: int, size: int) -> LoraLayout:
    """Check a safetensors header as a UNet LoRA; raises :class:`FormatProblem`."""
    data_bytes = size - data_start
    entries = {
        key: _tensor_entry(key, value, data_bytes)
        for key, value in header.items()
        if key != "__metadata__"
    }
    _check_no_overlap(list(entries.values()))
    alphas = _alpha_config(header.get("__metadata__"))
    grouped = _split_keys(entries)
    modules = tuple(_module_entry(m, parts, alphas) for m, parts in sorted(grouped.items()))
    if any(m.alpha_tensor is not None for m in modules):
        source = "keys"
    elif alphas.alpha is not None or alphas.patterns:
        source = "metadata"
    else:
        source = "rank"
    return LoraLayout(modules, data_start, data_bytes, source)


# -- reading -----------------------------------------------------------------------------------


def read_data(handle: io.BufferedIOBase, layout: LoraLayout, *, share: bool) -> torch.Tensor:
    """The data section as one uint8 tensor, read in place (into shared memory if ``share``)."""
    size = layout.data_bytes
    data = _shared_bytes(size) if share else torch.empty(size, dtype=torch.uint8)
    # numpy exports the buffer protocol (its stub does not say so): the tensor's own bytes
    view = memoryview(cast(bytearray, data.numpy()))
    handle.seek(layout.data_start)
    done = 0
    while done < layout.data_bytes:
        got = handle.readinto(view[done:])
        if not got:
            raise FormatProblem(f"truncated: data ends after {done} of {layout.data_bytes} bytes")
        done += got
    return data


def _shared_bytes(size: int) -> torch.Tensor:
    """An uninitialised uint8 tensor in shared memory.

    ``torch.UntypedStorage._new_shared`` (what ``torch.multiprocessing`` itself uses) maps the
    segment without touching it; ``empty().share_memory_()`` would first fill a private buffer
    and copy it over, a second pass over every page (measured: ~40% slower for 100 MiB).
    """
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:
        fallback: torch.Tensor = torch.empty(size, dtype=torch.uint8).share_memory_()
        return fallback
    shared: torch.Tensor = torch.empty(0, dtype=torch.uint8).set_(new_shared(size))
    return shared


def read_file(path: str, *, share: bool) -> SharedRead | ReadFailure:
    """Read and check one LoRA file. Runs in a loader process (``share=True``) or in place.

    Returns a failure value instead of raising, so that nothing but plain data and the
    shared-memory tensor cross the process boundary.
    """
    began = time.perf_counter()
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            header, data_start = read_header(handle, size)
            layout = parse_layout(header, data_start, size)
            data = read_data(handle, layout, share=share)
    except FormatProblem as problem:
        return ReadFailure("format", str(problem))
    except OSError as err:
        # the message reaches clients: the reason, not the server's path (the loader logs it)
        return ReadFailure("io", f"cannot read its file: {err.strerror or type(err).__name__}")
    return SharedRead(layout, data, time.perf_counter() - began)


def tensor_view(data: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """One tensor of the file as a view into the data buffer (a copy only if misaligned).

    safetensors writers keep every tensor aligned to its item size, so the view is the rule;
    an unaligned tensor (allowed by the format) is copied out rather than refused. Data is
    little-endian, as on every platform the worker runs on.
    """
    raw = data[entry.begin : entry.end]
    if entry.begin % _ITEMSIZE[entry.dtype]:
        raw = raw.clone()
    return raw.view(DTYPES[entry.dtype]).view(entry.shape)
