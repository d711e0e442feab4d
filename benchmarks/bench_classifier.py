"""Classifier speed and the choice of its encoder: 1 and 32 prompts, every variant side by side.

Runs committed artifacts on PartiPrompts, each a pair of heads (AC, SM) that share one encoder
pass: ``classifiers/minilm-l2-logistic-int8`` (the router's default: heads fitted on the
vectors of all-MiniLM-L6-v2's first 2 layers, a *student*, run by ONNX Runtime with int8
linear layers), ``classifiers/minilm-l2-logistic`` (the same student in float32),
``classifiers/minilm-logistic`` (heads on the whole float32 MiniLM, the default before them)
and ``classifiers/minilm-logistic-int8`` (the whole MiniLM in int8).

1. **Variants, side by side** (``--compare``, on by default), each a pair of heads on an
   encoder runtime (torch, ONNX Runtime float32 with its fused graph, ONNX Runtime int8) with
   1 or 2 intra-op threads and a token limit (256, or cut shorter); the heads' artifact says
   how many layers the encoder runs (a student runs its first ones). Every variant's samples
   are interleaved (sample i of each row, then i + 1), so a change in the machine's load
   reaches every row alike. Per row: wall time and CPU of one prompt and of 32
   (``ClassifierSet.classes_cleaned``, what the router's batcher thread runs; no vector
   cache), CPU per prompt within the 32, and on the EVAL prompts of the fixed split (labels
   rebuilt as ``argus train-classifier`` builds them: SYNTHETIC quality table, seed 0, δ 0.9)
   accuracy and macro-F1 in points against the first row, and the share of classes equal to
   the first row's. The full heads on an int8 runtime are a row the loader refuses; it is here
   to show why. A row's heads may be any artifact directory (``--runtimes
   onnx:1:256:/path/to/heads``), e.g. a candidate student not in git.
2. **The serving default** (``argus.classifier.serving.serving_runtime``, ``SERVING_THREADS``)
   through ``PromptClassifier``, the router's path: ``classify(prompt)`` from one caller and
   a batch of 32 through the serving ``ClassifierSet`` call, each over ``--repeats`` samples
   after a warm-up that is not counted, the prompt-vector cache emptied before every sample
   (uncached: the figure the targets are for), then the same prompts again (cached). Targets
   on 2 cores: p99 <= 10 ms for one prompt, <= 60 ms for 32.
3. The 32-threads micro-batcher line: 32 callers classifying concurrently.
4. Training (``--train-prompts``, 0 skips it): 2,000 prompts (the 1,632 PartiPrompts and 368
   of them again with ", variation 2"), SYNTHETIC labels for the default AC levels; the
   logistic backbone end to end, then one fine-tuning epoch of MiniLM (``--finetune-epochs 0``
   skips it). The paper reports 3.35 s for 2,000 prompts on an A100 80GB.

Percentiles are numpy's over every sample (at least 200 per figure; warm-up calls are not
counted); CPU is this process's user + system time per sample (all threads), so CPU > wall
means several cores worked. Tokenisation is timed alone. The machine is shared: the load
average is printed at the start and the end of each section; compare rows of one run.

    python benchmarks/bench_classifier.py [--repeats 300] [--compare-repeats 200]
                                          [--no-compare]
                                          [--runtimes onnx:1:256:minilm-logistic,...]
                                          [--train-prompts 2000] [--finetune-epochs 1]
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from _machine import load_line, machine_line

from argus.classifier.evaluate import confusion_matrix, macro_f1
from argus.classifier.labels import LabelledPrompts, labels_from_table
from argus.classifier.model import (
    CLASSIFIERS_DIR,
    Backbone,
    LevelClassifier,
    build_encoder,
    check_student,
    read_artifact_calibration,
    read_config,
    read_head,
    resolve_encoder_dir,
)
from argus.classifier.prompts import clean_prompt, max_chars_for
from argus.classifier.serving import (
    SERVING_RUNTIME,
    SERVING_THREADS,
    ClassifierSet,
    PromptClassifier,
    load_prompt_classifier,
    strategy_dirs,
)
from argus.classifier.train import TrainConfig, split_prompts, train_classifier
from argus.embedding import use_torch_threads
from argus.profiles import default_profiles
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.traces import PromptRecord, default_prompt_trace, load_prompts
from argus.types import Strategy

# (runtime, intra-op threads, token limit, heads): the first row is the reference. The heads
# are a directory of classifiers/ (or any path): FULL_HEADS (fitted on float32 vectors of the
# whole MiniLM), INT8_HEADS (on onnx-int8 vectors) or a student's (on the vectors of its first
# layers, the router's default); the full heads on an int8 runtime are what load_artifact
# refuses, measured
FULL_HEADS = "minilm-logistic"
INT8_HEADS = "minilm-logistic-int8"
STUDENT_HEADS = "minilm-l2-logistic"
INT8_STUDENT_HEADS = "minilm-l2-logistic-int8"
VARIANTS = (
    ("torch", 1, 256, FULL_HEADS),
    ("onnx", 1, 256, FULL_HEADS),
    ("onnx", 2, 256, FULL_HEADS),
    ("onnx", 1, 32, FULL_HEADS),
    ("onnx-int8", 1, 256, FULL_HEADS),
    ("onnx-int8", 1, 256, INT8_HEADS),
    ("torch", 1, 256, STUDENT_HEADS),
    ("onnx", 1, 256, STUDENT_HEADS),
    ("onnx-int8", 1, 256, INT8_STUDENT_HEADS),
    ("onnx-int8", 2, 256, INT8_STUDENT_HEADS),
)


@dataclass(frozen=True)
class Timing:
    """Samples of one measurement, in seconds."""

    wall: np.ndarray
    cpu: np.ndarray

    def line(self) -> str:
        w, c = self.wall * 1e3, self.cpu * 1e3
        return (
            f"wall p50 {np.percentile(w, 50):6.1f} p99 {np.percentile(w, 99):6.1f} ms, "
            f"cpu p50 {np.percentile(c, 50):6.1f} p99 {np.percentile(c, 99):6.1f} ms "
            f"({len(w)} samples)"
        )

    def p99_ms(self) -> float:
        return float(np.percentile(self.wall * 1e3, 99))


def timed(run: Callable[[int], object], samples: int, warmup: int = 5) -> Timing:
    """``run(i)`` for i in 0..samples-1 after ``warmup`` uncounted calls; wall and CPU."""
    for i in range(warmup):
        run(-1 - i)
    wall, cpu = np.empty(samples), np.empty(samples)
    for i in range(samples):
        w0, c0 = time.perf_counter(), time.process_time()
        run(i)
        wall[i], cpu[i] = time.perf_counter() - w0, time.process_time() - c0
    return Timing(wall, cpu)


def each(function: Callable[[Any], object], inputs: Sequence[Any]) -> Callable[[int], object]:
    """``run(i)`` for :func:`timed`: ``function(inputs[i])``."""
    return lambda i: function(inputs[i])


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


# -- 1. runtimes side by side -------------------------------------------------------------


@dataclass(frozen=True)
class EvalSet:
    """The EVAL prompts of each strategy with their labels."""

    texts: dict[Strategy, list[str]]
    labels: dict[Strategy, np.ndarray]


def eval_set(max_tokens: int) -> EvalSet:
    """EVAL prompts and labels as ``argus train-classifier`` builds them by default."""
    profiles = default_profiles()
    records = load_prompts(default_prompt_trace())
    texts, labels = {}, {}
    for strategy in (Strategy.AC, Strategy.SM):
        levels = [lv.name for lv in profiles.levels_for(strategy)]
        table = synthetic_quality_table(records, strategy, levels, seed=0)
        data: LabelledPrompts = labels_from_table(table, 0.9, max_chars=max_chars_for(max_tokens))
        rows = split_prompts(data, 0, 0.15).test
        texts[strategy] = [data.prompts[i] for i in rows.tolist()]
        labels[strategy] = data.labels[rows]
    return EvalSet(texts, labels)


def predictions(classifiers: ClassifierSet, evals: EvalSet) -> dict[Strategy, tuple[Any, Any]]:
    out = {}
    for strategy, texts in evals.texts.items():
        inferred = classifiers.infer_cleaned(list(texts))[strategy]
        out[strategy] = (inferred.levels, inferred.classes)
    return out


@dataclass(frozen=True)
class Variant:
    """One row of section 1: heads on an encoder runtime, cut at ``max_tokens``."""

    runtime: str
    threads: int
    max_tokens: int
    heads: str  # a directory of classifiers/, or a path

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``RUNTIME:THREADS[:TOKENS[:HEADS]]``, e.g. ``onnx:1:256:minilm-l2-logistic``."""
        parts = text.split(":")
        if not 2 <= len(parts) <= 4:
            raise ValueError(f"--runtimes: {text!r} is not RUNTIME:THREADS[:TOKENS[:HEADS]]")
        tokens = int(parts[2]) if len(parts) > 2 else 256
        return cls(parts[0], int(parts[1]), tokens, parts[3] if len(parts) > 3 else FULL_HEADS)

    def name(self) -> str:
        return f"{self.runtime}:{self.threads}t:{self.max_tokens}tok:{Path(self.heads).name}"

    def load(self) -> ClassifierSet:
        """The variant's heads on one private encoder that every strategy shares, as the
        router's does (no check of the runtime: the full heads on an int8 runtime measure
        what :func:`load_artifact` refuses)."""
        root = Path(self.heads) if "/" in self.heads else CLASSIFIERS_DIR / self.heads
        models = {}
        encoder = None
        for strategy, path in strategy_dirs(root).items():
            config = replace(read_config(path), max_tokens=self.max_tokens)
            directory = resolve_encoder_dir(config.encoder, path)
            weights = check_student(path, config, directory) if config.layers else None
            if encoder is None:  # the strategies of one directory share their encoder
                encoder = build_encoder(
                    directory,
                    self.max_tokens,
                    runtime=self.runtime,
                    threads=self.threads,
                    layers=config.layers,
                    layer_weights=weights,
                )
            calibration = read_artifact_calibration(path)
            models[strategy] = LevelClassifier(config, encoder, read_head(path), calibration)
        if self.runtime.startswith("torch"):
            use_torch_threads(self.threads)  # process-global: the last torch row's count wins
        return ClassifierSet(models)


