"""CUDA graphs for the worker's UNet work (argus/worker/models/cuda_graphs.py): on by default
on CUDA, off elsewhere; plain, LoRA, batched and ControlNet steps replayed.

On this machine (no GPU) the graphs run through ``capture="eager"``, the stand-in with the
same static buffers, signatures and eviction: what the worker puts into a graph and takes out
of it is checked here, bit for bit against the eager runs. What only a GPU can show (a real
capture replays the same latents; the checkpoints stay silent while recording) is in the tests
marked ``cuda``, which skip without one. The invariant a LoRA run under a graph rests on (a
merge and its restore write into the weights' own storage) is checked on the CPU.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from prometheus_client import CollectorRegistry

from argus import defaults
from argus.contracts.controlnet import ControlUnit
from argus.worker.adapters.controlnet.executor import LocalControlNetExecutor
from argus.worker.adapters.controlnet.models import ControlNetCatalog
from argus.worker.adapters.controlnet.predictor import (
    ControlNetMode,
    ControlNetPredictor,
    same_device,
)
from argus.worker.adapters.lora import LoraLibrary, WeightBackup, load_now, merge, write_tiny_lora
from argus.worker.adapters.lora.patch import patch_targets, weight_of
from argus.worker.editing.masked_blocks import (
    RecordingPredictor,
    ReplayPredictor,
    transformer_blocks,
)
from argus.worker.editing.step_batch import StepBatcher
from argus.worker.metrics import WorkerMetrics
from argus.worker.models.cuda_graphs import GraphCaptureError, GraphedUNet, pool_bytes
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec
from argus.worker.models.registry import default_cuda_graphs
from argus.worker.models.sources import build_tiny_pipeline
from tests.cuda_marks import HAS_CUDA, cuda_param, needs_cuda
from tests.editing_factories import block_edit_spec, latent_region
from tests.worker_factories import make_registry, torch_threads

pytestmark = pytest.mark.unit

STEPS = 3
SIZE = 32


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads(1):  # bit-for-bit comparisons: one summation order
        yield


def fresh(variant: str = "sd-1.5", device: str = "cpu") -> DiffusionModel:
    """A private tiny model (the tests give it graphs and patch its weights)."""
    source = f"tiny:{variant}"
    pipeline = build_tiny_pipeline(source).to(device)
    return DiffusionModel(variant, pipeline, device=device, source=source)


def spec(seed: int = 3, **kwargs: Any) -> GenerationSpec:
    kwargs.setdefault("steps", STEPS)
    kwargs.setdefault("height", SIZE)
    kwargs.setdefault("width", SIZE)
    return GenerationSpec("a lighthouse at dusk", seed=seed, **kwargs)


def eager_and_graphed(model: DiffusionModel, run: Any, capture: str = "eager") -> tuple[Any, Any]:
    """``run(model)`` eagerly, then with the model's graphs; the graphs are dropped after."""
    eager = run(model)
    model.use_cuda_graphs(2, capture=capture)
    try:
        graphed = run(model)
    finally:
        model.graphs = None
    return eager, graphed


# -- defaults ----------------------------------------------------------------------------------


def test_graphs_are_on_by_default_on_cuda_and_off_elsewhere() -> None:
    assert defaults.CUDA_GRAPHS is None  # the device decides
    assert default_cuda_graphs("cuda") == default_cuda_graphs("cuda:1") == 8
    assert default_cuda_graphs("cpu") == 0
    registry = make_registry()  # this machine's default device: the CPU
    assert registry.cuda_graphs == 0
    with pytest.raises(ValueError, match="cuda_graphs 2: needs a CUDA device"):
        make_registry(cuda_graphs=2)


