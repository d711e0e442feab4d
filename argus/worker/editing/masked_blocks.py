"""InstGenIE's mask-aware activation cache, the compute side: one request's record and replay.

An inpainting edit changes only the tokens of its region; every edit of one template sees the
same latents outside it at every step (:meth:`DiffusionModel.start_edit` noises the unmasked
region with the template's own seed). So the UNet's transformer blocks can take the unedited
tokens' outputs from a recorded run of the template and compute attention and feed-forward for
the edited tokens only (InstGenIE, §3.1, Fig. 5). Convolutions and everything outside the
``BasicTransformerBlock``\\ s run in full: they mix neighbouring latent pixels, so they need the
whole feature map, cached rows included.

Two predictors (:class:`~argus.worker.models.pipelines.NoisePredictor`) for
``DiffusionModel.denoise(..., predictor=...)``:

* :class:`RecordingPredictor` runs the UNet in full and keeps, per (step, block), the block's
  output Y for the tokens outside its run's region (the record's *coverage*), both CFG
  branches, in float16 on the CPU: an :class:`ActivationRecord` (and, while they fit a bound,
  the same rows on the UNet's device: :class:`DeviceCopy`);
* :class:`ReplayPredictor` runs every block in ``use_cache`` on the tokens it must compute
  (the request's region, plus any token the record does not cover) and scatters them into the
  recorded rows. Self-attention takes its queries from the computed tokens and its keys and
  values from all of them; norms, cross-attention, feed-forward and residuals run on the
  computed tokens only. A block whose ``use_cache`` is False computes all its tokens
  (InstGenIE's bubble-free pipeline, Algorithm 1, plans that list elsewhere).

A replay stages each step's rows (:class:`RowStager`) on the UNet's device and dtype while the
step before runs (on CUDA from pinned memory on a side stream); the latents are the same.

A block's tokens at h×w are masked when any latent pixel they cover is edited: the latent
region max-pooled by 2 (ceil mode, as the UNet's stride-2 convolutions give ceil sizes) until
it has as many pixels as the block has tokens. Records keep Y only by default
(:data:`DEFAULT_KEYS_VALUES`): self-attention's keys and values too would triple the bytes for
a few per cent of a step (measured: ``docs/worker-internals.md``). Records convert to and from
a flat ``dict[str, torch.Tensor]`` (:meth:`ActivationRecord.to_tensors`), safetensors-able:
``latent_size``, ``coverage.{h}x{w}``, ``s{step}.b{block}.y`` (and ``.k``, ``.v``).

The predictors patch each block instance's ``forward`` for the length of one UNet call and
restore it on exit, exceptions included; ``denoise`` runs under the model's lock, so no other
request sees the patch. Several requests' blocks in one batched UNet call are
:mod:`argus.worker.editing.packed_blocks`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from argus.worker.models.cuda_graphs import GraphCaptureError, call_unet, indexed

if TYPE_CHECKING:
    from argus.worker.models.cuda_graphs import GraphedUNet
    from argus.worker.models.pipelines import Conditioning, DiffusionModel

log = logging.getLogger(__name__)

DEFAULT_KEYS_VALUES = False
"""Whether records keep self-attention's keys and values besides Y (see the module's docstring:
3× the bytes for a few per cent of a step)."""
RECORD_DTYPE = torch.float16  # InstGenIE's and the brief's: half the bytes of float32
# the attention processors whose computation the masked forward reproduces: softmax(QKᵀ/√d)V
# with nothing else (AttnProcessor2_0 is diffusers' default on torch 2)
SUPPORTED_PROCESSORS = frozenset({"AttnProcessor2_0", "AttnProcessor"})
_TENSOR_NAME = re.compile(r"s(\d+)\.b(\d+)\.([ykv])")
_COVERAGE_NAME = re.compile(r"coverage\.(\d+)x(\d+)")

Size = tuple[int, int]  # (height, width) in tokens


class UnsupportedBlockError(ValueError):
    """A transformer block whose configuration the masked forward does not implement."""


class RecordMismatchError(ValueError):
    """A record that does not fit the run replaying it (size, step, block or mode)."""


# -- blocks and token masks ----------------------------------------------------------------


_BLOCKS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, ...]] = weakref.WeakKeyDictionary()
_BLOCKS_GUARD = threading.Lock()


def transformer_blocks(unet: torch.nn.Module) -> tuple[Any, ...]:
    """The UNet's ``BasicTransformerBlock``\\ s in ``unet.modules()`` order: a block's index
    in this list names it in records and in ``use_cache``. Found once per UNet (a walk of all
    its modules; every replay, recording and batched step asks), kept while the UNet lives."""
    with _BLOCKS_GUARD:
        found = _BLOCKS.get(unet)
    if found is None:
        from diffusers.models.attention import BasicTransformerBlock

        found = tuple(m for m in unet.modules() if isinstance(m, BasicTransformerBlock))
        with _BLOCKS_GUARD:
            _BLOCKS[unet] = found
    return found


def check_block(block: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedBlockError` unless ``block`` is the plain pre-norm block the
    masked forward implements: layer norms, self-attention then cross-attention then
    feed-forward, no positional embedding, GLIGEN fuser or ada-norm, and attentions that are
    softmax(QKᵀ/√d)V alone (a batch computes them itself:
    :func:`~argus.worker.editing.packed_blocks.packed_block_forward`)."""
    from diffusers.models.attention import BasicTransformerBlock

    problems = []
    if type(block) is not BasicTransformerBlock:
        problems.append(f"class {type(block).__name__}")
    else:
        if block.norm_type != "layer_norm":
            problems.append(f"norm_type {block.norm_type!r}")
        if block.only_cross_attention:
            problems.append("only_cross_attention")
        if block.double_self_attention:
            problems.append("double_self_attention")
        if block.pos_embed is not None:
            problems.append("positional embeddings")
        if hasattr(block, "fuser"):
            problems.append("a GLIGEN fuser")
        for kind, attn in (("self-attention", block.attn1), ("cross-attention", block.attn2)):
            if attn is not None:
                problems.extend(_attention_problems(kind, attn))
        if block.attn1.is_cross_attention:
            problems.append("self-attention over another sequence")
    if problems:
        raise UnsupportedBlockError(
            f"masked transformer block: unsupported {', '.join(problems)}; only diffusers' "
            "BasicTransformerBlock with norm_type 'layer_norm', self- then cross-attention "
            f"and one of {sorted(SUPPORTED_PROCESSORS)} is implemented"
        )


