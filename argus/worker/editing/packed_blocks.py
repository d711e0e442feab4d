"""The mask-aware activation cache inside a batched UNet call: several requests' transformer
blocks on packed tokens.

The step batcher (:mod:`argus.worker.editing.step_batch`) runs several requests' rows in one
UNet call. Each request may bring its own transformer blocks (a :class:`RowBlocks`): a replay
of its template's record (:class:`~argus.worker.editing.masked_blocks.Replay`), which computes
its region's tokens only, or a recording (:class:`RowRecorder`), which computes every token
and keeps the rows outside its region. :func:`batched_blocks` patches every block for one such
call, whose rows are a list of :class:`RowPart`\\ s:

* a block no request replays runs its own forward on the whole batch (a recording keeps its
  rows of the output);
* a block some request replays runs once for all rows on *packed* tokens
  (:func:`packed_block_forward`): each replaying request computes its region's tokens, each
  other request all its tokens, with no padding, and the replayed tokens' recorded rows are
  filled in after. So a step costs the sum of its edits' work, as the cost model prices it.

Around the call each request's blocks are entered (:meth:`RowBlocks.staged`): a replay's rows
of the step are on the device by then, staged while the step before ran, and the next step's
start. Rows that compute the same number of tokens attend in one call
(:func:`~argus.worker.editing.masked_blocks.grouped_attend`); a row's queries meet its own
keys and values, or its own prompt. Everything outside the blocks (convolutions, ResNets, the
time embedding) runs on the whole batch. Patches are restored on exit, exceptions included.
One request's record and replay, alone in its UNet call, are
:mod:`argus.worker.editing.masked_blocks`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from argus.worker.editing.masked_blocks import (
    RECORD_DTYPE,
    ActivationRecord,
    DeviceCopy,
    RowGroup,
    TokenPlan,
    UnsupportedBlockError,
    block_forward,
    fill_cached,
    grouped_attend,
    own_forward,
    patched_forwards,
    token_level,
    token_regions,
)


class RowBlocks(Protocol):
    """One request's transformer blocks inside a batched UNet call (the step batcher,
    :mod:`argus.worker.editing.step_batch`): per block and step of the request, whether it replays
    (:meth:`replay`: its token plan and recorded rows) or computes every token, what it
    keeps of a block computed in full (:meth:`keep`: a recording), and what it needs around
    the UNet call (:meth:`staged`: a replay's rows brought to the device, the next step's
    started)."""

    def replay(
        self, index: int, step: int, tokens: int, rows: int
    ) -> tuple[TokenPlan, torch.Tensor] | None: ...

    def keep(self, index: int, step: int, output: torch.Tensor) -> None: ...

    def staged(self, step: int) -> contextlib.AbstractContextManager[None]: ...


class RowRecorder:
    """A recording run inside a batch: each block computed in full, its output for the tokens
    outside ``region`` kept in :attr:`record` (Y only), as :func:`recording` keeps them for a
    run alone, and on the device in :attr:`device_copy` while they fit ``device_bytes`` (0:
    not kept)."""

    def __init__(
        self, region: torch.Tensor, *, dtype: torch.dtype = RECORD_DTYPE, device_bytes: int = 0
    ) -> None:
        self.region = region
        self.dtype = dtype
        self.record = ActivationRecord((int(region.shape[-2]), int(region.shape[-1])))
        self.device_copy = DeviceCopy(self.record.latent_size, device_bytes)
        self._levels = token_regions(region)

    def replay(
        self, index: int, step: int, tokens: int, rows: int
    ) -> tuple[TokenPlan, torch.Tensor] | None:
        return None

    def keep(self, index: int, step: int, output: torch.Tensor) -> None:
        size, edited = token_level(self._levels, output.shape[1])
        covered = ~edited
        self.record.coverage[size] = covered
        index_rows = covered.nonzero().flatten().to(output.device)
        rows = output.index_select(1, index_rows).to(self.dtype)
        self.record.outputs[(step, index)] = rows.to("cpu")
        self.device_copy.add("y", (step, index), size, covered, rows)

    @contextlib.contextmanager
    def staged(self, step: int) -> Iterator[None]:
        """Nothing to bring to the device; after the UNet call the device copy is checked
        against its bound."""
        try:
            yield
        finally:
            self.device_copy.check()


@dataclass(frozen=True)
class RowPart:
    """One request's share of a batched UNet call: its rows (in joining order), its blocks
    (None: every block in full, nothing kept) and the index of the step it is at."""

    rows: int
    blocks: RowBlocks | None
    step: int


@contextlib.contextmanager
def batched_blocks(blocks: Sequence[torch.nn.Module], parts: Sequence[RowPart]) -> Iterator[None]:
    """Patch every transformer block for one batched UNet call whose rows are ``parts``, in
    order. A block that no request replays runs its own forward on the whole batch (a
    recording keeps its rows of the output); a block that some request replays runs once for
    all rows on packed tokens (:func:`packed_block_forward`): each replaying request computes
    its region's tokens only, each other request all its tokens, with no padding, so a step
    costs the sum of its edits' work, as the cost model prices it. Everything outside the
    blocks (convolutions, ResNets, the time embedding) runs on the whole batch. Restored on
    exit, exceptions included. Each part's :meth:`RowBlocks.staged` is entered around the call
    (a replay's rows staged on the device a step ahead)."""
    rows = _PartRows(parts)
    forwards = [_batched_forward(index, block, parts, rows) for index, block in enumerate(blocks)]
    with contextlib.ExitStack() as around:
        for part in parts:  # each replay's rows of this step on the device, the next started
            if part.blocks is not None:
                around.enter_context(part.blocks.staged(part.step))
        with patched_forwards(blocks, forwards):
            yield


@dataclass(frozen=True)
class _Packing:
    """Where each row's computed tokens sit among the packed tokens of one block call."""

    index: torch.Tensor  # long: flat (row · tokens + token) index of every packed token
    groups: tuple[RowGroup, ...]


class _PartRows:
    """Per UNet call, the batch's row offsets and the packings its blocks ask for: made once
    per set of plans (the blocks of one call share a few), as index tensors on the step's
    device (on a GPU each new one is a copy to the device)."""

    def __init__(self, parts: Sequence[RowPart]) -> None:
        self.starts = [0]
        for part in parts:
            self.starts.append(self.starts[-1] + part.rows)
        self._made: dict[tuple[Any, ...], _Packing] = {}

    def packing(self, plans: Sequence[TokenPlan | None], tokens: int, device: Any) -> _Packing:
        """The packing for the parts' ``plans`` (None: the part computes every token)."""
        key = (tokens, tuple(id(plan) for plan in plans), device)
        found = self._made.get(key)
        if found is None:
            found = self._made[key] = self._pack(plans, tokens, device)
        return found

    def _pack(self, plans: Sequence[TokenPlan | None], tokens: int, device: Any) -> _Packing:
        every = torch.arange(tokens, device=device)
        by_count: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for k, plan in enumerate(plans):
            computed = every if plan is None else plan.computed.to(device)
            for row in range(self.starts[k], self.starts[k + 1]):
                by_count.setdefault(int(computed.numel()), []).append((row, computed))
        pieces: list[torch.Tensor] = []
        groups = []
        start = 0
        for count, members in by_count.items():
            rows = [row for row, _ in members]
            groups.append(
                RowGroup(torch.tensor(rows, dtype=torch.long, device=device), count, start)
            )
            pieces.extend(row * tokens + computed for row, computed in members)
            start += count * len(rows)
        return _Packing(torch.cat(pieces), tuple(groups))


def _batched_forward(
    index: int, block: Any, parts: Sequence[RowPart], part_rows: _PartRows
) -> Callable[..., torch.Tensor]:
    own = own_forward(block)
    starts = part_rows.starts

    def forward(
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        tokens = hidden_states.shape[1]
        found = [
            None if part.blocks is None else part.blocks.replay(index, part.step, tokens, part.rows)
            for part in parts
        ]
        full = [k for k, replay in enumerate(found) if replay is None]
        if len(full) == len(parts):
            output: torch.Tensor = own(
                hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=encoder_attention_mask,
            )
        else:
            plans = [None if replay is None else replay[0] for replay in found]
            packing = part_rows.packing(plans, tokens, hidden_states.device)
            output = packed_block_forward(
                block, hidden_states, packing, encoder_hidden_states, encoder_attention_mask
            )
            for k, replay in enumerate(found):  # the replayed tokens' recorded rows
                if replay is not None:
                    fill_cached(output[starts[k] : starts[k + 1]], *replay)
        _keep(parts, starts, full, index, output)
        return output

    return block_forward(forward)


def _keep(
    parts: Sequence[RowPart],
    starts: Sequence[int],
    full: Sequence[int],
    index: int,
    output: torch.Tensor,
) -> None:
    """Each fully computed part with blocks of its own keeps what it wants of its rows."""
    for k in full:
        part = parts[k]
        if part.blocks is not None:
            part.blocks.keep(index, part.step, output[starts[k] : starts[k + 1]])


def packed_block_forward(
    block: Any,
    hidden_states: torch.Tensor,
    packing: _Packing,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One ``BasicTransformerBlock`` (checked by :func:`check_block`) for a batch whose rows
    compute different tokens: ``packing`` lists every row's computed tokens (all of them for a
    row computed in full). Self-attention's keys and values are projected from every token of
    every row; queries, both attentions' output projections, the norms, the feed-forward and
    the residuals run once on the computed tokens of all rows packed together (no padding);
    each attention runs per group of rows with as many computed tokens (queries against the
    row's own keys or its own prompt). Returns batch × tokens × channels with the computed
    tokens written; the others are left for the caller to fill from the records."""
    x = hidden_states
    batch, tokens, channels = x.shape
    flat = x.reshape(batch * tokens, channels)
    x_packed = flat.index_select(0, packing.index)
    attn = block.attn1
    normed = block.norm1(x)
    query_in = normed.reshape(batch * tokens, channels).index_select(0, packing.index)
    key, value = attn.to_k(normed), attn.to_v(normed)
    h = grouped_attend(attn, query_in, key, value, packing.groups) + x_packed
    if block.attn2 is not None:
        if encoder_hidden_states is None:  # the UNets served always give the prompt
            raise UnsupportedBlockError(
                "masked transformer block: cross-attention without encoder hidden states"
            )
        cross_attn = block.attn2
        cross = grouped_attend(
            cross_attn,
            block.norm2(h),
            cross_attn.to_k(encoder_hidden_states),
            cross_attn.to_v(encoder_hidden_states),
            packing.groups,
            encoder_attention_mask,
        )
        h = cross + h
    h = block.ff(block.norm3(h)) + h
    output = x.new_empty(batch, tokens, channels)  # contiguous, whatever x's strides
    output.view(batch * tokens, channels).index_copy_(0, packing.index, h)
    return output
