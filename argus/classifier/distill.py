"""A small student encoder for the router: the first layers of MiniLM, distilled to the whole.

The router runs its encoder on every uncached prompt, on a CPU core it shares with gRPC. A
*student* keeps the embeddings and the first ``k`` of all-MiniLM-L6-v2's six transformer
layers (about ``k / 6`` of the compute) and is trained so that its mean-pooled unit vector
points where the full encoder's does (the *teacher*); the logistic heads are then fitted on
the student's vectors as on any frozen encoder (:mod:`argus.classifier.train`).

Steps of :func:`distill_student`:

1. **Teacher vectors**: the full encoder's pooled unit vectors of the given prompts (only
   TRAIN prompts of :mod:`argus.prompt_split`: the CALIBRATION and EVAL prompts stay unseen
   by every weight, the student's included).
2. **Student**: the teacher's checkpoint cut to its first ``k`` layers; the embedding table
   stays frozen (it is the package's, never copied), the ``k`` layers train.
3. **Loss**: ``1 - cos(student vector, teacher vector)``, AdamW with linear warm-up and decay,
   seeded shuffling and dropout off (the teacher's vectors are computed without it).
4. **Epoch**: after each epoch the mean cosine on a seeded held-out slice of the prompts is
   measured; the best epoch's weights are kept.
5. **Weights**: the ``k`` layers in float16 (about 3.5 MB per layer), in a safetensors file
   that :class:`argus.embedding.PromptEmbedder` reads with ``layer_weights``.

Command (writes ``student.safetensors`` and the AC and SM heads fitted on its vectors)::

    python -m argus.classifier.distill --layers 2 --out classifiers/minilm-l2-distilled
    python -m argus.classifier.distill --layers 2 --no-distil --out classifiers/minilm-l2

Same seed, prompts and thread count → the same weights (torch's CPU kernels are deterministic
for a given thread count).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from argus import defaults

STUDENT_FILE = "student.safetensors"
STUDENT_FORMAT = "argus-student-layers v1"
PINNED_FILE = "pinned.json"  # a few prompts' classes, checked by the tests against a reload
PINNED_PROMPTS = (
    "a red bus",
    "a photo of a cat",
    "a crowded street market at dusk, oil painting",
    "the words 'Argus' written in calligraphy on a chessboard",
    "an astronaut riding a horse on the moon, photorealistic",
    "a kaleidoscope of butterflies over a frozen lake",
    "",
    "two hands shaking, reflected in a mirror",
)


@dataclass(frozen=True)
class DistillConfig:
    """How a student is distilled; ``python -m argus.classifier.distill`` maps one flag to
    each field."""

    layers: int = 2
    """Transformer layers the student keeps (the teacher's first ``layers``)."""

    epochs: int = 8
    """Passes over the prompts; the epoch with the best held-out cosine is kept."""

    batch_size: int = 32
    """Prompts per step."""

    lr: float = 1e-4
    """Peak AdamW learning rate."""

    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and LayerNorm weights)."""

    warmup_fraction: float = 0.1
    """Share of the steps spent warming the learning rate up from 0."""

    held_out: float = 0.1
    """Share of the prompts held out to choose the epoch."""

    seed: int = 0
    """Seeds the held-out slice and the shuffling."""

    max_tokens: int = 256
    """Where prompts are cut, as the classifier cuts them."""

    def __post_init__(self) -> None:
        for name in ("layers", "epochs", "batch_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if not 0.0 < self.held_out < 0.5:
            raise ValueError(f"held_out: must be in (0, 0.5), got {self.held_out}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction: must be in [0, 1), got {self.warmup_fraction}")
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")


@dataclass(frozen=True)
class DistillResult:
    """The student's layer weights (float16, ``encoder.layer.*``) and what training saw."""

    weights: dict[str, Any]  # name -> torch.Tensor
    held_out_cosine: list[float]  # mean cosine to the teacher after each epoch (0: truncated)
    best_epoch: int
    prompts: int
    seconds: float


