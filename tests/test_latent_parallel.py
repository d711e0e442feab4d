"""Latent parallelism: CFG branches on two processes (gloo on the CPU) give single-device CFG.

One peer process serves most tests (module-scoped: starting one costs seconds of imports);
tests that break a peer start or restart their own.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from argus.worker.adapters.controlnet.models import build_controlnet
from argus.worker.adapters.latent_parallel import (
    ControlInput,
    LatentParallelConfig,
    LatentParallelError,
    LatentParallelGroup,
    PeerFailedError,
    PeerRequestError,
)
from argus.worker.models.pipelines import Conditioning, DiffusionModel, GenerationSpec
from argus.worker.models.sources import TINY_PREFIX, build_tiny_pipeline, load_pipeline_dir
from tests.worker_factories import tiny_model

pytestmark = pytest.mark.unit


STEPS = 3
FAMILY = {"sd-1.5": "sd15", "sdxl": "sdxl"}
# one torch thread in both processes: how an op splits its sums across threads is part of
# its rounding, so equal bits need equal thread counts (the peer's is set by its config)
THREADS = 1
CONFIG = LatentParallelConfig(
    peer_threads=THREADS, start_timeout_s=120.0, load_timeout_s=120.0, step_timeout_s=60.0
)


def spec(prompt: str = "a lighthouse at dusk", **kwargs: Any) -> GenerationSpec:
    kwargs.setdefault("steps", STEPS)
    return GenerationSpec(prompt=prompt, negative_prompt="blurry", **kwargs)


class _Shared:
    group: LatentParallelGroup | None = None


@pytest.fixture(scope="module", autouse=True)
def rank0_threads() -> Iterator[None]:
    """Rank 0 (this process) with the peer's thread count, restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shared() -> Iterator[_Shared]:
    holder = _Shared()
    yield holder
    if holder.group is not None:
        holder.group.close()


@pytest.fixture
def group(shared: _Shared) -> LatentParallelGroup:
    """The module's peer, (re)started when a test before this one closed or broke it."""
    if shared.group is None or not shared.group.healthy:
        if shared.group is not None:
            shared.group.close()
        shared.group = LatentParallelGroup.start(CONFIG)
    return shared.group


def controls(model: DiffusionModel, names: Sequence[str], seed: int = 7) -> list[ControlInput]:
    family = FAMILY[model.name]
    generator = torch.Generator().manual_seed(seed)
    found = []
    for i, name in enumerate(names):
        module = build_controlnet(name, base=family, device="cpu", dtype=torch.float32)
        image = torch.rand((1, 3, 64, 64), generator=generator)
        found.append(ControlInput(name, module, image, scale=1.0 - 0.25 * i))
    return found


def reference(model: DiffusionModel, inputs: Sequence[ControlInput] = ()) -> Any:
    """Single-process CFG computed the way the two ranks split it: each branch a batch of one,
    ControlNet residuals summed and handed to one UNet call per branch (what diffusers'
    ControlNet pipelines do), then the usual guidance.

    Batching matters for exactness: float32 kernels for a batch of two may block their sums
    differently from a batch of one, so the usual batched CFG differs from the two-process
    result by rounding (~1e-5 on these latents) that depends on the machine's kernels. Run
    branch by branch with the same thread count in both processes, the reference performs the
    same operations in the same order as the pair, and the tests can ask for equal bits.
    """

    def branch(
        sample: torch.Tensor,
        t: torch.Tensor,
        embeds: torch.Tensor,
        added: dict[str, torch.Tensor] | None,
    ) -> torch.Tensor:
        down: list[torch.Tensor] | None = None
        mid: torch.Tensor | None = None
        for control in inputs:
            d, m = control.module(
                sample,
                t,
                encoder_hidden_states=embeds,
                controlnet_cond=control.image,
                conditioning_scale=control.scale,
                added_cond_kwargs=added,
                return_dict=False,
            )
            down = list(d) if down is None else [a + b for a, b in zip(down, d, strict=True)]
            mid = m if mid is None else mid + m
        noise: torch.Tensor = model.pipeline.unet(
            sample,
            t,
            encoder_hidden_states=embeds,
            added_cond_kwargs=added,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
            return_dict=False,
        )[0]
        return noise

    def predict(
        latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scheduler: Any, step: int
    ) -> torch.Tensor:
        sample = scheduler.scale_model_input(latents, t)
        halves = [
            branch(
                sample,
                t,
                cond.embeds[i : i + 1],
                {k: v[i : i + 1] for k, v in cond.added.items()} if cond.added else None,
            )
            for i in range(2 if cond.cfg else 1)
        ]
        return model.guide(torch.cat(halves), cond)

    return predict


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(got, expected), f"differs by up to {float((got - expected).abs().max())}"


