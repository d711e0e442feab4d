"""A request's adapters on a worker: Katz's three designs behind one small interface.

The engine hands a request's ``adapters`` (the Generate contract's
:class:`~argus.contracts.generate.Adapter` values) to
:meth:`WorkerAdapters.plan`, which checks them and splits them into LoRAs and ControlNets, and
then runs the denoising loop inside :meth:`WorkerAdapters.attach`, which yields the extra
arguments of :meth:`~argus.worker.models.pipelines.DiffusionModel.denoise`:

* **LoRAs** go to bounded asynchronous loading (:mod:`argus.worker.adapters.lora`): loader processes
  read them into shared memory while the run starts without them; they are merged in place at
  the first step boundary after they are ready, waited for at the bound K, and the base
  weights are copied back, under the model's lock, whatever ends the run.
* **ControlNets** run beside the UNet (:mod:`argus.worker.adapters.controlnet`): on the shared
  ControlNet service (``host:port``) or in process (``local``), the UNet's down and mid blocks
  overlapping them; synchronous or pipelined (``async``).
* **Latent parallelism** (:mod:`argus.worker.adapters.latent_parallel`), when the worker has a peer:
  the two CFG branches run on two devices, each with its own copies of the request's
  ControlNets. A request with LoRAs stays on one device (the peer's UNet is not patched), and
  a peer that has failed sends requests back to the single-device path, counted.

Decisions:

* **Bound K scales with the step count.** ``lora_bound`` is given for ``bound_reference_steps``
  steps (10 of 50 by default: the LoRA changes little in the first fifth of the steps, Katz
  §6); a request with N steps waits at ``round(lora_bound · N / reference)``.
* **Adapters and the approximate cache.** The adapters are part of the cache's key
  (:func:`~argus.contracts.generate.adapters_digest`: LoRAs by name and scale, ControlNets by
  name, scale and control image), so a request resumes only from, and feeds only, latents
  made under the same adapters: a ControlNet's structure, laid down in the early steps a hit
  skips, is then the request's own (:mod:`argus.worker.approx_cache.use` says what stays
  restricted, and why).
* **Errors keep their own classes** and :func:`adapter_status` maps them to gRPC codes: an
  unknown or bad LoRA or ControlNet is INVALID_ARGUMENT whose details start with the
  request's field, ``adapters[i]`` (the request named it, so it is the request's error, and
  the router's HTTP API answers 400 with ``param`` from it; NOT_FOUND would be a 500 there),
  too many adapters INVALID_ARGUMENT on ``adapters``, a saturated loader RESOURCE_EXHAUSTED,
  an unreachable service UNAVAILABLE. The ControlNet path names its own fields
  (``controlnets[j]``, the j-th ControlNet); :meth:`WorkerAdapters.attach` renames them to the
  request's ``adapters[i]``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from argus.contracts.generate import Adapter, AdapterKind
from argus.request_limits import check_adapters
from argus.worker.adapters.controlnet.errors import ControlNetError
from argus.worker.models.pipelines import (
    DiffusionModel,
    GenerationSpec,
    NoisePredictor,
    StepHook,
    StepStart,
)

log = logging.getLogger(__name__)

_CONTROLNET_FIELD = re.compile(r"controlnets\[(\d+)\]")


class AdapterRequestError(ValueError):
    """An adapter entry that cannot be served as given (INVALID_ARGUMENT, ``field`` named)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class AdapterSettings:
    """How a worker serves adapters; each part is off unless configured."""

    lora_dir: str | None = None  # LoRA library directory (safetensors files)
    lora_processes: int = 2  # loader processes
    lora_bound: int = 10  # BAL bound K at ``bound_reference_steps`` steps
    bound_reference_steps: int = 50
    controlnet: str | None = None  # "host:port" of the ControlNet service, "local" or "local:DIR"
    controlnet_mode: str = "sync"  # "sync" or "async" (pipelined: step t uses t−1's residuals)
    latent_parallel: str | None = None  # the peer's device ("cpu", "cuda:1"): CFG on two devices
    controlnet_catalog: str = "tiny"  # the catalog latent parallelism builds ControlNets from

    def __post_init__(self) -> None:
        if self.lora_processes < 1:
            raise ValueError(f"lora_processes: must be >= 1, got {self.lora_processes}")
        if not 0 <= self.lora_bound <= self.bound_reference_steps:
            raise ValueError(
                f"lora_bound: must be in 0..{self.bound_reference_steps}, got {self.lora_bound}"
            )
        if self.controlnet_mode not in ("sync", "async"):
            raise ValueError(
                f"controlnet_mode: expected sync or async, got {self.controlnet_mode!r}"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.lora_dir or self.controlnet or self.latent_parallel)


