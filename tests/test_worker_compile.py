"""``argus worker --compile``: the UNet through ``torch.compile``, compiled when a model loads
(argus/worker/models/compiled.py), on tiny real pipelines on the CPU.

The backend is ``eager`` (dynamo traces the UNet and runs the captured graph as it is, no code
generation: about 7 s for tiny-sd on one core, where ``inductor`` took 73 s), so a compiled
run must equal the eager one exactly (tolerance 0). The eager reference runs through
``predictor=model.predict_noise``, which never takes the fast forward.

Acceptance: a plain run and a LoRA run (merged in place mid-run) through the compiled forward
give the eager latents bit for bit; the compiled forward is what ran (a counting wrapper sees
every step); a worker built from ``--compile`` compiles at load, reports the seconds in its
registry, its log and the ``argus_worker_compile_seconds`` gauge, and its first request
compiles nothing; an edit with a custom predictor does not touch the compiled forward; a bad
mode is refused by name, in the settings and on the command line.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from argus import defaults
from argus.request_limits import EditInput
from argus.worker.adapters.lora import LoraLibrary, WeightBackup, load_now, merge, write_tiny_lora
from argus.worker.editing.masked_blocks import RecordingPredictor
from argus.worker.engine import Worker
from argus.worker.models.compiled import check_compile_backend, compile_and_warm
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec
from tests.cuda_marks import needs_cuda
from tests.editing_factories import template_rgb
from tests.worker_factories import make_registry, torch_threads

pytestmark = pytest.mark.unit

SIZE = 32  # the fixture's serving size: a 4×4 latent for tiny-sd
STEPS = 3
BACKEND = "eager"


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and the machine is shared: take one core."""
    with torch_threads(1):
        yield


class Logged(logging.Handler):
    """Keeps the messages logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@dataclass
class Started:
    worker: Worker
    metrics: CollectorRegistry
    log: list[str]  # what argus.worker.models.compiled logged while the worker started


@pytest.fixture(scope="module")
def started() -> Iterator[Started]:
    """A worker started from ``argus worker --compile default --compile-backend eager`` at
    SIZE, serving tiny-sd: the one compilation of this module (tests patch its model's
    weights and put them back)."""
    from argus.cli.main import OneLineParser
    from argus.cli.worker import WorkerCommand
    from argus.worker.app import build_worker
    from argus.worker.metrics import WorkerMetrics

    command = WorkerCommand()
    parser = OneLineParser(prog="argus worker")
    command.add_arguments(parser)
    compile_flags = ["--compile", "default", "--compile-backend", BACKEND]
    serving = ["--default-size", str(SIZE), "--level", "sm-tiny-sd"]
    args = parser.parse_args([*compile_flags, *serving, "--no-cache", "--device", "cpu"])
    settings = command._settings(args, None)
    assert (settings.compile_mode, settings.compile_backend) == ("default", BACKEND)
    prom = CollectorRegistry()
    logger = logging.getLogger("argus.worker.models.compiled")
    handler, level = Logged(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        worker = build_worker(settings, metrics=WorkerMetrics(prom))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    try:
        yield Started(worker, prom, handler.messages)
    finally:
        worker.close()


@pytest.fixture
def model(started: Started) -> DiffusionModel:
    served = started.worker.registry.get("tiny-sd")
    assert served is not None
    return served


def spec(size: int = SIZE, **kwargs: Any) -> GenerationSpec:
    kwargs.setdefault("steps", STEPS)
    return GenerationSpec("an owl on a wire", seed=11, height=size, width=size, **kwargs)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def counting(model: DiffusionModel) -> Iterator[list[int]]:
    """Count the calls of ``model``'s compiled forward while the block runs."""
    compiled = model.compiled_unet
    assert compiled is not None
    calls = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return compiled(*args, **kwargs)

    model.compiled_unet = forward
    try:
        yield calls
    finally:
        model.compiled_unet = compiled


def eager(model: DiffusionModel, run: GenerationSpec, **kwargs: Any) -> torch.Tensor:
    """``run``'s latents through the eager UNet (the default predictor, given explicitly)."""
    return model.denoise(run, predictor=model.predict_noise, **kwargs).latents


# -- the compiled forward ------------------------------------------------------------------


def test_a_compiled_run_equals_the_eager_one(model: DiffusionModel) -> None:
    before = graphs_compiled()
    with counting(model) as calls:
        compiled = model.denoise(spec()).latents
    assert calls[0] == STEPS  # every step through the compiled forward
    assert graphs_compiled() == before  # compiled by the warm-up, not by this run
    torch.testing.assert_close(compiled, eager(model, spec()), rtol=0, atol=0)


def test_a_lora_merged_in_place_reaches_the_compiled_forward(
    model: DiffusionModel, tmp_path: Path
) -> None:
    """The LoRA is merged before step 1, after the compiled forward ran step 0: the compiled
    run follows the merged weights as the eager one does, bit for bit, and differs from a run
    without it."""
    write_tiny_lora(model, tmp_path / "style.safetensors", rank=4, seed=1, alpha=2.0)
    lora = load_now(LoraLibrary(tmp_path), "style")
    backup = WeightBackup()

    def patch(step: int) -> None:
        if step == 1:
            merge(model.pipeline.unet, lora, 0.8, backup)

    hooks: dict[str, Any] = {"before_step": [patch], "on_exit": [backup.restore]}
    before = graphs_compiled()
    with counting(model) as calls:
        compiled = model.denoise(spec(), **hooks).latents
    assert calls[0] == STEPS and len(backup) == 0  # restored on exit
    assert graphs_compiled() == before  # new weight values, same graph
    reference = eager(model, spec(), **hooks)
    torch.testing.assert_close(compiled, reference, rtol=0, atol=0)
    assert not torch.equal(compiled, model.denoise(spec()).latents)