def _attention_problems(kind: str, attn: Any) -> list[str]:
    """What in ``attn`` the masked forward's softmax(QKᵀ/√d)V does not reproduce."""
    problems = []
    processor = type(attn.processor).__name__
    if processor not in SUPPORTED_PROCESSORS:
        problems.append(f"{kind} processor {processor}")
    for name in ("spatial_norm", "group_norm", "norm_q", "norm_k", "norm_cross"):
        if getattr(attn, name, None) is not None:
            problems.append(f"{kind} {name}")
    if attn.residual_connection or attn.rescale_output_factor != 1.0:
        problems.append(f"{kind} residual or rescale")
    return problems


def token_regions(region: torch.Tensor) -> dict[int, tuple[Size, torch.Tensor]]:
    """The edited tokens at every resolution a UNet reaches from the latent ``region``
    (1×1×H×W, nonzero where edited): token count → ((h, w), flat bool mask of h·w tokens,
    row-major as ``Transformer2DModel`` flattens them). Each level is the one above
    max-pooled by 2 in ceil mode, down to 1×1; counts are distinct, so a block's token count
    names its level."""
    level = (region.detach().to("cpu", torch.float32) != 0).to(torch.float32)
    if level.dim() != 4 or level.shape[:2] != (1, 1):
        raise ValueError(f"region: expected 1×1×H×W, got {tuple(level.shape)}")
    levels: dict[int, tuple[Size, torch.Tensor]] = {}
    while True:
        h, w = int(level.shape[-2]), int(level.shape[-1])
        levels[h * w] = ((h, w), level.flatten() != 0)
        if h == 1 and w == 1:
            return levels
        level = F.max_pool2d(level, 2, 2, ceil_mode=True)


def token_level(
    levels: dict[int, tuple[Size, torch.Tensor]], tokens: int
) -> tuple[Size, torch.Tensor]:
    """The level of :func:`token_regions` that a block of ``tokens`` tokens runs at; raises
    :class:`RecordMismatchError` when none has as many."""
    if tokens not in levels:
        sizes = sorted(size for size, _ in levels.values())
        raise RecordMismatchError(f"a block of {tokens} tokens matches no level of {sizes}")
    return levels[tokens]


# -- the record ----------------------------------------------------------------------------


@dataclass
class ActivationRecord:
    """One template's recorded run: per (step, block), the block's output rows for the tokens
    ``coverage`` marks at the block's resolution, CFG branches stacked (negative first).

    ``outputs[(step, block)]`` is batch × covered tokens × channels, in the covered tokens'
    row-major order; ``keys`` and ``values`` (only when recorded with keys and values) are the
    block's self-attention projections of the same tokens."""

    latent_size: Size
    coverage: dict[Size, torch.Tensor] = field(default_factory=dict)  # (h, w) -> bool (h·w,)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    keys: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    values: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @property
    def keys_values(self) -> bool:
        """Whether the record holds self-attention's keys and values too."""
        return bool(self.keys)

    @property
    def steps(self) -> list[int]:
        return sorted({step for step, _ in self.outputs})

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor of :meth:`to_tensors` (what a store holds)."""
        return sum(t.nbytes for t in self.to_tensors().values())

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The record as flat, contiguous tensors (safetensors' ``save_file`` takes them)."""
        flat = {"latent_size": torch.tensor(self.latent_size, dtype=torch.int64)}
        for (h, w), covered in self.coverage.items():
            flat[f"coverage.{h}x{w}"] = covered.reshape(h, w).to(torch.uint8).contiguous()
        for kind, tensors in (("y", self.outputs), ("k", self.keys), ("v", self.values)):
            for (step, block), tensor in tensors.items():
                flat[f"s{step}.b{block}.{kind}"] = tensor.contiguous()
        return flat

    @classmethod
    def from_tensors(cls, flat: dict[str, torch.Tensor]) -> ActivationRecord:
        """The record :meth:`to_tensors` gave; raises :class:`RecordMismatchError` on a name
        it did not write."""
        if "latent_size" not in flat:
            raise RecordMismatchError("not an activation record: no latent_size")
        h, w = (int(v) for v in flat["latent_size"].tolist())
        record = cls((h, w))
        kinds = {"y": record.outputs, "k": record.keys, "v": record.values}
        for name, tensor in flat.items():
            if name == "latent_size":
                continue
            if match := _COVERAGE_NAME.fullmatch(name):
                record.coverage[(int(match[1]), int(match[2]))] = tensor.flatten() != 0
            elif match := _TENSOR_NAME.fullmatch(name):
                kinds[match[3]][(int(match[1]), int(match[2]))] = tensor
            else:
                raise RecordMismatchError(f"not an activation record's tensor: {name!r}")
        return record