def compare_runtimes(
    prompts: list[str], evals: EvalSet, repeats: int, variants: Sequence[Variant]
) -> None:
    """Section 1: every variant's samples interleaved (sample i of every row, then i + 1),
    so that a change in the machine's load reaches every row alike."""
    print(f"\n1. runtimes side by side, interleaved ({load_line('section 1')})")
    rng = np.random.default_rng(1)
    singles = [[prompts[i]] for i in rng.integers(0, len(prompts), size=repeats + 5)]
    batches = [
        [prompts[i] for i in rng.integers(0, len(prompts), size=32)] for _ in range(repeats + 5)
    ]
    loaded = [(variant, variant.load()) for variant in variants]
    for _, classifiers in loaded:  # warm-up, not counted
        for i in range(-5, 0):
            classifiers.classes_cleaned(singles[i])
            classifiers.classes_cleaned(batches[i])
    # per variant: 1 prompt wall, 1 prompt CPU, 32 prompts wall, 32 prompts CPU (seconds)
    samples: dict[Variant, tuple[list[float], ...]] = {v: ([], [], [], []) for v, _ in loaded}
    for i in range(repeats):
        for variant, classifiers in loaded:
            for inputs, (wall, cpu) in ((singles, (0, 1)), (batches, (2, 3))):
                w0, c0 = time.perf_counter(), time.process_time()
                classifiers.classes_cleaned(inputs[i])
                samples[variant][wall].append(time.perf_counter() - w0)
                samples[variant][cpu].append(time.process_time() - c0)
    reference: dict[Strategy, tuple[Any, Any]] | None = None
    print(
        "  ms: 1 prompt wall p50/p99 (CPU p50), 32 prompts wall p50/p99 (CPU p50), CPU per "
        "prompt in 32; EVAL per strategy (SYNTHETIC labels): accuracy, macro-F1 (points vs "
        "the first row), share of classes equal to the first row's"
    )
    for variant, classifiers in loaded:
        one_wall, one_cpu, many_wall, many_cpu = (np.array(x) * 1e3 for x in samples[variant])
        predicted = predictions(classifiers, evals)
        reference = reference or predicted
        cells = []
        for strategy, (levels, classes) in predicted.items():
            ref_levels, ref_classes = reference[strategy]
            truth, n = evals.labels[strategy], len(classifiers.current(strategy).levels)
            accuracy, f1 = _scores(truth, levels, n)
            ref_accuracy, ref_f1 = _scores(truth, ref_levels, n)
            cells.append(
                f"{strategy} {accuracy:.2f} ({accuracy - ref_accuracy:+.2f}), "
                f"F1 {f1:.2f} ({f1 - ref_f1:+.2f}), = {np.mean(classes == ref_classes):.3f}"
            )
        print(
            f"  {variant.name():<36} {np.percentile(one_wall, 50):5.1f}/"
            f"{np.percentile(one_wall, 99):6.1f} ({np.median(one_cpu):5.1f})  "
            f"{np.percentile(many_wall, 50):6.1f}/{np.percentile(many_wall, 99):6.1f} "
            f"({np.median(many_cpu):6.1f})  cpu/prompt {np.median(many_cpu) / 32:5.2f}  "
            + "; ".join(cells),
            flush=True,
        )
    print(f"  ({repeats} interleaved samples per row; {load_line('end of section 1')})")


