"""``argus evaluate --workload edits``: the editing balancers on the SYNTHETIC editing workload
(the method is in :mod:`argus.sim.edit_evaluate`). Kept apart from the text-to-image sweep:
``argus evaluate`` hands over to :func:`run_edits` when ``--workload edits`` is given, and only
the flags added by :func:`add_edit_arguments` and the shared ``--loads``, ``--seeds``,
``--duration``, ``--gpus`` (a worker count), ``--out`` and ``--quiet`` apply."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from argus.cli.main import CLIError

WORKLOADS = ("text-to-image", "edits")
DEFAULT_EDIT_LOADS = "0.5,0.7,0.9"
DEFAULT_BALANCERS = "mask-aware,least-requests,least-tokens,round-robin"


def add_edit_arguments(parser: argparse.ArgumentParser) -> None:
    """``--workload`` and the edits' own flags."""
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=WORKLOADS[0],
        help="text-to-image (default: the policies' sweep) or edits (the edit balancers)",
    )
    parser.add_argument(
        "--balancers",
        default=DEFAULT_BALANCERS,
        help=f"edits: comma-separated balancers (default {DEFAULT_BALANCERS}; ablation: mask-only)",
    )
    parser.add_argument(
        "--batch-bound", type=int, default=None, help="edits: batch bound per worker (default 8)"
    )
    parser.add_argument(
        "--batching",
        default="continuous",
        help="edits: comma-separated batching policies of the workers, continuous (default) "
        "and/or static (InstGenIE's baseline; both: paired in batching.csv)",
    )
    parser.add_argument(
        "--edit-steps",
        type=int,
        default=None,
        help="edits: denoising steps of an edit (default 50)",
    )
    parser.add_argument(
        "--masks",
        choices=("production", "public"),
        default="production",
        help="edits: mask-ratio distribution, mean 0.11 (production) or 0.19 (public)",
    )
    parser.add_argument(
        "--cache-templates",
        type=int,
        default=None,
        help="edits: template records a worker keeps, LRU (default 64)",
    )
    parser.add_argument(
        "--zipf", type=float, default=None, help="edits: template popularity exponent (default 1)"
    )
    parser.add_argument(
        "--edit-batch-table",
        metavar="FILE",
        help="edits: price steps with a measured latency-per-batch table's fit "
        "(benchmarks/bench_edit_cost.py --write-table; default: the model derived from "
        "InstGenIE's figures)",
    )
    parser.add_argument(
        "--edit-curve",
        metavar="MODEL",
        help="edits: which model's curve of --edit-batch-table (default: its first)",
    )
    parser.add_argument(
        "--t2i-share",
        type=float,
        default=0.0,
        help="edits: share of text-to-image requests in the mix (default 0)",
    )


def run_edits(args: argparse.Namespace) -> int:
    """Run the edits sweep, write its files into ``--out`` and print the table."""
    from argus.profiles.edit_cost import CostModelError
    from argus.sim.edit_evaluate import (
        EditEvaluationConfig,
        evaluate_edits,
        format_edit_evaluation,
        write_edit_evaluation,
    )
    from argus.sim.edits import BATCH_BOUND, CACHE_TEMPLATES, STEPS, ZIPF_S

    started = time.perf_counter()
    try:
        loads = tuple(float(x) for x in (args.loads or DEFAULT_EDIT_LOADS).split(",") if x.strip())
        if not args.gpus.strip().isdigit():
            raise ValueError(f"--gpus: edits take a worker count, got {args.gpus!r}")
        workers = int(args.gpus)
        config = EditEvaluationConfig(
            loads=loads,
            balancers=_names(args.balancers),
            batchings=_names(args.batching),
            seeds=args.seeds,
            duration_min=args.duration,
            workers=workers,
            bound=args.batch_bound or BATCH_BOUND,
            cache_templates=CACHE_TEMPLATES
            if args.cache_templates is None
            else args.cache_templates,
            zipf_s=ZIPF_S if args.zipf is None else args.zipf,
            masks=args.masks,
            text_to_image_share=args.t2i_share,
            steps=STEPS if args.edit_steps is None else args.edit_steps,
            **measured_cost(args),
        )
        progress = None if args.quiet else _progress(time.perf_counter())
        evaluation = evaluate_edits(config, progress)
    except (ValueError, CostModelError) as exc:
        raise CLIError(" ".join(str(exc).split())) from None
    if not args.quiet:
        sys.stderr.write("\n")
    write_edit_evaluation(evaluation, args.out)
    print(format_edit_evaluation(evaluation))
    model = config.model
    print(
        f"\n{len(evaluation.rows)} runs ({len(loads)} loads × {len(config.balancers)} balancers "
        f"× {config.seeds} seeds, {config.duration_min:g} min each) in "
        f"{time.perf_counter() - started:.1f} s; {workers} workers, batch bound {config.bound}, "
        f"{config.steps} steps an edit, "
        f"{config.cache_templates} records each, Zipf {config.zipf_s:g}; "
        f"capacity {evaluation.capacity_per_s:.3f} edits/s (hit rate {config.hit_rate():.3f}, "
        f"mean ratio {config.mean_ratio():.3f}); cost model a={model.base_s:.4g} s, "
        f"p={model.per_edit_s:.4g} s, c={model.per_mask_s:.4g} s a step, R²={model.r2:.4f} "
        f"({model.source}); files in {args.out}/"
    )
    return 0


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def measured_cost(args: argparse.Namespace) -> dict[str, Any]:
    """``model=`` the fit of ``--edit-batch-table``'s curve (``--edit-curve``'s model, else the
    first); nothing without a table. ValueError names the file or the model."""
    if not args.edit_batch_table:
        if args.edit_curve:
            raise ValueError("--edit-curve: needs --edit-batch-table")
        return {}
    from argus.profiles.batch_curve import load_batch_table

    table = load_batch_table(args.edit_batch_table)
    curves = [c for c in table.curves if args.edit_curve in (None, c.model)]
    if not curves:
        known = ", ".join(sorted({c.model for c in table.curves}))
        raise ValueError(f"--edit-curve: no curve of {args.edit_curve!r} (the table has {known})")
    return {"model": curves[0].cost_model()}


def _progress(started: float) -> Callable[[int, int], None]:
    def update(done: int, total: int) -> None:
        elapsed = time.perf_counter() - started
        sys.stderr.write(f"\revaluate edits: {done}/{total} (load, seed) points, {elapsed:.0f} s")
        sys.stderr.flush()

    return update
