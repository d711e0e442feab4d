"""Training a level classifier, reproducibly from a seed.

Steps of :func:`train_classifier`:

1. **Split** the labelled prompts into train / validation / test, stratified by label, from
   the seed (:func:`split_indices`). The test split is only evaluated, never selected on.
2. **Embed** every prompt with the frozen encoder (mean-pooled unit vectors).
3. **Logistic head** (both backbones): a multinomial logistic regression (scikit-learn,
   L-BFGS, deterministic) for each ``C`` of the grid; the one with the lowest validation
   log-loss wins. For the ``logistic`` backbone this is the model.
4. **Fine-tune** (``finetune`` backbone only): encoder and head together from the logistic
   head (LP-FT, Kumar et al., ICLR 2022: fitting the head first keeps the first gradient
   steps from distorting the pretrained features), AdamW with linear warm-up and decay,
   cross-entropy, seeded shuffling and dropout. After every epoch the validation log-loss is
   measured; the best epoch is kept (epoch 0 is the logistic head itself).
5. **Evaluate** on all three splits (:mod:`argus.classifier.evaluate`).

Same seed, same data, same thread count → identical weights and predictions (torch's CPU
kernels and L-BFGS are deterministic for a given thread count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.classifier.evaluate import Evaluation, evaluate
from argus.classifier.labels import LabelledPrompts
from argus.classifier.model import (
    DEFAULT_ENCODER,
    ENCODER_DIR,
    Backbone,
    ClassifierConfig,
    Encoder,
    LevelClassifier,
    LinearHead,
    embed_many,
    encoder_sha256,
    save_artifact,
    shared_encoder,
    softmax,
)

IntArray = npt.NDArray[np.int64]
Float32Array = npt.NDArray[np.float32]
FloatArray = npt.NDArray[np.float64]

ABSENT_LEVEL_BIAS = -30.0  # logit bias of a level no training prompt has: probability ~1e-13


@dataclass(frozen=True)
class TrainConfig:
    """How a classifier is trained. ``argus train-classifier`` maps one flag to each field."""

    backbone: Backbone = Backbone.LOGISTIC
    """``logistic`` (frozen encoder, the cheap CPU default) or ``finetune`` (Argus §4.1)."""

    seed: int = 0
    """Seeds the split, the shuffling and dropout."""

    val_fraction: float = 0.15
    """Share of each label's prompts held out for model selection."""

    test_fraction: float = 0.15
    """Share of each label's prompts held out for the reported metrics."""

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "backbone", Backbone(self.backbone))
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value < 0.5:
                raise ValueError(f"{name}: must be in [0, 0.5), got {value}")
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


@dataclass(frozen=True)
class Split:
    """Row indices of the three splits, each sorted."""

    train: IntArray
    val: IntArray
    test: IntArray


def split_indices(labels: IntArray, seed: int, val_fraction: float, test_fraction: float) -> Split:
    """Stratified seeded split: each label's rows shuffled, then cut test | val | train.

    A label with fewer than three prompts goes to training whole. When validation would be
    empty, selection falls back to the training split (see :func:`train_classifier`).
    """
    rng = np.random.default_rng([seed, 0x5E1])
    parts: dict[str, list[int]] = {"train": [], "val": [], "test": []}
    for label in np.unique(labels).tolist():
        rows = np.flatnonzero(labels == label)
        rows = rows[rng.permutation(len(rows))]
        n_test = round(test_fraction * len(rows)) if len(rows) >= 3 else 0
        n_val = round(val_fraction * len(rows)) if len(rows) >= 3 else 0
        parts["test"] += rows[:n_test].tolist()
        parts["val"] += rows[n_test : n_test + n_val].tolist()
        parts["train"] += rows[n_test + n_val :].tolist()
    return Split(**{k: np.array(sorted(v), dtype=np.int64) for k, v in parts.items()})