def _scores(truth: np.ndarray, predicted: np.ndarray, levels: int) -> tuple[float, float]:
    """Accuracy and macro-F1, in points, as ``argus train-classifier`` reports them."""
    matrix = confusion_matrix(truth, predicted, levels)
    return float(np.mean(truth == predicted)) * 100, macro_f1(matrix) * 100


def tokenizer_cost(classifiers: ClassifierSet, prompts: list[str], repeats: int) -> None:
    encoder = classifiers.current(Strategy.AC).encoder
    tokenize = getattr(encoder, "tokenize", None)
    if tokenize is None:
        return
    fast = getattr(encoder.tokenizer, "is_fast", False)  # type: ignore[attr-defined]
    for size in (1, 32):
        chunks = [prompts[(i * 7) % 1500 : (i * 7) % 1500 + size] for i in range(repeats)]
        t = timed(each(tokenize, chunks), repeats, warmup=0)
        kind = "fast" if fast else "Python"
        print(f"  tokenisation alone ({kind} tokenizer), {size:>2} prompt(s): {t.line()}")


# -- 2. the serving default ---------------------------------------------------------------


def bench_serving(prompts: list[str], repeats: int) -> PromptClassifier:
    print(
        f"\n2. serving default: the artifact's runtime ({SERVING_RUNTIME} for float32 heads), "
        f"{SERVING_THREADS} thread(s), through PromptClassifier (load average {load_average()})"
    )
    service = load_prompt_classifier(cache_entries=40 * repeats)
    encoder = service.classifiers.current(Strategy.AC).encoder
    print(f"  encoder runtime in use: {getattr(encoder, 'runtime', '?')}")
    recent = service.recent
    assert recent is not None
    rng = np.random.default_rng(2)
    singles = [prompts[i] for i in rng.integers(0, len(prompts), size=repeats + 10)]
    batches = [
        [clean_prompt(prompts[i]) for i in rng.integers(0, len(prompts), size=32)]
        for _ in range(repeats + 10)
    ]

    def one(i: int, clear: bool) -> None:
        if clear:
            recent.clear()
        service.classify(singles[i])

    def many(i: int, clear: bool) -> None:
        if clear:
            recent.clear()
        service.classifiers.infer_cleaned(batches[i], recent=recent)

    for name, run, target in (("1 prompt", one, 10.0), ("32 prompts", many, 60.0)):
        uncached = timed(functools.partial(run, clear=True), repeats)
        for i in range(repeats):  # every sample's prompts into the cache, then the same again
            run(i, False)
        cached = timed(functools.partial(run, clear=False), repeats, warmup=0)
        verdict = "meets" if uncached.p99_ms() <= target else "MISSES"
        print(f"  {name:>10}, uncached: {uncached.line()} ({verdict} the {target:g} ms p99 target)")
        print(f"  {name:>10}, cached  : {cached.line()}")
    tokenizer_cost(service.classifiers, prompts, repeats)
    return service


