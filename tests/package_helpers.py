"""Helpers that only tests need, built on the package's public pieces: a tiny ControlNet
catalog on disk, one request's adapters drawn by the Katz mix, an artifact's metrics."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from argus.classifier.model import METRICS_FILE
from argus.sim.adapters import (
    CONTROLNET,
    DEFAULT_SCALE,
    KATZ_SERVICE_A,
    LORA,
    AdapterMix,
    draw_adapters,
)
from argus.worker.adapters.controlnet.models import (
    TINY_NAMES,
    ControlNetCatalog,
    build_tiny_controlnet,
)


def export_tiny_catalog(
    root: str | Path, names: Mapping[str, Iterable[str]] | None = None
) -> ControlNetCatalog:
    """Write tiny ControlNets as a directory catalog (``ROOT/<family>/<name>/``) and open it;
    ``names`` maps family → names (default: all)."""
    base = Path(root)
    for family, family_names in (names or TINY_NAMES).items():
        for name in family_names:
            build_tiny_controlnet(family, name).save_pretrained(
                base / family / name, safe_serialization=True
            )
    return ControlNetCatalog.directory(base)


def sample_adapters(
    rng: np.random.Generator,
    mix: AdapterMix = KATZ_SERVICE_A,
    *,
    controlnets: Sequence[str] | None = None,
) -> list[tuple[str, str, float]]:
    """One request's adapters as ``(kind, name, scale)``. ``controlnets`` names the
    ControlNets a client can ask for, most popular first: popularity is cut to that many
    ranks and rank r takes ``controlnets[r]``; without it the names are the mix's own."""
    limit = None if controlnets is None else len(controlnets)
    draws = draw_adapters(1, rng, mix, controlnets=limit)
    found = draws.adapters(0)
    if controlnets is None:
        return found
    ranks = [int(r) for r in draws.controlnets[0] if r >= 0]
    named = [(CONTROLNET, controlnets[r], DEFAULT_SCALE) for r in ranks]
    return named + [entry for entry in found if entry[0] == LORA]


def read_metrics(directory: str | Path) -> dict[str, Any]:
    """``metrics.json`` of a classifier artifact."""
    metrics: dict[str, Any] = json.loads((Path(directory) / METRICS_FILE).read_text())
    return metrics