# -- recording -----------------------------------------------------------------------------


@contextlib.contextmanager
def recording(
    unet: torch.nn.Module,
    record: ActivationRecord,
    step: int,
    region: torch.Tensor | None = None,
    *,
    keys_values: bool = DEFAULT_KEYS_VALUES,
    dtype: torch.dtype = RECORD_DTYPE,
    on_device: DeviceCopy | None = None,
) -> Iterator[None]:
    """Record into ``record`` what the UNet's transformer blocks compute for step ``step``
    during the block (one full UNet call): each block's output, and with ``keys_values`` its
    self-attention's keys and values, for the tokens outside ``region`` (None: all tokens),
    as ``dtype`` on the CPU; ``on_device`` (None: none) receives the same rows as they were
    on the UNet's device, before the copy to the CPU. Hooks are removed on exit."""
    h, w = record.latent_size
    levels = token_regions(torch.zeros(1, 1, h, w) if region is None else region)
    if region is not None and tuple(region.shape[-2:]) != record.latent_size:
        raise RecordMismatchError(f"region {tuple(region.shape[-2:])} ≠ {record.latent_size}")
    handles = []

    def keep(key: tuple[int, int], kind: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            size, edited = token_level(levels, output.shape[1])
            covered = ~edited
            record.coverage[size] = covered
            index = covered.nonzero().flatten().to(output.device)
            rows = output.index_select(1, index).to(dtype)
            _kind(record, kind)[key] = rows.to("cpu")
            if on_device is not None:
                on_device.add(kind, key, size, covered, rows)

        return hook

    try:
        for index, block in enumerate(transformer_blocks(unet)):
            check_block(block)
            key = (step, index)
            handles.append(block.register_forward_hook(keep(key, "y")))
            if keys_values:
                handles.append(block.attn1.to_k.register_forward_hook(keep(key, "k")))
                handles.append(block.attn1.to_v.register_forward_hook(keep(key, "v")))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _kind(record: ActivationRecord, kind: str) -> dict[tuple[int, int], torch.Tensor]:
    """The record's tensors of ``kind``: ``"y"`` outputs, ``"k"`` keys, ``"v"`` values."""
    return {"y": record.outputs, "k": record.keys, "v": record.values}[kind]


class DeviceCopy:
    """The rows of a recording as they were on the model's device, kept while they fit
    ``max_bytes`` (the activation cache's device tier, so the template's next edit reads
    nothing over PCIe); once they outgrow it, dropped for the rest of the run."""

    def __init__(self, latent_size: Size, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.record: ActivationRecord | None = (
            ActivationRecord(latent_size) if max_bytes > 0 else None
        )
        self._rows_bytes = 0

    def add(
        self,
        kind: str,
        key: tuple[int, int],
        size: Size,
        covered: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Keep ``rows`` (of ``kind``, at ``key``: step and block) beside the host record's."""
        if self.record is None:
            return
        self.record.coverage[size] = covered
        held = _kind(self.record, kind)
        previous = held.get(key)
        self._rows_bytes += rows.nbytes - (0 if previous is None else previous.nbytes)
        held[key] = rows

    def check(self) -> None:
        """Drop the copy when it holds more than ``max_bytes`` (after each UNet call)."""
        if self.record is not None and self._rows_bytes > self.max_bytes:
            self.record = None

    def tensors(self) -> dict[str, torch.Tensor] | None:
        """The copy as flat tensors (:meth:`ActivationRecord.to_tensors`), None if dropped."""
        return None if self.record is None else self.record.to_tensors()


class RecordingPredictor:
    """The default predictor's noise, with every step's transformer-block outputs of the
    tokens outside ``region`` (1×1×H×W, the edit's
    :attr:`~argus.worker.models.pipelines.EditStart.region`; zeros for a template run with nothing
    edited) kept in :attr:`record`, and on the device in :attr:`device_copy` while they fit
    ``device_bytes`` (0: not kept)."""

    def __init__(
        self,
        model: DiffusionModel,
        region: torch.Tensor,
        *,
        keys_values: bool = DEFAULT_KEYS_VALUES,
        dtype: torch.dtype = RECORD_DTYPE,
        device_bytes: int = 0,
    ) -> None:
        self.model = model
        self.region = region
        self.keys_values = keys_values
        self.dtype = dtype
        self.record = ActivationRecord((int(region.shape[-2]), int(region.shape[-1])))
        self.device_copy = DeviceCopy(self.record.latent_size, device_bytes)

    def __call__(
        self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scheduler: Any, step: int
    ) -> torch.Tensor:
        unet = self.model.pipeline.unet
        with recording(
            unet,
            self.record,
            step,
            self.region,
            keys_values=self.keys_values,
            dtype=self.dtype,
            on_device=self.device_copy,
        ):
            noise = self.model.predict_noise(latents, t, cond, scheduler, step)
        self.device_copy.check()
        return noise


# -- replaying -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenPlan:
    """Which tokens of one resolution a replay computes and where the rest come from."""

    size: Size
    computed: torch.Tensor  # long: indices of the computed tokens (edited or not covered)
    cached: torch.Tensor  # long: indices of the tokens taken from the record
    rows: torch.Tensor | None  # long: the cached tokens' rows in the record; None: all rows

    @property
    def tokens(self) -> int:
        return self.size[0] * self.size[1]

    @property
    def all_computed(self) -> bool:
        return int(self.computed.numel()) == self.tokens


def plan_tokens(
    region: torch.Tensor, record: ActivationRecord, device: torch.device | str = "cpu"
) -> dict[int, TokenPlan]:
    """Token count → :class:`TokenPlan` for every resolution the record covers: a token is
    computed when it is edited (in ``region``) or the record does not cover it."""
    if tuple(region.shape[-2:]) != record.latent_size:
        raise RecordMismatchError(
            f"the edit's latent is {tuple(region.shape[-2:])}, the record's {record.latent_size}"
        )
    plans = {}
    for tokens, (size, edited) in token_regions(region).items():
        covered = record.coverage.get(size)
        if covered is None:
            continue
        computed = edited | ~covered
        cached = ~computed
        rows = None if torch.equal(cached, covered) else (cached[covered]).nonzero().flatten()
        plans[tokens] = TokenPlan(
            size,
            computed.nonzero().flatten().to(device),
            cached.nonzero().flatten().to(device),
            None if rows is None else rows.to(device),
        )
    return plans


def _attend(
    attn: Any, query_in: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """softmax(QKᵀ/√d)V through ``attn``'s projections for every row's queries (batch ×
    queries × channels) against its keys and values: :func:`grouped_attend` with one group."""
    batch, count, channels = query_in.shape
    rows = RowGroup(torch.arange(batch, device=query_in.device), count, 0)
    out = grouped_attend(attn, query_in.reshape(batch * count, channels), key, value, (rows,))
    return out.view(batch, count, out.shape[-1])


def _scatter(
    full: torch.Tensor, plan: TokenPlan, computed: torch.Tensor, recorded: torch.Tensor
) -> torch.Tensor:
    """``full`` (batch × tokens × channels) with the computed rows and the recorded rows put
    in their tokens' places."""
    fill_cached(full, plan, recorded)
    if computed.shape[1]:
        full.index_copy_(1, plan.computed, computed)
    return full


def fill_cached(full: torch.Tensor, plan: TokenPlan, recorded: torch.Tensor) -> None:
    """The recorded rows put in the places of ``plan``'s cached tokens of ``full``."""
    if recorded.device != full.device:  # a host-held record for a UNet on an accelerator
        recorded = recorded.to(full.device)
    rows = recorded if plan.rows is None else recorded.index_select(1, plan.rows)
    full.index_copy_(1, plan.cached, rows.to(full.dtype))


def masked_block_forward(
    block: Any,
    hidden_states: torch.Tensor,
    plan: TokenPlan,
    cached_y: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    cached_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One ``BasicTransformerBlock`` (checked by :func:`check_block`) computed for
    ``plan.computed`` tokens only, the other tokens' outputs taken from ``cached_y`` (their
    record rows). Self-attention's keys and values cover all tokens: projected from every
    token's norm, or with ``cached_kv`` (the record's keys and values) projected for the
    computed tokens only and taken from the record for the others."""
    x = hidden_states
    x_computed = x.index_select(1, plan.computed)
    attn = block.attn1
    if cached_kv is None:
        normed = block.norm1(x)
        normed_computed = normed.index_select(1, plan.computed)
        key, value = attn.to_k(normed), attn.to_v(normed)
    else:
        normed_computed = block.norm1(x_computed)
        inner = attn.to_k.out_features
        shape = (x.shape[0], x.shape[1], inner)
        key = _scatter(x.new_empty(shape), plan, attn.to_k(normed_computed), cached_kv[0])
        value = _scatter(x.new_empty(shape), plan, attn.to_v(normed_computed), cached_kv[1])
    h = _attend(attn, normed_computed, key, value) + x_computed
    h = _after_self_attention(block, h, encoder_hidden_states, encoder_attention_mask)
    return _scatter(torch.empty_like(x), plan, h, cached_y)


def _after_self_attention(
    block: Any,
    h: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    encoder_attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """The rest of the block on the computed tokens: cross-attention then feed-forward, each
    with its norm and residual."""
    if block.attn2 is not None:
        h = (
            block.attn2(
                block.norm2(h),
                encoder_hidden_states=encoder_hidden_states,
                attention_mask=encoder_attention_mask,
            )
            + h
        )
    # diffusers' optional feed-forward chunking computes the same numbers, so it is ignored
    out: torch.Tensor = block.ff(block.norm3(h)) + h
    return out


# -- patching blocks -----------------------------------------------------------------------


@contextlib.contextmanager
def patched_forwards(
    blocks: Sequence[torch.nn.Module], forwards: Sequence[Callable[..., torch.Tensor] | None]
) -> Iterator[None]:
    """Give each block its replacement forward (None: leave it) for the ``with`` block;
    every block's own forward comes back on exit, exceptions included."""
    saved: list[tuple[torch.nn.Module, Any]] = []
    try:
        for block, forward in zip(blocks, forwards, strict=True):
            if forward is not None:
                saved.append((block, block.__dict__.get("forward")))
                block.forward = forward
        yield
    finally:
        for block, own in reversed(saved):
            if own is None:
                del block.forward
            else:
                block.forward = own


def own_forward(block: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The block's class forward, bound to it: its computation whatever a patch put on the
    instance."""
    return functools.partial(type(block).forward, block)


BlockCompute = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
"""A block's replacement computation: (hidden states, encoder hidden states, encoder mask)."""


def block_forward(compute: BlockCompute) -> Callable[..., torch.Tensor]:
    """``compute`` behind ``BasicTransformerBlock.forward``'s signature, as
    ``Transformer2DModel`` calls it; a self-attention mask or cross-attention kwargs, which the
    masked computation does not implement, raise :class:`UnsupportedBlockError`."""

    def forward(
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        timestep: Any = None,
        cross_attention_kwargs: dict[str, Any] | None = None,
        class_labels: Any = None,
        added_cond_kwargs: Any = None,
    ) -> torch.Tensor:
        if attention_mask is not None or cross_attention_kwargs:
            raise UnsupportedBlockError(
                "masked transformer block: a self-attention mask or cross_attention_kwargs "
                "is not implemented"
            )
        return compute(hidden_states, encoder_hidden_states, encoder_attention_mask)

    return forward


# -- staging rows on the device ------------------------------------------------------------

RowName = tuple[str, int]  # (kind: "y", "k" or "v"; block index)


@dataclass(frozen=True)
class StagedRows:
    """One step's recorded rows on the model's device: ``rows`` in the blocks' dtype, what the
    step's replay reads; ``resident`` in the record's dtype, what a device copy of the record
    keeps (the same tensors when the two dtypes agree)."""

    rows: dict[RowName, torch.Tensor]
    resident: dict[RowName, torch.Tensor]


class RowStager:
    """Brings a replay's recorded rows to the model's device and dtype one step ahead of the
    step that reads them (InstGenIE's bubble-free pipeline, §4.2): :meth:`stage` starts a
    step's copies, :meth:`take` hands them over, ready on the calling thread's stream.

    ``streamed`` (default: on CUDA) runs the copies on a side stream, issued by a thread of
    their own (:class:`_SideCopier`, one per device): rows on the host are copied into pinned
    memory on that thread and cross with ``non_blocking`` copies, so the compute stream and the
    Python thread launching the step wait for neither. Otherwise :meth:`stage` copies at once on
    the calling thread with plain ``.to``: the same values, nothing overlapped."""

    def __init__(
        self, device: torch.device | str, dtype: torch.dtype, *, streamed: bool | None = None
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        if streamed is None:
            streamed = self.device.type == "cuda"
        if streamed and self.device.type != "cuda":
            raise ValueError(f"streamed staging needs a CUDA device, got {self.device}")
        self.streamed = streamed
        self._pending: dict[int, StagedRows | Future[tuple[StagedRows, Any]]] = {}

    def stage(self, step: int, rows: dict[RowName, torch.Tensor]) -> None:
        """Start bringing step ``step``'s ``rows`` to the device (nothing if already started)."""
        if step in self._pending:
            return
        if self.streamed:
            self._pending[step] = _side_copier(self.device).submit(rows, self.dtype)
            return
        resident = {name: tensor.to(self.device) for name, tensor in rows.items()}
        converted = {name: tensor.to(self.dtype) for name, tensor in resident.items()}
        self._pending[step] = StagedRows(converted, resident)

    @property
    def started(self) -> list[int]:
        """The steps whose rows were staged and not yet taken, in the order they started."""
        return list(self._pending)

    def take(self, step: int, rows: dict[RowName, torch.Tensor]) -> StagedRows:
        """Step ``step``'s rows on the device, staged now if :meth:`stage` was not called for
        it. On a side stream: the current stream waits for the copies' event, and every tensor
        they made is marked used by it (``record_stream``), so the allocator does not reuse
        their memory before the step that reads them has run."""
        self.stage(step, rows)
        pending = self._pending.pop(step)
        if isinstance(pending, StagedRows):
            return pending
        staged, copied = pending.result()
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copied)
        for tensor in (*staged.rows.values(), *staged.resident.values()):
            tensor.record_stream(stream)
        return staged


class _SideCopier:
    """One CUDA device's side stream for staged rows, and the thread that issues its copies
    (the copy into pinned memory takes the host's time, which the step's launches need)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"row-stager-{device}")

    def submit(
        self, rows: dict[RowName, torch.Tensor], dtype: torch.dtype
    ) -> Future[tuple[StagedRows, Any]]:
        """Copy ``rows`` after the work queued on the calling thread's stream so far (a record
        already on the device is read after its writes), on the side stream."""
        queued = torch.cuda.Event()
        queued.record(torch.cuda.current_stream(self.device))
        return self.pool.submit(self._copy, dict(rows), dtype, queued)

    def _copy(
        self, rows: dict[RowName, torch.Tensor], dtype: torch.dtype, queued: Any
    ) -> tuple[StagedRows, Any]:
        converted: dict[RowName, torch.Tensor] = {}
        resident: dict[RowName, torch.Tensor] = {}
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(queued)
            for name, tensor in rows.items():
                resident[name] = _pinned(tensor).to(self.device, non_blocking=True)
                converted[name] = resident[name].to(dtype)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return StagedRows(converted, resident), copied


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in pinned host memory, so its transfer runs beside the compute stream: a
    copy when it is in pageable host memory (freed once its transfer is done: torch's host
    allocator waits for the transfer's stream before reusing it); itself when it is pinned, on
    a device, or when pinned memory cannot be had (its transfer then holds the thread)."""
    if tensor.device.type != "cpu" or tensor.is_pinned():
        return tensor
    try:
        pinned = torch.empty_like(tensor, pin_memory=True)
    except RuntimeError:
        log.warning("no pinned memory for staged rows: copying from pageable memory")
        return tensor
    return pinned.copy_(tensor)


_SIDE_COPIERS: dict[torch.device, _SideCopier] = {}
_SIDE_COPIERS_GUARD = threading.Lock()


def _side_copier(device: torch.device) -> _SideCopier:
    device = indexed(device)
    with _SIDE_COPIERS_GUARD:
        copier = _SIDE_COPIERS.get(device)
        if copier is None:
            copier = _SIDE_COPIERS[device] = _SideCopier(device)
        return copier


# -- replaying a record --------------------------------------------------------------------


class Replay:
    """Replays ``record`` on a UNet for edits of ``region``: :meth:`step` patches the blocks
    for one UNet call. ``use_cache`` (one bool per block, default all True) chooses, per
    block, between the cached rows and computing every token; ``keys_values`` (default: the
    record has them and :data:`DEFAULT_KEYS_VALUES`) takes self-attention's keys and values of
    the cached tokens from the record too.

    With ``stage`` (the default) a :class:`RowStager` brings each step's rows of every block
    that may replay to the UNet's device and dtype while the step before runs (the first
    step's from construction on, while the prompt is encoded); without, each block copies its
    rows when it runs. The results are the same to the bit. ``streamed`` is the stager's.
    ``collect`` stages every row of the record (every block, keys and values too) and keeps
    them, so that once every step ran :meth:`device_record` is the record on the device."""

    def __init__(
        self,
        unet: torch.nn.Module,
        record: ActivationRecord,
        region: torch.Tensor,
        *,
        use_cache: Sequence[bool] | None = None,
        keys_values: bool | None = None,
        stage: bool = True,
        streamed: bool | None = None,
        collect: bool = False,
    ) -> None:
        self.blocks = transformer_blocks(unet)
        for block in self.blocks:
            check_block(block)
        if use_cache is None:
            use_cache = [True] * len(self.blocks)
        if len(use_cache) != len(self.blocks):
            raise ValueError(f"use_cache has {len(use_cache)} entries for {len(self.blocks)}")
        self.use_cache = [bool(u) for u in use_cache]
        if keys_values is None:
            keys_values = record.keys_values and DEFAULT_KEYS_VALUES
        if keys_values and not record.keys_values:
            raise RecordMismatchError("keys and values asked for; the record has only Y")
        self.keys_values = keys_values
        self.record = record
        parameter = next(unet.parameters())
        self.plans = plan_tokens(region, record, parameter.device)
        # the plans' index tensors, as a graph takes them (static inputs beside the rows)
        self._plan_indices = {n: (p.computed, p.cached, p.rows) for n, p in self.plans.items()}
        self.steps = record.steps
        self.collect = collect
        self._needed = self._blocks_read()
        self.stager: RowStager | None = None
        if stage:
            self.stager = RowStager(parameter.device, parameter.dtype, streamed=streamed)
        self._staged: dict[int, StagedRows] = {}
        self._collected: dict[tuple[str, int, int], torch.Tensor] = {}
        # what the replayed step's Python decides beyond its tensors' shapes, so that edits
        # whose plans and rows have the same shapes (a template's mask edited again) share
        # one graph: the blocks that replay, and whether keys and values come from the record
        choice = "".join("1" if use else "0" for use in self.use_cache)
        self.graph_name = f"edit-replay:{choice}:{'kv' if keys_values else 'y'}"
        self.graphable = self.stager is not None  # graphs read the staged rows only
        self._ran_eagerly = False  # a graphed replay's first UNet call: its capture's warm-up
        self._strict = False  # while a graph captures: a row not staged is an error
        if self.stager is not None and self.steps:
            self.stager.stage(self.steps[0], self._step_rows(self.steps[0]))

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Patch the blocks for one UNet call of step ``step`` (restored on exit)."""
        with self.staged(step), patched_forwards(self.blocks, self._forwards(step)):
            yield

    def _forwards(self, step: int) -> list[Callable[..., torch.Tensor] | None]:
        """Per block, its replacement forward for step ``step`` (None: it runs as it is)."""
        return [
            self._forward(index, block, step) if use else None
            for index, (block, use) in enumerate(zip(self.blocks, self.use_cache, strict=True))
        ]

    def graphed(
        self,
        graphs: GraphedUNet,
        step: int,
        unet: torch.nn.Module,
        sample: torch.Tensor,
        t: torch.Tensor,
        embeds: torch.Tensor,
        added: dict[str, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The UNet's output for step ``step`` with the blocks replayed, from ``graphs``: the
        step's staged rows and the token plans' indices are the graph's static inputs beside
        the UNet's, so one capture serves every step, and every later edit, whose rows and
        plans have the same names and shapes (a template's mask edited again replays at once).
        Where no graph fits yet, the replay's first call runs eagerly and is the capture's
        warm-up (its kernels loaded, its shapes seen, on a graph stream whose handles the
        load's capture made), so the capture, at the next call, adds only its recording. A
        capture that fails (:class:`~argus.worker.models.cuda_graphs.GraphCaptureError`)
        turns this replay eager; the step then runs eagerly."""
        with self.staged(step):
            staged = self._staged[step]
            own_plans = self.plans

            def call(
                sample: torch.Tensor,
                timestep: torch.Tensor,
                embeds: torch.Tensor,
                added: dict[str, torch.Tensor] | None,
                rows: dict[RowName, torch.Tensor],
                plans: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
            ) -> torch.Tensor:
                # the blocks read the static rows and plans, under this step's name
                self._staged[step] = StagedRows(rows, {})
                self.plans = {
                    tokens: TokenPlan(own_plans[tokens].size, *indices)
                    for tokens, indices in plans.items()
                }
                self._strict = True
                try:
                    return self._unet_call(step, unet, sample, timestep, embeds, added)
                finally:
                    self._strict = False
                    self.plans = own_plans

            timestep = torch.as_tensor(t, device=sample.device)
            args = (sample, timestep, embeds, added, staged.rows, self._plan_indices)
            if not self._ran_eagerly and not graphs.holds(self.graph_name, *args):
                self._ran_eagerly = True
                return self._unet_call(step, unet, sample, t, embeds, added)
            self._ran_eagerly = True
            try:
                out: torch.Tensor = graphs.run(
                    self.graph_name, call, *args, work="edit-replay", warmup=0, fallback=False
                )
                return out
            except GraphCaptureError:  # logged and counted by the graphs
                self.graphable = False
                self._staged[step] = staged
                return self._unet_call(step, unet, sample, t, embeds, added)

    def _unet_call(
        self,
        step: int,
        unet: torch.nn.Module,
        sample: torch.Tensor,
        t: torch.Tensor,
        embeds: torch.Tensor,
        added: dict[str, torch.Tensor] | None,
    ) -> torch.Tensor:
        """One UNet call with the blocks patched for ``step``, reading the staged rows."""
        with patched_forwards(self.blocks, self._forwards(step)):
            return call_unet(unet, sample, t, embeds, added)

    @contextlib.contextmanager
    def staged(self, step: int) -> Iterator[None]:
        """Step ``step``'s rows on the device for the ``with`` block (one UNet call), once the
        copies started a step ahead are done; the next recorded step's copies start now, so
        they run beside this step. A :class:`~argus.worker.editing.packed_blocks.RowBlocks`."""
        if self.stager is not None:
            staged = self.stager.take(step, self._step_rows(step))
            self._staged[step] = staged
            if self.collect:
                for (kind, index), tensor in staged.resident.items():
                    self._collected[(kind, step, index)] = tensor
            following = next((s for s in self.steps if s > step), None)
            if following is not None:
                self.stager.stage(following, self._step_rows(following))
        try:
            yield
        finally:
            self._staged.pop(step, None)

    def device_record(self) -> dict[str, torch.Tensor] | None:
        """With ``collect``, once every step was staged: the record as flat tensors
        (:meth:`ActivationRecord.to_tensors`) whose rows are the copies on the UNet's device,
        in the record's dtype; else None."""
        if not self.collect:
            return None
        copy = ActivationRecord(self.record.latent_size, dict(self.record.coverage))
        for kind in ("y", "k", "v"):
            for step, index in _kind(self.record, kind):
                found = self._collected.get((kind, step, index))
                if found is None:
                    return None
                _kind(copy, kind)[(step, index)] = found
        return copy.to_tensors()

    def _blocks_read(self) -> list[bool]:
        """Per block, whether a replay may read its recorded rows: it replays, and some
        resolution with as many covered tokens as the block has rows in the record keeps
        tokens cached (its token count is known only when it runs)."""
        plans_by_rows: dict[int, list[TokenPlan]] = {}
        for plan in self.plans.values():
            rows = int(self.record.coverage[plan.size].sum())
            plans_by_rows.setdefault(rows, []).append(plan)
        first = self.steps[0] if self.steps else None
        needed = []
        for index, use in enumerate(self.use_cache):
            found = self.record.outputs.get((first, index)) if first is not None else None
            plans = plans_by_rows.get(int(found.shape[1]), []) if found is not None else []
            needed.append(use and (not plans or any(not p.all_computed for p in plans)))
        return needed

    def _step_rows(self, step: int) -> dict[RowName, torch.Tensor]:
        """The record's rows of ``step`` that the stager brings: those of the blocks that may
        replay (with their keys and values when replayed too), or every row with ``collect``."""
        kinds = ("y", "k", "v") if self.keys_values or self.collect else ("y",)
        rows = {}
        for index in range(len(self.blocks)):
            if not (self.collect or self._needed[index]):
                continue
            for kind in kinds:
                found = _kind(self.record, kind).get((step, index))
                if found is not None:
                    rows[(kind, index)] = found
        return rows

    def _rows(self, kind: str, step: int, index: int) -> torch.Tensor:
        """Block ``index``'s recorded rows of ``kind`` at ``step``: as staged on the device,
        or the record's own."""
        staged = self._staged.get(step)
        found = None if staged is None else staged.rows.get((kind, index))
        if found is None and self._strict:  # a graph would hold the host tensor as a constant
            raise GraphCaptureError(f"block {index}'s {kind} rows of step {step} are not staged")
        return _kind(self.record, kind)[(step, index)] if found is None else found

    def _forward(self, index: int, block: Any, step: int) -> Callable[..., torch.Tensor]:
        own = own_forward(block)

        def forward(
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor | None,
            encoder_attention_mask: torch.Tensor | None,
        ) -> torch.Tensor:
            found = self.replay(index, step, hidden_states.shape[1], hidden_states.shape[0])
            if found is None:  # nothing to take from the record: the block's own forward
                computed: torch.Tensor = own(
                    hidden_states,
                    encoder_hidden_states=encoder_hidden_states,
                    encoder_attention_mask=encoder_attention_mask,
                )
                return computed
            plan, cached_y = found
            kv = None
            if self.keys_values:
                kv = (self._rows("k", step, index), self._rows("v", step, index))
            return masked_block_forward(
                block,
                hidden_states,
                plan,
                cached_y,
                encoder_hidden_states,
                encoder_attention_mask,
                kv,
            )

        return block_forward(forward)

    def replay(
        self, index: int, step: int, tokens: int, rows: int
    ) -> tuple[TokenPlan, torch.Tensor] | None:
        """Block ``index`` of step ``step`` at ``tokens`` tokens on ``rows`` rows: its token
        plan and recorded output rows (staged on the device when :meth:`staged` brought them),
        or None when the block computes every token (Algorithm 1 chose so, or the record
        covers nothing the edit keeps); :class:`RecordMismatchError` when the record does not
        fit. A :class:`~argus.worker.editing.packed_blocks.RowBlocks`."""
        if not self.use_cache[index]:
            return None
        plan = self.plans.get(tokens)
        if plan is None:
            raise RecordMismatchError(
                f"block {index}: the record covers no resolution of {tokens} tokens"
            )
        if plan.all_computed:
            return None
        key = (step, index)
        if key not in self.record.outputs:
            raise RecordMismatchError(f"the record has no step {step} block {index}")
        cached_y = self._rows("y", step, index)
        if cached_y.shape[0] != rows:
            raise RecordMismatchError(
                f"the record's batch is {cached_y.shape[0]} (CFG branches), this run's {rows}"
            )
        return plan, cached_y

    def keep(self, index: int, step: int, output: torch.Tensor) -> None:
        """A block computed in full keeps nothing of a replay (a
        :class:`~argus.worker.editing.packed_blocks.RowBlocks`)."""


class ReplayPredictor:
    """The default predictor's noise with the transformer blocks replayed from ``record``
    for an edit of ``region`` (:class:`Replay`, which takes the other keywords)."""

    def __init__(
        self,
        model: DiffusionModel,
        record: ActivationRecord,
        region: torch.Tensor,
        *,
        use_cache: Sequence[bool] | None = None,
        keys_values: bool | None = None,
        stage: bool = True,
        streamed: bool | None = None,
        collect: bool = False,
    ) -> None:
        self.model = model
        self.replay = Replay(
            model.pipeline.unet,
            record,
            region,
            use_cache=use_cache,
            keys_values=keys_values,
            stage=stage,
            streamed=streamed,
            collect=collect,
        )

    def __call__(
        self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scheduler: Any, step: int
    ) -> torch.Tensor:
        graphs = self.model.graphs
        if graphs is None or not self.replay.graphable:
            with self.replay.step(step):
                return self.model.predict_noise(latents, t, cond, scheduler, step)
        graphed = functools.partial(self.replay.graphed, graphs, step, self.model.pipeline.unet)
        return self.model.predict_noise(latents, t, cond, scheduler, step, unet=graphed)


# -- attention over groups of rows ---------------------------------------------------------


@dataclass(frozen=True)
class RowGroup:
    """Batch rows that compute the same number of tokens: one attention call between them.
    Their tokens are ``count`` consecutive packed tokens a row, from ``start``."""

    rows: torch.Tensor  # long: the rows, in packed order
    count: int
    start: int


def grouped_attend(
    attn: Any,
    query_in: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    groups: Sequence[RowGroup],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``attn`` with the operations of diffusers' ``AttnProcessor2_0`` (so all tokens computed
    give its very numbers) for packed queries: the query and output projections once for all
    packed tokens, softmax(QKᵀ/√d)V per group of rows against each row's ``key`` and ``value``
    (batch × length × inner, projected)."""
    query = attn.to_q(query_in)
    length, inner = key.shape[1:]
    heads = attn.heads
    head_dim = inner // heads
    out = torch.empty(query.shape[0], inner, dtype=query.dtype, device=query.device)
    for group in groups:
        size = int(group.rows.numel())
        span = slice(group.start, group.start + size * group.count)
        q = query[span].view(size, group.count, heads, head_dim).transpose(1, 2)
        k = _group_rows(key, group).view(size, length, heads, head_dim).transpose(1, 2)
        v = _group_rows(value, group).view(size, length, heads, head_dim).transpose(1, 2)
        mask = None
        if attention_mask is not None:
            mask = attn.prepare_attention_mask(_group_rows(attention_mask, group), length, size)
            mask = mask.view(size, heads, -1, length)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        out[span] = o.transpose(1, 2).reshape(size * group.count, inner).to(query.dtype)
    projected: torch.Tensor = attn.to_out[1](attn.to_out[0](out))
    return projected


def _group_rows(tensor: torch.Tensor, group: RowGroup) -> torch.Tensor:
    """The group's rows of ``tensor`` (itself when the group is every row, in order)."""
    if int(group.rows.numel()) == tensor.shape[0]:  # rows are kept in order: no copy
        return tensor
    return tensor.index_select(0, group.rows)