def bench_batcher(service: PromptClassifier, prompts: list[str], rng: np.random.Generator) -> None:
    per_thread = 20
    latencies: list[float] = []
    lock = threading.Lock()
    chosen = [prompts[i] for i in rng.permutation(len(prompts))[: 32 * per_thread]]  # distinct
    assert service.recent is not None
    service.recent.clear()
    before, cache_before = service.stats(), service.recent.stats()

    def caller(index: int) -> None:
        for j in range(per_thread):
            started = time.perf_counter()
            service.classify(chosen[index * per_thread + j])
            with lock:
                latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(32)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    stats = service.stats()
    items, batches = stats.items - before.items, stats.batches - before.batches
    cache = service.recent.stats()
    hits, misses = cache.hits - cache_before.hits, cache.misses - cache_before.misses
    ms = np.array(latencies) * 1e3
    print(
        f"\n3. micro-batcher, 32 threads x {per_thread} prompts (cache emptied first): per call "
        f"p50 {np.percentile(ms, 50):.1f} ms, p99 {np.percentile(ms, 99):.1f} ms; "
        f"{items / elapsed:.0f} prompts/s, mean batch {items / batches:.1f}, "
        f"cache {hits} hits, {misses} misses (distinct prompts)"
    )


# -- 4. training -------------------------------------------------------------------------