# -- equivalence -----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["sd-1.5", "sdxl"])
def test_two_processes_match_single_device_cfg(group: LatentParallelGroup, variant: str) -> None:
    model = tiny_model(variant)
    steps_before = group.stats().steps
    expected = model.denoise(spec(), predictor=reference(model)).latents
    got = model.denoise(spec(), predictor=group.predictor(model)).latents
    assert_same(got, expected)
    assert group.stats().steps - steps_before == STEPS  # every step went through the peer


@pytest.mark.parametrize(
    ("variant", "names"), [("sd-1.5", ["canny"]), ("sdxl", ["canny", "depth"])]
)
def test_controlnets_run_per_branch_and_match_one_batched_call(
    group: LatentParallelGroup, variant: str, names: list[str]
) -> None:
    model = tiny_model(variant)
    inputs = controls(model, names)
    expected = model.denoise(spec(), predictor=reference(model, inputs)).latents
    got = model.denoise(spec(), predictor=group.predictor(model, inputs)).latents
    assert_same(got, expected)
    plain = model.denoise(spec(), predictor=reference(model)).latents
    assert float((expected - plain).abs().max()) > 1e-3  # the ControlNets did something


def test_resume_at_step_k_matches(group: LatentParallelGroup) -> None:
    model = tiny_model("sd-1.5")
    full = model.denoise(spec(steps=4), capture=[2])
    start = full.captured[2]
    expected = model.denoise(
        spec(steps=4), start_latents=start, start_step=2, predictor=reference(model)
    ).latents
    got = model.denoise(
        spec(steps=4), start_latents=start, start_step=2, predictor=group.predictor(model)
    ).latents
    assert_same(got, expected)


def test_a_model_directory_is_loaded_by_the_peer_too(
    group: LatentParallelGroup, tmp_path: Path
) -> None:
    """A real model source: the peer loads only ``unet/`` from the same diffusers directory."""
    build_tiny_pipeline(TINY_PREFIX + "sd-1.5").save_pretrained(tmp_path, safe_serialization=True)
    pipeline = load_pipeline_dir(tmp_path, torch.float32)
    model = DiffusionModel("sd-1.5", pipeline, device="cpu", source=str(tmp_path))
    expected = model.denoise(spec(steps=2), predictor=reference(model)).latents
    assert_same(model.denoise(spec(steps=2), predictor=group.predictor(model)).latents, expected)


def test_interleaved_requests_resend_their_state(group: LatentParallelGroup) -> None:
    """Two requests alternating steps on one peer each get their own branch back."""
    model = tiny_model("sd-1.5")
    scheduler = model.new_scheduler()
    scheduler.set_timesteps(STEPS)
    t = scheduler.timesteps[0]
    latents = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        conds = [model.encode(spec(p)) for p in ("a red fox", "a blue whale")]
        predictors = [group.predictor(model), group.predictor(model)]
        for i in (0, 1, 0, 1):
            got = predictors[i](latents, t, conds[i], scheduler, 0)
            assert_same(got, reference(model)(latents, t, conds[i], scheduler, 0))


def test_cfg_off_runs_locally(group: LatentParallelGroup) -> None:
    model = tiny_model("sd-1.5")
    before = group.stats()
    expected = model.denoise(spec(guidance_scale=1.0)).latents
    got = model.denoise(spec(guidance_scale=1.0), predictor=group.predictor(model)).latents
    after = group.stats()
    assert torch.equal(got, expected)
    assert after.steps == before.steps
    assert after.local_requests == before.local_requests + 1


# -- refusals that leave the group usable ----------------------------------------------------


