"""LoRA with bounded asynchronous loading (BAL): file format, in-place merge, step-boundary
merging, the bound, exact restore, loader processes and shared memory, ``argus profile-lora``.

Timing is controlled, never measured: a "slow" load is a future the test completes from a
step hook, or a :class:`ManualExecutor` whose reads run only when the test says so.
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from argus.cli.main import main as argus_main
from argus.contracts.generate import Adapter, AdapterKind
from argus.worker.adapters.lora import (
    LoadedLora,
    LoraBusyError,
    LoraConfig,
    LoraFormatError,
    LoraInvalidError,
    LoraLibrary,
    LoraLoader,
    LoraLoadError,
    LoraMismatchError,
    LoraNotFoundError,
    LoraRequest,
    LoraSession,
    PendingLora,
    WeightBackup,
    load_now,
    merge,
    requests_from_adapters,
    write_tiny_lora,
)
from argus.worker.adapters.lora.bound import first_below
from argus.worker.adapters.lora.patch import patch_targets, weight_of
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec
from argus.worker.models.sources import build_tiny_pipeline
from tests.lora_factories import write_unfit_lora
from tests.worker_factories import torch_threads

pytestmark = pytest.mark.unit


STEPS = 4
SIZE = 32
# attention projections, the 1×1 proj_in convs and the 3×3 resnet convs: Linear and Conv2d
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1")


# -- fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and the machine is shared: take one core."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    """A private tiny model (tests patch its weights; every test checks they come back)."""
    source = "tiny:tiny-sd"
    return DiffusionModel("tiny-sd", build_tiny_pipeline(source), device="cpu", source=source)


@pytest.fixture(scope="module")
def library(model: DiffusionModel, tmp_path_factory: pytest.TempPathFactory) -> LoraLibrary:
    root = tmp_path_factory.mktemp("loras")
    write_tiny_lora(model, root / "style.safetensors", rank=4, seed=1, targets=TARGETS, alpha=2.0)
    write_tiny_lora(model, root / "film.safetensors", rank=2, seed=2, targets=("to_v",))
    write_tiny_lora(model, root / "keyed.safetensors", rank=4, seed=3, alpha=8.0, alpha_keys=True)
    write_unfit_lora(model, root / "wrong-shape.safetensors", problem="shape")
    write_unfit_lora(model, root / "wrong-key.safetensors", problem="key")
    torch.save({"unet.x.lora_A.weight": torch.zeros(1)}, root / "pickled.safetensors")
    (root / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    good = (root / "style.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(good[: len(good) - 100])
    text = load_file(str(root / "film.safetensors"))
    text["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(
        2, 16
    )
    save_file(text, str(root / "text-encoder.safetensors"))
    return LoraLibrary(root)


def spec(**kwargs: Any) -> GenerationSpec:
    kwargs.setdefault("steps", STEPS)
    return GenerationSpec(prompt="an owl on a wire", height=SIZE, width=SIZE, **kwargs)


def digest(unet: torch.nn.Module) -> str:
    """A checksum of every parameter and buffer, bit for bit."""
    h = hashlib.sha256()
    for name, tensor in sorted(unet.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def done(lora: LoadedLora) -> Future[LoadedLora]:
    future: Future[LoadedLora] = Future()
    future.set_result(lora)
    return future


def session(
    model: DiffusionModel, loads: list[tuple[str, Future[LoadedLora]]], *, bound: int
) -> LoraSession:
    pending = [
        PendingLora(LoraRequest(name, 0.8, field=f"adapters[{i}]"), future, 0.0)
        for i, (name, future) in enumerate(loads)
    ]
    return LoraSession(model.pipeline.unet, pending, steps=STEPS, bound=bound, lock=model.lock)


def run(model: DiffusionModel, lora_session: LoraSession, *extra: Callable[[int], None]) -> Any:
    with lora_session:
        return model.denoise(
            spec(),
            before_step=[*extra, lora_session.before_step],
            hooks=[lora_session.after_step],
        ).latents


def merged_at(model: DiffusionModel, lora: LoadedLora, step: int, scale: float = 0.8) -> Any:
    """Reference run: the LoRA merged by hand before step ``step``, restored afterwards."""
    backup = WeightBackup()

    def patch(index: int) -> None:
        if index == step:
            merge(model.pipeline.unet, lora, scale, backup)

    try:
        return model.denoise(spec(), before_step=[patch]).latents
    finally:
        backup.restore()


class ManualExecutor(Executor):
    """An executor whose tasks run only when the test calls :meth:`run_next` (in this thread)."""

    def __init__(self, config: LoraConfig | None = None) -> None:
        self.tasks: list[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.tasks.append((future, fn, args))
        return future

    def run_next(self, error: BaseException | None = None) -> None:
        future, fn, args = self.tasks.pop(0)
        future.set_running_or_notify_cancel()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(fn(*args))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            for future, _, _ in self.tasks:
                future.cancel()
            self.tasks.clear()


@pytest.fixture
def manual(library: LoraLibrary) -> Iterator[tuple[LoraLoader, ManualExecutor]]:
    executor = ManualExecutor()
    loader = LoraLoader(
        library, LoraConfig(max_pending=2, cache_items=2), executor=lambda config: executor
    )
    yield loader, executor
    loader.close()


# -- the merge ---------------------------------------------------------------------------------


def _lora_branch(module: torch.nn.Module, down: torch.Tensor, up: torch.Tensor, c: float) -> Any:
    """A forward hook adding the unmerged LoRA branch c · B(A(x)) to ``module``'s output."""

    def hook(mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> Any:
        x = inputs[0]
        if isinstance(mod, torch.nn.Conv2d):
            h = F.conv2d(x, down, stride=mod.stride, padding=mod.padding, dilation=mod.dilation)
            return out + c * F.conv2d(h, up)
        return out + c * F.linear(F.linear(x, down), up)

    return module.register_forward_hook(hook)


@pytest.mark.parametrize(("name", "factor"), [("style", 2.0 / 4), ("keyed", 8.0 / 4)])
def test_merge_equals_the_unmerged_lora_forward(
    model: DiffusionModel, library: LoraLibrary, name: str, factor: float
) -> None:
    """Merged weights compute what the LoRA branch computes beside the base layer."""
    unet = model.pipeline.unet
    raw = load_file(str(library.path(name)))
    lora = load_now(library, name)
    assert {m.factor for m in lora.modules} == {factor}
    assert {type(patch_targets(unet)[m.module]) for m in lora.modules} >= (
        {torch.nn.Linear, torch.nn.Conv2d} if name == "style" else {torch.nn.Linear}
    )
    torch.manual_seed(0)
    x = torch.randn(1, 4, 4, 4)
    t = torch.tensor(500)
    text = torch.randn(1, 77, int(unet.config.cross_attention_dim))
    scale = 0.7
    handles = []
    for entry in lora.modules:
        down = raw[entry.down_key].float()
        up = raw[entry.up_key].float()
        module = patch_targets(unet)[entry.module]
        handles.append(_lora_branch(module, down, up, scale * factor))
    with torch.no_grad():
        reference = unet(x, t, encoder_hidden_states=text).sample
    for handle in handles:
        handle.remove()
    before = digest(unet)
    backup = WeightBackup()
    try:
        assert merge(unet, lora, scale, backup) == len(lora.modules)
        with torch.no_grad():
            merged = unet(x, t, encoder_hidden_states=text).sample
    finally:
        backup.restore()
    torch.testing.assert_close(merged, reference, rtol=1e-4, atol=1e-5)
    assert digest(unet) == before


def test_merge_is_w_plus_scaled_b_at_a(model: DiffusionModel, library: LoraLibrary) -> None:
    unet = model.pipeline.unet
    lora = load_now(library, "style")
    entry = lora.modules[0]
    weight = weight_of(patch_targets(unet)[entry.module])
    expected = weight.detach().clone() + 1.5 * (2.0 / 4) * (
        entry.up.float().flatten(1) @ entry.down.float().flatten(1)
    ).view(weight.shape)
    backup = WeightBackup()
    try:
        merge(unet, lora, 1.5, backup)
        torch.testing.assert_close(weight.detach(), expected, rtol=1e-6, atol=1e-7)
    finally:
        backup.restore()


# -- bounded asynchronous loading --------------------------------------------------------------


def test_lora_ready_before_step_0_equals_lora_fused_before_denoising(
    model: DiffusionModel, library: LoraLibrary
) -> None:
    lora = load_now(library, "style")
    before = digest(model.pipeline.unet)
    bal = session(model, [("style", done(lora))], bound=2)
    latents = run(model, bal)
    assert bal.stats.loras[0].merge_step == 0
    assert not bal.stats.waited
    torch.testing.assert_close(latents, merged_at(model, lora, 0), rtol=0, atol=0)
    assert not torch.equal(latents, model.denoise(spec()).latents)
    assert digest(model.pipeline.unet) == before


def test_late_load_merges_at_the_first_boundary_after_it_is_ready(
    model: DiffusionModel, library: LoraLibrary
) -> None:
    lora = load_now(library, "style")
    pending: Future[LoadedLora] = Future()

    def finish_load_after_step_1(index: int) -> None:
        if index == 1:  # runs before step 1, ahead of the session's hook: ready "during" step 0
            pending.set_result(lora)

    bal = session(model, [("style", pending)], bound=3)
    latents = run(model, bal, finish_load_after_step_1)
    record = bal.stats.loras[0]
    assert record.merge_step == 1
    assert record.wait_s == 0.0
    assert record.modules == len(lora.modules)
    torch.testing.assert_close(latents, merged_at(model, lora, 1), rtol=0, atol=0)


def test_the_bound_waits_for_a_load_still_running(
    model: DiffusionModel, library: LoraLibrary
) -> None:
    lora = load_now(library, "style")
    pending: Future[LoadedLora] = Future()
    at_bound = threading.Event()

    def slow_loader() -> None:
        at_bound.wait()  # finishes only once the run has reached the bound
        pending.set_result(lora)

    def reach(index: int) -> None:
        if index <= 2:
            assert not pending.done()  # still loading at every step up to the bound
        if index == 2:
            at_bound.set()

    thread = threading.Thread(target=slow_loader)
    thread.start()
    bal = session(model, [("style", pending)], bound=2)
    latents = run(model, bal, reach)
    thread.join()
    record = bal.stats.loras[0]
    assert record.merge_step == 2
    assert bal.stats.waited and bal.stats.bound == 2
    torch.testing.assert_close(latents, merged_at(model, lora, 2), rtol=0, atol=0)


def test_bound_beyond_the_run_is_clamped_to_the_last_step(
    model: DiffusionModel, library: LoraLibrary
) -> None:
    lora = load_now(library, "film")
    pending: Future[LoadedLora] = Future()
    threading.Timer(0.0, pending.set_result, args=(lora,)).start()
    bal = session(model, [("film", pending)], bound=50)
    run(model, bal)
    assert bal.stats.bound == STEPS - 1
    assert 0 <= bal.stats.loras[0].merge_step <= STEPS - 1


def test_restore_is_bit_exact_with_two_loras_and_after_an_exception(
    model: DiffusionModel, library: LoraLibrary
) -> None:
    unet = model.pipeline.unet
    before = digest(unet)
    style, film = load_now(library, "style"), load_now(library, "film")
    bal = session(model, [("style", done(style)), ("film", done(film))], bound=1)
    run(model, bal)
    assert [r.merge_step for r in bal.stats.loras] == [0, 0]
    assert digest(unet) == before

    def crash(index: int) -> None:
        if index == 2:
            assert bal2.patched
            raise RuntimeError("GPU fell over")

    bal2 = session(model, [("style", done(style)), ("film", done(film))], bound=1)
    with pytest.raises(RuntimeError, match="GPU fell over"):
        run(model, bal2, crash)
    assert not bal2.patched
    assert digest(unet) == before


def test_a_failed_load_fails_the_request_and_restores_under_the_lock(
    model: DiffusionModel, library: LoraLibrary
) -> None:
    before = digest(model.pipeline.unet)
    broken: Future[LoadedLora] = Future()
    broken.set_exception(LoraFormatError("bad", "not a safetensors file"))
    bal = session(model, [("style", done(load_now(library, "style"))), ("bad", broken)], bound=1)
    with pytest.raises(LoraFormatError) as caught:
        model.denoise(spec(), before_step=[bal.before_step], hooks=[bal.after_step])
    assert caught.value.field == "adapters[1]" and caught.value.name == "bad"
    assert not bal.patched  # restored inside before_step, before the model's lock was released
    assert digest(model.pipeline.unet) == before
    bal.close()


# -- errors: unknown names, bad files; weights untouched ---------------------------------------


@pytest.mark.parametrize("name", ["nope", "../loras/style", "a/b", ".hidden", "", "x" * 200])
def test_unknown_or_escaping_names_are_not_found(library: LoraLibrary, name: str) -> None:
    with pytest.raises(LoraNotFoundError):
        library.path(name)


def test_library_lists_its_loras(library: LoraLibrary) -> None:
    assert {"style", "film", "keyed", "wrong-key"} <= set(library.names())
    assert "style" in library and "nope" not in library


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("pickled", "not a safetensors file"),
        ("garbage", "not a safetensors file"),
        ("truncated", "outside the data section|truncated"),
        ("text-encoder", "text-encoder LoRAs are not supported"),
    ],
)
def test_unusable_files_are_format_errors(library: LoraLibrary, name: str, match: str) -> None:
    with pytest.raises(LoraFormatError, match=match) as caught:
        load_now(library, name)
    assert isinstance(caught.value, LoraInvalidError)