def training_prompts(records: list[PromptRecord], count: int) -> list[PromptRecord]:
    out = list(records[:count])
    for i in range(count - len(out)):
        base = records[i]
        out.append(PromptRecord(f"{base.prompt}, variation 2", base.category, base.challenge))
    return out


def bench_training(records: list[PromptRecord], count: int, epochs: int) -> None:
    prompts = training_prompts(records, count)
    levels = [lv.name for lv in default_profiles().levels_for(Strategy.AC)]
    data = labels_from_table(synthetic_quality_table(prompts, Strategy.AC, levels, seed=0))
    result = train_classifier(data, TrainConfig())
    seconds = result.seconds
    print(
        f"training, logistic backbone, {len(data)} prompts (SYNTHETIC labels): "
        f"{seconds['embed'] + seconds['fit_head']:.1f} s = embedding {seconds['embed']:.1f} s "
        f"+ {len(TrainConfig().c_grid) + 1} logistic fits (the C grid and the refit on all "
        f"TRAIN prompts) {seconds['fit_head']:.1f} s; calibration "
        f"{seconds.get('calibrate', 0.0):.2f} s "
        f"(encoder load {seconds['load_encoder']:.1f} s not counted)"
    )
    if epochs < 1:
        return
    result = train_classifier(data, TrainConfig(backbone=Backbone.FINETUNE, epochs=epochs))
    seconds = result.seconds
    print(
        f"training, fine-tuned MiniLM, {len(data)} prompts, {epochs} epoch(s): "
        f"{seconds['finetune']:.1f} s fine-tuning ({seconds['finetune'] / epochs:.1f} s per "
        f"epoch, validation included) + {seconds['embed'] + seconds['fit_head']:.1f} s "
        "for the logistic head it starts from; paper: 3.35 s on an A100 80GB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300, help="samples per serving figure")
    parser.add_argument("--compare-repeats", type=int, default=200, help="samples per variant")
    parser.add_argument("--no-compare", action="store_true", help="skip section 1")
    parser.add_argument("--train-prompts", type=int, default=2000, help="0: skip training")
    parser.add_argument("--finetune-epochs", type=int, default=1, help="0: skip fine-tuning")
    parser.add_argument(
        "--runtimes",
        default=",".join(":".join(map(str, v)) for v in VARIANTS),
        help="section 1's RUNTIME:THREADS[:TOKENS[:HEADS]] list (HEADS: a directory of "
        f"classifiers/ or a path; {FULL_HEADS} by default); "
        "the first is the reference",
    )
    args = parser.parse_args()
    for name in ("repeats", "compare_repeats"):
        if getattr(args, name) < 200:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag}: at least 200, for a p99 over enough samples")
    import onnxruntime
    import torch

    print(machine_line())
    print(
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; "
        f"load average at start: {load_average()} (other work on the machine inflates figures)"
    )
    records = load_prompts(default_prompt_trace())
    prompts = [r.prompt for r in records]
    if not args.no_compare:
        try:
            variants = [Variant.parse(v) for v in args.runtimes.split(",")]
        except ValueError as exc:
            parser.error(str(exc))
        compare_runtimes(prompts, eval_set(256), args.compare_repeats, variants)
    service = bench_serving(prompts, args.repeats)
    bench_batcher(service, prompts, np.random.default_rng(3))
    service.close()
    if args.train_prompts > 0:
        print(f"\n4. training (load average {load_average()})")
        bench_training(records, args.train_prompts, args.finetune_epochs)
    print(f"\nload average at end: {load_average()}")


if __name__ == "__main__":
    main()
