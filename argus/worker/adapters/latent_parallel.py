"""Latent parallelism (Katz §7): the two CFG branches of every denoising step on two devices.

Classifier-free guidance evaluates the UNet twice per step, on the negative text and on the
prompt, and mixes the two predictions. The evaluations are independent, so Katz runs them on
two GPUs at once instead of as a batch of two on one (1.36–1.71× on the base model, §9.5,
since a batch of two already saturates a GPU, §3.3). Each device runs the ControlNets for its
own branch, so residuals never cross devices.

* **Rank 0** is the worker process: it encodes the prompt, owns the scheduler, runs the
  *negative* branch (the first of :class:`~argus.worker.models.pipelines.Conditioning`'s
  stacked branches) and combines the two predictions (:meth:`DiffusionModel.guide`).
* **Rank 1, the peer**, is a process started with the *spawn* context (the worker runs gRPC
  threads; forking would copy held locks). It holds the UNet of the same model source alone
  and runs the *prompt* branch.
* **Two channels**: a ``multiprocessing`` pipe carries small control messages, and its end of
  file is how either side learns at once that the other died; every wait on it has a timeout,
  so a hung peer is an error, never a hang. A ``torch.distributed`` group (gloo on the CPU,
  NCCL between GPUs) carries the tensors; it is constructed directly, not through
  ``init_process_group``, so the process's default group is left alone and peers can stop and
  start without global state.
* **Per request** rank 0 sends the peer's embeddings and conditions, the ControlNets and
  fingerprints of the weights it uses (a peer with other weights is refused loudly); **per
  step** the scaled latents and the timestep, receiving the peer's noise prediction while it
  computes its own branch.

Use (see :class:`LatentParallelGroup`)::

    config = LatentParallelConfig(peer_device="cuda:1", controlnet_loader=...)
    group = LatentParallelGroup.start(config, model_device="cuda:0")
    group.prepare(model)                      # at worker start / model switch: peer loads it
    result = model.denoise(spec, predictor=group.predictor(model, controls))
    group.close()                             # at worker stop

With guidance ≤ 1 there is one branch and the predictor runs it locally. Limits: the peer's
UNet is never LoRA-patched, so a request with LoRAs runs on one device; every step waits for
the peer (Katz's asynchronous variant for slow links is not implemented); steps of concurrent
requests are serialised by a lock.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import multiprocessing
import os
import re
import threading
import time
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from argus.worker.models.pipelines import Conditioning, DiffusionModel
from argus.worker.models.sources import build_tiny_pipeline, check_pipeline_dir, is_tiny

# a ControlNet the peer builds by name: (name, base UNet, device, dtype) -> ControlNetModel.
# It must be picklable (a module-level function, or a functools.partial of one): it travels
# to the spawned peer.
ControlNetLoader = Callable[[str, Any, str, torch.dtype], Any]

# (numel, sum, sum of |w|) of a module's parameters in float64: cheap, and different weights
# from the same architecture differ in it with overwhelming probability
Fingerprint = tuple[int, float, float]

_DTYPES = {
    str(dtype): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
    )
}
_CUDA_DEVICE = re.compile(r"cuda(:[0-9]{1,3})?")
_TAG = 0  # every tensor uses one tag: the pair's message order is the protocol's order


class LatentParallelError(RuntimeError):
    """Latent parallelism cannot serve this request."""


class PeerFailedError(LatentParallelError):
    """The peer died, hung past a timeout or broke the protocol; the group is unusable until
    it is started again (the worker may keep serving on one device meanwhile)."""


class PeerRequestError(LatentParallelError):
    """The peer refused one request (an unknown ControlNet, mismatched weights); the group
    stays usable."""


@dataclass(frozen=True)
class CatalogControlNetLoader:
    """The peer's ControlNets from a catalog of :mod:`argus.worker.adapters.controlnet.models`.

    ``catalog`` is ``"tiny"`` (seeded tiny ControlNets, the same in every process) or a
    catalog directory; the base family comes from the peer's UNet config. A picklable value,
    so it can travel to the spawned peer; it should name the catalog the worker builds its
    own ControlNets from (a mismatch is caught by the weight fingerprints).
    """

    catalog: str = "tiny"

    def __call__(self, name: str, unet: Any, device: str, dtype: torch.dtype) -> Any:
        from argus.worker.adapters.controlnet.models import base_family, build_controlnet

        family = base_family(unet.config)
        return build_controlnet(name, base=family, catalog=self.catalog, device=device, dtype=dtype)


@dataclass(frozen=True)
class LatentParallelConfig:
    """How the peer is started and how long rank 0 waits for it (one per worker)."""

    peer_device: str = "cpu"
    """Device of the peer's UNet: ``cpu`` or ``cuda:N`` (a second GPU, not the worker's)."""

    backend: str = "auto"
    """Tensor transport: ``gloo``, ``nccl`` or ``auto`` (NCCL when the peer and the models
    are on CUDA, else gloo; gloo stages tensors through host memory)."""

    host: str = "127.0.0.1"
    """Address of the rendezvous store (the peer runs on the same host)."""

    start_timeout_s: float = 600.0
    """Starting the peer (interpreter, imports, rendezvous), seconds."""

    load_timeout_s: float = 600.0
    """The peer loading a base UNet or a ControlNet, seconds (real weights are GiBs)."""

    step_timeout_s: float = 60.0
    """One denoising step on the peer, seconds; past it the peer counts as hung."""

    stop_timeout_s: float = 10.0
    """A clean stop before the peer is terminated, seconds."""

    peer_threads: int | None = None
    """CPU threads of the peer's torch (``None``: torch's default)."""

    max_models: int = 2
    """Base UNets the peer keeps (a model switch holds two, as the registry does)."""

    max_controlnets: int = 8
    """ControlNets the peer keeps, least recently used dropped first (Katz §3.1: the top 5-8
    serve 95-98% of invocations)."""

    controlnet_loader: ControlNetLoader | None = CatalogControlNetLoader()
    """How the peer builds a ControlNet by name (default: the tiny catalog); ``None`` refuses
    requests with ControlNets."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend: expected auto, gloo or nccl, got {self.backend!r}")
        if self.peer_device != "cpu" and not _CUDA_DEVICE.fullmatch(self.peer_device):
            raise ValueError(f"peer_device: expected cpu or cuda:N, got {self.peer_device!r}")
        for name in ("start_timeout_s", "load_timeout_s", "step_timeout_s", "stop_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
        if self.peer_threads is not None and self.peer_threads < 1:
            raise ValueError(f"peer_threads: must be >= 1, got {self.peer_threads}")
        if self.max_models < 1 or self.max_controlnets < 1:
            raise ValueError(
                f"max_models and max_controlnets must be >= 1, got "
                f"{self.max_models} and {self.max_controlnets}"
            )

    def resolved_backend(self, model_device: str) -> str:
        if self.backend != "auto":
            return self.backend
        cuda = self.peer_device.startswith("cuda") and model_device.startswith("cuda")
        return "nccl" if cuda else "gloo"


@dataclass(frozen=True)
class ControlInput:
    """One ControlNet on a request, as rank 0 holds it; the peer loads its own copy by name."""

    name: str
    module: Any  # diffusers ControlNetModel on the model's device and dtype
    image: torch.Tensor  # the prepared control image, (1, 3, H, W), model device and dtype
    scale: float = 1.0  # conditioning scale: the residuals are multiplied by it


@dataclass(frozen=True)
class LatentParallelStats:
    requests: int  # requests whose branches ran on two devices
    local_requests: int  # requests run on rank 0 alone (CFG off)
    steps: int  # parallel steps
    peer_wait_s: float  # time rank 0 waited for the peer after finishing its own branch
    failure: str  # why the group is unusable; "" while it is healthy


# -- the computation both ranks run ----------------------------------------------------------


def branch_noise(
    unet: Any,
    sample: torch.Tensor,
    t: torch.Tensor,
    embeds: torch.Tensor,
    added: Mapping[str, torch.Tensor] | None,
    controls: Sequence[tuple[Any, torch.Tensor, float]] = (),
) -> torch.Tensor:
    """The UNet's noise prediction for one (or a stack of) CFG branches, with ControlNets.

    ``sample`` is already scaled by the scheduler. Several ControlNets add their residuals, as
    diffusers' ``MultiControlNetModel`` does; the UNet then takes the sums.
    """
    down: list[torch.Tensor] | None = None
    mid: torch.Tensor | None = None
    extra = dict(added) if added is not None else None
    for controlnet, image, scale in controls:
        d, m = controlnet(
            sample,
            t,
            encoder_hidden_states=embeds,
            controlnet_cond=image,
            conditioning_scale=scale,
            added_cond_kwargs=extra,
            return_dict=False,
        )
        if down is None or mid is None:
            down, mid = list(d), m
        else:
            down = [a + b for a, b in zip(down, d, strict=True)]
            mid = mid + m
    noise: torch.Tensor = unet(
        sample,
        t,
        encoder_hidden_states=embeds,
        added_cond_kwargs=extra,
        down_block_additional_residuals=down,
        mid_block_additional_residual=mid,
        return_dict=False,
    )[0]
    return noise


def fingerprint(module: torch.nn.Module) -> Fingerprint:
    """(numel, Σw, Σ|w|) over the module's parameters, accumulated in float64."""
    count, total, absolute = 0, 0.0, 0.0
    with torch.no_grad():
        for p in module.parameters():
            wide = p.detach().to(torch.float64)
            count += p.numel()
            total += float(wide.sum())
            absolute += float(wide.abs().sum())
    return count, total, absolute


def same_fingerprint(a: Sequence[float], b: Sequence[float]) -> bool:
    return int(a[0]) == int(b[0]) and all(
        math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6) for x, y in zip(a[1:], b[1:], strict=True)
    )


