"""The UNet step replayed from CUDA graphs: the launch cost of eager PyTorch taken off the host.

Run eagerly, a UNet step can leave the GPU waiting for the Python process to launch its kernels
(``docs/gpu.md`` measures a guided SDXL step at 1024 px both ways on an H200).
:class:`GraphedUNet` captures the UNet's forward once per input shape (latent size, CFG rows,
text length, dtype) and replays it afterwards: each step copies its inputs into the graph's
static tensors, replays, and hands back a copy of the output.

What a graph cannot do, and what the worker does about it:

* Python inside the UNet does not run on replay, so the cancellation checkpoints inside the
  UNet (``install_checkpoints``) are not heard: a request is stopped between steps only.
* Weights must stay where they were at capture. LoRA's in-place merge, ControlNet residuals
  and the edit cache's replay change what a step computes, so
  :meth:`~argus.worker.models.pipelines.DiffusionModel.denoise` uses the graph only for a plain
  request (no predictor, no step-start callbacks).
* A graph keeps the activations of its shape in a memory pool. All graphs of one UNet share
  one pool, and at most ``max_graphs`` are kept (least recently used leaves first), so a
  worker serving several sizes holds a bounded number of them. Sharing is safe because a
  step's output is copied out right after its replay: one graph's replay may overwrite what
  another graph left in the pool, never what a caller still holds.

Off by default (``argus worker --cuda-graphs``); CUDA devices only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

GraphKey = tuple[Any, ...]


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    sample: torch.Tensor
    timestep: torch.Tensor
    embeds: torch.Tensor
    added: dict[str, torch.Tensor] | None
    out: torch.Tensor


class GraphedUNet:
    """A UNet's forward, captured per input shape and replayed (see the module docstring).

    ``__call__(sample, t, embeds, added)`` returns what ``unet(sample, t,
    encoder_hidden_states=embeds, added_cond_kwargs=added, return_dict=False)[0]`` returns.
    Not thread-safe by itself: the model's lock serialises its steps, and a lock here guards
    the table against a concurrent :meth:`clear`."""

    def __init__(self, unet: torch.nn.Module, max_graphs: int = 4, warmup: int = 2) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs {max_graphs}: at least 1")
        device = next(unet.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the UNet is on {device}")
        self.unet = unet
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.captures = 0
        self.replays = 0
        self._graphs: OrderedDict[GraphKey, _Captured] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle()
        self._lock = threading.Lock()

    @staticmethod
    def key(
        sample: torch.Tensor, embeds: torch.Tensor, added: dict[str, torch.Tensor] | None
    ) -> GraphKey:
        shapes = tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in (added or {}).items()))
        return (tuple(sample.shape), sample.dtype, tuple(embeds.shape), embeds.dtype, shapes)

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
        key = self.key(sample, embeds, added)
        with self._lock:
            captured = self._graphs.get(key)
            if captured is None:
                captured = self._capture(key, sample, timestep, embeds, added)
            else:
                self._graphs.move_to_end(key)
            captured.sample.copy_(sample)
            captured.timestep.copy_(timestep.to(captured.timestep.dtype))
            captured.embeds.copy_(embeds)
            if added is not None and captured.added is not None:
                for name, value in added.items():
                    captured.added[name].copy_(value)
            captured.graph.replay()
            self.replays += 1
            return captured.out.clone()

    def clear(self) -> None:
        """Drop every graph (their memory goes back to the pool)."""
        with self._lock:
            self._graphs.clear()

    def _forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        embeds: torch.Tensor,
        added: dict[str, torch.Tensor] | None,
    ) -> torch.Tensor:
        out: torch.Tensor = self.unet(
            sample,
            timestep,
            encoder_hidden_states=embeds,
            added_cond_kwargs=added,
            return_dict=False,
        )[0]
        return out

    def _capture(
        self,
        key: GraphKey,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        embeds: torch.Tensor,
        added: dict[str, torch.Tensor] | None,
    ) -> _Captured:
        static_sample = sample.clone()
        static_t = timestep.clone()
        static_embeds = embeds.clone()
        static_added = None if added is None else {k: v.clone() for k, v in added.items()}
        # warm-up on a side stream, as PyTorch's capture recipe asks (lazy init, autotuning)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self._forward(static_sample, static_t, static_embeds, static_added)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(static_sample, static_t, static_embeds, static_added)
        captured = _Captured(graph, static_sample, static_t, static_embeds, static_added, out)
        self._graphs[key] = captured
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return captured
