"""One loaded diffusion model and the denoising loop the worker runs on it.

:class:`DiffusionModel` wraps a diffusers ``StableDiffusionPipeline`` or
``StableDiffusionXLPipeline`` (real weights or tiny random ones) and runs the denoising loop
itself rather than through ``pipeline.__call__``, because the worker needs what the stock call
does not give:

* **resume at step K** (approximate caching): start from a cached latent with the scheduler
  positioned at step K and run only the remaining N−K steps. The stock call always scales
  given latents by ``init_noise_sigma`` and starts at step 0;
* **capture** the latents after K steps, for every K the cache keeps, during a full run;
* **step hooks**, the seam the adapter workflows (LoRA patching at step boundaries,
  ControlNet residuals) attach to;
* **edits** (:class:`~argus.request_limits.EditInput` on the spec): img2img starts at the step
  its strength implies from the template's latent noised to that step, the resume-at-step-K
  path above with a latent made from an image instead of fetched from the cache; inpainting
  starts from the seed's noise and, after every step, puts back the template's latent noised
  to the next step outside the region (:class:`EditStart`);
* **cancellation** inside steps and decodes: a :class:`CancelToken` whose client went away
  or whose deadline passed stops the run with :class:`Cancelled` at its next *checkpoint*:
  before every step, and before every attention and ResNet block of the UNet and of the VAE's
  decoder (a forward pre-hook installed once per model), so a request stops within one block's
  time, not one step's (a large image's step takes seconds on a CPU). The checkpoints cover
  every path that runs this model's UNet: the default predictor, ControlNet's split UNet and
  rank 0's branch of latent parallelism (the ControlNet service's and the peer's halves of a
  step are theirs to finish).

Decoding (:meth:`DiffusionModel.decode`) an image larger than the VAE's own tile (at least
:data:`MIN_DECODE_TILE` latent pixels) runs diffusers' tiled decode with the token checked
before each tile, since a whole decode's mid-block attention is one uninterruptible call.
Everything else is the pipeline's own: ``encode_prompt``, SDXL's time ids, the scheduler (a
fresh instance per request, so requests never share scheduler state), the VAE's scaling and
the image post-processor. A full run (``start_step=0``) matches
``pipeline(..., output_type="latent")`` for the same seed; this is tested.

"Latents after K steps" are the scheduler's own sample after it has stepped K times, i.e. the
input of step K. Resuming from them with the same scheduler reproduces the rest of the
original trajectory exactly for first-order schedulers (Euler, DDIM); a multistep scheduler
(DPM++) restarts its history at K (close, not identical). Figures: ``docs/worker-internals.md``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from argus.request_limits import EditInput
from argus.worker.models.cuda_graphs import GraphedUNet, call_unet, capturing
from argus.worker.models.sources import make_scheduler, scheduler_name


class Cancelled(Exception):
    """A request stopped before it finished: its client cancelled the call (``reason``
    "cancelled") or its deadline passed (``reason`` "expired")."""

    def __init__(self, reason: str, steps_done: int = 0) -> None:
        super().__init__(
            "deadline passed" if reason == "expired" else "the client cancelled the call"
        )
        self.reason = reason
        self.steps_done = steps_done
        self.stage = "running"  # or "queued": set by the worker when it never got the GPU


class CancelToken:
    """Whether one request should stop: set by the transport when its client goes away, or
    by the clock when ``deadline`` (a ``time.monotonic()`` time; None: none) has passed.
    Thread-safe: the gRPC callback thread cancels while the denoising thread checks."""

    def __init__(
        self, deadline: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.deadline = deadline
        self._clock = clock
        self._cancelled = threading.Event()
        self._reason = "cancelled"

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the request: "cancelled" (its client went away) or "expired" (the transport
        saw its deadline pass first; the first reason given stays)."""
        if not self._cancelled.is_set():
            self._reason = reason
            self._cancelled.set()

    def reason(self) -> str | None:
        """ "cancelled", "expired" or None while the request should go on."""
        if self.deadline is not None and self._clock() >= self.deadline:
            return "expired"
        if self._cancelled.is_set():
            return self._reason
        return None

    def remaining_s(self) -> float | None:
        """Seconds to the deadline (may be negative); None without a deadline."""
        return None if self.deadline is None else self.deadline - self._clock()

    def check(self, steps_done: int = 0) -> None:
        """Raise :class:`Cancelled` if the request should stop."""
        reason = self.reason()
        if reason is not None:
            raise Cancelled(reason, steps_done)


