"""UNet work replayed from CUDA graphs: the launch cost of eager PyTorch taken off the host.

Run eagerly, a UNet step can leave the GPU waiting for the Python process to launch its kernels
(``docs/gpu.md`` measures a guided SDXL step at 1024 px both ways on an H200).
:class:`GraphedUNet` captures a piece of UNet work once per input signature and replays it
afterwards: each call copies its inputs into the graph's static tensors, replays, and hands
back copies of the outputs. A piece of work is a function of tensors (nested in tuples, lists,
dicts or registered dataclasses) named by the caller; the signature is that name, the nesting,
every tensor's shape, dtype and device, and the value of every other leaf (a flag such as
"the latent size is odd" is part of what was captured). The worker graphs:

* the UNet's forward (:meth:`GraphedUNet.__call__`): plain runs and LoRA runs of
  :meth:`~argus.worker.models.pipelines.DiffusionModel.denoise`, and batched steps of the step
  batcher when no request in the batch brings its own transformer blocks;
* a step with ControlNets: ControlNets and UNet in one graph (synchronous, on the UNet's GPU),
  else the UNet's down and mid blocks, then its up blocks with the residuals as static inputs;
* an edit replaying a template (:class:`~argus.worker.editing.masked_blocks.Replay`): the
  patched UNet, staged rows and token plans as static inputs, shared by edits of their shapes.

What a graph cannot do, and what the worker does about it:

* Python inside the captured work does not run on replay, so the cancellation checkpoints
  inside the UNet are not heard: a request is stopped between steps (and, with ControlNet,
  between the halves of a step). The checkpoints stay silent while a capture records.
* Weights must stay where they were at capture. LoRA merges into the weights in place and
  restores them with ``copy_`` (:mod:`argus.worker.adapters.lora.patch`), so a replay computes
  with whatever the weights hold at that moment: a LoRA run replays the base model's graph.
* A graph keeps the activations of its signature in a memory pool. All graphs of one UNet
  share one pool, and at most ``max_graphs`` are kept (least recently used leaves first), so a
  worker serving several sizes holds a bounded number of them. Sharing is safe because outputs
  are copied out right after a replay: one graph's replay may overwrite what another graph
  left in the pool, never what a caller holds.

A capture (``warmup`` eager calls and the recording, on one stream of the UNet's own, so the
per-stream cuBLAS handle a recording cannot create is made by the first warm-up) is paid once
per signature and reported through ``on_capture(name, seconds)``; work that just ran eagerly
at its shapes (an edit's first step) captures with ``warmup=0``. On by default on CUDA
devices (``--cuda-graphs``), off elsewhere. ``capture="eager"`` is the CPU tests' stand-in:
the same static buffers, keys and eviction, with the function re-run instead of a replay.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

GraphKey = tuple[Any, ...]
CAPTURES = ("cuda", "eager")


class GraphCaptureError(RuntimeError):
    """The recording of a graph failed (the work does something a graph cannot hold, such as
    a host sync); the eager warm-up calls before it ran. The caller may run the work eagerly."""


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph, or None for the eager stand-in
    fn: Callable[..., Any]
    inputs: list[Any]  # the flattened static inputs (tensors cloned at capture)
    in_spec: Any
    outputs: list[Any]  # the flattened static outputs
    out_spec: Any


class GraphedUNet:
    """A UNet's work, captured per signature and replayed (see the module docstring).

    ``__call__(sample, t, embeds, added)`` returns what ``unet(sample, t,
    encoder_hidden_states=embeds, added_cond_kwargs=added, return_dict=False)[0]`` returns;
    :meth:`run` replays any other function of tensors. Not thread-safe by itself: the model's
    lock serialises its steps, and a lock here guards the table against a concurrent
    :meth:`clear`."""

    def __init__(
        self,
        unet: torch.nn.Module,
        max_graphs: int = 4,
        warmup: int = 2,
        *,
        capture: str = "cuda",
        on_capture: Callable[[str, float], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs {max_graphs}: at least 1")
        if capture not in CAPTURES:
            raise ValueError(f"capture {capture!r}: expected one of {', '.join(CAPTURES)}")
        device = next(unet.parameters()).device
        if capture == "cuda" and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the UNet is on {device}")
        self.unet = unet
        self._forward = functools.partial(call_unet, unet)
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.capture = capture
        self.on_capture = on_capture
        self.on_failure = on_failure
        self.captures = 0
        self.failures = 0
        self.pool_bytes = 0  # device memory the graphs' pool holds (measured after a capture)
        self.capture_s = 0.0  # seconds spent capturing, all signatures together
        self.replays = 0
        self._graphs: OrderedDict[GraphKey, _Captured] = OrderedDict()
        self._eager: set[GraphKey] = set()  # signatures whose capture failed: run eagerly
        self._pool = torch.cuda.graph_pool_handle() if capture == "cuda" else None
        # warm-ups and recordings: one stream, so its cuBLAS handle is made once, eagerly
        self._stream = torch.cuda.Stream(device) if capture == "cuda" else None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(
        self,
        sample: torch.Tensor,
        t: torch.Tensor | float,
        embeds: torch.Tensor,
        added: dict[str, torch.Tensor] | None,
    ) -> torch.Tensor:
        timestep = torch.as_tensor(t, device=sample.device)
        out: torch.Tensor = self.run("unet", self._forward, sample, timestep, embeds, added)
        return out

    def run(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        work: str | None = None,
        warmup: int | None = None,
        fallback: bool = True,
    ) -> Any:
        """``fn(*args)``, from the graph captured for ``name`` and ``args``' signature (captured
        now if there is none). ``fn`` must read nothing but its arguments, the UNet's weights
        and tensors that outlive the graph, and must do the same work whenever the signature
        is the same. ``work`` (default ``name``) is what ``on_capture`` hears: a kind of work,
        where ``name`` may name one request's. ``warmup`` (default the instance's) is the
        eager calls a capture makes first. A capture that fails (:class:`GraphCaptureError`)
        is logged, reported through ``on_failure(work)``, and with ``fallback`` (the default)
        that signature runs ``fn`` eagerly from then on; without, the error is raised."""
        leaves, in_spec = pytree.tree_flatten(args)
        key = _graph_key(name, leaves, in_spec)
        with self._lock:
            captured = self._graphs.get(key)
            if captured is not None:
                self._graphs.move_to_end(key)
            elif key not in self._eager:
                warm = self.warmup if warmup is None else warmup
                try:
                    captured = self._capture(key, work or name, fn, leaves, in_spec, warm)
                except GraphCaptureError as err:
                    self._failed(key, work or name, err, remember=fallback)
                    if not fallback:
                        raise
            if captured is not None:
                for static, given in zip(captured.inputs, leaves, strict=True):
                    if isinstance(static, torch.Tensor):
                        static.copy_(given)
                self._replay(captured)
                self.replays += 1
                fresh = [o.clone() if isinstance(o, torch.Tensor) else o for o in captured.outputs]
                return pytree.tree_unflatten(fresh, captured.out_spec)
        return fn(*args)  # this signature's capture failed: it runs eagerly

    def holds(self, name: str, *args: Any) -> bool:
        """Whether a graph for ``name`` and ``args``' signature is captured (:meth:`run` would
        replay it rather than capture)."""
        leaves, in_spec = pytree.tree_flatten(args)
        key = _graph_key(name, leaves, in_spec)
        with self._lock:
            return key in self._graphs

    def _measure_pool(self) -> int:
        """The bytes of the segments the CUDA caching allocator gave the graphs' pool (0 for
        the eager stand-in, or where the allocator's snapshot cannot be read)."""
        if self._pool is None:
            return 0
        try:
            segments = torch.cuda.memory_snapshot()
        except Exception:  # a snapshot is a diagnostic: its absence must not fail a capture
            log.debug("no allocator snapshot: the graphs' pool is not measured", exc_info=True)
            return self.pool_bytes
        return pool_bytes(segments, self._pool)

    def _failed(self, key: GraphKey, work: str, err: Exception, *, remember: bool) -> None:
        self.failures += 1
        if remember:
            self._eager.add(key)
        log.warning("CUDA graph of %s not captured (%s); it runs eagerly", work, err)
        if self.on_failure is not None:
            self.on_failure(work)

    def clear(self) -> None:
        """Drop every graph (their memory goes back to the pool)."""
        with self._lock:
            self._graphs.clear()

    def _replay(self, captured: _Captured) -> None:
        if captured.graph is not None:
            captured.graph.replay()
            return
        # the eager stand-in: the function on the static inputs, into the static outputs
        args = pytree.tree_unflatten(captured.inputs, captured.in_spec)
        values = pytree.tree_leaves(captured.fn(*args))
        for static, value in zip(captured.outputs, values, strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(value)

    def _capture(
        self,
        key: GraphKey,
        name: str,
        fn: Callable[..., Any],
        leaves: list[Any],
        in_spec: Any,
        warmup: int,
    ) -> _Captured:
        began = time.perf_counter()
        inputs = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        args = pytree.tree_unflatten(inputs, in_spec)
        graph = None
        if self.capture == "cuda":
            # warm-up off the current stream, as PyTorch's capture recipe asks (lazy init,
            # autotuning), on the stream the recording then uses
            stream = self._stream
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread-local: the worker's other threads keep using CUDA on their own
                # streams while this one records (the edit's row stager allocating pinned and
                # device memory, the cache writer copying results out), as they may; "global"
                # would fail their calls and void the recording
                with torch.cuda.graph(
                    graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"
                ):
                    out = fn(*args)
                torch.cuda.synchronize()
            except Exception as err:
                raise GraphCaptureError(f"capturing {name}: {err}") from err
        else:
            out = fn(*args)
        outputs, out_spec = pytree.tree_flatten(out)
        captured = _Captured(graph, fn, inputs, in_spec, outputs, out_spec)
        self._graphs[key] = captured
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        self.pool_bytes = self._measure_pool()
        seconds = time.perf_counter() - began
        self.captures += 1
        self.capture_s += seconds
        if self.on_capture is not None:
            self.on_capture(name, seconds)
        return captured


def call_unet(
    unet: Any,
    sample: torch.Tensor,
    t: torch.Tensor | float,
    embeds: torch.Tensor,
    added: dict[str, torch.Tensor] | None,
) -> torch.Tensor:
    """``unet``'s noise prediction: diffusers' keyword call, spelled as
    :data:`~argus.worker.models.pipelines.UNetCall` takes it once ``unet`` is bound (the eager
    forward of plain runs, step batches, edit replays and graphs)."""
    out: torch.Tensor = unet(
        sample, t, encoder_hidden_states=embeds, added_cond_kwargs=added, return_dict=False
    )[0]
    return out


def pool_bytes(segments: Any, pool: Any) -> int:
    """The bytes of the allocator ``segments`` (``torch.cuda.memory_snapshot()``'s) that belong
    to memory pool ``pool`` (``torch.cuda.graph_pool_handle()``'s)."""
    want = tuple(pool)
    return sum(
        int(segment.get("total_size", 0))
        for segment in segments
        if tuple(segment.get("segment_pool_id", ())) == want
    )


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: "cuda" alone is the current GPU."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def capturing() -> bool:
    """True while the current CUDA stream records a graph (Python checks must stay silent)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _graph_key(name: str, leaves: list[Any], in_spec: Any) -> GraphKey:
    return (name, str(in_spec), *(_leaf_key(leaf) for leaf in leaves))


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device)
    return (type(leaf).__name__, leaf)
