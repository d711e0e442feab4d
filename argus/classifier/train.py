"""Training a level classifier on the fixed prompt split, reproducibly from a seed.

Every prompt has one purpose, set by :mod:`argus.prompt_split` from its text (60 / 20 / 20):
TRAIN prompts fit the weights, CALIBRATION prompts calibrate them, EVAL prompts are only
reported on. Steps of :func:`train_classifier`:

1. **Split** (:func:`split_prompts`): the three sets; inside TRAIN a seeded slice of each
   label's prompts (``val_fraction``, stratified) is held out to choose ``C`` or the
   fine-tuning epoch.
2. **Embed** every prompt with the frozen encoder (mean-pooled unit vectors), through an
   :class:`~argus.classifier.embedding_cache.EmbeddingCache` when one is given, so that
   retraining on the same prompts (new labels, another seed) runs the encoder once.
3. **Logistic head** (both backbones): a multinomial logistic regression (scikit-learn,
   L-BFGS, deterministic) fitted on TRAIN minus the validation slice for each ``C`` of the
   grid; the lowest validation log-loss wins. For the ``logistic`` backbone the head is then
   refitted with that ``C`` on all TRAIN prompts, and that is the model.
4. **Fine-tune** (``finetune`` backbone only): encoder and head together from the step-3 head
   fitted without the validation slice (LP-FT, Kumar et al., ICLR 2022: fitting the head
   first keeps the first gradient steps from distorting the pretrained features), AdamW with
   linear warm-up and decay, cross-entropy, seeded shuffling and dropout, on TRAIN minus the
   validation slice. After every epoch the validation log-loss is measured; the best epoch is
   kept (epoch 0 is the logistic head itself).
5. **Calibrate** on the CALIBRATION prompts (:mod:`argus.classifier.calibration`):
   temperature, tolerance classes and Q(v | c).
6. **Evaluate** on TRAIN (in-sample, for comparison) and EVAL
   (:mod:`argus.classifier.evaluate`), with the calibration's log-loss, ECE and Q(v | c) on
   EVAL beside the ones measured on CALIBRATION.

Same seed, same data, same thread count → identical weights, calibration and metrics (torch's
CPU kernels and L-BFGS are deterministic for a given thread count).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.classifier.calibration import (
    Calibration,
    calibrate,
    expected_calibration_error,
    measure_class_quality,
    negative_log_likelihood,
    softmax_t,
)
from argus.classifier.embedding_cache import EmbeddingCache, EncoderIdentity
from argus.classifier.evaluate import Evaluation, evaluate
from argus.classifier.labels import LabelledPrompts
from argus.classifier.model import (
    DEFAULT_ENCODER,
    ENCODER_DIR,
    RUNTIMES,
    Backbone,
    ClassifierConfig,
    Encoder,
    LevelClassifier,
    LinearHead,
    embed_many,
    encoder_sha256,
    file_sha256,
    save_artifact,
    shared_encoder,
    softmax,
    vectors_sha256,
)
from argus.prompt_split import PromptSet

IntArray = npt.NDArray[np.int64]
Float32Array = npt.NDArray[np.float32]
FloatArray = npt.NDArray[np.float64]

ABSENT_LEVEL_BIAS = -30.0  # logit bias of a level no training prompt has: probability ~1e-13
SPLIT_SCHEME = "argus.prompt_split: keyed hash of the prompt text, train/calibration/eval 60/20/20"


@dataclass(frozen=True)
class TrainConfig:
    """How a classifier is trained. ``argus train-classifier`` maps one flag to each field."""

    backbone: Backbone = Backbone.LOGISTIC
    """``logistic`` (frozen encoder, the cheap CPU default) or ``finetune`` (Argus §4.1)."""

    seed: int = 0
    """Seeds the validation slice, the shuffling and dropout (the three sets are fixed)."""

    val_fraction: float = 0.15
    """Share of each label's TRAIN prompts held out to choose ``C`` or the epoch."""

    c_grid: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
    """Inverse L2 strengths tried for the logistic head; validation log-loss picks one."""

    max_iter: int = 5000
    """L-BFGS iterations of the logistic head."""

    epochs: int = 4
    """Fine-tuning epochs (``finetune`` only)."""

    batch_size: int = 32
    """Prompts per fine-tuning step."""

    encoder_lr: float = 3e-5
    """Peak AdamW learning rate of the encoder."""

    head_lr: float = 3e-4
    """Peak AdamW learning rate of the head."""

    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and LayerNorm weights)."""

    warmup_fraction: float = 0.1
    """Share of the fine-tuning steps spent warming the learning rate up from 0."""

    max_tokens: int = 256
    """Encoder input limit (all-MiniLM-L6-v2 was trained on 256)."""

    runtime: str = "torch"
    """Encoder runtime whose vectors the ``logistic`` head is fitted on, recorded in the
    artifact and used wherever it is served (:func:`argus.embedding.vectors_of`): ``torch``
    or ``onnx`` for float32 vectors, ``onnx-int8`` for the router's cheaper int8 encoder.
    ``finetune`` trains in torch and needs ``torch``."""

    layers: int | None = None
    """A student encoder: only the encoder's first ``layers`` transformer layers (``None``:
    all of them); ``logistic`` only."""

    student_weights: Path | None = None
    """A distilled student's layer weights (:mod:`argus.classifier.distill`), which replace
    the first ``layers`` layers of the encoder; needs ``layers``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "backbone", Backbone(self.backbone))
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")
        if not 0.0 <= self.val_fraction < 0.5:
            raise ValueError(f"val_fraction: must be in [0, 0.5), got {self.val_fraction}")
        if not self.c_grid or any(not c > 0 for c in self.c_grid):
            raise ValueError(f"c_grid: need positive values, got {self.c_grid}")
        for name in ("max_iter", "epochs", "batch_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("encoder_lr", "head_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction: must be in [0, 1), got {self.warmup_fraction}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime: must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")
        if self.backbone is Backbone.FINETUNE and self.runtime != "torch":
            raise ValueError(f"runtime: finetune trains in torch, got {self.runtime!r}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers: must be >= 1, got {self.layers}")
        if self.layers is not None and self.backbone is not Backbone.LOGISTIC:
            raise ValueError("layers: a student encoder is for the logistic backbone only")
        if self.student_weights is not None and self.layers is None:
            raise ValueError("student_weights: needs layers (the student's layer count)")


@dataclass(frozen=True)
class Split:
    """Row indices of each purpose, each sorted; ``fit`` and ``val`` partition TRAIN."""

    fit: IntArray  # TRAIN prompts the weights are fitted on
    val: IntArray  # TRAIN prompts held out to choose C or the epoch
    calibration: IntArray  # CALIBRATION prompts: temperature, classes, Q(v | c)
    test: IntArray  # EVAL prompts: reported only

    @property
    def train(self) -> IntArray:
        """Every TRAIN prompt (``fit`` and ``val``)."""
        out: IntArray = np.sort(np.concatenate([self.fit, self.val]))
        return out


def stratified_holdout(labels: IntArray, seed: int, fraction: float) -> tuple[IntArray, IntArray]:
    """``(kept, held_out)`` positions: each label's positions shuffled from ``seed`` and the
    first ``round(fraction × count)`` held out. A label with fewer than three prompts is kept
    whole; both arrays are sorted."""
    rng = np.random.default_rng([seed, 0x5E1])
    kept: list[int] = []
    held: list[int] = []
    for label in np.unique(labels).tolist():
        rows = np.flatnonzero(labels == label)
        rows = rows[rng.permutation(len(rows))]
        n_held = round(fraction * len(rows)) if len(rows) >= 3 else 0
        held += rows[:n_held].tolist()
        kept += rows[n_held:].tolist()
    return np.array(sorted(kept), dtype=np.int64), np.array(sorted(held), dtype=np.int64)


def split_prompts(data: LabelledPrompts, seed: int, val_fraction: float) -> Split:
    """Step 1: the fixed sets of :mod:`argus.prompt_split` and the validation slice of TRAIN."""
    sets = np.array([str(s) for s in data.prompt_sets()])

    def rows(which: PromptSet) -> IntArray:
        return np.flatnonzero(sets == str(which)).astype(np.int64)

    train = rows(PromptSet.TRAIN)
    kept, held = stratified_holdout(data.labels[train], seed, val_fraction)
    return Split(train[kept], train[held], rows(PromptSet.CALIBRATION), rows(PromptSet.EVAL))


@dataclass
class TrainResult:
    """A trained classifier with what training measured."""

    classifier: LevelClassifier
    data: LabelledPrompts
    config: TrainConfig
    split: Split
    selection: dict[str, Any]  # what validation chose (C, epoch) and its log-loss
    evaluations: dict[str, Evaluation]  # arg-max levels on "train" and "eval"
    calibration: dict[str, Any] | None  # temperature, log-loss and ECE on both sets
    classes: dict[str, Any] | None  # class edges, counts and Q(v | c) on EVAL
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per step

    def metrics_json(self) -> dict[str, Any]:
        """The ``metrics.json`` of the artifact (no timings: it is reproducible from a seed)."""
        data, config, split = self.data, self.classifier.config, self.split
        return {
            "strategy": config.strategy.value,
            "backbone": config.backbone.value,
            "description": config.describe(),
            "labels": {
                "source": data.source,
                "synthetic": data.synthetic,
                "delta": data.delta,
                "prompts": len(data),
                "level_counts": np.bincount(data.labels, minlength=len(data.levels)).tolist(),
            },
            "split": {
                "scheme": SPLIT_SCHEME,
                "train": len(split.fit) + len(split.val),
                "calibration": len(split.calibration),
                "eval": len(split.test),
                "validation": {
                    "seed": self.config.seed,
                    "fraction": self.config.val_fraction,
                    "stratified": True,
                    "fit": len(split.fit),
                    "val": len(split.val),
                },
            },
            "selection": self.selection,
            "calibration": self.calibration,
            "classes": self.classes,
            "eval": self.evaluations["eval"].to_json() if "eval" in self.evaluations else None,
            "train": self.evaluations["train"].to_json(),
        }


def log_loss(probabilities: FloatArray, labels: IntArray) -> float:
    """Mean negative log-likelihood of ``labels``."""
    picked = probabilities[np.arange(len(labels)), labels]
    return float(-np.mean(np.log(np.clip(picked, 1e-15, 1.0))))


def fit_logistic_head(
    vectors: Float32Array, labels: IntArray, n_levels: int, c: float, max_iter: int
) -> LinearHead:
    """Multinomial logistic regression as a :class:`LinearHead` over all ``n_levels``.

    Levels absent from ``labels`` get zero weights and :data:`ABSENT_LEVEL_BIAS`.
    """
    weight = np.zeros((n_levels, vectors.shape[1]), dtype=np.float32)
    bias = np.full(n_levels, ABSENT_LEVEL_BIAS, dtype=np.float32)
    present = np.unique(labels)
    if len(present) == 1:
        bias[present[0]] = 0.0
        return LinearHead(weight, bias)
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=c, max_iter=max_iter)
    model.fit(vectors.astype(np.float64), labels)
    classes = model.classes_.astype(np.int64)
    if len(classes) == 2:  # scikit-learn keeps one row: the logit of classes[1] over classes[0]
        bias[classes[0]] = 0.0
        weight[classes[1]] = model.coef_[0]
        bias[classes[1]] = model.intercept_[0]
    else:
        weight[classes] = model.coef_
        bias[classes] = model.intercept_
    return LinearHead(weight, bias)