NEVER_CANCELLED = CancelToken()

# the modules whose forward checks the running request's token first (class names, so that
# they match whichever diffusers module defines them): each is a short part of a step
CHECKPOINT_MODULES = frozenset({"Attention", "ResnetBlock2D"})
# the least tile side, in latent pixels, a large image is decoded in: below it, each tile's
# fixed cost dominates (at 2048×2048 on two idle CPU cores the tiny VAE's own 8-pixel tiles
# took 56 s, 32-pixel ones 2.3 s, 64-pixel ones 2.3 s, the whole image 6.9 s; on a loaded
# machine the many small operations of 32-pixel tiles were up to three times slower than
# 64-pixel ones, so 64)
MIN_DECODE_TILE = 64


class _Watch:
    """The token of the run a model is serving now on the calling thread, checked by the
    model's checkpoints (forward pre-hooks on :data:`CHECKPOINT_MODULES`). Per thread: a
    decode on the worker's decode thread (:mod:`argus.worker.engine`) runs beside the step
    batcher's loop on the device thread, and each checks its own request's token, never the
    other's. Holds no reference to the model, so the hooks do not make a reference cycle that
    would keep an unloaded model's weights alive."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def token(self) -> CancelToken:
        token: CancelToken = getattr(self._local, "token", NEVER_CANCELLED)
        return token

    @property
    def steps_done(self) -> int:
        """Reported by a :class:`Cancelled` raised at a checkpoint."""
        done: int = getattr(self._local, "steps_done", 0)
        return done

    @steps_done.setter
    def steps_done(self, done: int) -> None:
        self._local.steps_done = done

    def checkpoint(self, module: torch.nn.Module, args: Any) -> None:
        """A forward pre-hook: raise :class:`Cancelled` if the calling thread's run should
        stop. Silent while a CUDA graph records: a capture is never left half done."""
        if capturing():
            return
        self.token.check(self.steps_done)

    @contextlib.contextmanager
    def watching(self, token: CancelToken) -> Iterator[None]:
        """Check ``token`` at the checkpoints this thread reaches while the block runs."""
        local = self._local
        local.token, local.steps_done = token, 0
        try:
            yield
        finally:
            local.token, local.steps_done = NEVER_CANCELLED, 0


_VAE_LOCKS: weakref.WeakKeyDictionary[torch.nn.Module, threading.Lock] = weakref.WeakKeyDictionary()
_VAE_LOCKS_GUARD = threading.Lock()


def vae_lock(vae: torch.nn.Module) -> threading.Lock:
    """The one lock of a VAE module, whichever models share it
    (:mod:`argus.worker.models.components`
    shares a family's VAE): encoding a template and decoding an image hold it, not the model's
    lock, so a decode can run beside the denoising loop; an fp16 VAE's upcast for a decode
    changes the module's dtype, which nothing else may see meanwhile."""
    with _VAE_LOCKS_GUARD:
        lock = _VAE_LOCKS.get(vae)
        if lock is None:
            lock = _VAE_LOCKS[vae] = threading.Lock()
        return lock


def install_checkpoints(
    root: torch.nn.Module, hook: Callable[..., None]
) -> list[torch.utils.hooks.RemovableHandle]:
    """Register ``hook`` as a forward pre-hook on every module of ``root`` whose class is in
    :data:`CHECKPOINT_MODULES`; returns the hooks' handles."""
    return [
        module.register_forward_pre_hook(hook)
        for module in root.modules()
        if type(module).__name__ in CHECKPOINT_MODULES
    ]


# called after every step with (steps done, latents); may return replacement latents
StepHook = Callable[[int, torch.Tensor], torch.Tensor | None]
# called before every step with the index of the step about to run; may block (LoRA BAL waits)
StepStart = Callable[[int], None]
"""Runs before a step, under the model's lock. One that changes weights must change them in
place (``addmm_``, ``copy_``): a CUDA graph or compiled forward replays over the same storage."""

UNetCall = Callable[
    [torch.Tensor, "torch.Tensor | float", torch.Tensor, "dict[str, torch.Tensor] | None"],
    torch.Tensor,
]
"""A UNet's forward as ``(sample, t, embeds, added) -> noise``: :meth:`DiffusionModel.fast_unet`."""


class NoisePredictor(Protocol):
    """One guided noise prediction; :meth:`DiffusionModel.predict_noise` is the default.

    Adapter workflows replace it: ControlNet residuals computed beside the UNet, CFG branches
    on two devices (latent parallelism). ``step`` is the index of the step being run.
    """

    def __call__(
        self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scheduler: Any, step: int
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class GenerationSpec:
    """What to generate. ``guidance_scale`` 0 means the model's default."""

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    height: int = 64
    width: int = 64
    steps: int = 50
    guidance_scale: float = 0.0
    edit: EditInput | None = None  # img2img or inpainting of a template; None: from noise

    @property
    def start_step(self) -> int:
        """The step a run of this spec starts at without the cache: an img2img edit's by its
        strength, else 0."""
        return 0 if self.edit is None else self.edit.start_step(self.steps)


@dataclass(frozen=True)
class EditStart:
    """Where an edit's denoising starts (:meth:`DiffusionModel.start_edit`), and for
    inpainting how every step keeps the template outside the region.

    ``template`` is the image's latent (VAE-encoded, scaled to the scheduler's space);
    ``region`` is the edited region at latent resolution, 1 where edited (a latent pixel is
    edited when any of its 8×8 pixels is, so every edited pixel is generated, not
    reconstructed from the template's latent); None for img2img. This is the seam InstGenIE's
    mask-aware activation cache slots into: the tokens outside ``region`` are the same in
    every edit of one template, so a :class:`NoisePredictor` given ``region`` can compute
    attention and feed-forward for the edited tokens only and take the rest from the
    template's recorded run."""

    latents: torch.Tensor  # the input of the edit's first step
    template: torch.Tensor
    noise: torch.Tensor  # the seed's noise, unscaled (the template is noised with it)
    region: torch.Tensor | None
    scheduler: Any  # a scheduler of the run's timesteps, used only to noise the template

    def blend(self, steps: int) -> StepHook:
        """The step hook of inpainting: after step ``done`` the latent outside the region is
        the template noised to the next step's level (the template itself after the last),
        as diffusers' inpainting pipeline does for a UNet with 4 input channels."""
        region = self.region
        assert region is not None
        keep = 1.0 - region
        order = int(getattr(self.scheduler, "order", 1))
        timesteps = self.scheduler.timesteps

        def kept(done: int, latents: torch.Tensor) -> torch.Tensor:
            known = self.template
            if done < steps:
                t = timesteps[done * order : done * order + 1]
                known = self.scheduler.add_noise(self.template, self.noise, t)
            blended: torch.Tensor = keep * known + region * latents
            return blended

        return kept


@dataclass
class DenoiseResult:
    latents: torch.Tensor  # final latents, scheduler space
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # step K -> latents after K
    steps_run: int = 0
    encode_s: float = 0.0
    denoise_s: float = 0.0


@dataclass(frozen=True)
class Conditioning:
    """Text conditioning for one request, CFG branches stacked (negative first)."""

    embeds: torch.Tensor
    added: dict[str, torch.Tensor] | None  # SDXL: pooled text embeds and time ids
    guidance_scale: float

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0


class DiffusionModel:
    """A loaded pipeline: encode, denoise (from noise or from step K), decode."""

    def __init__(self, name: str, pipeline: Any, *, device: str, source: str) -> None:
        self.name = name
        self.pipeline = pipeline
        self.device = device
        self.source = source
        self.xl = hasattr(pipeline, "text_encoder_2")
        self.dtype: torch.dtype = pipeline.unet.dtype
        self.scheduler_config: dict[str, Any] = dict(pipeline.scheduler.config)
        self.scheduler_name = scheduler_name(pipeline.scheduler)
        self.vae_scale_factor = int(pipeline.vae_scale_factor)
        self.latent_channels = int(pipeline.unet.config.in_channels)
        self.default_guidance = 5.0 if self.xl else 7.5
        # the tokenizer and modules are not safe to drive from two threads at once
        self.lock = threading.Lock()
        pipeline.set_progress_bar_config(disable=True)
        self._watch = _Watch()
        self._hooks = install_checkpoints(pipeline.unet, self._watch.checkpoint)
        vae_decoder = getattr(pipeline.vae, "decoder", None)
        if isinstance(vae_decoder, torch.nn.Module):
            self._hooks += install_checkpoints(vae_decoder, self._watch.checkpoint)
        self.checkpoints = len(self._hooks)
        self.graphs: GraphedUNet | None = None  # use_cuda_graphs() sets it
        self.compiled_unet: Any = None  # use_compile() sets it: torch.compile(unet)

    # -- parts -----------------------------------------------------------------------------

    def new_scheduler(self) -> Any:
        return make_scheduler(self.scheduler_name, self.scheduler_config)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        f = self.vae_scale_factor
        return (1, self.latent_channels, height // f, width // f)

    def initial_noise(self, spec: GenerationSpec, scheduler: Any) -> torch.Tensor:
        """The seeded starting noise, drawn on the CPU so a seed means the same on any device."""
        scaled: torch.Tensor = self.seed_noise(spec) * scheduler.init_noise_sigma
        return scaled.to(self.device, self.dtype)

    def seed_noise(self, spec: GenerationSpec) -> torch.Tensor:
        """The seed's standard normal noise of the latent's shape (float32, on the CPU)."""
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        shape = self.latent_shape(spec.height, spec.width)
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    def encode_image(self, rgb: Any) -> torch.Tensor:
        """An RGB image (height × width × 3, uint8) as a latent in the scheduler's space: the
        VAE's mode (deterministic: an edit of a template starts from one latent), scaled as
        :meth:`decode` unscales it. Holds the VAE's lock (:func:`vae_lock`)."""
        vae = self.pipeline.vae
        config = vae.config
        with vae_lock(vae):
            upcast = vae.dtype == torch.float16 and getattr(config, "force_upcast", False)
            encoder = vae.to(torch.float32) if upcast else vae
            try:
                rgb_pixels = torch.from_numpy(np.array(rgb)).permute(2, 0, 1).unsqueeze(0)
                x = (rgb_pixels.to(torch.float32) / 127.5 - 1.0).to(self.device, encoder.dtype)
                z = encoder.encode(x).latent_dist.mode()
            finally:
                if upcast:
                    vae.to(torch.float16)
        mean = getattr(config, "latents_mean", None)
        std = getattr(config, "latents_std", None)
        if mean is not None and std is not None:
            channels = z.shape[1]
            m = torch.tensor(mean).view(1, channels, 1, 1).to(z)
            s = torch.tensor(std).view(1, channels, 1, 1).to(z)
            z = (z - m) * config.scaling_factor / s
        else:
            z = z * config.scaling_factor
        latent: torch.Tensor = z.to(self.device, self.dtype)
        return latent

    def start_edit(self, spec: GenerationSpec) -> EditStart:
        """Step 3 of an edit (prepare the latents), under the model's lock: the template's
        latent, and the first step's input. Inpainting and img2img at strength 1 start from
        the seed's noise exactly as a generation does (diffusers' inpainting pipeline at
        strength 1; its img2img pipeline noises the image to the first timestep instead, which
        leaves a trace of it in an image asked to be made anew); img2img below 1 starts from
        the template noised to its start step.

        Inpainting's noise is the request's seed inside the region and the template's own
        (:attr:`~argus.request_limits.EditInput.template_seed`) outside it: the unmasked
        latents of every edit of one template are then the same at every step, whatever the
        seed, which is what the mask-aware activation cache reuses; the region itself, all an
        edit shows, varies with the seed as a generation does."""
        edit = spec.edit
        assert edit is not None
        scheduler = self.new_scheduler()
        scheduler.set_timesteps(spec.steps, device=self.device)
        template = self.encode_image(edit.rgb)
        noise = self.seed_noise(spec)
        region = self.edit_region(spec)
        if region is not None:
            own = self.seed_noise(replace(spec, seed=edit.template_seed))
            noise = region * noise + (1.0 - region) * own
            region = region.to(self.device, self.dtype)
        noise = noise.to(self.device, self.dtype)
        start = spec.start_step
        if start == 0:
            latents = (noise * scheduler.init_noise_sigma).to(self.device, self.dtype)
        else:
            order = int(getattr(scheduler, "order", 1))
            t = scheduler.timesteps[start * order : start * order + 1]
            latents = scheduler.add_noise(template, noise, t)
        return EditStart(latents, template, noise, region, scheduler)

    def edit_region(self, spec: GenerationSpec) -> torch.Tensor | None:
        """An inpainting edit's region at latent resolution (1×1×h×w, float32 on the CPU, 1
        where edited): a latent pixel is edited when any of its pixels is. None for img2img
        and generations."""
        if spec.edit is None or spec.edit.region is None:
            return None
        f = self.vae_scale_factor
        pixels = torch.from_numpy(np.array(spec.edit.region)).to(torch.float32)[None, None]
        return torch.nn.functional.max_pool2d(pixels, f)

    def encode(self, spec: GenerationSpec) -> Conditioning:
        scale = spec.guidance_scale or self.default_guidance
        cfg = scale > 1.0
        pipe = self.pipeline
        if self.xl:
            embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
                prompt=spec.prompt,
                device=self.device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=cfg,
                negative_prompt=spec.negative_prompt or None,
            )
            size = (spec.height, spec.width)
            time_ids = pipe._get_add_time_ids(
                size,
                (0, 0),
                size,
                dtype=embeds.dtype,
                text_encoder_projection_dim=int(pipe.text_encoder_2.config.projection_dim),
            ).to(self.device)
            if cfg:
                embeds = torch.cat([negative, embeds])
                pooled = torch.cat([negative_pooled, pooled])
                time_ids = torch.cat([time_ids, time_ids])
            added = {"text_embeds": pooled, "time_ids": time_ids}
            return Conditioning(embeds, added, scale)
        embeds, negative = pipe.encode_prompt(
            spec.prompt, self.device, 1, cfg, negative_prompt=spec.negative_prompt or None
        )
        if cfg:
            embeds = torch.cat([negative, embeds])
        return Conditioning(embeds, None, scale)

    @staticmethod
    def unet_input(
        latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scheduler: Any
    ) -> torch.Tensor:
        """The UNet's input for one step: both CFG branches stacked (negative first), scaled."""
        model_input = torch.cat([latents, latents]) if cond.cfg else latents
        scaled: torch.Tensor = scheduler.scale_model_input(model_input, t)
        return scaled

    @staticmethod
    def guide(noise: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Classifier-free guidance over the stacked branches' predictions."""
        if not cond.cfg:
            return noise
        uncond, text = noise.chunk(2)
        return uncond + cond.guidance_scale * (text - uncond)

    def predict_noise(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        cond: Conditioning,
        scheduler: Any,
        step: int = 0,
        *,
        unet: UNetCall | None = None,
    ) -> torch.Tensor:
        """One UNet evaluation with classifier-free guidance (the default predictor); ``unet``
        replaces the eager module's forward (:meth:`fast_unet`: its CUDA graphs or its
        compiled forward)."""
        sample = self.unet_input(latents, t, cond, scheduler)
        forward = unet if unet is not None else functools.partial(call_unet, self.pipeline.unet)
        return self.guide(forward(sample, t, cond.embeds, cond.added), cond)

    def fast_unet(self) -> UNetCall | None:
        """The UNet's forward for runs that do not patch its blocks (plain and LoRA runs, whose
        in-place merge keeps every weight's storage): its CUDA graphs if it has them, else its
        compiled forward if it has one, else None (eager)."""
        if self.graphs is not None:
            return self.graphs
        if self.compiled_unet is not None:
            return functools.partial(call_unet, self.compiled_unet)
        return None

    def use_compile(self, mode: str = "default", backend: str = "inductor") -> None:
        """Run plain and LoRA runs' UNet through ``torch.compile(unet, mode=, backend=)`` from
        now on (compiled lazily, by the first call of each shape;
        :mod:`argus.worker.models.compiled` warms it up and times it). CUDA graphs taken
        before are retaken over the compiled forward."""
        self.compiled_unet = torch.compile(self.pipeline.unet, mode=mode, backend=backend)
        if self.graphs is not None:
            self.use_cuda_graphs(self.graphs.max_graphs, capture=self.graphs.capture)

    def use_cuda_graphs(
        self,
        max_graphs: int = 4,
        *,
        capture: str = "cuda",
        on_capture: Callable[[str, float], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """Replay the UNet's work from CUDA graphs from now on: plain and LoRA runs, batched
        steps, ControlNet steps and edit replays (:mod:`argus.worker.models.cuda_graphs`;
        ``capture``, ``on_capture`` and ``on_failure`` are
        :class:`~argus.worker.models.cuda_graphs.GraphedUNet`'s). The graphs capture the
        compiled forward when :meth:`use_compile` ran first. ValueError off CUDA (unless
        ``capture="eager"``, the tests' stand-in)."""
        unet = self.compiled_unet if self.compiled_unet is not None else self.pipeline.unet
        if self.graphs is not None:
            on_capture = on_capture or self.graphs.on_capture
            on_failure = on_failure or self.graphs.on_failure
        self.graphs = GraphedUNet(
            unet, max_graphs, capture=capture, on_capture=on_capture, on_failure=on_failure
        )

    def start_run(
        self,
        spec: GenerationSpec,
        start_latents: torch.Tensor | None,
        start_step: int,
        hooks: tuple[StepHook, ...],
    ) -> tuple[Any, torch.Tensor, torch.Tensor, tuple[StepHook, ...]]:
        """A run's own scheduler (set to begin at ``start_step``), the timesteps it has left,
        its starting latents (an edit's from :meth:`start_edit`, else ``start_latents``, else
        the seed's noise) and its step hooks (inpainting's blend first). Under the model's
        lock; :meth:`denoise` and the step batcher start every run here."""
        scheduler = self.new_scheduler()
        scheduler.set_timesteps(spec.steps, device=self.device)
        order = int(getattr(scheduler, "order", 1))
        timesteps = scheduler.timesteps[start_step * order :]
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(start_step * order)
        if spec.edit is not None:
            edit = self.start_edit(spec)
            latents = edit.latents
            if edit.region is not None:
                hooks = (edit.blend(spec.steps), *hooks)
        elif start_latents is None:
            latents = self.initial_noise(spec, scheduler)
        else:
            latents = start_latents.to(self.device, self.dtype)
        return scheduler, timesteps, latents, hooks

    # -- the loop --------------------------------------------------------------------------

    def denoise(
        self,
        spec: GenerationSpec,
        *,
        start_latents: torch.Tensor | None = None,
        start_step: int = 0,
        capture: Iterable[int] = (),
        hooks: Iterable[StepHook] = (),
        before_step: Iterable[StepStart] = (),
        predictor: NoisePredictor | None = None,
        on_exit: Iterable[Callable[[], None]] = (),
        cancel: CancelToken = NEVER_CANCELLED,
        on_step: Callable[[int], None] | None = None,
    ) -> DenoiseResult:
        """Run steps ``start_step`` … N−1; ``start_latents`` are the latents after ``start_step``.

        ``capture`` names the steps K whose latents (after K steps) are returned, for the
        cache. Without ``start_latents`` the run starts from the seed's noise at step 0.
        ``before_step`` callbacks run before each step (with its index), ``hooks`` after it;
        ``predictor`` replaces :meth:`predict_noise`; ``on_exit`` callbacks run when the run
        ends, normally or by an exception. All run under the model's lock, so a callback may
        patch the model's weights for this request alone and undo it before another request
        can see them.

        ``cancel`` is checked before every step and at the UNet's checkpoints inside it: once
        it says stop, the run raises :class:`Cancelled` before the next block (``on_exit``
        still runs).
        ``on_step`` is called with the index of each step after it ran (the worker counts
        steps with it).

        An edit (``spec.edit``) starts at ``spec.start_step`` from latents it makes itself
        (:meth:`start_edit`; ``start_latents`` must be None), and inpainting's blend runs as
        the first step hook, so the other hooks (adapters, progress previews) see the latent
        with the template put back.
        """
        if not 0 <= start_step < spec.steps:
            raise ValueError(f"start_step {start_step} outside [0, {spec.steps})")
        if spec.edit is not None and (start_latents is not None or start_step != spec.start_step):
            raise ValueError(f"an edit starts at its own step {spec.start_step}, from its image")
        if spec.edit is None and start_step > 0 and start_latents is None:
            raise ValueError("resuming at a step > 0 needs start_latents")
        wanted = {k for k in capture if start_step < k < spec.steps}
        hooks = tuple(hooks)
        starts = tuple(before_step)
        exits = tuple(on_exit)
        if predictor is not None:
            predict = predictor
        elif (fast := self.fast_unet()) is not None:
            # no block is patched: LoRA's before_step merges in place, which a graph sees
            predict = functools.partial(self.predict_noise, unet=fast)
        else:
            predict = self.predict_noise
        with self.lock, torch.inference_mode(), self._watch.watching(cancel):
            try:
                began = time.perf_counter()
                cond = self.encode(spec)
                scheduler, timesteps, latents, hooks = self.start_run(
                    spec, start_latents, start_step, hooks
                )
                encoded = time.perf_counter()
                captured: dict[int, torch.Tensor] = {}
                step = start_step
                for t in timesteps:
                    self._watch.steps_done = step - start_step
                    cancel.check(step - start_step)
                    for start in starts:
                        start(step)
                    noise = predict(latents, t, cond, scheduler, step)
                    latents = scheduler.step(noise, t, latents, return_dict=False)[0]
                    if on_step is not None:
                        on_step(step)
                    step += 1
                    for hook in hooks:
                        replaced = hook(step, latents)
                        if replaced is not None:
                            latents = replaced
                    if step in wanted:
                        captured[step] = latents.detach().to("cpu", torch.float32).clone()
                done = time.perf_counter()
            finally:
                for exit_callback in exits:  # e.g. restore LoRA-patched weights, under the lock
                    exit_callback()
        return DenoiseResult(
            latents=latents,
            captured=captured,
            steps_run=len(timesteps),
            encode_s=encoded - began,
            denoise_s=done - encoded,
        )

    def decode(self, latents: torch.Tensor, cancel: CancelToken = NEVER_CANCELLED) -> Image.Image:
        """Latents to an RGB image through the VAE (upcast to fp32 where the VAE asks for it).

        ``cancel`` is checked at the decoder's checkpoints and, for an image larger than one
        tile (:meth:`decode_tile`), before each tile; it raises :class:`Cancelled`.
        """
        vae = self.pipeline.vae
        with vae_lock(vae), torch.inference_mode(), self._watch.watching(cancel):
            config = vae.config
            upcast = vae.dtype == torch.float16 and getattr(config, "force_upcast", False)
            decoder = vae.to(torch.float32) if upcast else vae
            try:
                x = latents.to(self.device, decoder.dtype)
                mean = getattr(config, "latents_mean", None)
                std = getattr(config, "latents_std", None)
                if mean is not None and std is not None:
                    channels = x.shape[1]
                    m = torch.tensor(mean).view(1, channels, 1, 1).to(x)
                    s = torch.tensor(std).view(1, channels, 1, 1).to(x)
                    x = x * s / config.scaling_factor + m
                else:
                    x = x / config.scaling_factor
                tile = self.decode_tile()
                if tile is not None and max(x.shape[-2:]) > tile:
                    image = decode_tiled(decoder, x, tile, self.vae_scale_factor, cancel)
                else:
                    image = decoder.decode(x, return_dict=False)[0]
            finally:
                if upcast:
                    vae.to(torch.float16)
            pil: list[Image.Image] = self.pipeline.image_processor.postprocess(
                image, output_type="pil"
            )
        return pil[0]

    def decode_tile(self) -> int | None:
        """The tile side, in latent pixels, above which :meth:`decode` decodes in tiles: the
        VAE's own tile, at least :data:`MIN_DECODE_TILE`; None when the VAE cannot tile."""
        vae = self.pipeline.vae
        own = getattr(vae, "tile_latent_min_size", None)
        if own is None or not hasattr(vae, "blend_v") or not hasattr(vae, "decoder"):
            return None
        return max(int(own), MIN_DECODE_TILE)

    def parameter_bytes(self) -> int:
        total = 0
        for part in self.pipeline.components.values():
            if isinstance(part, torch.nn.Module):
                total += sum(p.numel() * p.element_size() for p in part.parameters())
        return total

    def release(self) -> None:
        """Remove this model's checkpoints from its modules, which may be shared with models
        that stay resident (the worker's component registry): without this, every unloaded
        model would leave a hook behind on a shared VAE. A request still running on a
        released model keeps its step-boundary checks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def to(self, device: str) -> None:
        self.pipeline.to(device)
        self.device = device


def decode_tiled(
    vae: Any, z: torch.Tensor, tile: int, scale: int, cancel: CancelToken = NEVER_CANCELLED
) -> torch.Tensor:
    """diffusers' ``AutoencoderKL.tiled_decode`` with a tile of ``tile`` latent pixels (the
    VAE's own may be too small to be worth it) and ``cancel`` checked before each tile.

    Tiles overlap by the VAE's ``tile_overlap_factor``; each decoded tile is blended into the
    one above and the one to its left over the overlap, as diffusers does, so the output
    equals ``tiled_decode`` with ``tile_latent_min_size = tile`` (tested).
    """
    overlap = vae.tile_overlap_factor
    stride = int(tile * (1 - overlap))
    sample_tile = tile * scale
    blend = int(sample_tile * overlap)
    keep = sample_tile - blend
    rows: list[list[torch.Tensor]] = []
    for i in range(0, z.shape[2], stride):
        row = []
        for j in range(0, z.shape[3], stride):
            cancel.check()
            part = z[:, :, i : i + tile, j : j + tile]
            if vae.post_quant_conv is not None:
                part = vae.post_quant_conv(part)
            row.append(vae.decoder(part))
        rows.append(row)
    out_rows = []
    for i, row in enumerate(rows):
        out_row = []
        for j, part in enumerate(row):
            if i > 0:
                part = vae.blend_v(rows[i - 1][j], part, blend)
            if j > 0:
                part = vae.blend_h(row[j - 1], part, blend)
            out_row.append(part[:, :, :keep, :keep])
        out_rows.append(torch.cat(out_row, dim=3))
    return torch.cat(out_rows, dim=2)


def paste_unmasked(image: Image.Image, edit: EditInput) -> Image.Image:
    """The decoded ``image`` with the pixels outside the edit's region taken from the template,
    so that they come back exactly as sent (the VAE's round trip alone changes them); an
    img2img edit (no region) is returned as decoded."""
    if edit.region is None:
        return image
    pixels = np.array(image.convert("RGB"), dtype=np.uint8)
    pixels[~edit.region] = edit.rgb[~edit.region]
    return Image.fromarray(pixels, mode="RGB")