def distill_student(
    prompts: Sequence[str],
    config: DistillConfig,
    *,
    encoder_dir: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> DistillResult:
    """Steps 1-5 of the module docstring on ``prompts`` (TRAIN prompts, already cleaned)."""
    import torch

    from argus.embedding import PromptEmbedder, mean_pool

    say = log or (lambda _message: None)
    started = time.perf_counter()
    texts = list(prompts)
    if len(texts) < 10:
        raise ValueError(f"prompts: need at least 10 to distil, got {len(texts)}")
    teacher = PromptEmbedder(encoder_dir, max_tokens=config.max_tokens)
    targets = torch.from_numpy(_embed_all(teacher, texts))
    student = PromptEmbedder(encoder_dir, max_tokens=config.max_tokens, layers=config.layers)
    model = student.model
    rng = np.random.default_rng([config.seed, 0xD15])
    order = rng.permutation(len(texts))
    n_held = max(1, round(config.held_out * len(texts)))
    held, fit = np.sort(order[:n_held]), np.sort(order[n_held:])

    def vectors(rows: Sequence[int]) -> Any:
        batch = student.tokenizer(
            [texts[i] for i in rows],
            padding=True,
            truncation=True,
            max_length=student.max_tokens,
            return_tensors="pt",
        )
        hidden = model(**batch).last_hidden_state
        pooled = mean_pool(hidden, batch["attention_mask"])
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def held_cosine() -> float:
        model.eval()
        with torch.inference_mode():
            total = 0.0
            for start in range(0, len(held), 64):
                rows = held[start : start + 64].tolist()
                total += float((vectors(rows) * targets[rows]).sum())
        return total / len(held)

    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("encoder.layer."))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trained if not (n.endswith("bias") or "LayerNorm" in n)]
    no_decay = [p for n, p in trained if n.endswith("bias") or "LayerNorm" in n]
    steps = math.ceil(len(fit) / config.batch_size) * config.epochs
    warmup = max(1, int(config.warmup_fraction * steps))
    cosines = [round(held_cosine(), 6)]
    say(f"layers {config.layers}: held-out cosine to the teacher, truncated: {cosines[0]:.4f}")
    best = (cosines[0], 0, _layer_state(model))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=config.lr,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: (
                (step + 1) / warmup
                if step < warmup
                else max(0.0, (steps - step) / max(1, steps - warmup))
            ),
        )
        for epoch in range(1, config.epochs + 1):
            model.eval()  # dropout off: the teacher's vectors have none
            shuffled = fit[rng.permutation(len(fit))]
            for start in range(0, len(shuffled), config.batch_size):
                rows = shuffled[start : start + config.batch_size].tolist()
                loss = 1.0 - (vectors(rows) * targets[rows]).sum(dim=1).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
            cosine = held_cosine()
            cosines.append(round(cosine, 6))
            say(f"layers {config.layers}: epoch {epoch}: held-out cosine {cosine:.4f}")
            if cosine > best[0]:
                best = (cosine, epoch, _layer_state(model))
    return DistillResult(
        best[2], cosines, best[1], len(texts), round(time.perf_counter() - started, 1)
    )


def _embed_all(encoder: Any, texts: Sequence[str]) -> Any:
    from argus.classifier.model import embed_many

    return embed_many(encoder, texts)


def _layer_state(model: Any) -> dict[str, Any]:
    """The transformer layers' tensors, float16 (what is stored: rounding now means the
    heads are fitted on exactly the vectors serving computes)."""
    import torch

    return {
        name: tensor.detach().to(torch.float16).clone()
        for name, tensor in model.state_dict().items()
        if name.startswith("encoder.layer.")
    }