def test_the_cli_takes_auto_or_a_count(capsys: pytest.CaptureFixture[str]) -> None:
    from argus.cli.main import OneLineParser, load_command

    parser = OneLineParser(prog="argus worker")
    load_command("worker").add_arguments(parser)
    assert parser.parse_args([]).cuda_graphs is None
    assert parser.parse_args(["--cuda-graphs", "auto"]).cuda_graphs is None
    assert parser.parse_args(["--cuda-graphs", "0"]).cuda_graphs == 0
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--cuda-graphs", bad])
        assert "--cuda-graphs" in capsys.readouterr().err


# -- the table of graphs -----------------------------------------------------------------------


def test_a_signature_is_captured_once_and_replayed_with_new_inputs() -> None:
    model = fresh()
    seen: list[tuple[str, float]] = []
    graphs = GraphedUNet(
        model.pipeline.unet, 2, capture="eager", on_capture=lambda *a: seen.append(a)
    )
    unet = model.pipeline.unet
    torch.manual_seed(0)
    embeds = torch.randn(2, 77, int(unet.config.cross_attention_dim))
    with torch.inference_mode():
        for seed in range(3):
            x = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(seed))
            t = torch.tensor(900.0 - 100 * seed)
            expected = unet(x, t, encoder_hidden_states=embeds, return_dict=False)[0]
            assert torch.equal(graphs(x, t, embeds, None), expected)
        assert (graphs.captures, graphs.replays, len(graphs)) == (1, 3, 1)
        assert [work for work, _ in seen] == ["unet"]
        # a per-row timestep (a batched step) is another signature than one timestep
        graphs(x, t.reshape(1).expand(2), embeds, None)
        assert graphs.captures == 2
        # least recently used leaves first: a third signature evicts the scalar-t graph
        graphs(torch.randn(2, 4, 6, 6), t, embeds, None)
        assert (graphs.captures, len(graphs)) == (3, 2)
        graphs(x, t, embeds, None)
        assert graphs.captures == 4
    assert graphs.capture_s > 0


def test_an_output_handed_out_is_never_overwritten_by_the_next_replay() -> None:
    model = fresh()
    graphs = GraphedUNet(model.pipeline.unet, 1, capture="eager")
    embeds = torch.randn(1, 77, int(model.pipeline.unet.config.cross_attention_dim))
    with torch.inference_mode():
        first = graphs(torch.randn(1, 4, 4, 4), torch.tensor(500.0), embeds, None)
        kept = first.clone()
        graphs(torch.randn(1, 4, 4, 4), torch.tensor(100.0), embeds, None)
    assert torch.equal(first, kept)


def test_the_stand_in_is_refused_nowhere_and_real_graphs_off_cuda() -> None:
    model = fresh()
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GraphedUNet(model.pipeline.unet)
    with pytest.raises(ValueError, match="capture 'fake'"):
        GraphedUNet(model.pipeline.unet, capture="fake")
    with pytest.raises(ValueError, match="max_graphs 0"):
        GraphedUNet(model.pipeline.unet, 0, capture="eager")


# -- what the worker puts through the graphs ---------------------------------------------------


@pytest.mark.parametrize("variant", ["sd-1.5", "sdxl"])
def test_a_plain_run_replays_its_steps_bit_for_bit(variant: str) -> None:
    model = fresh(variant)
    eager, graphed = eager_and_graphed(model, lambda m: (m.denoise(spec()).latents, m.graphs))
    assert torch.equal(graphed[0], eager[0])
    assert graphed[1].replays == STEPS and graphed[1].captures == 1


def test_a_lora_run_replays_the_base_models_graph(tmp_path: Path) -> None:
    model = fresh("tiny-sd")
    write_tiny_lora(model, tmp_path / "style.safetensors", rank=4, seed=1, alpha=2.0)
    lora = load_now(LoraLibrary(tmp_path), "style")

    def with_lora(m: DiffusionModel) -> tuple[torch.Tensor, int]:
        backup = WeightBackup()

        def before(step: int) -> None:
            if step == 1:  # merged between steps, as a LoRA session merges a late load
                merge(m.pipeline.unet, lora, 0.8, backup)

        try:
            latents = m.denoise(spec(), before_step=[before]).latents
        finally:
            backup.restore()
        return latents, m.graphs.replays if m.graphs is not None else 0

    eager, graphed = eager_and_graphed(model, with_lora)
    assert graphed[1] == STEPS  # every step, the merged ones included, replayed
    assert torch.equal(graphed[0], eager[0])
    assert not torch.equal(eager[0], model.denoise(spec()).latents)  # the LoRA did something