def test_different_weights_are_refused(group: LatentParallelGroup) -> None:
    pipeline = build_tiny_pipeline(TINY_PREFIX + "sd-1.5")
    with torch.no_grad():
        pipeline.unet.conv_in.weight.add_(0.01)
    tampered = DiffusionModel("sd-1.5", pipeline, device="cpu", source=TINY_PREFIX + "sd-1.5")
    with pytest.raises(PeerRequestError, match="differ"):
        group.prepare(tampered)
    assert group.healthy


def test_a_controlnet_the_peer_cannot_build_is_refused(group: LatentParallelGroup) -> None:
    model = tiny_model("sd-1.5")
    good = controls(model, ["canny"])[0]
    wrong_name = ControlInput("no-such-controlnet", good.module, good.image)
    with pytest.raises(PeerRequestError, match="no-such-controlnet"):
        model.denoise(spec(), predictor=group.predictor(model, [wrong_name]))
    wrong_weights = ControlInput("depth", good.module, good.image)  # canny's weights as depth
    with pytest.raises(PeerRequestError, match="differ"):
        model.denoise(spec(), predictor=group.predictor(model, [wrong_weights]))
    assert group.healthy
    expected = model.denoise(spec(), predictor=reference(model)).latents  # and the next is served
    assert_same(model.denoise(spec(), predictor=group.predictor(model)).latents, expected)


# -- failures and life cycle (each test ends its peer; the fixture starts the next one) -------


def test_a_peer_killed_mid_step_is_a_clear_error(group: LatentParallelGroup) -> None:
    model = tiny_model("sd-1.5")
    group.prepare(model)
    pid = group.pid
    assert pid is not None

    def kill_peer(*_: object) -> None:  # runs in rank 0's own branch, while the peer works
        os.kill(pid, signal.SIGKILL)

    handle = model.pipeline.unet.register_forward_pre_hook(kill_peer)
    try:
        with pytest.raises(PeerFailedError, match=rf"{pid} died during step 0") as caught:
            model.denoise(spec(), predictor=group.predictor(model))
    finally:
        handle.remove()
    assert "exit code -9" in str(caught.value)
    assert not group.healthy
    with pytest.raises(PeerFailedError, match="unusable"):
        group.prepare(model)
    group.close()
    assert not group._process.is_alive()


def test_a_hung_peer_times_out(group: LatentParallelGroup) -> None:
    """A peer that stops answering is an error after the timeout, not a hang."""
    group.config = replace(group.config, step_timeout_s=0.5, load_timeout_s=0.5)
    assert group.pid is not None
    os.kill(group.pid, signal.SIGSTOP)
    with pytest.raises(  # the message is the timeout's: a hang would never return
        PeerFailedError, match=re.escape("no answer to loading tiny:sd-1.5 within 0.5 s")
    ):
        group.prepare(tiny_model("sd-1.5"))
    assert not group.healthy and not group._process.is_alive()  # the hung peer was reaped
    group.close()


def test_stop_ends_the_peer_and_refuses_later_use(group: LatentParallelGroup) -> None:
    process = group._process
    group.close()
    assert not process.is_alive()
    assert process.exitcode == 0  # it left on the stop message, not by a signal
    group.close()  # idempotent
    model = tiny_model("sd-1.5")
    with pytest.raises(PeerFailedError, match="closed"):
        model.denoise(spec(), predictor=group.predictor(model))


def test_a_peer_that_cannot_start_is_an_error() -> None:
    config = replace(CONFIG, peer_device="cuda:99", backend="gloo")
    with pytest.raises(PeerFailedError, match="failed to start"):
        LatentParallelGroup.start(config)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="backend"):
        LatentParallelConfig(backend="mpi")
    with pytest.raises(ValueError, match="peer_device"):
        LatentParallelConfig(peer_device="gpu1")
    with pytest.raises(ValueError, match="step_timeout_s"):
        LatentParallelConfig(step_timeout_s=0)
    with pytest.raises(ValueError, match="nccl"):
        LatentParallelGroup.start(LatentParallelConfig(backend="nccl"))
    assert issubclass(PeerFailedError, LatentParallelError)