@dataclass
class TrainResult:
    """A trained classifier with what training measured."""

    classifier: LevelClassifier
    data: LabelledPrompts
    config: TrainConfig
    split: Split
    selection: dict[str, Any]  # what validation chose (C, epoch) and its log-loss
    evaluations: dict[str, Evaluation]  # "train", "val", "test"
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per step

    def metrics_json(self) -> dict[str, Any]:
        """The ``metrics.json`` of the artifact (no timings: it is reproducible from a seed)."""
        data, config = self.data, self.classifier.config
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
                "seed": self.config.seed,
                "stratified": True,
                "train": len(self.split.train),
                "val": len(self.split.val),
                "test": len(self.split.test),
            },
            "selection": self.selection,
            "test": self.evaluations["test"].to_json() if "test" in self.evaluations else None,
            "val": self.evaluations["val"].to_json() if "val" in self.evaluations else None,
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
    """Step 3: the grid's head with the lowest validation log-loss (smaller C on ties)."""
    select = split.val if len(split.val) else split.train
    best: tuple[float, float, LinearHead] | None = None
    losses: dict[str, float] = {}
    for c in sorted(config.c_grid):
        head = fit_logistic_head(
            vectors[split.train], labels[split.train], n_levels, c, config.max_iter
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


def train_classifier(
    data: LabelledPrompts,
    config: TrainConfig | None = None,
    *,
    encoder_dir: str | Path | None = None,
    clock: Callable[[], float] = time.perf_counter,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Steps 1–5 of the module docstring; ``encoder_dir`` defaults to all-MiniLM-L6-v2."""
    config = config or TrainConfig()
    say = log or (lambda _message: None)
    seconds: dict[str, float] = {}
    if len(data) < 2:
        raise ValueError(f"need at least 2 labelled prompts to train, got {len(data)}")
    split = split_indices(data.labels, config.seed, config.val_fraction, config.test_fraction)
    reference = DEFAULT_ENCODER if encoder_dir is None else str(Path(encoder_dir).resolve())
    base = reference
    from argus.classifier.model import resolve_encoder_dir

    directory = resolve_encoder_dir(reference)
    n_levels = len(data.levels)

    started = clock()
    encoder: Encoder
    if config.backbone is Backbone.LOGISTIC:
        encoder = shared_encoder(directory, config.max_tokens)
    else:
        from argus.embedding import PromptEmbedder

        encoder = PromptEmbedder(directory, max_tokens=config.max_tokens)  # private: trained
    seconds["load_encoder"] = clock() - started
    started = clock()
    vectors = embed_many(encoder, data.prompts)
    seconds["embed"] = clock() - started
    say(f"{data.strategy}: embedded {len(data)} prompts in {seconds['embed']:.1f} s")

    started = clock()
    head, selection = _select_logistic(vectors, data.labels, split, n_levels, config)
    seconds["fit_head"] = clock() - started
    say(f"{data.strategy}: logistic head C={selection['C']:g} in {seconds['fit_head']:.1f} s")

    if config.backbone is Backbone.FINETUNE:
        started = clock()
        head, selection = _finetune(encoder, head, data, split, config, selection, say)
        seconds["finetune"] = clock() - started
        vectors = embed_many(encoder, data.prompts)  # the fine-tuned encoder's vectors
        reference = ENCODER_DIR

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
    )
    classifier = LevelClassifier(classifier_config, encoder, head)
    predicted = classifier.predict_vectors(vectors)
    evaluations = {
        name: evaluate(
            data.labels[rows],
            predicted[rows],
            n_levels,
            scores=None if data.scores is None else data.scores[rows],
            delta=data.delta,
        )
        for name, rows in (("train", split.train), ("val", split.val), ("test", split.test))
        if len(rows)
    }
    seconds["total"] = sum(seconds.values())
    return TrainResult(classifier, data, config, split, selection, evaluations, seconds)


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
        classifier = LevelClassifier(config, classifier.encoder, classifier.head)
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
    select = split.val if len(split.val) else split.train
    train_texts = [data.prompts[i] for i in split.train.tolist()]
    train_labels = data.labels[split.train]
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