def test_a_lora_merge_and_restore_keep_every_weights_storage(tmp_path: Path) -> None:
    """A graph reads the weights' memory at replay: a merge that replaced a tensor instead of
    writing into it would leave a replayed run on the base model."""
    model = fresh("tiny-sd")
    write_tiny_lora(model, tmp_path / "style.safetensors", rank=4, seed=1, alpha=2.0)
    lora = load_now(LoraLibrary(tmp_path), "style")
    unet = model.pipeline.unet
    targets = patch_targets(unet)
    weights = {m.module: weight_of(targets[m.module]) for m in lora.modules}
    where = {name: (w.data_ptr(), w.clone()) for name, w in weights.items()}
    backup = WeightBackup()
    with torch.inference_mode():
        merge(unet, lora, 0.8, backup)
        for name, module in patch_targets(unet).items():
            if name in where:
                assert weight_of(module).data_ptr() == where[name][0], name
        assert any(not torch.equal(weights[n], where[n][1]) for n in where)
        backup.restore()
    for name, module in patch_targets(unet).items():
        if name in where:
            assert weight_of(module).data_ptr() == where[name][0], name
            assert torch.equal(weight_of(module), where[name][1]), name


def _png(seed: int, size: int = SIZE) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("variant", "mode", "works"),
    [
        ("sd-1.5", ControlNetMode.SYNC, {"controlnet-step": 1}),
        ("sdxl", ControlNetMode.SYNC, {"controlnet-step": 1}),
        ("sdxl", ControlNetMode.ASYNC, {"controlnet-encode": 1, "controlnet-decode": 1}),
    ],
)
def test_a_controlnet_run_is_replayed_whole_or_in_halves_with_the_eager_latents(
    variant: str, mode: ControlNetMode, works: dict[str, int]
) -> None:
    """A synchronous run whose ControlNets share the UNet's device is one graph a step (the
    ControlNets, then the UNet with their residuals); a pipelined one keeps the ControlNets on
    their session's thread and replays the UNet's halves with the residuals as static inputs.
    Either gives the eager run's latents, with two ControlNets at different scales."""
    model = fresh(variant)
    units = (ControlUnit("canny", 1.0, _png(1)), ControlUnit("depth", 0.5, _png(2)))
    executor = LocalControlNetExecutor(ControlNetCatalog.tiny())
    try:

        def controlled(m: DiffusionModel) -> tuple[torch.Tensor, dict[str, int]]:
            captured: dict[str, int] = {}
            if m.graphs is not None:
                m.graphs.on_capture = lambda work, s: captured.update(
                    {work: captured.get(work, 0) + 1}
                )
            predictor = ControlNetPredictor(m, executor, units, mode=mode)
            return m.denoise(spec(), predictor=predictor).latents, captured

        eager, graphed = eager_and_graphed(model, controlled)
        steps = executor.stats().steps_total
    finally:
        executor.close()
    assert graphed[1] == works
    assert torch.equal(graphed[0], eager[0])
    assert steps == 2 * (STEPS if mode is ControlNetMode.SYNC else STEPS - 1)  # both runs


