"""``argus train-classifier``: train the router's level classifiers, one per strategy.

Labels come from quality tables (``--quality-table``, e.g. from ``argus profile``) or, without
any, from the SYNTHETIC quality model over the prompts (PartiPrompts by default) and the
profile's levels, with ``--quality-seed`` (0, as ``argus replay`` uses by default). Writes
``<out>/ac`` and ``<out>/sm`` (see :mod:`argus.classifier.model` for the files) and prints
what training measured. The prompts' purposes come from the fixed split of
:mod:`argus.prompt_split`: TRAIN fits the weights, CALIBRATION the temperature, classes and
Q(v | c) (``calibration.json``), EVAL is only reported. Same flags, same seed → the same
weights, ``calibration.json`` and ``metrics.json``.

Bad input (tables, prompts, profiles, flags) exits with code 2 and a one-line error.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from argus import defaults
from argus.cli.main import CLIError


class TrainClassifierCommand:
    name = "train-classifier"
    help = "Train the level classifiers (one per strategy) and write them under classifiers/."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--backbone",
            default="logistic",
            choices=["logistic", "finetune"],
            help="logistic: head on the frozen encoder (default, CPU-cheap); "
            "finetune: fine-tune the encoder with the head",
        )
        parser.add_argument(
            "--encoder", help="BERT-family checkpoint directory (default: all-MiniLM-L6-v2)"
        )
        parser.add_argument(
            "--quality-table",
            action="append",
            default=[],
            metavar="FILE",
            help="quality table (argus profile's format); one per strategy, repeatable",
        )
        parser.add_argument("--prompts", help="prompt file for synthetic labels (TSV, Prompt)")
        parser.add_argument("--profiles", default="default", help="'default' or a TOML/YAML file")
        parser.add_argument(
            "--quality-seed", type=int, default=0, help="seed of the synthetic quality model"
        )
        parser.add_argument("--strategies", default="AC,SM", help="comma-separated (AC,SM)")
        parser.add_argument("--seed", type=int, default=0, help="split, shuffling and dropout")
        parser.add_argument(
            "--delta", type=float, default=defaults.DELTA, help="δ of the optimal-level rule"
        )
        parser.add_argument("--epochs", type=int, default=4, help="fine-tuning epochs")
        parser.add_argument("--batch-size", type=int, default=32, help="fine-tuning batch")
        parser.add_argument("--encoder-lr", type=float, default=3e-5)
        parser.add_argument("--head-lr", type=float, default=3e-4)
        parser.add_argument("--max-tokens", type=int, default=256, help="encoder input limit")
        parser.add_argument(
            "--runtime",
            default="torch",
            choices=["torch", "onnx", "onnx-int8"],
            help="encoder runtime the logistic head is fitted on and served with "
            "(torch and onnx: the same float32 vectors; onnx-int8: the router's int8 encoder)",
        )
        parser.add_argument(
            "--out", type=Path, help="output directory (default classifiers/minilm-BACKBONE)"
        )
        parser.add_argument("--quiet", action="store_true", help="no progress lines")

    def run(self, args: argparse.Namespace) -> int:
        from argus.classifier.labels import LabelledPrompts, labels_from_table
        from argus.classifier.model import CLASSIFIERS_DIR, Backbone
        from argus.classifier.prompts import max_chars_for
        from argus.classifier.train import TrainConfig, save_trained, train_classifier
        from argus.types import Strategy

        try:
            strategies = [Strategy.parse(s) for s in args.strategies.split(",") if s.strip()]
            if not strategies:
                raise CLIError("--strategies: no strategy named")
            config = TrainConfig(
                backbone=Backbone(args.backbone),
                seed=args.seed,
                epochs=args.epochs,
                batch_size=args.batch_size,
                encoder_lr=args.encoder_lr,
                head_lr=args.head_lr,
                max_tokens=args.max_tokens,
                runtime=args.runtime,
            )
            if args.encoder is not None and not (Path(args.encoder) / "config.json").is_file():
                raise CLIError(f"--encoder: {args.encoder} is not a checkpoint directory")
            tables = _tables(args, strategies)
            data: dict[Strategy, LabelledPrompts] = {
                s: labels_from_table(t, args.delta, max_chars=max_chars_for(config.max_tokens))
                for s, t in tables.items()
            }
        except ValueError as exc:
            raise CLIError(str(exc)) from None
        name = "minilm" if args.encoder is None else Path(args.encoder).name
        out = args.out or CLASSIFIERS_DIR / f"{name}-{config.backbone.value}"
        log = None if args.quiet else _log
        for strategy, labelled in data.items():
            started = time.perf_counter()
            result = train_classifier(labelled, config, encoder_dir=args.encoder, log=log)
            directory = save_trained(result, out / strategy.value.lower())
            _report(result.metrics_json(), directory, time.perf_counter() - started)
        return 0


def _tables(args: argparse.Namespace, strategies: list[Any]) -> dict[Any, Any]:
    """The quality table of each strategy: the files given, else synthetic ones."""
    from argus.contracts.quality import load_quality_table
    from argus.profiles import ProfileError, load_profiles
    from argus.profiles.synthetic_quality import synthetic_quality_table
    from argus.sim.workloads import WorkloadError, load_prompt_file
    from argus.traces import default_prompt_trace

    if args.quality_table:
        tables = {}
        for path in args.quality_table:
            table = load_quality_table(path)
            if table.strategy in tables:
                raise ValueError(f"--quality-table: two tables for {table.strategy} ({path})")
            tables[table.strategy] = table
        missing = [s.value for s in strategies if s not in tables]
        if missing:
            raise ValueError(f"--quality-table: no table for {', '.join(missing)}")
        return {s: tables[s] for s in strategies}
    try:
        profiles = load_profiles(args.profiles)
        prompts = load_prompt_file(args.prompts or default_prompt_trace())
    except (ProfileError, WorkloadError, FileNotFoundError) as exc:
        raise ValueError(str(exc)) from None
    return {
        s: synthetic_quality_table(
            prompts, s, [lv.name for lv in profiles.levels_for(s)], seed=args.quality_seed
        )
        for s in strategies
    }


def _log(message: str) -> None:
    print(f"  {message}", flush=True)


def _report(metrics: dict[str, Any], directory: Path, seconds: float) -> None:
    """Print what training measured for one strategy's classifier."""
    test, split = metrics["eval"], metrics["split"]
    labels = "SYNTHETIC" if metrics["labels"]["synthetic"] else "profiled"
    validation = split["validation"]
    print(
        f"{metrics['strategy']}: {metrics['description']} -> {directory} ({seconds:.1f} s)\n"
        f"  labels: {labels} ({metrics['labels']['source']}), δ = {metrics['labels']['delta']}, "
        f"{metrics['labels']['prompts']} prompts; fixed split train/calibration/eval "
        f"{split['train']}/{split['calibration']}/{split['eval']}; validation slice of train "
        f"{validation['val']} (seed {validation['seed']})"
    )
    _report_calibration(metrics)
    if test is None:
        print("  no eval prompts")
        return
    print(f"  eval: accuracy {test['accuracy']:.3f}, macro-F1 {test['macro_f1']:.3f}")
    quality = test["quality"]
    if quality is not None:
        print(
            f"  eval quality (arg-max level): classifier {quality['classifier']:.2f}, random "
            f"{quality['random']:.2f}, oracle {quality['oracle']:.2f}, slowest "
            f"{quality['slowest']:.2f}; gap closed {quality['gap_closed']:.0%}; within δ "
            f"{quality['within_delta']:.0%}; mean level classifier "
            f"{quality['mean_level_classifier']:.2f} vs oracle {quality['mean_level_oracle']:.2f}"
        )


def _report_calibration(metrics: dict[str, Any]) -> None:
    calibration, classes = metrics["calibration"], metrics["classes"]
    if calibration is None or classes is None:
        print("  no calibration prompts: no calibration.json (classes are arg-max levels)")
        return
    for name in ("calibration", "eval"):
        fit = calibration[name]
        if fit is not None:
            print(
                f"  {name}: log-loss {fit['log_loss_before']:.4f} -> {fit['log_loss_after']:.4f}, "
                f"ECE {fit['ece_before']:.4f} -> {fit['ece_after']:.4f} "
                f"(temperature {calibration['temperature']:.3f}, {fit['prompts']} prompts)"
            )
    edges = ", ".join(f"{e:.3f}" for e in classes["edges"])
    print(
        f"  classes: edges {edges}; calibration counts {classes['calibration_counts']}, "
        f"eval counts {classes['eval_counts']}"
    )
    quality = classes["calibration_quality"]
    if quality is not None:
        for c, row in enumerate(quality):
            print(f"    Q(v | {c}) " + " ".join(f"{q:.3f}" for q in row))