def _select_logistic(
    vectors: Float32Array, labels: IntArray, split: Split, n_levels: int, config: TrainConfig
) -> tuple[LinearHead, dict[str, Any]]:
    """Step 3: the grid's head with the lowest validation log-loss (smaller C on ties),
    fitted on ``split.fit``."""
    select = split.val if len(split.val) else split.fit
    best: tuple[float, float, LinearHead] | None = None
    losses: dict[str, float] = {}
    for c in sorted(config.c_grid):
        head = fit_logistic_head(
            vectors[split.fit], labels[split.fit], n_levels, c, config.max_iter
        )
        loss = log_loss(softmax(head.logits(vectors[select])), labels[select])
        losses[f"{c:g}"] = round(loss, 6)
        if best is None or loss < best[0]:
            best = (loss, c, head)
    assert best is not None
    selection = {
        "criterion": "validation log-loss" if len(split.val) else "training log-loss",
        "C": best[1],
        "log_loss": round(best[0], 6),
        "log_loss_by_C": losses,
    }
    return best[2], selection


def _calibration_summary(
    calibration: Calibration, logits: Float32Array, labels: IntArray
) -> dict[str, Any]:
    """Temperature with log-loss and ECE before / after on CALIBRATION and EVAL."""
    fit = calibration.fit
    summary: dict[str, Any] = {
        "method": "temperature scaling, NLL minimised on the calibration prompts",
        "temperature": calibration.temperature,
        "calibration": {
            "prompts": calibration.prompts,
            "log_loss_before": fit.log_loss_before,
            "log_loss_after": fit.log_loss_after,
            "ece_before": fit.ece_before,
            "ece_after": fit.ece_after,
        },
        "eval": None,
    }
    if len(labels):
        t = calibration.temperature
        summary["eval"] = {
            "prompts": len(labels),
            "log_loss_before": negative_log_likelihood(logits, labels),
            "log_loss_after": negative_log_likelihood(logits, labels, t),
            "ece_before": expected_calibration_error(softmax_t(logits), labels),
            "ece_after": expected_calibration_error(softmax_t(logits, t), labels),
        }
    return summary