def test_a_whole_step_graph_serves_only_the_controlnets_and_scales_it_was_captured_with() -> None:
    """The ControlNets and their scales are part of the graph's key: another scale, or
    another ControlNet, captures a graph of its own and gets its own eager latents."""
    model = fresh("sdxl")
    executor = LocalControlNetExecutor(ControlNetCatalog.tiny())
    cases = [
        (ControlUnit("canny", 1.0, _png(1)),),
        (ControlUnit("canny", 0.5, _png(1)),),
        (ControlUnit("depth", 1.0, _png(1)),),
    ]
    try:

        def run(units: tuple[ControlUnit, ...]) -> torch.Tensor:
            return model.denoise(
                spec(), predictor=ControlNetPredictor(model, executor, units)
            ).latents

        eager = [run(units) for units in cases]
        model.use_cuda_graphs(4, capture="eager")
        assert model.graphs is not None
        graphed = [run(units) for units in cases]
        assert model.graphs.captures == 3
        assert torch.equal(run(cases[0]), eager[0]) and model.graphs.captures == 3
    finally:
        executor.close()
    for one, other in zip(graphed, eager, strict=True):
        assert torch.equal(one, other)
    assert not torch.equal(eager[0], eager[1]) and not torch.equal(eager[0], eager[2])


def test_a_batched_step_replays_a_graph_per_batch_shape() -> None:
    model = fresh()
    specs = [spec(seed=1), spec(seed=2, steps=STEPS + 1)]

    def batched(m: DiffusionModel) -> tuple[list[torch.Tensor], int]:
        batcher = StepBatcher(m, bound=2)
        futures = [batcher.submit(s, key=str(i)) for i, s in enumerate(specs)]
        batcher.run_until_idle()
        return [f.result().latents for f in futures], m.graphs.captures if m.graphs else 0

    eager, graphed = eager_and_graphed(model, batched)
    assert graphed[1] == 2  # two rows' worth of CFG (4), then the longer request alone (2)
    for one, other in zip(graphed[0], eager[0], strict=True):
        assert torch.equal(one, other)


def test_a_predictor_of_its_own_bypasses_the_unets_graph() -> None:
    """A custom predictor takes no graph unless it asks for one (the edit cache's replay and
    ControlNet's do, below and above)."""
    model = fresh()
    model.use_cuda_graphs(2, capture="eager")
    assert model.graphs is not None
    calls: list[int] = []

    def predictor(latents: Any, t: Any, cond: Any, scheduler: Any, step: int) -> torch.Tensor:
        calls.append(step)
        return model.predict_noise(latents, t, cond, scheduler, step)

    model.denoise(spec(), predictor=predictor)
    assert calls == list(range(STEPS)) and model.graphs.captures == 0


def test_captures_reach_the_workers_metrics() -> None:
    reg = CollectorRegistry()
    metrics = WorkerMetrics(reg)
    registry = make_registry(on_capture=metrics.observe_capture)
    model = fresh()
    callback = registry._capture_callback("sd-1.5")
    model.use_cuda_graphs(2, capture="eager", on_capture=callback)
    model.denoise(spec())
    labels = {"model": "sd-1.5", "work": "unet"}
    assert reg.get_sample_value("argus_worker_cuda_graph_captures_total", labels) == 1
    count = reg.get_sample_value(
        "argus_worker_cuda_graph_capture_seconds_count", {"model": "sd-1.5"}
    )
    assert count == 1


def _replay_case(model: DiffusionModel) -> tuple[GenerationSpec, Any, Any]:
    """An inpainting edit at m = 0.25 and its template's record (another seed's run, every
    token covered), on the block tests' 128 px template."""
    spec = block_edit_spec(0.25, seed=2)
    region = latent_region(model, spec)
    template = block_edit_spec(0.25, seed=5)
    recorder = RecordingPredictor(model, torch.zeros_like(region))
    model.denoise(template, predictor=recorder)
    return spec, region, recorder.record


