"""``argus worker``: one GPU worker as a gRPC service (``argus.v1.Worker``).

``--model tiny`` serves every model of the profile as a tiny seeded random variant (no GPU,
no weights needed); ``--model DIR`` serves a diffusers directory as the AC base model, with
``--variant NAME=DIR`` for the smaller models of the SM levels. The cache lives in
``--cache-dir`` (latent store and Qdrant Edge shard) or, with ``--qdrant-url``, indexes in a
Qdrant server. Prints ``argus worker ID listening on HOST:PORT`` once bound; Ctrl-C stops it.

With ``--allocator HOST:PORT`` the worker joins the cluster: it heartbeats to the allocator,
advertising ``--advertise HOST:PORT`` (default: the bound address) and ``--worker-class``
(default: the profile's first class), and serves the level the plan assigns it.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from argus import defaults
from argus.cli.internal import add_internal_tls_arguments, internal_tls_dir
from argus.cli.main import (
    CLIError,
    add_nice_argument,
    config_error,
    lower_priority,
    passive_openmp,
)
from argus.plumbing.quoting import quoted

if TYPE_CHECKING:
    from argus.worker.app import WorkerSettings


def count_or_auto(text: str, what: str) -> int | None:
    """A count >= 0 of ``what`` on the command line, or None for ``auto``."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} or auto, got {quoted(text)}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected {what} >= 0 or auto, got {value}")
    return value


def byte_bound(text: str) -> int | str:
    """A tier's bound on the command line: a count of bytes, or ``auto``."""
    value = count_or_auto(text, "bytes")
    return "auto" if value is None else value


def _graphs(text: str) -> int | None:
    """``--cuda-graphs``: a count of graphs, or None for ``auto`` (the device decides)."""
    return count_or_auto(text, "a count")


def parse_variant(text: str) -> tuple[str, str]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise CLIError(f"--variant: expected NAME=DIR, got {quoted(text)}")
    return name, directory


