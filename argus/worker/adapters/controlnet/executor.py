"""Running a request's ControlNets: sessions, the executor interface, the in-process executor.

A *session* is one request's denoising run. It is opened once with everything that does not
change between steps (the ControlNets and their scales, the control images, the text
conditioning) and then asked for residuals once per step with the step's UNet input and
timestep. Control images are therefore decoded once per request, not once per step, and the
text embeddings cross a network once.

Two executors implement :class:`ControlNetExecutor`:

* :class:`LocalControlNetExecutor` runs the ControlNets in this process, on any device (a
  second GPU, as in Katz §5, or the worker's own), from a :class:`~.cache.ModelCache`;
* :class:`~argus.worker.adapters.controlnet.client.RemoteControlNetExecutor` sends the same session
  to the shared ControlNet service, whose servicer runs a :class:`LocalControlNetExecutor`.

The service and a worker's local executor thus run the same validation and the same
ControlNet code; the remote one only adds the transport.

A session's ControlNets run one after the other on its device and their residuals are
summed in request order, exactly as diffusers' ``MultiControlNetModel`` does, so a
synchronous run reproduces diffusers' images. The session's residuals come from a thread of
its own (:meth:`LocalSession.submit`), which is what lets the base UNet's down and mid blocks
run at the same time. Where that overlap happens depends on the device: on a second GPU
(Katz's layout) or in the service the two run truly in parallel; on the worker's own GPU
both threads issue to the device's default stream, so the results are the same but the
kernels take turns; on a CPU they share the cores.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from argus.contracts.controlnet import ControlUnit, ExecutorStats, OpenInfo
from argus.worker.adapters.controlnet.cache import Lease, ModelCache, Policy
from argus.worker.adapters.controlnet.errors import (
    ControlNetBusyError,
    ControlNetError,
    InvalidControlNetRequest,
)
from argus.worker.adapters.controlnet.models import (
    VAE_SCALE_FACTOR,
    ControlNetCatalog,
    check_size,
    estimate_bytes,
    load_entry,
    model_bytes,
    prepare_control_image,
)
from argus.worker.adapters.controlnet.unet_split import Residuals, sum_residuals

MAX_CONTROLNETS = 8  # per request; production requests use 1–3 (Katz Table 1)


@dataclass(frozen=True)
class SessionSpec:
    """What stays fixed over a request's steps; the text conditioning has CFG branches stacked."""

    family: str  # the base UNet's family, "sd15" or "sdxl"
    height: int  # pixels; the control images are resized to it
    width: int
    units: tuple[ControlUnit, ...]
    encoder_hidden_states: torch.Tensor  # (batch, tokens, cross_attention_dim)
    text_embeds: torch.Tensor | None = None  # SDXL: (batch, pooled dim)
    time_ids: torch.Tensor | None = None  # SDXL: (batch, 6)
    request_id: str = ""


class ControlNetSession(Protocol):
    """One request's ControlNets; residuals come back in the order steps were submitted."""

    info: OpenInfo

    def submit(self, step: int, sample: torch.Tensor, timestep: torch.Tensor) -> Future[Residuals]:
        """Start the ControlNets on one step's UNet input; the future holds the residuals."""
        ...

    def close(self) -> None: ...


class ControlNetExecutor(Protocol):
    """Where sessions run: in this process, or in the ControlNet service."""

    def open(self, spec: SessionSpec) -> ControlNetSession:
        """Validate the request, load its ControlNets, decode its images; raise on bad input."""
        ...

    def close(self) -> None: ...


# -- validation shared by the local executor and the service --------------------------------


def check_units(units: Sequence[ControlUnit]) -> None:
    if not units:
        raise InvalidControlNetRequest("controlnets", "no ControlNet given")
    if len(units) > MAX_CONTROLNETS:
        raise InvalidControlNetRequest(
            "controlnets", f"{len(units)} ControlNets, at most {MAX_CONTROLNETS} per request"
        )
    for i, unit in enumerate(units):
        if not unit.name:
            raise InvalidControlNetRequest(f"controlnets[{i}].name", "missing")
        if not math.isfinite(unit.scale):
            raise InvalidControlNetRequest(f"controlnets[{i}].scale", f"{unit.scale} is not finite")


def check_float(tensor: torch.Tensor, field: str, dims: int) -> None:
    if not tensor.is_floating_point():
        raise InvalidControlNetRequest(field, f"dtype {tensor.dtype}, expected a floating dtype")
    if tensor.dim() != dims:
        raise InvalidControlNetRequest(
            field, f"shape {tuple(tensor.shape)} has {tensor.dim()} dims, expected {dims}"
        )
    if tensor.numel() == 0:
        raise InvalidControlNetRequest(field, f"shape {tuple(tensor.shape)} is empty")