def test_an_edit_with_a_custom_predictor_stays_eager(model: DiffusionModel) -> None:
    """An inpainting edit recording its activations (the edit cache's predictor patches the
    UNet's blocks) never calls the compiled forward, and its blocks ran eagerly."""
    region = np.zeros((SIZE, SIZE), dtype=bool)
    region[: SIZE // 2] = True
    edit = spec(edit=EditInput(template_rgb(SIZE), region, 1.0))
    with model.lock, torch.inference_mode():
        latent_region = model.start_edit(edit).region
    assert latent_region is not None
    recorder = RecordingPredictor(model, latent_region)
    with counting(model) as calls:
        model.denoise(edit, predictor=recorder)
    assert calls[0] == 0
    assert recorder.record.steps == list(range(STEPS))  # the patched blocks saw every step


# -- at load -------------------------------------------------------------------------------


def test_a_worker_with_compile_compiles_at_load_and_reports_it(started: Started) -> None:
    """``argus worker --compile default --compile-backend eager``: the model was compiled and
    warmed up at the serving size before it was ready; the seconds are in the model's state
    (the Stats reply's too), the log line and the gauge, and the first request at that size
    compiles nothing new."""
    from argus.contracts.worker_control import stats_to_pb

    registry = started.worker.registry
    (info,) = registry.infos()
    assert info.name == "tiny-sd" and info.compile_s > 0
    gauge = started.metrics.get_sample_value("argus_worker_compile_seconds", {"model": "tiny-sd"})
    assert gauge == info.compile_s
    assert info.load_s >= info.compile_s  # part of the load
    (state,) = stats_to_pb(started.worker.stats()).models
    assert state.compile_s == info.compile_s
    assert [m for m in started.log if m.startswith("compiled tiny-sd (default, eager) in ")]
    served = registry.get("tiny-sd")
    assert served is not None and served.compiled_unet is not None
    before = graphs_compiled()
    with counting(served) as calls:
        served.denoise(spec(steps=2))
    assert calls[0] == 2 and graphs_compiled() == before


def test_a_registry_without_compile_compiles_nothing() -> None:
    registry = make_registry(serving_size=SIZE)
    try:
        model = registry.activate("tiny-sd").result(timeout=60)
        assert model.compiled_unet is None and model.fast_unet() is None
        assert [m.compile_s for m in registry.infos()] == [0.0]
    finally:
        registry.close()


# -- refused settings ----------------------------------------------------------------------


def test_a_bad_mode_or_backend_is_refused_by_name(model: DiffusionModel) -> None:
    from argus.worker.app import WorkerSettings

    with pytest.raises(ValueError, match=r"compile_mode: 'fast' is not a torch\.compile mode"):
        WorkerSettings(compile_mode="fast")
    with pytest.raises(ValueError, match="compile_backend"):
        WorkerSettings(compile_mode="default", compile_backend="")
    with pytest.raises(ValueError, match="compile_mode: 'fast'"):
        make_registry(compile_mode="fast")
    with pytest.raises(ValueError, match="compile_backend: 'no-such-backend'"):
        make_registry(compile_mode="default", compile_backend="no-such-backend")
    with pytest.raises(ValueError, match=r"mode: 'max_autotune'.*max-autotune"):
        compile_and_warm(model, "max_autotune", BACKEND, SIZE, SIZE)
    assert check_compile_backend("aot_eager") == "aot_eager"


def test_the_command_line_refuses_a_bad_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from argus.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["worker", "--compile", "fast"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --compile: invalid choice: 'fast'" in err
    assert all(mode in err for mode in defaults.COMPILE_MODES)


# -- on a GPU ----------------------------------------------------------------------------------


@needs_cuda
def test_inductor_on_cuda_stays_close_to_eager_and_graphs_capture_the_compiled_forward() -> None:
    from argus.worker.models.sources import build_tiny_pipeline

    source = "tiny:tiny-sd"
    pipeline = build_tiny_pipeline(source).to("cuda")
    model = DiffusionModel("tiny-sd", pipeline, device="cuda", source=source)
    spec = GenerationSpec("a lighthouse at dusk", seed=3, height=SIZE, width=SIZE, steps=STEPS)
    eager = model.denoise(spec).latents
    assert compile_and_warm(model, "default", "inductor", SIZE, SIZE) > 0
    model.use_cuda_graphs(2)
    graphed = model.denoise(spec).latents
    assert model.graphs is not None and model.graphs.unet is model.compiled_unet
    torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)


@needs_cuda
def test_reduce_overhead_leaves_the_workers_own_graphs_out() -> None:
    registry = make_registry(device="cuda", compile_mode="reduce-overhead", serving_size=SIZE)
    try:
        assert registry.cuda_graphs == 0
    finally:
        registry.close()