@pytest.mark.parametrize(
    ("name", "key", "match"),
    [
        ("wrong-key", "unet.down_blocks.0.no_such_module.to_q.lora_A.weight", "names no module"),
        ("wrong-shape", None, "inputs"),
    ],
)
def test_a_lora_that_does_not_fit_fails_before_any_patch(
    model: DiffusionModel, library: LoraLibrary, name: str, key: str | None, match: str
) -> None:
    before = digest(model.pipeline.unet)
    lora = load_now(library, name)
    bal = session(model, [("style", done(load_now(library, "style"))), (name, done(lora))], bound=0)
    with pytest.raises(LoraMismatchError, match=match) as caught:
        run(model, bal)
    if key is not None:
        assert caught.value.key == key
    else:
        assert caught.value.key.endswith(".lora_A.weight")
    assert caught.value.field == "adapters[1]"
    assert digest(model.pipeline.unet) == before


def test_invalid_requests_are_refused_before_loading(manual: Any, model: DiffusionModel) -> None:
    loader, executor = manual
    unet = model.pipeline.unet
    with pytest.raises(LoraNotFoundError):
        loader.open_session(unet, [LoraRequest("style"), LoraRequest("nope")], steps=STEPS)
    with pytest.raises(LoraInvalidError, match="twice"):
        loader.open_session(unet, [LoraRequest("style"), LoraRequest("style")], steps=STEPS)
    with pytest.raises(LoraInvalidError, match="finite"):
        loader.open_session(unet, [LoraRequest("style", float("nan"))], steps=STEPS)
    assert executor.tasks == []


