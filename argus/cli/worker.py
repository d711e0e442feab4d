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
            type=int,
            default=defaults.CUDA_GRAPHS,
            help="UNet step shapes kept as CUDA graphs and replayed (CUDA only; a request is "
            "then stopped between steps, not inside one; default 0: eager)",
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
            type=int,
            default=defaults.EDIT_CACHE_HOST_BYTES,
            help="host memory for templates' recorded activations (mask-aware edit cache; 0: off)",
        )
        parser.add_argument(
            "--edit-cache-dir", help="the edit cache's disk tier (default: host memory only)"
        )
        parser.add_argument(
            "--edit-cache-disk-bytes", type=int, default=defaults.EDIT_CACHE_DISK_BYTES
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