def check_conditioning(spec: SessionSpec, config: Any, name: str) -> None:
    """The text conditioning must fit the ControlNet ``name`` (with config ``config``)."""
    ehs = spec.encoder_hidden_states
    check_float(ehs, "encoder_hidden_states", 3)
    batch = ehs.shape[0]
    if ehs.shape[-1] != config.cross_attention_dim:
        raise InvalidControlNetRequest(
            "encoder_hidden_states",
            f"width {ehs.shape[-1]}, ControlNet {name!r} attends to {config.cross_attention_dim}",
        )
    xl = config.addition_embed_type == "text_time"
    if not xl:
        for field, extra in (("text_embeds", spec.text_embeds), ("time_ids", spec.time_ids)):
            if extra is not None:
                raise InvalidControlNetRequest(field, f"given, but {spec.family} takes none")
        return
    if spec.text_embeds is None or spec.time_ids is None:
        missing = "text_embeds" if spec.text_embeds is None else "time_ids"
        raise InvalidControlNetRequest(missing, "missing (SDXL ControlNets need it)")
    check_float(spec.text_embeds, "text_embeds", 2)
    check_float(spec.time_ids, "time_ids", 2)
    for field, tensor in (("text_embeds", spec.text_embeds), ("time_ids", spec.time_ids)):
        if tensor.shape[0] != batch:
            raise InvalidControlNetRequest(
                field, f"batch {tensor.shape[0]}, encoder_hidden_states has {batch}"
            )
    expected = spec.text_embeds.shape[1] + spec.time_ids.shape[1] * config.addition_time_embed_dim
    if expected != config.projection_class_embeddings_input_dim:
        raise InvalidControlNetRequest(
            "text_embeds",
            f"text_embeds {tuple(spec.text_embeds.shape)} and time_ids"
            f" {tuple(spec.time_ids.shape)} do not fit ControlNet {name!r}",
        )


def check_step(
    sample: torch.Tensor,
    timestep: torch.Tensor,
    *,
    batch: int,
    channels: int,
    size: tuple[int, int],
) -> None:
    """One step's input: ``(batch, channels, height/8, width/8)`` and a single timestep."""
    check_float(sample, "step.sample", 4)
    expected = (batch, channels, *size)
    if tuple(sample.shape) != expected:
        raise InvalidControlNetRequest(
            "step.sample", f"shape {tuple(sample.shape)}, this session expects {expected}"
        )
    if timestep.numel() != 1 or timestep.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise InvalidControlNetRequest(
            "step.timestep",
            f"expected one real number, got {timestep.dtype} {tuple(timestep.shape)}",
        )


# -- the in-process executor --------------------------------------------------------------


StepInputs = tuple[
    torch.Tensor,  # the UNet's input (both CFG branches)
    torch.Tensor,  # the timestep, a 0-d tensor
    tuple[Any, ...],  # the ControlNets, in request order
    tuple[torch.Tensor, ...],  # their control images, repeated over the batch
    tuple[float, ...],  # their scales
    torch.Tensor,  # the text conditioning
    dict[str, torch.Tensor] | None,  # SDXL's added conditioning
]


def summed_residuals(
    sample: torch.Tensor,
    timestep: torch.Tensor,
    nets: tuple[Any, ...],
    images: tuple[torch.Tensor, ...],
    scales: tuple[float, ...],
    encoder_hidden_states: torch.Tensor,
    added: dict[str, torch.Tensor] | None,
) -> Residuals:
    """One step's residuals of ``nets``, each at its scale, summed in order (diffusers'
    ``MultiControlNetModel``): a function of its arguments alone, so a CUDA graph can hold it."""
    parts = []
    for net, image, scale in zip(nets, images, scales, strict=True):
        down, mid = net(
            sample,
            timestep,
            encoder_hidden_states=encoder_hidden_states,
            controlnet_cond=image,
            conditioning_scale=scale,
            added_cond_kwargs=added,
            return_dict=False,
        )
        parts.append(Residuals(tuple(down), mid))
    return sum_residuals(parts)


