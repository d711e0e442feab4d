"""How tensors and sessions cross the wire between workers and the ControlNet service.

**Transport: gRPC bidirectional streams, tensors as raw bytes.** The ControlNet service is
shared by a changing set of workers (Katz §5: "a separate, independently scalable service …
shared among many T2I workflows"). ``torch.distributed`` (gloo, NCCL) assumes a fixed world:
every rank joins one process group at start, and a worker that starts, dies or scales out
means re-forming the group for everyone. gRPC has none of that: a worker opens a stream per
request, the service needs no knowledge of who its clients are, and it comes with what the
rest of Argus already uses (deadlines, status codes, health checking, reflection, load
balancing by address). The price is bandwidth and copies: per step one message goes each
way, and a tensor is copied once into the message on send and once out of it on receive;
there is no per-element encoding and no base64 (JSON would add a third to the size and a
parse per number). On a fast fabric where those copies matter (NVLink, Katz's 108 MiB per
SDXL step) a transport that hands CUDA buffers over directly (NCCL point-to-point, CUDA IPC)
can implement the same :class:`~argus.worker.adapters.controlnet.executor.ControlNetExecutor`
interface; over slow links the pipelined asynchronous mode hides the transfer instead.

One stream per request, not one call per step: the stream's first message carries what is
fixed for the whole run (ControlNet names and scales, the PNG control images, the text
conditioning), so those cross once per request; each later message carries only the step's
UNet input and timestep, and the service answers each with the step's residuals, in order.

**The tensor codec** is :func:`tensor_to_pb` / :func:`tensor_from_pb` and nothing else in
Argus encodes tensors: dtype by name, shape, and the contiguous row-major bytes in the
host's order, which is little-endian on every platform Argus runs on (x86-64, aarch64).
Decoding checks dtype, rank, and that the byte count is numel × itemsize before touching the
bytes, and names the field when it does not add up.

The rest of this module converts the ``argus.v1.ControlNet*`` messages that carry tensors
(opening a session, a step, its residuals), in both directions, for the service and the client
alike; their plain parts, and the messages without a tensor, convert in the contract
:mod:`argus.contracts.controlnet`, which imports no torch.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from argus.contracts.controlnet import units_from_pb, units_to_pb
from argus.contracts.wire import FieldError
from argus.plumbing import rpc
from argus.worker.adapters.controlnet.errors import InvalidControlNetRequest, TensorCodecError
from argus.worker.adapters.controlnet.executor import SessionSpec
from argus.worker.adapters.controlnet.unet_split import Residuals

controlnet_pb2: Any = rpc.load("controlnet_pb2")

if sys.byteorder != "little":  # pragma: no cover - no such host in the fleet
    raise ImportError("the ControlNet tensor codec assumes a little-endian host")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}
MAX_DIMS = 8


# -- the tensor codec ----------------------------------------------------------------------


def tensor_to_pb(tensor: torch.Tensor) -> Any:
    """A ``RawTensor``: dtype name, shape, and the bytes of the contiguous CPU tensor."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TensorCodecError("tensor", f"dtype {name} cannot be sent")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return controlnet_pb2.RawTensor(dtype=name, shape=list(tensor.shape), data=data)


def tensor_from_pb(
    message: Any, field: str, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The tensor a ``RawTensor`` holds, on ``device``; a malformed one raises naming ``field``."""
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        known = ", ".join(DTYPES)
        raise TensorCodecError(field, f"dtype {message.dtype!r} is not one of {known}")
    shape = tuple(int(d) for d in message.shape)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise TensorCodecError(field, f"shape {shape} is not a tensor shape")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    data = message.data
    if len(data) != expected:
        raise TensorCodecError(
            field, f"{len(data)} bytes for a {message.dtype} tensor of shape {shape} ({expected})"
        )
    if expected == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        # bytearray: a writable copy the tensor owns (protobuf's bytes are immutable)
        tensor = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    return tensor if device is None else tensor.to(device)


def _optional(message: Any, name: str, field: str) -> torch.Tensor | None:
    return tensor_from_pb(getattr(message, name), field) if message.HasField(name) else None


def _required(message: Any, name: str, field: str) -> torch.Tensor:
    if not message.HasField(name):
        raise InvalidControlNetRequest(field, "missing")
    return tensor_from_pb(getattr(message, name), field)


# -- sessions ------------------------------------------------------------------------------


def open_to_pb(spec: SessionSpec) -> Any:
    message = controlnet_pb2.ControlNetOpen(
        request_id=spec.request_id,
        base_family=spec.family,
        height=spec.height,
        width=spec.width,
        controlnets=units_to_pb(spec.units),
        encoder_hidden_states=tensor_to_pb(spec.encoder_hidden_states),
    )
    if spec.text_embeds is not None:
        message.text_embeds.CopyFrom(tensor_to_pb(spec.text_embeds))
    if spec.time_ids is not None:
        message.time_ids.CopyFrom(tensor_to_pb(spec.time_ids))
    return controlnet_pb2.ControlNetRequest(open=message)


def open_from_pb(message: Any) -> SessionSpec:
    """The session a ``ControlNetOpen`` asks for; missing or malformed fields raise naming them."""
    if not message.base_family:
        raise InvalidControlNetRequest("base_family", "missing (sd15 or sdxl)")
    try:
        units = units_from_pb(message.controlnets)
    except FieldError as err:  # its message starts with the field's path
        field, _, problem = str(err).partition(": ")
        raise InvalidControlNetRequest(field, problem) from None
    return SessionSpec(
        family=message.base_family,
        height=message.height,
        width=message.width,
        units=units,
        encoder_hidden_states=_required(message, "encoder_hidden_states", "encoder_hidden_states"),
        text_embeds=_optional(message, "text_embeds", "text_embeds"),
        time_ids=_optional(message, "time_ids", "time_ids"),
        request_id=message.request_id,
    )


def step_to_pb(step: int, sample: torch.Tensor, timestep: torch.Tensor) -> Any:
    return controlnet_pb2.ControlNetRequest(
        step=controlnet_pb2.ControlNetStep(
            step=step, sample=tensor_to_pb(sample), timestep=tensor_to_pb(timestep)
        )
    )


def step_from_pb(message: Any) -> tuple[int, torch.Tensor, torch.Tensor]:
    sample = _required(message, "sample", "step.sample")
    timestep = _required(message, "timestep", "step.timestep")
    return message.step, sample, timestep


def residuals_to_pb(step: int, residuals: Residuals, compute_s: float) -> Any:
    return controlnet_pb2.ControlNetReply(
        residuals=controlnet_pb2.ControlNetResiduals(
            step=step,
            down=[tensor_to_pb(t) for t in residuals.down],
            mid=tensor_to_pb(residuals.mid),
            compute_ms=compute_s * 1e3,
        )
    )


def residuals_from_pb(message: Any, *, device: torch.device | str | None = None) -> Residuals:
    down = tuple(
        tensor_from_pb(t, f"residuals.down[{i}]", device=device) for i, t in enumerate(message.down)
    )
    mid = tensor_from_pb(message.mid, "residuals.mid", device=device)
    return Residuals(down, mid)