# -- the loader: dedup, cache, in-flight bound, failures ---------------------------------------


def test_loader_shares_loads_caches_and_bounds_the_queue(manual: Any) -> None:
    loader, executor = manual
    first, second = loader.load("style"), loader.load("style")
    assert first is second and len(executor.tasks) == 1
    loader.load("film")
    with pytest.raises(LoraBusyError):
        loader.load("keyed")  # max_pending = 2 distinct files in flight
    executor.run_next()
    executor.run_next()
    assert first.result().name == "style"
    hit = loader.load("style")
    assert hit.done() and hit.result() is first.result()
    stats = loader.stats()
    assert (stats.loads, stats.shared_loads, stats.cache_hits, stats.busy_rejections) == (
        2,
        1,
        1,
        1,
    )
    loader.load("keyed")  # cache_items = 2: the least recently used ("film") goes
    executor.run_next()
    assert loader.stats().cached == 2
    assert not loader.load("film").done()


def test_loader_reports_bad_files_and_dead_processes(manual: Any) -> None:
    loader, executor = manual
    bad = loader.load("garbage")
    executor.run_next()
    with pytest.raises(LoraFormatError):
        bad.result()
    crashed = loader.load("style")
    executor.run_next(error=BrokenProcessPool("killed"))
    with pytest.raises(LoraLoadError, match="died"):
        crashed.result()
    assert loader.stats().pool_restarts == 1 and loader.stats().failures == 2
    again = loader.load("style")  # a fresh pool takes the next load
    executor.run_next()
    assert again.result().name == "style"