@pytest.mark.parametrize("variant", ["sd-1.5", "sdxl"])
def test_an_edit_replaying_its_template_is_captured_once_and_replayed_bit_for_bit(
    variant: str,
) -> None:
    """The replayed step's staged rows and token plans are the graph's static inputs: the
    first step runs eagerly (the capture's warm-up), one capture at the second serves every
    later step, and the latents are the eager replay's."""
    model = fresh(variant)
    spec, region, record = _replay_case(model)
    use = [True] * len(transformer_blocks(model.pipeline.unet))
    use[1] = False  # Algorithm 1's mix: one block computes all its tokens
    eager = model.denoise(spec, predictor=ReplayPredictor(model, record, region, use_cache=use))
    model.use_cuda_graphs(2, capture="eager")
    assert model.graphs is not None
    works: list[str] = []
    model.graphs.on_capture = lambda work, s: works.append(work)
    predictor = ReplayPredictor(model, record, region, use_cache=use)
    graphed = model.denoise(spec, predictor=predictor)
    assert torch.equal(graphed.latents, eager.latents)
    assert works == ["edit-replay"]  # a kind of work: one label value, not one per edit
    assert model.graphs.replays == spec.steps - spec.start_step - 1  # all but the first


@pytest.mark.parametrize("device", ["cpu", *([cuda_param("cuda")] if HAS_CUDA else [])])
def test_an_edit_whose_plans_and_rows_have_the_same_shapes_replays_the_graph_at_once(
    device: str,
) -> None:
    """Edits whose plans and rows have the same shapes share a graph. A second edit, of
    another template's record and another mask with the same token counts (the region moved
    by four latent pixels), with another prompt and seed, captures nothing and replays from
    its first step, with its own eager replay's latents: its rows and plans reached the
    graph. A mask with other counts, or a replay of other blocks, has a graph of its own."""
    model = fresh("sdxl", device)
    spec, region, record = _replay_case(model)
    other_record = RecordingPredictor(model, torch.zeros_like(region))
    model.denoise(block_edit_spec(0.25, seed=7), predictor=other_record)
    moved = torch.roll(region, shifts=4, dims=-1)
    again = replace(spec, prompt="a red bicycle by a wall", seed=11)

    def second() -> torch.Tensor:
        replay = ReplayPredictor(model, other_record.record, moved)
        return model.denoise(again, predictor=replay).latents

    eager = second()
    model.use_cuda_graphs(4, capture="cuda" if device == "cuda" else "eager")
    assert model.graphs is not None
    model.denoise(spec, predictor=ReplayPredictor(model, record, region))
    captures, replays = model.graphs.captures, model.graphs.replays
    assert captures == 1
    assert torch.equal(second(), eager)
    assert model.graphs.captures == captures  # nothing captured
    assert model.graphs.replays - replays == again.steps - again.start_step  # every step
    wider = torch.zeros_like(region)
    wider[..., : region.shape[-2] // 2, :] = 1.0  # other token counts
    model.denoise(spec, predictor=ReplayPredictor(model, record, wider))
    assert model.graphs.captures == captures + 1
    use = [True] * len(transformer_blocks(model.pipeline.unet))
    use[0] = False
    mixed = ReplayPredictor(model, record, region, use_cache=use).replay.graph_name
    assert mixed != ReplayPredictor(model, record, region).replay.graph_name


def test_a_replay_whose_rows_are_not_all_staged_runs_eagerly() -> None:
    """A row the graph would hold as a host constant stops the capture; the edit falls back
    to the eager replay, with the same latents."""
    model = fresh("sdxl")
    spec, region, record = _replay_case(model)
    eager = model.denoise(spec, predictor=ReplayPredictor(model, record, region))
    model.use_cuda_graphs(2, capture="eager")
    assert model.graphs is not None
    predictor = ReplayPredictor(model, record, region)
    predictor.replay._needed = [False] * len(predictor.replay._needed)  # nothing staged
    graphed = model.denoise(spec, predictor=predictor)
    assert not predictor.replay.graphable and len(model.graphs) == 0
    assert torch.equal(graphed.latents, eager.latents)


def test_an_unstaged_replay_is_never_graphed() -> None:
    model = fresh("sd-1.5")
    spec, region, record = _replay_case(model)
    model.use_cuda_graphs(2, capture="eager")
    assert model.graphs is not None
    predictor = ReplayPredictor(model, record, region, stage=False)
    assert not predictor.replay.graphable
    model.denoise(spec, predictor=predictor)
    assert model.graphs.captures == 0


# -- on a GPU ----------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("variant", ["sd-1.5", "sdxl"])
def test_real_graphs_replay_a_plain_run_bit_for_bit(variant: str) -> None:
    model = fresh(variant, "cuda")
    eager, graphed = eager_and_graphed(model, lambda m: m.denoise(spec()).latents, "cuda")
    assert torch.equal(graphed, eager)


@needs_cuda
def test_real_graphs_see_a_lora_merged_in_place(tmp_path: Path) -> None:
    model = fresh("tiny-sd", "cuda")
    write_tiny_lora(model, tmp_path / "style.safetensors", rank=4, seed=1, alpha=2.0)
    lora = load_now(LoraLibrary(tmp_path), "style")

    def with_lora(m: DiffusionModel) -> torch.Tensor:
        backup = WeightBackup()

        def before(step: int) -> None:
            if step == 1:
                merge(m.pipeline.unet, lora, 0.8, backup)

        try:
            return m.denoise(spec(), before_step=[before]).latents
        finally:
            backup.restore()

    eager, graphed = eager_and_graphed(model, with_lora, "cuda")
    assert torch.equal(graphed, eager)


@needs_cuda
@pytest.mark.parametrize("mode", [ControlNetMode.SYNC, ControlNetMode.ASYNC])
def test_real_graphs_replay_a_controlnet_run_whole_or_in_halves(mode: ControlNetMode) -> None:
    model = fresh("sdxl", "cuda")
    units = (ControlUnit("canny", 1.0, _png(1)),)
    executor = LocalControlNetExecutor(ControlNetCatalog.tiny(), device="cuda")
    try:
        eager, graphed = eager_and_graphed(
            model,
            lambda m: (
                m.denoise(
                    spec(), predictor=ControlNetPredictor(m, executor, units, mode=mode)
                ).latents
            ),
            "cuda",
        )
    finally:
        executor.close()
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0)


