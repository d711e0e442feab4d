"""Command-line options that ``argus replay`` and ``argus evaluate`` share: the simulated GPUs
(``--gpus``) and the quality world (``--quality``).

Both commands import them from here, so neither imports the other.
"""

from __future__ import annotations

import argparse

from argus import defaults
from argus.cli.main import CLIError
from argus.plumbing.quoting import quoted


def add_quality_argument(parser: argparse.ArgumentParser) -> None:
    """``--quality WORLD`` (``argus evaluate`` and ``argus replay``); an unknown world is
    argparse's usage error, naming the choices."""
    parser.add_argument(
        "--quality",
        choices=defaults.QUALITY_WORLDS,
        default=defaults.QUALITY_WORLDS[0],
        metavar="WORLD",
        help=(
            "quality world: synthetic (the SYNTHETIC model; default), uniform (the same with "
            "every prompt degrading alike: no per-prompt signal) or genai-bench (GenAI-Bench "
            "human ratings on an SM ladder SDXL-Base > SD-2.1 > SDXL-Turbo, 1-5 scale; "
            "its own EVAL prompts and profiles)"
        ),
    )


def parse_gpus(text: str, known: tuple[str, ...] | None) -> dict[str, int]:
    """``--gpus``: ``N`` (N GPUs of the first known class, ``a100`` when ``known`` is None)
    or ``CLASS=N,CLASS=N`` -> {class: count}, in the given order. Classes not in ``known``
    (when given), counts below 1 and repeated classes are CLIErrors quoting the text."""
    spec = text.strip()
    if spec.isdigit():
        count = int(spec)
        if count < 1:
            raise CLIError(f"--gpus: must be >= 1, got {quoted(text)}")
        return {known[0] if known else "a100": count}
    counts: dict[str, int] = {}
    for part in spec.split(","):
        name, equals, number = part.partition("=")
        name = name.strip()
        if not equals or not name or not number.strip().isdigit():
            raise CLIError(f"--gpus: expected N or CLASS=N[,CLASS=N...], got {quoted(text)}")
        if name in counts:
            raise CLIError(f"--gpus: class {quoted(name)} given twice in {quoted(text)}")
        if known is not None and name not in known:
            raise CLIError(
                f"--gpus: unknown GPU class {quoted(name)}; the profiles have {', '.join(known)}"
            )
        counts[name] = int(number)
        if counts[name] < 1:
            raise CLIError(f"--gpus: class {quoted(name)} needs >= 1 GPU, got {quoted(text)}")
    return counts


def describe_gpus(counts: dict[str, int]) -> str:
    """``8 GPUs`` or ``8 GPUs (a100=4, h100=4)``."""
    total = sum(counts.values())
    if len(counts) == 1:
        return f"{total} GPUs"
    return f"{total} GPUs ({', '.join(f'{c}={n}' for c, n in counts.items())})"


def add_cache_warm_argument(parser: argparse.ArgumentParser) -> None:
    """``--cache-warm none|train`` (``argus evaluate``)."""
    parser.add_argument(
        "--cache-warm",
        choices=("none", "train"),
        default="none",
        help=(
            "what the realistic caches hold at the start: none (default, cold) or train (the "
            "prompt file's TRAIN prompts, disjoint from the EVAL prompts served, dealt "
            "round-robin over the workers)"
        ),
    )


def add_late_binding_argument(parser: argparse.ArgumentParser) -> None:
    """``--late-binding-window N`` (``argus evaluate`` and ``argus replay``): the live
    router's flag; off by default here (see docs/concepts/policies.md)."""
    parser.add_argument(
        "--late-binding-window",
        type=int,
        default=0,
        help=(
            "requests sent to a worker at once; the router holds the rest and a worker with "
            "room takes the first by deadline, refusing what can no longer finish in time, as "
            f"argus router does (its default: {defaults.LATE_BINDING_WINDOW}); 0, the default "
            "here: every request queued on its worker when routed"
        ),
    )


def add_cache_argument(parser: argparse.ArgumentParser) -> None:
    """``--cache realistic|perfect`` (``argus evaluate`` and ``argus replay``)."""
    parser.add_argument(
        "--cache",
        choices=("realistic", "perfect"),
        default="realistic",
        help=(
            "what an AC request finds: realistic (default; each worker's own cache of the "
            "prompts it generated, with misses, cold start and the K its nearest prompt's "
            "similarity allows) or perfect (every AC request a hit at its routed K)"
        ),
    )