@dataclass(frozen=True)
class AdapterPlan:
    """A request's adapters, checked: LoRA requests and ControlNet units, in request order."""

    loras: tuple[Any, ...] = ()  # argus.worker.adapters.lora.LoraRequest
    controls: tuple[Any, ...] = ()  # argus.contracts.controlnet.ControlUnit
    control_fields: tuple[str, ...] = ()  # each control's request field, "adapters[i]"

    def __bool__(self) -> bool:
        return bool(self.loras or self.controls)

    @property
    def label(self) -> str:
        return f"{len(self.controls)}C/{len(self.loras)}L"


NO_ADAPTERS = AdapterPlan()


@dataclass
class DenoiseExtras:
    """The keyword arguments :meth:`DiffusionModel.denoise` takes for one request's adapters,
    and, after the run, where its adapter time went (for the timing breakdown)."""

    before_step: list[StepStart] = field(default_factory=list)
    hooks: list[StepHook] = field(default_factory=list)
    on_exit: list[Callable[[], None]] = field(default_factory=list)
    predictor: NoisePredictor | None = None
    timing_ms: dict[str, float] = field(default_factory=dict)
    path: str = "plain"  # "plain", "controlnet" or "latent-parallel"

    def kwargs(self) -> dict[str, Any]:
        return {
            "before_step": self.before_step,
            "hooks": self.hooks,
            "on_exit": self.on_exit,
            "predictor": self.predictor,
        }