class LocalSession:
    """A request's ControlNets, leased from the cache, run on the executor's device."""

    def __init__(
        self,
        spec: SessionSpec,
        leases: list[Lease[Any]],
        images: list[torch.Tensor],
        *,
        device: torch.device,
        dtype: torch.dtype,
        info: OpenInfo,
        on_step: Callable[[], None],
        on_close: Callable[[], None],
    ) -> None:
        self.spec = spec
        self.info = info
        self.device = device
        self.dtype = dtype
        self._leases = leases
        self._images = images
        self._batched: dict[int, list[torch.Tensor]] = {}
        self._ehs = spec.encoder_hidden_states.to(device, dtype)
        self._added = (
            {
                "text_embeds": spec.text_embeds.to(device, dtype),
                "time_ids": spec.time_ids.to(device, dtype),
            }
            if spec.text_embeds is not None and spec.time_ids is not None
            else None
        )
        first = leases[0].value.config
        self._channels = int(first.in_channels)
        self._latent_size = (spec.height // VAE_SCALE_FACTOR, spec.width // VAE_SCALE_FACTOR)
        self._pool: ThreadPoolExecutor | None = None
        self._on_step = on_step
        self._on_close = on_close
        self._closed = False
        self._lock = threading.Lock()

    def compute(self, sample: torch.Tensor, timestep: torch.Tensor) -> Residuals:
        """The summed residuals of one step, on the caller's thread."""
        inputs = self.step_inputs(sample, timestep)
        with torch.inference_mode():
            return summed_residuals(*inputs)

    def step_inputs(self, sample: torch.Tensor, timestep: torch.Tensor) -> StepInputs:
        """One step's arguments of :func:`summed_residuals`, checked and on the session's
        device (the step is counted): what :meth:`compute` runs, and what the worker's
        predictor captures in one CUDA graph with the UNet when the session shares its GPU."""
        batch = self._ehs.shape[0]
        check_step(sample, timestep, batch=batch, channels=self._channels, size=self._latent_size)
        self._on_step()
        return (
            sample.to(self.device, self.dtype),
            timestep.reshape(()).to(self.device),
            tuple(lease.value for lease in self._leases),
            tuple(self._images_for(batch)),
            tuple(unit.scale for unit in self.spec.units),
            self._ehs,
            self._added,
        )

    def _images_for(self, batch: int) -> list[torch.Tensor]:
        # diffusers repeats the control image over the batch (CFG: both branches)
        if batch not in self._batched:
            self._batched[batch] = [image.repeat(batch, 1, 1, 1) for image in self._images]
        return self._batched[batch]

    def submit(self, step: int, sample: torch.Tensor, timestep: torch.Tensor) -> Future[Residuals]:
        """:meth:`compute` on the session's own thread; steps run in submission order."""
        with self._lock:
            if self._closed:
                raise ControlNetError("step", "the session is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="controlnet")
            return self._pool.submit(self.compute, sample, timestep)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool = self._pool
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for lease in self._leases:
            lease.release()
        self._on_close()


class LocalControlNetExecutor:
    """ControlNets in this process, on ``device``, from a cache bounded by count or bytes."""

    def __init__(
        self,
        catalog: ControlNetCatalog,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        policy: Policy = Policy.LRU,
        max_models: int | None = None,
        max_bytes: int | None = None,
        max_sessions: int | None = None,
    ) -> None:
        self.catalog = catalog
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sessions = max_sessions
        self.cache: ModelCache[Any] = ModelCache(
            self._load,
            size_of=model_bytes,
            estimate=self._estimate,
            policy=policy,
            max_entries=max_models,
            max_bytes=max_bytes,
        )
        self._lock = threading.Lock()
        self._open = 0
        self._sessions = 0
        self._steps = 0

    def _entry(self, key: str) -> Any:
        family, name = key.split("/", 1)
        return self.catalog.resolve(name, family)

    def _load(self, key: str) -> Any:
        return load_entry(self._entry(key), device=self.device, dtype=self.dtype)

    def _estimate(self, key: str) -> int:
        return estimate_bytes(self._entry(key), self.dtype)

    def open(self, spec: SessionSpec) -> LocalSession:
        """Check the request, decode its images, lease its ControlNets (loading cold ones)."""
        check_size(spec.height, spec.width)
        check_units(spec.units)
        check_float(spec.encoder_hidden_states, "encoder_hidden_states", 3)
        entries = [
            self.catalog.resolve(u.name, spec.family, field=f"controlnets[{i}].name")
            for i, u in enumerate(spec.units)
        ]
        images = [
            prepare_control_image(
                u.image,
                spec.height,
                spec.width,
                self.device,
                self.dtype,
                field=f"controlnets[{i}].control_image",
            )
            for i, u in enumerate(spec.units)
        ]
        self._admit()
        leases: list[Lease[Any]] = []
        try:
            began = time.perf_counter()
            for entry in entries:
                leases.append(self.cache.acquire(entry.key))
            load_s = time.perf_counter() - began
            for unit, lease in zip(spec.units, leases, strict=True):
                check_conditioning(spec, lease.value.config, unit.name)
        except BaseException:
            for lease in leases:
                lease.release()
            self._closed_session()
            raise
        info = OpenInfo(tuple(lease.hit for lease in leases), load_s)
        return LocalSession(
            spec,
            leases,
            images,
            device=self.device,
            dtype=self.dtype,
            info=info,
            on_step=self._stepped,
            on_close=self._closed_session,
        )

    def _admit(self) -> None:
        with self._lock:
            if self.max_sessions is not None and self._open >= self.max_sessions:
                raise ControlNetBusyError(
                    "", f"{self._open} sessions open, the limit is {self.max_sessions}"
                )
            self._open += 1
            self._sessions += 1

    def _closed_session(self) -> None:
        with self._lock:
            self._open -= 1

    def _stepped(self) -> None:
        with self._lock:
            self._steps += 1

    def stats(self) -> ExecutorStats:
        with self._lock:
            open_, total, steps = self._open, self._sessions, self._steps
        return ExecutorStats(self.cache.stats(), open_, total, steps)

    def close(self) -> None:
        self.cache.clear()