def test_session_from_the_loader_merges_when_the_read_completes(
    manual: Any, model: DiffusionModel
) -> None:
    loader, executor = manual
    before = digest(model.pipeline.unet)

    def read_after_step_0(index: int) -> None:
        if index == 1:
            executor.run_next()

    requests = [LoraRequest("style", 0.8)]
    with loader.open_session(
        model.pipeline.unet, requests, steps=STEPS, bound=3, lock=model.lock
    ) as bal:
        model.denoise(
            spec(), before_step=[read_after_step_0, bal.before_step], hooks=[bal.after_step]
        )
    assert bal.stats.loras[0].merge_step == 1 and not bal.stats.loras[0].cached
    assert digest(model.pipeline.unet) == before


# -- loader processes and shared memory --------------------------------------------------------


def _shm_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum("/dev/shm/" in line for line in maps)


def test_loader_processes_read_into_shared_memory_and_clean_up(library: LoraLibrary) -> None:
    gc.collect()  # shared tensors of earlier tests' loaders go now, not during the test
    children_before = {p.pid for p in multiprocessing.active_children()}
    shm_files_before = set(os.listdir("/dev/shm"))
    mappings_before = _shm_mappings()
    loader = LoraLoader(library, LoraConfig(processes=1, cache_items=4))
    try:
        lora = loader.load("style").result(timeout=120)
        bad = loader.load("wrong-key").result(timeout=60)
        assert bad.name == "wrong-key"  # fits no model, but is a well-formed file
        with pytest.raises(LoraFormatError):
            loader.load("pickled").result(timeout=60)
        ours = {p.pid for p in multiprocessing.active_children()} - children_before
        assert len(ours) == 1 and os.getpid() not in ours
        assert lora.shared
        assert all(m.down.is_shared() and m.up.is_shared() for m in lora.modules)  # type: ignore[no-untyped-call]
        assert _shm_mappings() > mappings_before
        reference = load_file(str(library.path("style")))
        for entry in lora.modules:
            assert torch.equal(entry.down, reference[entry.down_key])
            assert torch.equal(entry.up, reference[entry.up_key])
    finally:
        loader.close()
    with pytest.raises(LoraLoadError, match="closed"):
        loader.load("style")
    del lora, bad, entry
    gc.collect()
    alive = {p.pid for p in multiprocessing.active_children()} - children_before
    assert alive == set()
    # joblib's semaphores (sem.loky-PID-*) belong to another test process sharing /dev/shm
    # (scikit-learn under pytest -n 2); the loader uses no joblib
    left = {f for f in os.listdir("/dev/shm") if not f.startswith("sem.loky-")}
    assert left <= shm_files_before
    assert _shm_mappings() == mappings_before