def _class_summary(
    calibration: Calibration, logits: Float32Array, scores: FloatArray | None
) -> dict[str, Any]:
    """The classes' edges and counts, and Q(v | c) measured again on EVAL for comparison."""
    classes = calibration.classes_of_logits(logits)
    n = calibration.n_classes
    summary: dict[str, Any] = {
        "score": "expected optimal level index under the calibrated probabilities",
        "edges": list(calibration.edges),
        "calibration_counts": list(calibration.counts),
        "calibration_quality": None
        if calibration.stats is None
        else [list(row) for row in calibration.stats.quality],
        "eval_counts": np.bincount(classes, minlength=n).tolist(),
        "eval_quality": None,
    }
    if scores is not None and len(classes):
        stats = measure_class_quality(classes, scores, n)
        summary["eval_quality"] = [list(row) for row in stats.quality]
    return summary


def train_classifier(
    data: LabelledPrompts,
    config: TrainConfig | None = None,
    *,
    encoder_dir: str | Path | None = None,
    cache: EmbeddingCache | None = None,
    clock: Callable[[], float] = time.perf_counter,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Steps 1–6 of the module docstring; ``encoder_dir`` defaults to all-MiniLM-L6-v2,
    ``cache`` (none by default) keeps the step-2 vectors."""
    config = config or TrainConfig()
    say = log or (lambda _message: None)
    seconds: dict[str, float] = {}
    split = split_prompts(data, config.seed, config.val_fraction)
    if len(split.fit) + len(split.val) < 2:
        raise ValueError(
            f"need at least 2 TRAIN prompts of the fixed split to train, got "
            f"{len(split.fit) + len(split.val)} of {len(data)} prompts"
        )
    reference = DEFAULT_ENCODER if encoder_dir is None else str(Path(encoder_dir).resolve())
    base = reference
    from argus.classifier.model import resolve_encoder_dir

    directory = resolve_encoder_dir(reference)
    n_levels = len(data.levels)

    started = clock()
    encoder: Encoder
    weights = None if config.student_weights is None else Path(config.student_weights).resolve()
    if config.backbone is Backbone.LOGISTIC:
        encoder = shared_encoder(
            directory,
            config.max_tokens,
            runtime=config.runtime,
            layers=config.layers,
            layer_weights=weights,
        )
    else:
        from argus.embedding import PromptEmbedder

        encoder = PromptEmbedder(directory, max_tokens=config.max_tokens)  # private: trained
    seconds["load_encoder"] = clock() - started
    started = clock()
    if cache is None:
        vectors = embed_many(encoder, data.prompts)
    else:
        student_sha256 = "" if weights is None else file_sha256(weights)
        sha256 = vectors_sha256(encoder_sha256(directory), config.layers, student_sha256)
        identity = EncoderIdentity.of_encoder(reference, sha256, encoder)
        vectors = cache.embed(encoder, identity, data.prompts)
    seconds["embed"] = clock() - started
    say(f"{data.strategy}: embedded {len(data)} prompts in {seconds['embed']:.1f} s")

    started = clock()
    head, selection = _select_logistic(vectors, data.labels, split, n_levels, config)
    if config.backbone is Backbone.LOGISTIC and len(split.val):
        train = split.train
        head = fit_logistic_head(
            vectors[train], data.labels[train], n_levels, selection["C"], config.max_iter
        )
        selection["refit"] = "all TRAIN prompts (fit and validation) with the chosen C"
    seconds["fit_head"] = clock() - started
    say(f"{data.strategy}: logistic head C={selection['C']:g} in {seconds['fit_head']:.1f} s")

    if config.backbone is Backbone.FINETUNE:
        started = clock()
        head, selection = _finetune(encoder, head, data, split, config, selection, say)
        seconds["finetune"] = clock() - started
        vectors = embed_many(encoder, data.prompts)  # the fine-tuned encoder's vectors
        reference = ENCODER_DIR

    # the weights file's absolute path for now; save_trained makes it relative to the artifact
    classifier_config = ClassifierConfig(
        strategy=data.strategy,
        levels=data.levels,
        backbone=config.backbone,
        encoder=reference,
        encoder_sha256=encoder_sha256(directory) if config.backbone is Backbone.LOGISTIC else "",
        hidden_size=encoder.dim,
        max_tokens=config.max_tokens,
        delta=data.delta,
        seed=config.seed,
        labels_source=data.source,
        base_encoder=base,
        runtime=config.runtime,
        layers=config.layers,
        student_weights="" if weights is None else str(weights),
        student_sha256="" if weights is None else file_sha256(weights),
    )
    logits = head.logits(vectors)
    calibration = calibration_metrics = class_metrics = None
    held = split.calibration
    if len(held):
        started = clock()
        scores = None if data.scores is None else data.scores[held]
        calibration = calibrate(
            data.strategy, data.levels, logits[held], data.labels[held], scores, data.source
        )
        test = split.test
        calibration_metrics = _calibration_summary(calibration, logits[test], data.labels[test])
        test_scores = None if data.scores is None else data.scores[test]
        class_metrics = _class_summary(calibration, logits[test], test_scores)
        seconds["calibrate"] = clock() - started
        say(
            f"{data.strategy}: temperature {calibration.temperature:.3f} on "
            f"{len(held)} calibration prompts"
        )
    classifier = LevelClassifier(classifier_config, encoder, head, calibration)
    predicted = classifier.predict_vectors(vectors)
    evaluations = {
        name: evaluate(
            data.labels[rows],
            predicted[rows],
            n_levels,
            scores=None if data.scores is None else data.scores[rows],
            delta=data.delta,
        )
        for name, rows in (("train", split.train), ("eval", split.test))
        if len(rows)
    }
    seconds["total"] = sum(seconds.values())
    return TrainResult(
        classifier,
        data,
        config,
        split,
        selection,
        evaluations,
        calibration_metrics,
        class_metrics,
        seconds,
    )


def save_trained(result: TrainResult, directory: str | Path) -> Path:
    """Write the artifact of ``result`` into ``directory`` (the encoder too, if fine-tuned)."""
    directory = Path(directory)
    classifier = result.classifier
    if classifier.config.backbone is Backbone.FINETUNE:
        encoder_dir = directory / ENCODER_DIR
        encoder_dir.mkdir(parents=True, exist_ok=True)
        embedder: Any = classifier.encoder
        embedder.model.save_pretrained(encoder_dir)
        embedder.tokenizer.save_pretrained(encoder_dir)
        config = replace(classifier.config, encoder_sha256=encoder_sha256(encoder_dir))
        classifier = LevelClassifier(
            config, classifier.encoder, classifier.head, classifier.calibration
        )
        result.classifier = classifier
    if classifier.config.student_weights:  # the artifact names the student's file relative to it
        relative = os.path.relpath(classifier.config.student_weights, directory.resolve())
        config = replace(classifier.config, student_weights=relative)
        classifier = LevelClassifier(
            config, classifier.encoder, classifier.head, classifier.calibration
        )
        result.classifier = classifier
    return save_artifact(directory, classifier, result.metrics_json())


# ---------------------------------------------------------------------------------------------
# Fine-tuning (step 4)


def _finetune(
    encoder: Encoder,
    head: LinearHead,
    data: LabelledPrompts,
    split: Split,
    config: TrainConfig,
    selection: Mapping[str, Any],
    say: Callable[[str], None],
) -> tuple[LinearHead, dict[str, Any]]:
    """Fine-tune ``encoder`` (a private PromptEmbedder) and ``head`` in place; best epoch."""
    import torch

    from argus.embedding import PromptEmbedder

    assert isinstance(encoder, PromptEmbedder)
    select = split.val if len(split.val) else split.fit
    train_texts = [data.prompts[i] for i in split.fit.tolist()]
    train_labels = data.labels[split.fit]
    select_texts = [data.prompts[i] for i in select.tolist()]

    def select_loss(current: LinearHead) -> float:
        encoder.model.eval()
        probabilities = softmax(current.logits(embed_many(encoder, select_texts)))
        return log_loss(probabilities, data.labels[select])

    best_loss = float(selection["log_loss"])
    best_epoch = 0
    best_state = {k: v.detach().clone() for k, v in encoder.model.state_dict().items()}
    best_head = head
    losses = [round(best_loss, 6)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        linear = torch.nn.Linear(encoder.dim, len(data.levels))
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(np.array(head.weight)))
            linear.bias.copy_(torch.from_numpy(np.array(head.bias)))
        optimizer = _optimizer(encoder.model, linear, config)
        steps_per_epoch = math.ceil(len(train_texts) / config.batch_size)
        schedule = _schedule(optimizer, steps_per_epoch * config.epochs, config.warmup_fraction)
        rng = np.random.default_rng([config.seed, 0xF7])
        for epoch in range(1, config.epochs + 1):
            encoder.model.train()
            order = rng.permutation(len(train_texts))
            total = 0.0
            for start in range(0, len(order), config.batch_size):
                rows = order[start : start + config.batch_size].tolist()
                logits = _forward(encoder, linear, [train_texts[i] for i in rows])
                target = torch.from_numpy(train_labels[rows])
                loss = torch.nn.functional.cross_entropy(logits, target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                total += float(loss.detach()) * len(rows)
            current = LinearHead(
                linear.weight.detach().numpy().copy(), linear.bias.detach().numpy().copy()
            )
            loss_now = select_loss(current)
            losses.append(round(loss_now, 6))
            say(
                f"{data.strategy}: epoch {epoch}: train loss {total / len(order):.4f}, "
                f"selection log-loss {loss_now:.4f}"
            )
            if loss_now < best_loss:
                best_loss, best_epoch, best_head = loss_now, epoch, current
                best_state = {k: v.detach().clone() for k, v in encoder.model.state_dict().items()}
    encoder.model.load_state_dict(best_state)
    encoder.model.eval()
    return best_head, {
        **selection,
        "epoch": best_epoch,
        "log_loss": round(best_loss, 6),
        "log_loss_by_epoch": losses,
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "encoder_lr": config.encoder_lr,
        "head_lr": config.head_lr,
    }


def _forward(encoder: Any, linear: Any, texts: Sequence[str]) -> Any:
    """Logits with gradients: tokenise, encode, mean-pool, normalise, head."""
    import torch

    from argus.embedding import mean_pool

    batch = encoder.tokenizer(
        list(texts),
        padding=True,
        truncation=True,
        max_length=encoder.max_tokens,
        return_tensors="pt",
    )
    hidden = encoder.model(**batch).last_hidden_state
    pooled = mean_pool(hidden, batch["attention_mask"])
    return linear(torch.nn.functional.normalize(pooled, p=2, dim=1))


def _optimizer(model: Any, linear: Any, config: TrainConfig) -> Any:
    import torch

    decay: list[Any] = []
    no_decay: list[Any] = []
    for name, parameter in model.named_parameters():
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(parameter)
    return torch.optim.AdamW(
        [
            {"params": decay, "lr": config.encoder_lr, "weight_decay": config.weight_decay},
            {"params": no_decay, "lr": config.encoder_lr, "weight_decay": 0.0},
            {"params": list(linear.parameters()), "lr": config.head_lr, "weight_decay": 0.0},
        ]
    )


def _schedule(optimizer: Any, total_steps: int, warmup_fraction: float) -> Any:
    """Linear warm-up over ``warmup_fraction`` of the steps, then linear decay to zero."""
    import torch

    warmup = max(1, int(warmup_fraction * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