_FINGERPRINTS: weakref.WeakKeyDictionary[Any, Fingerprint] = weakref.WeakKeyDictionary()
_FINGERPRINT_LOCK = threading.Lock()


def _cached_fingerprint(module: torch.nn.Module) -> Fingerprint:
    """A module's fingerprint, computed once per module object (weights do not change under
    latent parallelism; a LoRA patched in place would change them, see the module notes)."""
    with _FINGERPRINT_LOCK:
        found = _FINGERPRINTS.get(module)
    if found is None:
        found = fingerprint(module)
        with _FINGERPRINT_LOCK:
            _FINGERPRINTS[module] = found
    return found


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise LatentParallelError(f"dtype {name!r} is not sent between ranks")
    return _DTYPES[name]


# -- rank 0 ----------------------------------------------------------------------------------


class LatentParallelGroup:
    """Rank 0's side: the peer process, the pipe to it and the tensor process group.

    Created once per worker with :meth:`start`, closed with :meth:`close` (also a context
    manager). Thread-safe: every exchange with the peer holds one lock, and a request whose
    step finds another request's state on the peer sends its own again, so interleaved
    requests stay correct (the worker runs one at a time anyway).
    """

    def __init__(
        self,
        config: LatentParallelConfig,
        process: Any,
        conn: Connection,
        store: Any,
        pg: Any,
        backend: str,
    ) -> None:
        self.config = config
        self.backend = backend
        self._process = process
        self._conn = conn
        self._store = store
        self._pg = pg
        self._lock = threading.Lock()
        self._session: object | None = None  # token of the request whose state the peer holds
        self._failure = ""
        self._closed = False
        self._requests = 0
        self._local_requests = 0
        self._steps = 0
        self._peer_wait_s = 0.0
        # a group dropped without close() still takes its peer down
        self._finalizer = weakref.finalize(self, _reap, process, conn, 0.0)

    # -- life cycle ------------------------------------------------------------------------

    @classmethod
    def start(
        cls, config: LatentParallelConfig | None = None, *, model_device: str = "cpu"
    ) -> LatentParallelGroup:
        """Spawn the peer and join it in a two-rank process group; returns when it is ready.

        ``model_device`` is the device of the worker's models (rank 0). Raises
        :class:`PeerFailedError` when the peer cannot start within ``start_timeout_s``.
        """
        config = config or LatentParallelConfig()
        backend = config.resolved_backend(model_device)
        if backend == "nccl" and not (
            model_device.startswith("cuda") and config.peer_device.startswith("cuda")
        ):
            raise ValueError("backend nccl needs the models and the peer on CUDA devices")
        timeout = datetime.timedelta(seconds=config.start_timeout_s)
        store = TCPStore(config.host, 0, 2, True, timeout=timeout, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        spec = _PeerSpec(
            host=config.host,
            port=int(store.port),
            backend=backend,
            device=config.peer_device,
            threads=config.peer_threads,
            op_timeout_s=max(config.step_timeout_s, config.load_timeout_s),
            start_timeout_s=config.start_timeout_s,
            max_models=config.max_models,
            max_controlnets=config.max_controlnets,
            controlnet_loader=config.controlnet_loader,
            parent_pid=os.getpid(),
        )
        process = context.Process(
            target=_peer_main, args=(child, spec), name="argus-latent-peer", daemon=True
        )
        process.start()
        child.close()  # only the peer holds its end: its death is our end of file
        try:
            _expect(parent, process, config.start_timeout_s, "start", "hello")
            pg = _make_group(store, 0, backend, model_device, spec.op_timeout_s)
            _expect(parent, process, config.start_timeout_s, "start", "ready")
        except BaseException:
            _reap(process, parent, 0.0)
            raise
        return cls(config, process, parent, store, pg, backend)

    def close(self) -> None:
        """Stop the peer (cleanly if it answers, else terminated) and release the group."""
        if self._closed:
            return
        self._closed = True
        locked = self._lock.acquire(timeout=self.config.stop_timeout_s)
        try:
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(("stop",))
            self._finalizer.detach()
            _reap(self._process, self._conn, self.config.stop_timeout_s)
            self._pg = None
            self._store = None
            if not self._failure:
                self._failure = "closed"
        finally:
            if locked:
                self._lock.release()

    def __enter__(self) -> LatentParallelGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        pid: int | None = self._process.pid
        return pid

    @property
    def healthy(self) -> bool:
        """True while requests can use the peer (started, not failed, not closed)."""
        return not self._failure and self._process.is_alive()

    def stats(self) -> LatentParallelStats:
        with self._lock:
            return LatentParallelStats(
                requests=self._requests,
                local_requests=self._local_requests,
                steps=self._steps,
                peer_wait_s=self._peer_wait_s,
                failure=self._failure,
            )

    # -- requests --------------------------------------------------------------------------

    def prepare(self, model: DiffusionModel) -> None:
        """Have the peer load ``model``'s UNet now (at worker start or a model switch), so the
        first request does not wait for it. Checks the peer's weights match rank 0's."""
        with self._lock:
            self._check_usable()
            self._load(model)

    def predictor(
        self, model: DiffusionModel, controls: Sequence[ControlInput] = ()
    ) -> LatentParallelPredictor:
        """A :class:`~argus.worker.models.pipelines.NoisePredictor` for one request on ``model``."""
        return LatentParallelPredictor(self, model, tuple(controls))

    def _check_usable(self) -> None:
        if self._closed:
            raise PeerFailedError("latent-parallel group is closed")
        if self._failure:
            raise PeerFailedError(f"latent-parallel peer is unusable: {self._failure}")
        if not self._process.is_alive():
            self._fail(f"peer process {self._process.pid} exited (code {self._process.exitcode})")

    def _fail(self, reason: str) -> NoReturn:
        """Mark the group unusable, take the peer down, raise."""
        self._failure = reason
        self._session = None
        _reap(self._process, self._conn, 0.0, force=True)
        raise PeerFailedError(f"latent-parallel peer failed: {reason}")

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError) as err:
            self._fail(f"cannot reach the peer ({type(err).__name__}: {err})")

    def _reply(self, timeout_s: float, what: str) -> Any:
        """The peer's answer to the last message; raises on an error, a death or a timeout."""
        try:
            ready = self._conn.poll(timeout_s)
            message = self._conn.recv() if ready else None
        except (EOFError, OSError):
            self._process.join(1.0)
            self._fail(
                f"peer process {self._process.pid} died during {what} "
                f"(exit code {self._process.exitcode})"
            )
        if message is None:
            self._fail(f"no answer to {what} within {timeout_s:g} s")
        kind, payload = message
        if kind == "error":
            raise PeerRequestError(f"peer refused {what}: {payload}")
        if kind != "ok":
            self._fail(f"unexpected message {kind!r} during {what}")
        return payload

    def _send_tensor(self, tensor: torch.Tensor) -> Any:
        wire = tensor.detach().contiguous()
        if self.backend == "gloo":
            wire = wire.cpu()
        return self._pg.send([wire], 1, _TAG)

    def _recv_tensor(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: str,
        timeout_s: float,
        what: str = "receiving the peer's tensor",
    ) -> torch.Tensor:
        where = "cpu" if self.backend == "gloo" else device
        buffer = torch.empty(tuple(shape), dtype=dtype, device=where)
        self._wait(self._pg.recv([buffer], 1, _TAG), timeout_s, what)
        return buffer.to(device)

    def _wait(self, work: Any, timeout_s: float, what: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as err:
            # a peer killed between its reply and its tensor shows first as a reset socket:
            # name the death, as the control pipe's EOF would
            self._process.join(1.0)
            if not self._process.is_alive():
                self._fail(
                    f"peer process {self._process.pid} died during {what} "
                    f"(exit code {self._process.exitcode})"
                )
            self._fail(f"{what}: {str(err).splitlines()[0]}")

    def _load(self, model: DiffusionModel) -> None:
        weights = _cached_fingerprint(model.pipeline.unet)
        self._send(("load", model.source, str(model.dtype), weights))
        self._reply(self.config.load_timeout_s, f"loading {model.source}")

    def _begin(
        self,
        token: object,
        model: DiffusionModel,
        cond: Conditioning,
        controls: Sequence[ControlInput],
    ) -> None:
        """Send the peer its branch of one request: embeddings, added conds, ControlNets. The
        peer loads the model first if it does not hold it (or dropped it for another)."""
        tensors: list[tuple[str, torch.Tensor]] = [("embeds", cond.embeds[1:])]
        for key, value in sorted((cond.added or {}).items()):
            tensors.append((f"added.{key}", value[1:]))
        for i, control in enumerate(controls):
            tensors.append((f"control.{i}", control.image))
        meta = {
            "source": model.source,
            "dtype": str(model.dtype),
            "fingerprint": _cached_fingerprint(model.pipeline.unet),
            "tensors": [(k, tuple(v.shape), str(v.dtype)) for k, v in tensors],
            "controls": [(c.name, float(c.scale), _cached_fingerprint(c.module)) for c in controls],
        }
        self._session = None
        self._send(("begin", meta))
        works = [self._send_tensor(v) for _, v in tensors]
        for work in works:  # the peer receives before it loads anything: a step's timeout
            self._wait(work, self.config.step_timeout_s, "sending the request")
        self._reply(self.config.load_timeout_s, "the request")
        self._session = token
        self._requests += 1

    def _step(
        self,
        token: object,
        begin: Callable[[], None],
        sample: torch.Tensor,
        t: torch.Tensor,
        step: int,
        local: Callable[[], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One parallel step: (rank 0's prediction, the peer's prediction)."""
        with self._lock:
            self._check_usable()
            if self._session is not token:
                begin()
            timeout = self.config.step_timeout_s
            shape, dtype = tuple(sample.shape), str(sample.dtype)
            self._send(("step", step, t.item(), str(t.dtype), shape, dtype))
            sent = self._send_tensor(sample)
            try:
                mine = local()
            except BaseException:
                self._drain(sent, sample)
                raise
            waited = time.perf_counter()
            try:
                self._reply(timeout, f"step {step}")
            except PeerRequestError:
                self._wait(sent, timeout, "sending the latents")  # the peer took them
                raise
            theirs = self._recv_tensor(
                sample.shape,
                sample.dtype,
                str(sample.device),
                timeout,
                f"step {step}, receiving the peer's tensor",
            )
            self._wait(sent, timeout, "sending the latents")
            self._peer_wait_s += time.perf_counter() - waited
            self._steps += 1
            return mine, theirs

    def _drain(self, sent: Any, sample: torch.Tensor) -> None:
        """Rank 0 failed mid-step: take the peer's answer anyway so the channels stay in step."""
        timeout = self.config.step_timeout_s
        with contextlib.suppress(PeerRequestError):
            self._reply(timeout, "a step rank 0 abandoned")
            self._recv_tensor(sample.shape, sample.dtype, str(sample.device), timeout)
        self._wait(sent, timeout, "sending the latents")

    def _count_local(self) -> None:
        with self._lock:
            self._local_requests += 1


class LatentParallelPredictor:
    """The noise predictor of one request: rank 0's branch here, the other on the peer.

    Called by :meth:`DiffusionModel.denoise` once per step. The first call of a request (a new
    :class:`Conditioning`) sends the peer its branch. Without CFG (guidance ≤ 1) there is one
    branch, computed here; the peer is not used.
    """

    def __init__(
        self, group: LatentParallelGroup, model: DiffusionModel, controls: tuple[ControlInput, ...]
    ) -> None:
        self.group = group
        self.model = model
        self.controls = controls
        self._token = object()
        self._cond: Conditioning | None = None
        self._counted: Conditioning | None = None

    def __call__(
        self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scheduler: Any, step: int
    ) -> torch.Tensor:
        sample: torch.Tensor = scheduler.scale_model_input(latents, t)
        unet = self.model.pipeline.unet
        mine = tuple((c.module, c.image, float(c.scale)) for c in self.controls)
        if not cond.cfg:
            if self._counted is not cond:
                self._counted = cond
                self.group._count_local()
            return branch_noise(unet, sample, t, cond.embeds, cond.added, mine)
        if self._cond is not cond:  # a new request for this predictor: the peer needs it
            self._cond = cond
            self._token = object()
        token = self._token
        negative = {k: v[:1] for k, v in cond.added.items()} if cond.added else None

        def local() -> torch.Tensor:
            return branch_noise(unet, sample, t, cond.embeds[:1], negative, mine)

        def begin() -> None:
            self.group._begin(token, self.model, cond, self.controls)

        uncond, text = self.group._step(token, begin, sample, t, step, local)
        return DiffusionModel.guide(torch.cat([uncond, text]), cond)


def _expect(conn: Connection, process: Any, timeout_s: float, what: str, wanted: str) -> Any:
    """Wait for one message of kind ``wanted`` from a starting peer."""
    try:
        ready = conn.poll(timeout_s)
        message = conn.recv() if ready else None
    except (EOFError, OSError):
        process.join(5.0)
        raise PeerFailedError(
            f"latent-parallel peer died during {what} (exit code {process.exitcode}); "
            "its stderr has the traceback"
        ) from None
    if message is None:
        raise PeerFailedError(f"latent-parallel peer: no {wanted!r} within {timeout_s:g} s")
    kind, payload = message
    if kind == "error":
        raise PeerFailedError(f"latent-parallel peer failed to {what}: {payload}")
    if kind != wanted:
        raise PeerFailedError(f"latent-parallel peer sent {kind!r}, expected {wanted!r}")
    return payload


def _reap(process: Any, conn: Connection, grace_s: float, *, force: bool = False) -> None:
    """End a peer: wait ``grace_s`` for it to leave, then terminate, then kill (at once with
    ``force``: a broken peer has nothing to clean up, and a stopped one ignores SIGTERM)."""
    if process.pid is not None:
        process.join(grace_s)
        if process.is_alive() and not force:
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)
    with contextlib.suppress(OSError):
        conn.close()


def _cuda_index(device: str) -> int:
    """The N of ``cuda:N`` (0 for ``cuda``), read from the text: ``torch.device`` keeps the
    index in 8 bits and wraps large ones."""
    _, _, index = device.partition(":")
    return int(index) if index else 0


def _make_group(store: Any, rank: int, backend: str, device: str, timeout_s: float) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise LatentParallelError("this torch build has no NCCL; use backend gloo")
    torch.cuda.set_device(torch.device(device))
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, 2, options)


# -- rank 1: the peer ------------------------------------------------------------------------


@dataclass(frozen=True)
class _PeerSpec:
    """Everything the spawned peer needs (pickled into it)."""

    host: str
    port: int
    backend: str
    device: str
    threads: int | None
    op_timeout_s: float
    start_timeout_s: float
    max_models: int
    max_controlnets: int
    controlnet_loader: ControlNetLoader | None
    parent_pid: int


@dataclass
class _Request:
    unet: Any
    embeds: torch.Tensor
    added: dict[str, torch.Tensor] | None
    controls: list[tuple[Any, torch.Tensor, float]] = field(default_factory=list)


def _peer_main(conn: Connection, spec: _PeerSpec) -> None:
    """The peer process: join the group, then serve messages until stop or end of file."""
    try:
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        if spec.device.startswith("cuda"):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if _cuda_index(spec.device) >= count:
                raise LatentParallelError(f"peer_device {spec.device}: {count} CUDA devices here")
            torch.cuda.set_device(torch.device(spec.device))
        timeout = datetime.timedelta(seconds=spec.start_timeout_s)
        store = TCPStore(spec.host, spec.port, 2, False, timeout=timeout)
        conn.send(("hello", None))
        pg = _make_group(store, 1, spec.backend, spec.device, spec.op_timeout_s)
        conn.send(("ready", os.getpid()))
    except Exception as err:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    peer = _Peer(spec, pg)
    with torch.inference_mode():
        peer.serve(conn)


class _Peer:
    """The peer's state: loaded UNets and ControlNets, and the current request."""

    def __init__(self, spec: _PeerSpec, pg: Any) -> None:
        self.spec = spec
        self.pg = pg
        self.unets: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.controlnets: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self.request: _Request | None = None

    def serve(self, conn: Connection) -> None:
        handlers: dict[str, Callable[..., Any]] = {
            "load": self.load,
            "begin": self.begin,
            "step": self.step,
        }
        while True:
            try:
                if not conn.poll(1.0):
                    if os.getppid() != self.spec.parent_pid:  # the worker is gone
                        return
                    continue
                message = conn.recv()
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "stop":
                return
            handler = handlers.get(kind)
            if handler is None:
                conn.send(("error", f"unknown message {kind!r}"))
                continue
            try:
                after = handler(*message[1:])
            except Exception as err:
                traceback.print_exc()
                conn.send(("error", f"{type(err).__name__}: {err}"))
                continue
            conn.send(("ok", None))
            if after is not None:  # send the result only once rank 0 knows it is coming
                try:
                    after()
                except RuntimeError:  # rank 0 is gone mid-step
                    traceback.print_exc()
                    return

    # -- messages --------------------------------------------------------------------------

    def load(self, source: str, dtype_name: str, expected: Sequence[float]) -> None:
        self.unet(source, dtype_name, expected)

    def unet(self, source: str, dtype_name: str, expected: Sequence[float]) -> Any:
        """The UNet of ``source``, loaded if needed, checked against rank 0's fingerprint."""
        key = (source, dtype_name)
        if key not in self.unets:
            unet = _load_unet(source, self.spec.device, _dtype(dtype_name))
            self.unets[key] = unet
            while len(self.unets) > self.spec.max_models:
                self.unets.popitem(last=False)
        self.unets.move_to_end(key)
        got = _cached_fingerprint(self.unets[key])
        if not same_fingerprint(got, expected):
            raise LatentParallelError(
                f"{source}: the peer's UNet weights differ from the worker's "
                f"(fingerprint {got} vs {tuple(expected)})"
            )
        return self.unets[key]

    def begin(self, meta: dict[str, Any]) -> None:
        self.request = None
        received: dict[str, torch.Tensor] = {}
        for key, shape, dtype_name in meta["tensors"]:  # always receive, to stay in step
            received[key] = self._recv(shape, _dtype(dtype_name))
        unet = self.unet(meta["source"], meta["dtype"], meta["fingerprint"])
        added = {k[len("added.") :]: v for k, v in received.items() if k.startswith("added.")}
        request = _Request(unet, received["embeds"], added or None)
        for i, (name, scale, expected) in enumerate(meta["controls"]):
            module = self._controlnet(name, meta["source"], meta["dtype"], unet)
            got = _cached_fingerprint(module)
            if not same_fingerprint(got, expected):
                raise LatentParallelError(
                    f"ControlNet {name!r}: the peer's weights differ from the worker's"
                )
            request.controls.append((module, received[f"control.{i}"], float(scale)))
        self.request = request

    def step(
        self, step: int, t_value: float, t_dtype: str, shape: Sequence[int], dtype_name: str
    ) -> Callable[[], None]:
        sample = self._recv(shape, _dtype(dtype_name))  # first, to stay in step with rank 0
        request = self.request
        if request is None:
            raise LatentParallelError(f"step {step} without a request")
        t = torch.tensor(t_value, dtype=_dtype(t_dtype), device=self.spec.device)
        noise = branch_noise(
            request.unet, sample, t, request.embeds, request.added, request.controls
        )

        def send() -> None:
            wire = noise.contiguous().cpu() if self.spec.backend == "gloo" else noise.contiguous()
            self.pg.send([wire], 0, _TAG).wait()

        return send

    # -- helpers ---------------------------------------------------------------------------

    def _recv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        where = "cpu" if self.spec.backend == "gloo" else self.spec.device
        buffer = torch.empty(tuple(shape), dtype=dtype, device=where)
        self.pg.recv([buffer], 0, _TAG).wait()
        return buffer.to(self.spec.device)

    def _controlnet(self, name: str, source: str, dtype_name: str, unet: Any) -> Any:
        loader = self.spec.controlnet_loader
        if loader is None:
            raise LatentParallelError(f"ControlNet {name!r}: the peer has no ControlNet loader")
        key = (name, source, dtype_name)
        if key not in self.controlnets:
            module = loader(name, unet, self.spec.device, _dtype(dtype_name))
            self.controlnets[key] = module.to(self.spec.device, _dtype(dtype_name)).eval()
            while len(self.controlnets) > self.spec.max_controlnets:
                self.controlnets.popitem(last=False)
        self.controlnets.move_to_end(key)
        return self.controlnets[key]


def _load_unet(source: str, device: str, dtype: torch.dtype) -> Any:
    """The UNet of a model source: the only part of the pipeline the peer runs."""
    if is_tiny(source):
        unet = build_tiny_pipeline(source).unet
    else:
        from diffusers import UNet2DConditionModel

        root = Path(source)
        check_pipeline_dir(root)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        unet = UNet2DConditionModel.from_pretrained(
            str(root), subfolder="unet", dtype=dtype, use_safetensors=True, local_files_only=True
        )
    if unet.dtype != dtype:  # a cast diffusers warns about even when it is a no-op
        unet = unet.to(dtype=dtype)
    return unet.to(device).eval()