@needs_cuda
def test_a_cuda_worker_has_graphs_by_default_and_captures_its_serving_size_at_load() -> None:
    seen: list[tuple[str, str]] = []
    registry = make_registry(
        device="cuda", serving_size=SIZE, on_capture=lambda m, work, s: seen.append((m, work))
    )
    try:
        assert registry.cuda_graphs == defaults.CUDA_GRAPHS_ON_CUDA
        model = registry.activate("sd-1.5").result(timeout=300)
        assert model.graphs is not None and seen == [("sd-1.5", "unet")]
        model.denoise(spec())  # the serving size: replayed, nothing captured
        assert seen == [("sd-1.5", "unet")]
    finally:
        registry.close()


@needs_cuda
def test_real_graphs_replay_an_edit_of_a_cached_template() -> None:
    model = fresh("sdxl", "cuda")
    spec, region, record = _replay_case(model)
    eager = model.denoise(spec, predictor=ReplayPredictor(model, record, region)).latents
    model.use_cuda_graphs(2)
    predictor = ReplayPredictor(model, record, region)
    graphed = model.denoise(spec, predictor=predictor).latents
    assert predictor.replay.graphable
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0)


@needs_cuda
def test_a_capture_holds_while_another_thread_allocates_and_copies_on_its_own_stream() -> None:
    """What an edit's row stager and the cache writer do beside a recording: pinned and device
    allocations and copies on another stream, from another thread. The recording is
    thread-local, so neither side fails, and the replay is still the eager run to the bit."""
    model = fresh("sdxl", "cuda")
    eager = model.denoise(spec()).latents
    model.use_cuda_graphs(2)
    assert model.graphs is not None
    stop = threading.Event()
    failures: list[BaseException] = []

    def busy() -> None:
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    host = torch.empty(1 << 16, pin_memory=True).fill_(1.0)
                    device = host.to("cuda", non_blocking=True) * 2  # a fresh allocation
                    device.cpu()  # a synchronous copy back, as the cache writer's
        except BaseException as err:  # the test reports whatever it was
            failures.append(err)

    beside = threading.Thread(target=busy, daemon=True)
    beside.start()
    try:
        graphed = model.denoise(spec()).latents
    finally:
        stop.set()
        beside.join(timeout=30)
    assert failures == [] and model.graphs.captures >= 1
    assert torch.equal(graphed, eager)