class WorkerCommand:
    name = "worker"
    help = "Run a GPU worker (gRPC) serving the profile's levels."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="tiny", help="'tiny' or a diffusers directory")
        parser.add_argument(
            "--variant", action="append", default=[], help="NAME=DIR of a smaller model"
        )
        parser.add_argument("--host", default=defaults.LOOPBACK, help="address to bind")
        parser.add_argument("--port", type=int, default=0, help="port (0: any free port)")
        parser.add_argument("--worker-id", default=defaults.WORKER_ID)
        parser.add_argument("--profile", help="profile file (default: the embedded one)")
        parser.add_argument("--level", help="level served at start (default: the first AC level)")
        parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
        parser.add_argument("--dtype", default="auto", help="auto, fp32, fp16 or bf16")
        parser.add_argument("--scheduler", default=defaults.SCHEDULER, help="euler, ddim or dpm++")
        parser.add_argument("--memory-budget-gib", type=float, help="model memory budget")
        parser.add_argument(
            "--max-resident",
            type=int,
            default=defaults.MAX_RESIDENT_MODELS,
            help="ready models kept resident at most, least recently used leaving first "
            "(shared parts held once; default 1)",
        )
        parser.add_argument(
            "--cuda-graphs",
            type=_graphs,
            default=defaults.CUDA_GRAPHS,
            metavar="N|auto",
            help="UNet work shapes kept as CUDA graphs and replayed: plain and LoRA steps, "
            "batched steps, ControlNet steps, edit replays (CUDA only; a request is then stopped "
            f"between steps, not inside one; default auto: {defaults.CUDA_GRAPHS_ON_CUDA} on CUDA, "
            "0 (eager) elsewhere)",
        )
        parser.add_argument(
            "--compile",
            metavar="MODE",
            choices=defaults.COMPILE_MODES,
            help=f"run plain and LoRA steps through torch.compile(unet, mode=MODE), MODE one of "
            f"{', '.join(defaults.COMPILE_MODES)}; each model is compiled and warmed up at "
            "--default-size when it loads, the time logged and in argus_worker_compile_seconds "
            "(runs with a predictor of their own, the edit cache's, ControlNet's and latent "
            "parallelism's, are not compiled; a request is then stopped between steps, not "
            "inside one; default: off)",
        )
        parser.add_argument(
            "--compile-backend",
            metavar="NAME",
            default=defaults.COMPILE_BACKEND,
            help=f"torch.compile's backend with --compile (default {defaults.COMPILE_BACKEND}; "
            "eager and aot_eager skip code generation, for tests)",
        )
        parser.add_argument(
            "--edit-batch",
            type=int,
            default=defaults.EDIT_BATCH,
            help="edits (without adapters) run together at most, a new one joining the running "
            "batch at the next denoising step (default 1: one request at a time)",
        )
        parser.add_argument(
            "--edit-batch-table",
            metavar="FILE",
            help="measured latency-per-batch curves (benchmarks/bench_edit_cost.py "
            "--write-table): each model's and size's bound is the curve's knee, at most "
            "--edit-batch, and 1 where the table has none",
        )
        parser.add_argument(
            "--decode-thread",
            action="store_true",
            help="batched edits decode on a thread of their own, so the next step starts at once",
        )
        parser.add_argument("--no-cache", action="store_true", help="serve without AC caching")
        parser.add_argument("--cache-dir", help="latent store and Qdrant Edge directory")
        parser.add_argument("--qdrant-url", help="Qdrant server URL (default: Qdrant Edge)")
        parser.add_argument(
            "--index-outage-file",
            help="fault injection: the vector index fails as unreachable while this file exists",
        )
        parser.add_argument("--cache-max-entries", type=int, default=defaults.CACHE_MAX_ENTRIES)
        parser.add_argument("--cache-max-bytes", type=int)
        parser.add_argument(
            "--min-similarity",
            type=float,
            default=0.0,
            help="raise every similarity floor of the profile's cache rule to at least this "
            "(cosine; default 0: the rule as it is)",
        )
        parser.add_argument(
            "--edit-cache-bytes",
            type=byte_bound,
            default=defaults.EDIT_CACHE_HOST_BYTES,
            help="host memory for templates' recorded activations (mask-aware edit cache; 0: "
            "off; default auto: a quarter of the machine's memory, at least 1 GiB)",
        )
        parser.add_argument(
            "--edit-cache-dir", help="the edit cache's disk tier (default: host memory only)"
        )
        parser.add_argument(
            "--edit-cache-disk-bytes",
            type=byte_bound,
            default=defaults.EDIT_CACHE_DISK_BYTES,
            help="bytes of the edit cache's disk tier at most (default auto: half the "
            "directory's free space)",
        )
        parser.add_argument(
            "--edit-cache-device-bytes",
            type=byte_bound,
            default=defaults.EDIT_CACHE_DEVICE_BYTES,
            help="device memory for templates' records, so a repeated template's rows never "
            "cross PCIe (0: none; default auto: on CUDA a quarter of the memory free once the "
            "model has loaded, on a CPU 0)",
        )
        parser.add_argument(
            "--default-size", type=int, default=defaults.DEFAULT_SIZE, help="pixels (tiny: 64)"
        )
        parser.add_argument("--default-steps", type=int, default=defaults.DEFAULT_STEPS)
        parser.add_argument("--max-queue", type=int, default=defaults.MAX_QUEUE)
        parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here")
        parser.add_argument(
            "--score-sample",
            type=float,
            default=defaults.SCORE_SAMPLE,
            help="share of images scored with PickScore for the router's drift monitor, off "
            "the request path (0: off; default 0.05)",
        )
        parser.add_argument(
            "--scorer", help="PickScore (CLIP) directory (default: a tiny random CLIP)"
        )
        cluster = parser.add_argument_group("cluster (the allocator's plan)")
        cluster.add_argument("--allocator", help="allocator HOST:PORT (default: standalone)")
        cluster.add_argument(
            "--advertise", help="HOST:PORT routers reach this worker at (default: the bound one)"
        )
        cluster.add_argument(
            "--worker-class", help="GPU type, a class of the profile (default: the first)"
        )
        adapters = parser.add_argument_group("adapters (Katz: LoRA BAL, ControlNets, CFG split)")
        adapters.add_argument("--lora-dir", help="LoRA library: a directory of safetensors files")
        adapters.add_argument("--lora-processes", type=int, default=2, help="LoRA loaders")
        adapters.add_argument(
            "--lora-bound", type=int, default=10, help="BAL bound K at 50 steps (scaled to N)"
        )
        adapters.add_argument(
            "--controlnet", help="ControlNet service HOST:PORT, or local / local:DIR in process"
        )
        adapters.add_argument("--controlnet-mode", default="sync", choices=("sync", "async"))
        adapters.add_argument(
            "--latent-parallel",
            metavar="DEVICE",
            help="run the CFG branches on two devices: the peer's device (cpu, cuda:1)",
        )
        add_nice_argument(parser)
        add_internal_tls_arguments(parser, "worker")

    def run(self, args: argparse.Namespace) -> int:
        lower_priority(args.nice)  # before any thread starts
        passive_openmp()  # before torch loads
        from argus.worker.app import serve

        tls_dir = internal_tls_dir(args, "worker")
        try:  # the settings check every value, before anything loads
            settings = self._settings(args, tls_dir)
        except ValueError as err:
            raise config_error(err, args) from None
        try:
            return serve(settings)
        except (ValueError, OSError) as err:
            raise CLIError(str(err)) from None

    def _settings(self, args: argparse.Namespace, tls_dir: str | None) -> WorkerSettings:
        """The worker's settings from its flags; ValueError names a bad field."""
        from argus.worker.adapters.workflow import AdapterSettings
        from argus.worker.app import WorkerSettings

        adapter_settings = AdapterSettings(
            lora_dir=args.lora_dir,
            lora_processes=args.lora_processes,
            lora_bound=args.lora_bound,
            controlnet=args.controlnet,
            controlnet_mode=args.controlnet_mode,
            latent_parallel=args.latent_parallel,
        )
        return WorkerSettings(
            model=args.model,
            variants=tuple(parse_variant(v) for v in args.variant),
            host=args.host,
            port=args.port,
            worker_id=args.worker_id,
            profile=args.profile,
            level=args.level,
            device=args.device,
            dtype=args.dtype,
            scheduler=args.scheduler,
            memory_budget_gib=args.memory_budget_gib,
            max_resident=args.max_resident,
            cuda_graphs=args.cuda_graphs,
            compile_mode=args.compile,
            compile_backend=args.compile_backend,
            edit_batch=args.edit_batch,
            decode_thread=args.decode_thread,
            edit_batch_table=args.edit_batch_table,
            cache=not args.no_cache,
            cache_dir=args.cache_dir,
            qdrant_url=args.qdrant_url,
            index_outage_file=args.index_outage_file,
            cache_max_entries=args.cache_max_entries,
            cache_max_bytes=args.cache_max_bytes,
            min_similarity=args.min_similarity,
            edit_cache_bytes=args.edit_cache_bytes,
            edit_cache_dir=args.edit_cache_dir,
            edit_cache_disk_bytes=args.edit_cache_disk_bytes,
            edit_cache_device_bytes=args.edit_cache_device_bytes,
            default_size=args.default_size,
            default_steps=args.default_steps,
            max_queue=args.max_queue,
            metrics_port=args.metrics_port,
            adapters=adapter_settings,
            allocator=args.allocator,
            advertise=args.advertise,
            worker_class=args.worker_class,
            internal_tls_dir=tls_dir,
            score_sample=args.score_sample,
            scorer_dir=args.scorer,
        )
