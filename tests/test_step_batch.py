"""Step-level continuous batching (argus/worker/editing/step_batch.py; issue 33, item 1): a
request's
final latents in a batch are its latents run alone through ``DiffusionModel.denoise``, with
requests of different kinds (generation, img2img at different strengths, inpainting of
different templates and mask ratios, different prompts and step counts) joining at different
steps; a cancel or an expired deadline frees its slot at the next step and leaves the others'
outputs as they were; bound 1 serialises.

Tolerance: at one torch thread a request alone in the batcher is bit for bit its ``denoise``
run (asserted with ``torch.equal``), but in a batch of several its rows go through batched
matmuls and convolutions that on the CPU may sum in another order than its rows alone (one
tiny-UNet call: up to 7e-7 absolute, measured), and the steps carry that on, so batched
outputs are compared with :data:`ATOL` / :data:`RTOL` (measured: at most 1.4e-5 absolute on
final latents of magnitude up to 19 after 4-6 steps). A wrong step is far outside it (another
seed: 24; breaking the batcher by sharing one scheduler between requests, or giving every row
the first request's timestep, fails the batched tests; tried by hand), which
:func:`test_the_tolerance_catches_a_wrong_step` checks for one case.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from argus.request_limits import EditInput
from argus.worker.editing.step_batch import StepBatcher
from argus.worker.models.pipelines import Cancelled, CancelToken, DiffusionModel, GenerationSpec
from tests.editing_factories import SIZE, region_of, template_rgb
from tests.worker_factories import tiny_model, torch_threads

pytestmark = pytest.mark.unit

ATOL = 1e-4
RTOL = 1e-4


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    return tiny_model("sd-1.5")


def specs() -> dict[str, GenerationSpec]:
    """A mixed batch: a generation, two img2img strengths, two inpaintings (two templates,
    two mask ratios), different prompts, seeds and step counts."""
    one, two = template_rgb(SIZE, seed=7), template_rgb(SIZE, seed=11)
    return {
        "gen": GenerationSpec("a red bus in the snow", seed=1, steps=6),
        "i2i-half": GenerationSpec(
            "a watercolour", seed=2, steps=6, edit=EditInput(one, None, 0.5)
        ),
        "i2i-most": GenerationSpec(
            "an oil painting", seed=3, steps=5, edit=EditInput(two, None, 0.8)
        ),
        "inpaint-small": GenerationSpec(
            "a cat", seed=4, steps=6, edit=EditInput(one, region_of(0.25), 1.0)
        ),
        "inpaint-large": GenerationSpec(
            "a dog on a sofa", seed=5, steps=4, edit=EditInput(two, region_of(0.5), 1.0)
        ),
    }


def alone(model: DiffusionModel, spec: GenerationSpec) -> torch.Tensor:
    return model.denoise(spec, start_step=spec.start_step).latents


def test_bound_one_serialises_and_matches_denoise_bit_for_bit(model: DiffusionModel) -> None:
    batcher = StepBatcher(model, bound=1)
    cases = specs()
    futures = {name: batcher.submit(spec, key=name) for name, spec in cases.items()}
    order: list[str] = []
    while not batcher.idle():
        batcher.step()
        running = batcher.running
        if running and (not order or order[-1] != running[0]):
            order.append(str(running[0]))
    assert set(batcher.stats.rows_per_step) == {1}
    steps = [spec.steps - spec.start_step for spec in cases.values()]
    assert batcher.stats.steps == sum(steps)
    finished = sorted(futures, key=lambda name: futures[name].result().finished_s)
    assert finished == list(cases)  # arrival order, one at a time
    for name, spec in cases.items():
        result = futures[name].result()
        assert result.steps_run == spec.steps - spec.start_step
        assert torch.equal(result.latents, alone(model, spec)), name


def test_requests_joining_at_different_steps_match_their_runs_alone(
    model: DiffusionModel,
) -> None:
    cases = specs()
    batcher = StepBatcher(model, bound=4)
    futures = {"gen": batcher.submit(cases["gen"], key="gen")}
    batcher.step()
    batcher.step()
    futures["i2i-half"] = batcher.submit(cases["i2i-half"], key="i2i-half")
    batcher.step()
    for name in ("inpaint-small", "inpaint-large", "i2i-most"):
        futures[name] = batcher.submit(cases[name], key=name)
    batcher.run_until_idle()
    joined = {name: future.result().joined_at_step for name, future in futures.items()}
    assert joined["gen"] == 0 and joined["i2i-half"] == 2
    assert joined["inpaint-small"] == joined["inpaint-large"] == 3
    assert joined["i2i-most"] > 3  # the bound of 4 held it until a slot freed
    assert max(batcher.stats.rows_per_step) == 4
    stats = batcher.stats  # the UNet's time by batch size covers every step, once
    assert stats.steps_by_batch == {
        size: stats.rows_per_step.count(size) for size in set(stats.rows_per_step)
    }
    assert sum(stats.unet_s_by_batch.values()) == pytest.approx(stats.unet_s)
    for name, future in futures.items():
        torch.testing.assert_close(
            future.result().latents, alone(model, cases[name]), atol=ATOL, rtol=RTOL, msg=name
        )


def test_a_cancel_and_an_expired_deadline_leave_at_the_next_step(model: DiffusionModel) -> None:
    cases = specs()
    now = [0.0]
    cancelled = CancelToken()
    deadline = CancelToken(deadline=10.0, clock=lambda: now[0])
    batcher = StepBatcher(model, bound=4)
    keep = {name: batcher.submit(cases[name], key=name) for name in ("gen", "i2i-most")}
    gone = batcher.submit(cases["inpaint-large"], key="gone", cancel=cancelled)
    late = batcher.submit(cases["inpaint-small"], key="late", cancel=deadline)
    batcher.step()
    batcher.step()
    assert batcher.stats.rows_per_step == [4, 4]
    cancelled.cancel()
    batcher.step()  # the boundary takes it out; the step runs without it
    assert "gone" not in batcher.running and batcher.stats.rows_per_step[-1] == 3
    with pytest.raises(Cancelled) as error:
        gone.result(timeout=0)
    assert error.value.reason == "cancelled" and error.value.steps_done == 2
    now[0] = 11.0
    batcher.step()
    assert "late" not in batcher.running and batcher.stats.rows_per_step[-1] == 2
    with pytest.raises(Cancelled) as error:
        late.result(timeout=0)
    assert error.value.reason == "expired" and error.value.steps_done == 3
    # a request cancelled while it waits never runs
    queued_token = CancelToken()
    queued = StepBatcher(model, bound=1)
    first = queued.submit(cases["inpaint-large"], key="first")
    second = queued.submit(cases["gen"], key="second", cancel=queued_token)
    queued.step()
    queued_token.cancel()
    queued.run_until_idle()
    with pytest.raises(Cancelled) as error:
        second.result(timeout=0)
    assert error.value.stage == "queued" and error.value.steps_done == 0
    assert torch.equal(first.result().latents, alone(model, cases["inpaint-large"]))
    batcher.run_until_idle()
    for name, future in keep.items():
        torch.testing.assert_close(
            future.result().latents, alone(model, cases[name]), atol=ATOL, rtol=RTOL, msg=name
        )


def test_incompatible_requests_never_share_a_step_and_static_waits_for_the_batch(
    model: DiffusionModel,
) -> None:
    cases = specs()
    batcher = StepBatcher(model, bound=4)
    cfg = batcher.submit(cases["gen"], key="cfg")
    plain = batcher.submit(GenerationSpec("no guidance", seed=9, steps=3, guidance_scale=1.0))
    also = batcher.submit(cases["inpaint-large"], key="also")
    batcher.run_until_idle()
    assert cfg.result().joined_at_step == also.result().joined_at_step == 0
    assert plain.result().joined_at_step == cases["gen"].steps  # after the CFG batch drained
    assert batcher.stats.rows_per_step == [2] * 4 + [1] * 2 + [1] * 3
    # static batching: a request arriving mid-batch waits for the whole batch to finish
    static = StepBatcher(model, bound=4, static=True)
    first = static.submit(cases["gen"], key="first")
    static.step()
    second = static.submit(cases["inpaint-large"], key="second")
    static.run_until_idle()
    assert second.result().joined_at_step == first.result().steps_run
    assert torch.equal(second.result().latents, alone(model, cases["inpaint-large"]))


def test_the_tolerance_catches_a_wrong_step(model: DiffusionModel) -> None:
    """One step fewer, or another seed, is far outside the tolerance: it is not vacuous."""
    spec = specs()["inpaint-small"]
    reference = alone(model, spec)
    other = alone(model, GenerationSpec(spec.prompt, seed=99, steps=spec.steps, edit=spec.edit))
    assert not torch.allclose(other, reference, atol=ATOL * 100, rtol=RTOL * 100)