def save_student(result: DistillResult, config: DistillConfig, path: Path) -> Path:
    """Write the student's layers to ``path`` (safetensors; metadata: format, layer count,
    how it was distilled); readable by everyone, written through a rename."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": STUDENT_FORMAT,
        "layers": str(config.layers),
        "config": json.dumps(asdict(config), sort_keys=True),
        "held_out_cosine": json.dumps(result.held_out_cosine),
        "best_epoch": str(result.best_epoch),
    }
    temporary = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in result.weights.items()}, str(temporary), metadata)
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
    return path


# ---------------------------------------------------------------------------------------------
# Command line: the student and its heads


def _labelled(max_tokens: int) -> dict[Any, Any]:
    """The default SYNTHETIC labels of ``argus train-classifier`` (seed 0, δ
    :data:`argus.defaults.DELTA`, the PartiPrompts and the default profile's levels), per
    strategy."""
    from argus.classifier.labels import labels_from_table
    from argus.classifier.prompts import max_chars_for
    from argus.profiles import default_profiles
    from argus.profiles.synthetic_quality import synthetic_quality_table
    from argus.traces import default_prompt_trace, load_prompts
    from argus.types import Strategy

    profiles = default_profiles()
    records = load_prompts(default_prompt_trace())
    out = {}
    for strategy in (Strategy.AC, Strategy.SM):
        levels = [lv.name for lv in profiles.levels_for(strategy)]
        table = synthetic_quality_table(records, strategy, levels, seed=0)
        out[strategy] = labels_from_table(
            table, defaults.DELTA, max_chars=max_chars_for(max_tokens)
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m argus.classifier.distill", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--layers", type=int, default=2, help="student layers (default 2)")
    parser.add_argument("--out", type=Path, required=True, help="artifact directory to write")
    parser.add_argument("--no-distil", action="store_true", help="truncate only: no weights")
    parser.add_argument("--epochs", type=int, default=DistillConfig.epochs)
    parser.add_argument("--lr", type=float, default=DistillConfig.lr)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DistillConfig.max_tokens,
        help="where prompts are cut, in training and serving (default %(default)s)",
    )
    parser.add_argument(
        "--runtime",
        default="torch",
        choices=["torch", "onnx", "onnx-int8"],
        help="encoder runtime the heads are fitted on and served with (as argus "
        "train-classifier --runtime)",
    )
    args = parser.parse_args(argv)
    from argus.classifier.train import TrainConfig, save_trained, split_prompts, train_classifier
    from argus.embedding import use_torch_threads

    try:
        config = DistillConfig(
            layers=args.layers,
            epochs=args.epochs,
            lr=args.lr,
            seed=args.seed,
            max_tokens=args.max_tokens,
        )
    except ValueError as exc:
        parser.error(str(exc))
    use_torch_threads(args.threads)  # one: a shared machine's second core is not ours
    data = _labelled(config.max_tokens)
    weights = None
    if not args.no_distil:
        first = next(iter(data.values()))
        train = split_prompts(first, 0, 0.15).train  # TRAIN only: the same for every strategy
        texts = [first.prompts[i] for i in train.tolist()]
        result = distill_student(texts, config, log=lambda m: print(m, file=sys.stderr))
        weights = save_student(result, config, args.out / STUDENT_FILE)
        print(
            f"student: {config.layers} layers, {len(texts)} TRAIN prompts, best epoch "
            f"{result.best_epoch}, held-out cosine {result.held_out_cosine[0]:.4f} -> "
            f"{max(result.held_out_cosine):.4f}, {result.seconds:.0f} s; {weights}"
        )
    train_config = TrainConfig(
        layers=config.layers,
        student_weights=weights,
        runtime=args.runtime,
        max_tokens=config.max_tokens,
    )
    pinned: dict[str, Any] = {"layers": config.layers, "prompts": list(PINNED_PROMPTS)}
    for strategy, labelled in data.items():
        trained = train_classifier(labelled, train_config)
        directory = save_trained(trained, args.out / strategy.value.lower())
        evaluation = trained.evaluations["eval"].to_json()
        print(
            f"{strategy}: {directory}: EVAL accuracy {evaluation['accuracy']:.4f}, "
            f"macro-F1 {evaluation['macro_f1']:.4f} (SYNTHETIC labels)"
        )
        classifier = trained.classifier
        pinned[strategy.value] = {
            "classes": classifier.classes(list(PINNED_PROMPTS)).tolist(),
            "levels": classifier.predict(list(PINNED_PROMPTS)).tolist(),
        }
    (args.out / PINNED_FILE).write_text(json.dumps(pinned, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