def test_cuda_without_an_index_is_the_current_gpu_and_the_cpu_is_the_cpu() -> None:
    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert not same_device(torch.device("cpu"), torch.device("cuda", 0))
    assert same_device(torch.device("cuda", 1), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))


@needs_cuda
def test_on_cuda_an_executor_made_for_cuda_shares_the_unets_gpu() -> None:
    assert same_device(torch.device("cuda"), torch.device("cuda", torch.cuda.current_device()))


def test_a_failed_capture_runs_that_signature_eagerly_and_is_counted() -> None:
    """A capture that fails (a host sync inside the work, say) is reported once, and the
    signature runs eagerly from then on, with the eager result; ``fallback=False`` raises."""
    reg = CollectorRegistry()
    metrics = WorkerMetrics(reg)
    registry = make_registry(on_capture_failure=metrics.observe_capture_failure)
    model = fresh()
    model.use_cuda_graphs(2, capture="eager", on_failure=registry._failure_callback("sd-1.5"))
    graphs = model.graphs
    assert graphs is not None
    calls: list[int] = []

    def work(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(calls))
        if len(calls) == 1:  # the stand-in's recording is the first call
            raise GraphCaptureError("operation not permitted when stream is capturing")
        return x * 2

    x = torch.ones(3)
    assert torch.equal(graphs.run("synced", work, x), x * 2)
    assert torch.equal(graphs.run("synced", work, x), x * 2)
    assert len(calls) == 3 and graphs.captures == 0 and graphs.failures == 1 and len(graphs) == 0
    labels = {"model": "sd-1.5", "work": "synced"}
    assert reg.get_sample_value("argus_worker_cuda_graph_failures_total", labels) == 1
    calls.clear()
    with pytest.raises(GraphCaptureError):
        graphs.run("strict", work, x, fallback=False)
    assert graphs.failures == 2
    assert torch.equal(graphs.run("strict", work, x), x * 2)  # not remembered: captured now
    assert graphs.captures == 1


def test_the_graphs_pool_is_measured_from_the_allocators_segments_and_guarded() -> None:
    """``pool_bytes`` sums the segments of the graphs' own pool, and the model registry's
    memory guard counts what a resident model's graphs hold beside its weights."""
    segments = [
        {"total_size": 2 << 20, "segment_pool_id": (0, 7)},
        {"total_size": 6 << 20, "segment_pool_id": (0, 7)},
        {"total_size": 20 << 20, "segment_pool_id": (0, 0)},  # the allocator's own pool
        {"total_size": 1 << 20},
    ]
    assert pool_bytes(segments, (0, 7)) == 8 << 20
    assert pool_bytes(segments, (0, 9)) == 0
    registry = make_registry()
    try:
        model = registry.activate("sd-1.5").result(timeout=60)
        weights = registry.used_bytes()
        model.use_cuda_graphs(2, capture="eager")
        assert model.graphs is not None and model.graphs.pool_bytes == 0  # no pool on a CPU
        model.graphs.pool_bytes = 8 << 20
        assert registry.used_bytes() == weights + (8 << 20)
    finally:
        registry.close()


@needs_cuda
def test_on_cuda_a_capture_measures_its_pool() -> None:
    model = fresh("sd-1.5", "cuda")
    model.use_cuda_graphs(2)
    assert model.graphs is not None
    model.denoise(spec())
    assert model.graphs.captures == 1 and model.graphs.pool_bytes > 0