# -- the bound profile and the CLI -------------------------------------------------------------


def test_first_below_indexes_steps_from_zero() -> None:
    assert first_below([0.999, 0.995, 0.98, 0.9], 0.99) == 2
    assert first_below([0.98], 0.99) == 0
    assert first_below([0.999, 0.999], 0.99) == 2


def test_profile_lora_prints_k(
    library: LoraLibrary, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "k.json"
    code = argus_main(
        [
            "profile-lora",
            "--model",
            "tiny:tiny-sd",
            "--lora",
            "style",
            "--lora-dir",
            str(library.root),
            "--steps",
            "3",
            "--size",
            "32",
            "--prompts",
            "an owl on a wire",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    profile = json.loads(out.read_text())
    assert f"K = {profile['bound']}" in printed
    assert 0 <= profile["bound"] <= 3 and len(profile["min_similarity"]) == 3


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--lora", "nope"], "no such LoRA"),
        (["--lora", "wrong-shape"], "does not fit"),
        (["--lora", "style", "--threshold", "1.5"], "--threshold"),
    ],
)
def test_profile_lora_rejects_bad_input(
    library: LoraLibrary, extra: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["profile-lora", "--model", "tiny:tiny-sd", "--lora-dir", str(library.root), *extra]
    assert argus_main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


def test_alphas_from_peft_metadata_patterns_and_rslora(tmp_path: Path) -> None:
    tensors = {
        f"unet.blocks.0.{m}.{part}": torch.ones(shape)
        for m in ("attn.to_q", "attn.to_k")
        for part, shape in (("lora_A.weight", (4, 8)), ("lora_B.weight", (8, 4)))
    }
    config: dict[str, Any] = {"unet.r": 4, "unet.lora_alpha": 8, "unet.alpha_pattern": {"to_q": 2}}

    def factors(name: str) -> dict[str, float]:
        metadata = {"lora_adapter_metadata": json.dumps(config)}
        save_file(tensors, str(tmp_path / f"{name}.safetensors"), metadata)
        return {m.module: m.factor for m in load_now(LoraLibrary(tmp_path), name).modules}

    assert factors("a") == {"blocks.0.attn.to_q": 2 / 4, "blocks.0.attn.to_k": 8 / 4}
    config["unet.use_rslora"] = True  # alpha / √r
    assert factors("b") == {"blocks.0.attn.to_q": 2 / 2, "blocks.0.attn.to_k": 8 / 2}


def test_unpaired_or_rank_mismatched_tensors_are_format_errors(tmp_path: Path) -> None:
    save_file({"unet.a.lora_A.weight": torch.ones(4, 8)}, str(tmp_path / "lone.safetensors"))
    save_file(
        {"unet.a.lora_A.weight": torch.ones(4, 8), "unet.a.lora_B.weight": torch.ones(8, 3)},
        str(tmp_path / "ranks.safetensors"),
    )
    library = LoraLibrary(tmp_path)
    with pytest.raises(LoraFormatError, match="no matching lora_B"):
        load_now(library, "lone")
    with pytest.raises(LoraFormatError, match="rank 3"):
        load_now(library, "ranks")


@pytest.mark.parametrize(
    "bad",
    [
        {"processes": 0},
        {"bound": -1},
        {"start_method": "fork"},
        {"wait_timeout_s": 0},
        {"niceness": 20},
    ],
)
def test_lora_config_rejects_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        LoraConfig(**bad)


def test_requests_from_adapters_keeps_loras_and_their_fields() -> None:
    adapters = [
        Adapter(AdapterKind.CONTROLNET, "canny", 0.5, b"png"),
        Adapter(AdapterKind.LORA, "papercut", 0.0),
        Adapter(AdapterKind.LORA, "film", 0.6),
    ]
    assert requests_from_adapters(adapters) == (
        LoraRequest("papercut", 1.0, field="adapters[1]"),
        LoraRequest("film", pytest.approx(0.6), field="adapters[2]"),
    )