class WorkerAdapters:
    """The adapter machinery of one worker: LoRA loader, ControlNet executor, latent peer."""

    def __init__(
        self, settings: AdapterSettings, *, device: str, dtype: torch.dtype, tls: Any = None
    ) -> None:
        self.settings = settings
        # argus.plumbing.internal_tls.InternalTLS for the ControlNet service; None: plain
        self.tls = tls
        self.device = device
        self.dtype = dtype
        self.loras: Any = None  # argus.worker.adapters.lora.LoraLoader
        self.controlnets: Any = None  # ControlNetExecutor
        self.peer: Any = None  # LatentParallelGroup
        self._peer_modules: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.counts = {
            "requests": 0,
            "lora_requests": 0,
            "controlnet_requests": 0,
            "latent_parallel_requests": 0,
            "peer_fallbacks": 0,
        }

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loader processes, connect the ControlNet executor, spawn the peer."""
        s = self.settings
        try:
            if s.lora_dir:
                from argus.worker.adapters.lora import LoraConfig, LoraLibrary, LoraLoader

                self.loras = LoraLoader(
                    LoraLibrary(s.lora_dir),
                    LoraConfig(processes=s.lora_processes, bound=s.lora_bound),
                )
                self.loras.warm()
            if s.controlnet:
                from argus.worker.adapters.controlnet.client import executor_for

                self.controlnets = executor_for(
                    s.controlnet, device=self.device, dtype=self.dtype, tls=self.tls
                )
            if s.latent_parallel:
                from argus.worker.adapters.latent_parallel import (
                    CatalogControlNetLoader,
                    LatentParallelConfig,
                    LatentParallelGroup,
                )

                config = LatentParallelConfig(
                    peer_device=s.latent_parallel,
                    controlnet_loader=CatalogControlNetLoader(s.controlnet_catalog),
                )
                self.peer = LatentParallelGroup.start(config, model_device=self.device)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for part in (self.peer, self.controlnets, self.loras):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.close()
        self.peer = self.controlnets = self.loras = None

    def model_loaded(self, model: DiffusionModel) -> None:
        """A model became active: the latent-parallel peer loads its UNet now, not on the
        first request (a failure only marks the peer unusable)."""
        if self.peer is not None and self.peer.healthy:
            try:
                self.peer.prepare(model)
            except Exception as err:  # the single-device path still serves
                log.warning("latent-parallel peer could not load %s: %s", model.name, err)

    # -- requests --------------------------------------------------------------------------

    def plan(self, adapters: Sequence[Adapter]) -> AdapterPlan:
        """Check a request's adapters; raises AdapterRequestError (an unspecified or unknown
        kind among them) or a LoRA/ControlNet error."""
        if not adapters:
            return NO_ADAPTERS
        check_adapters(adapters)  # the router's words: InvalidRequestError on "adapters"
        loras: list[Any] = []
        controls: list[Any] = []
        control_fields: list[str] = []
        for i, adapter in enumerate(adapters):
            where = f"adapters[{i}]"
            name = adapter.name
            if not name.strip():
                raise AdapterRequestError(f"{where}.name", "missing")
            if adapter.kind is AdapterKind.LORA:
                if self.loras is None:
                    raise AdapterRequestError(where, "this worker serves no LoRAs (no --lora-dir)")
                if adapter.control_image:
                    raise AdapterRequestError(f"{where}.control_image", "only ControlNets take one")
                from argus.worker.adapters.lora import LoraRequest

                request = LoraRequest(name, adapter.scale or 1.0, field=where)
                request.check()
                self.loras.library.path(name, field=where)  # NOT_FOUND now, before anything runs
                loras.append(request)
            elif adapter.kind is AdapterKind.CONTROLNET:
                if self.controlnets is None and self.peer is None:
                    raise AdapterRequestError(
                        where, "this worker serves no ControlNets (no --controlnet)"
                    )
                if not adapter.control_image:
                    raise AdapterRequestError(f"{where}.control_image", "a ControlNet needs a PNG")
                from argus.contracts.controlnet import ControlUnit

                scale = adapter.scale or 1.0
                if not torch.isfinite(torch.tensor(scale)):
                    raise AdapterRequestError(f"{where}.scale", f"{scale} is not finite")
                controls.append(ControlUnit(name, scale, adapter.control_image))
                control_fields.append(where)
            else:
                raise AdapterRequestError(
                    f"{where}.kind", "unspecified or unknown, not LORA or CONTROLNET"
                )
        return AdapterPlan(tuple(loras), tuple(controls), tuple(control_fields))

    def bound(self, steps: int) -> int:
        s = self.settings
        return round(s.lora_bound * steps / s.bound_reference_steps)

    @contextlib.contextmanager
    def attach(
        self, model: DiffusionModel, spec: GenerationSpec, plan: AdapterPlan, request_id: str = ""
    ) -> Iterator[DenoiseExtras]:
        """The denoise arguments for ``plan`` on ``model``; cleans up when the block ends. A
        ControlNet error raised in it, or in the block, names the request's field
        (:func:`at_request_field`)."""
        with self._lock:
            self.counts["requests"] += 1
            self.counts["lora_requests"] += bool(plan.loras)
            self.counts["controlnet_requests"] += bool(plan.controls)
        try:
            with self._attached(model, spec, plan, request_id) as extras:
                yield extras
        except ControlNetError as err:
            raise at_request_field(err, plan) from err

    @contextlib.contextmanager
    def _attached(
        self, model: DiffusionModel, spec: GenerationSpec, plan: AdapterPlan, request_id: str
    ) -> Iterator[DenoiseExtras]:
        extras = DenoiseExtras()
        with contextlib.ExitStack() as stack:
            if plan.loras:
                session = self.loras.open_session(
                    model.pipeline.unet,
                    plan.loras,
                    steps=spec.steps,
                    bound=self.bound(spec.steps),
                    lock=model.lock,
                )
                stack.callback(session.close)
                extras.before_step.append(session.before_step)
                extras.hooks.append(session.after_step)
                extras.on_exit.append(session.on_exit)
                stack.callback(_lora_timing, session, extras)
            if self._use_peer(plan):
                extras.predictor = self.peer.predictor(
                    model, self._peer_controls(model, spec, plan)
                )
                extras.path = "latent-parallel"
                with self._lock:
                    self.counts["latent_parallel_requests"] += 1
            elif plan.controls:
                if self.controlnets is None:
                    raise AdapterRequestError(
                        "adapters", "ControlNets need the latent-parallel peer, which has failed"
                    )
                from argus.worker.adapters.controlnet.predictor import (
                    ControlNetMode,
                    ControlNetPredictor,
                )

                predictor = ControlNetPredictor(
                    model,
                    self.controlnets,
                    plan.controls,
                    mode=ControlNetMode.parse(self.settings.controlnet_mode),
                    request_id=request_id,
                )
                stack.callback(predictor.close)
                stack.callback(_controlnet_timing, predictor, extras)
                extras.predictor = predictor
                extras.path = "controlnet"
            yield extras

    def note_peer_failure(self) -> None:
        with self._lock:
            self.counts["peer_fallbacks"] += 1

    def _use_peer(self, plan: AdapterPlan) -> bool:
        if self.peer is None or plan.loras:
            return False
        return bool(self.peer.healthy)

    def _peer_controls(
        self, model: DiffusionModel, spec: GenerationSpec, plan: AdapterPlan
    ) -> list[Any]:
        if not plan.controls:
            return []
        from argus.worker.adapters.controlnet.models import (
            base_family,
            build_controlnet,
            prepare_control_image,
        )
        from argus.worker.adapters.latent_parallel import ControlInput

        family = base_family(model.pipeline.unet.config)
        inputs = []
        for i, unit in enumerate(plan.controls):
            key = (family, unit.name)
            with self._lock:
                module = self._peer_modules.get(key)
                if module is not None:
                    self._peer_modules.move_to_end(key)
            if module is None:
                try:
                    module = build_controlnet(
                        unit.name,
                        base=family,
                        catalog=self.settings.controlnet_catalog,
                        device=model.device,
                        dtype=model.dtype,
                    )
                except ControlNetError as err:  # the catalog names its own field, "name"
                    raise _with_field(err, f"controlnets[{i}].{err.field or 'name'}") from err
                with self._lock:
                    self._peer_modules[key] = module
                    while len(self._peer_modules) > 8:
                        self._peer_modules.popitem(last=False)
            image = prepare_control_image(
                unit.image,
                spec.height,
                spec.width,
                model.device,
                model.dtype,
                field=f"controlnets[{i}].control_image",
            )
            inputs.append(ControlInput(unit.name, module, image, unit.scale))
        return inputs

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counts)
        if self.loras is not None:
            out["lora_loader"] = self.loras.stats()
        if self.peer is not None:
            out["latent_parallel"] = self.peer.stats()
        return out


def _lora_timing(session: Any, extras: DenoiseExtras) -> None:
    stats = session.stats
    extras.timing_ms["lora_wait_ms"] = stats.wait_s * 1e3
    extras.timing_ms["lora_restore_ms"] = stats.restore_s * 1e3


def _controlnet_timing(predictor: Any, extras: DenoiseExtras) -> None:
    extras.timing_ms["controlnet_open_ms"] = predictor.stats.open_s * 1e3
    extras.timing_ms["controlnet_wait_ms"] = predictor.stats.wait_s * 1e3


def at_request_field(err: ControlNetError, plan: AdapterPlan) -> ControlNetError:
    """``err`` naming the worker request's field: ``controlnets[j]...`` (the j-th ControlNet
    of ``plan``) becomes ``adapters[i]...``, the entry the request gave it at. An error that
    names another field, or none, is returned as it is."""
    match = _CONTROLNET_FIELD.match(err.field)
    if match is None or int(match[1]) >= len(plan.control_fields):
        return err
    return _with_field(err, plan.control_fields[int(match[1])] + err.field[match.end() :])


def _with_field(err: ControlNetError, field: str) -> ControlNetError:
    """A copy of ``err`` (same class and message) that names ``field``."""
    message = str(err).removeprefix(f"{err.field}: ") if err.field else str(err)
    return type(err)(field, message)


def adapter_status(err: BaseException) -> tuple[str, str] | None:
    """The gRPC status code name and details for an adapter error; None for other errors.
    An adapter the request names but the worker does not have (an unknown LoRA or
    ControlNet) is INVALID_ARGUMENT, like a bad one: the request's error, with its field."""
    if isinstance(err, AdapterRequestError):
        return "INVALID_ARGUMENT", str(err)
    from argus.worker.adapters.controlnet.errors import (
        ControlNetBusyError,
        ControlNetError,
        ControlNetLoadError,
        ControlNetUnavailableError,
        InvalidControlNetRequest,
        UnknownControlNetError,
    )
    from argus.worker.adapters.lora.errors import (
        LoraBusyError,
        LoraError,
        LoraInvalidError,
        LoraLoadError,
        LoraNotFoundError,
    )

    if isinstance(err, LoraError):
        where = f"{err.field}: {err}"
        if isinstance(err, LoraNotFoundError | LoraInvalidError):
            return "INVALID_ARGUMENT", where
        if isinstance(err, LoraBusyError):
            return "RESOURCE_EXHAUSTED", where
        if isinstance(err, LoraLoadError):
            return "UNAVAILABLE", where
        return "INTERNAL", where
    if isinstance(err, ControlNetError):
        if isinstance(err, UnknownControlNetError | InvalidControlNetRequest):
            return "INVALID_ARGUMENT", str(err)
        if isinstance(err, ControlNetBusyError):
            return "RESOURCE_EXHAUSTED", str(err)
        if isinstance(err, ControlNetUnavailableError):
            return "UNAVAILABLE", str(err)
        if isinstance(err, ControlNetLoadError):
            return "INTERNAL", str(err)
        return "INTERNAL", str(err)
    return None
