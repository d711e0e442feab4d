"""One loaded diffusion model and the denoising loop the worker runs on it.

:class:`DiffusionModel` wraps a diffusers ``StableDiffusionPipeline`` or
``StableDiffusionXLPipeline`` (real weights or tiny random ones) and runs the denoising loop
itself rather than through ``pipeline.__call__``, because the worker needs three things the
stock call does not give:

* **resume at step K** (approximate caching): start from a cached latent with the scheduler
  positioned at step K and run only the remaining N−K steps. The stock call always scales
  given latents by ``init_noise_sigma`` and starts at step 0;
* **capture** the latents after K steps, for every K the cache keeps, during a full run;
* **step hooks**, the seam the adapter workflows (LoRA patching at step boundaries,
  ControlNet residuals) attach to;
* **cancellation** at step boundaries: a :class:`CancelToken` whose client went away or whose
  deadline passed stops the loop before its next step with :class:`Cancelled`, so an expired
  request frees the GPU after at most one more step instead of running to the end.

Everything else is the pipeline's own: ``encode_prompt``, SDXL's time ids, the scheduler
(a fresh instance per request, built from the pipeline's scheduler config, so requests never
share scheduler state), the VAE's scaling and the image post-processor. A full run
(``start_step=0``) matches ``pipeline(..., output_type="latent")`` for the same seed; this is
tested.

"Latents after K steps" are the scheduler's own sample after it has stepped K times, i.e. the
input of step K. Resuming from them with the same scheduler reproduces the rest of the
original trajectory exactly for first-order schedulers (Euler, DDIM). A multistep scheduler
(DPM++) restarts its history at K, so its resumed run is close but not identical.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from PIL import Image

from argus.worker.models import make_scheduler, scheduler_name


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

# called after every step with (steps done, latents); may return replacement latents
StepHook = Callable[[int, torch.Tensor], torch.Tensor | None]
# called before every step with the index of the step about to run; may block (LoRA BAL waits)
StepStart = Callable[[int], None]


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

    # -- parts -----------------------------------------------------------------------------

    def new_scheduler(self) -> Any:
        return make_scheduler(self.scheduler_name, self.scheduler_config)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        f = self.vae_scale_factor
        return (1, self.latent_channels, height // f, width // f)

    def initial_noise(self, spec: GenerationSpec, scheduler: Any) -> torch.Tensor:
        """The seeded starting noise, drawn on the CPU so a seed means the same on any device."""
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        shape = self.latent_shape(spec.height, spec.width)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        scaled: torch.Tensor = noise * scheduler.init_noise_sigma
        return scaled.to(self.device, self.dtype)

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
    ) -> torch.Tensor:
        """One UNet evaluation with classifier-free guidance (the default predictor)."""
        noise: torch.Tensor = self.pipeline.unet(
            self.unet_input(latents, t, cond, scheduler),
            t,
            encoder_hidden_states=cond.embeds,
            added_cond_kwargs=cond.added,
            return_dict=False,
        )[0]
        return self.guide(noise, cond)

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

        ``cancel`` is checked before every step: once it says stop, the loop raises
        :class:`Cancelled` without running another step (``on_exit`` still runs).
        ``on_step`` is called with the index of each step after it ran (the worker counts
        steps with it).
        """
        if not 0 <= start_step < spec.steps:
            raise ValueError(f"start_step {start_step} outside [0, {spec.steps})")
        if start_step > 0 and start_latents is None:
            raise ValueError("resuming at a step > 0 needs start_latents")
        wanted = {k for k in capture if start_step < k < spec.steps}
        hooks = tuple(hooks)
        starts = tuple(before_step)
        exits = tuple(on_exit)
        predict = self.predict_noise if predictor is None else predictor
        with self.lock, torch.inference_mode():
            try:
                began = time.perf_counter()
                cond = self.encode(spec)
                scheduler = self.new_scheduler()
                scheduler.set_timesteps(spec.steps, device=self.device)
                order = int(getattr(scheduler, "order", 1))
                timesteps = scheduler.timesteps[start_step * order :]
                if hasattr(scheduler, "set_begin_index"):
                    scheduler.set_begin_index(start_step * order)
                if start_latents is None:
                    latents = self.initial_noise(spec, scheduler)
                else:
                    latents = start_latents.to(self.device, self.dtype)
                encoded = time.perf_counter()
                captured: dict[int, torch.Tensor] = {}
                step = start_step
                for t in timesteps:
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

    def decode(self, latents: torch.Tensor) -> Image.Image:
        """Latents to an RGB image through the VAE (upcast to fp32 where the VAE asks for it)."""
        vae = self.pipeline.vae
        with self.lock, torch.inference_mode():
            config = vae.config
            upcast = vae.dtype == torch.float16 and getattr(config, "force_upcast", False)
            decoder = vae.to(torch.float32) if upcast else vae
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
            image = decoder.decode(x, return_dict=False)[0]
            if upcast:
                vae.to(torch.float16)
            pil: list[Image.Image] = self.pipeline.image_processor.postprocess(
                image, output_type="pil"
            )
        return pil[0]

    def parameter_bytes(self) -> int:
        total = 0
        for part in self.pipeline.components.values():
            if isinstance(part, torch.nn.Module):
                total += sum(p.numel() * p.element_size() for p in part.parameters())
        return total

    def to(self, device: str) -> None:
        self.pipeline.to(device)
        self.device = device
