"""Measured latency-per-batch curves of masked edits, and the batch bound they give.

``benchmarks/bench_edit_cost.py --write-table FILE`` runs the worker's step batcher
(:mod:`argus.worker.editing.step_batch`) on each model at each size, batches of b edits at mask
ratio m replaying their template's record (m = 1: a full step, a miss), and writes one
:class:`BatchCurve` per (model, size): the seconds of one denoising step of the batch at each
measured (b, m). A worker started with ``--edit-batch-table FILE`` reads it
(:func:`load_batch_table`) and takes each model's and size's bound from it
(:meth:`BatchTable.bound`), capped by ``--edit-batch``; a model or size the table does not
cover keeps bound 1, one request at a time.

**The bound is the knee of the throughput curve.** At the expected mask ratio (the measured
ratio nearest at or above it) a batch of b edits steps at ``b / t(b)`` edits per second-step.
The bound is the largest measured b whose throughput is at least ``1 + min_gain`` times that
of the next smaller measured b, walking up from 1 and stopping at the first b that does not
pay: beyond the knee a larger batch only makes every edit in it slower (InstGenIE §4.3: the
batch's latency grows with its work once the device is full). With ``min_gain`` 0.1 a batch
must step at least 10% more edits per second than the one below it.

The table also gives the cost model the router and the simulator price edits with
(:meth:`BatchCurve.cost_model`: :func:`~argus.profiles.edit_cost.fit_cost_model` on its
points, with R²).

The file is TOML::

    source = "benchmarks/bench_edit_cost.py ..."
    device = "cpu: x86_64, 2 CPUs, torch 1 thread"
    [[curve]]
    model = "sdxl"
    width = 64
    height = 64
    steps = 10                       # the steps each measured edit was set to run
    points = [[1, 0.1, 0.0052], ...] # [batch, mask ratio, seconds a step]

It lives with the profiles (below the services) so that the worker, the router and the
simulator read the same table.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from argus.profiles.edit_cost import EditCostModel, fit_cost_model

MIN_GAIN = 0.1
"""How much more throughput the next batch size must give to be worth its latency."""
EXPECTED_MASK_RATIO = 0.11
"""The mask ratio a worker expects of an edit: InstGenIE's production trace's mean (Fig. 4)."""


class BatchTableError(ValueError):
    """A batch-curve table that cannot be read; the message names the file and the field."""


@dataclass(frozen=True)
class CurvePoint:
    batch: int  # edits in the batch
    mask_ratio: float  # every edit's (1: a full step)
    step_s: float  # seconds one denoising step of the batch took (median)


@dataclass(frozen=True)
class BatchCurve:
    """One model's and size's measured steps."""

    model: str
    width: int
    height: int
    points: tuple[CurvePoint, ...]
    steps: int = 0  # the steps each measured edit ran (0: not said)

    def ratios(self) -> list[float]:
        return sorted({p.mask_ratio for p in self.points})

    def at_ratio(self, mask_ratio: float) -> list[CurvePoint]:
        """The points at the measured ratio nearest at or above ``mask_ratio`` (the largest
        measured one when none is), by batch."""
        ratios = self.ratios()
        chosen = next((r for r in ratios if r >= mask_ratio - 1e-9), ratios[-1])
        return sorted((p for p in self.points if p.mask_ratio == chosen), key=lambda p: p.batch)

    def bound(self, mask_ratio: float = EXPECTED_MASK_RATIO, min_gain: float = MIN_GAIN) -> int:
        """The knee of the throughput curve at ``mask_ratio`` (see the module's docstring)."""
        points = self.at_ratio(mask_ratio)
        best = 1
        previous: CurvePoint | None = None
        for point in points:
            if previous is not None:
                gain = (point.batch / point.step_s) / (previous.batch / previous.step_s)
                if gain < 1.0 + min_gain:
                    break
                best = point.batch
            elif point.batch != 1:
                best = point.batch  # nothing measured below it
            previous = point
        return best

    def step_s(self, batch: int, mask_sum: float) -> float:
        """One step of ``batch`` edits whose effective ratios sum to ``mask_sum``, read off the
        points rather than the fit: linear in the mean ratio between the ratios measured at a
        batch size (the nearest one outside them), then linear in the batch size between
        measured sizes (the two last, or first, extended beyond them)."""
        if batch <= 0:
            return 0.0
        mean = mask_sum / batch
        by_size = self._by_size

        def at(size: int) -> float:
            ratios, seconds = by_size[size]
            return float(np.interp(mean, ratios, seconds))

        sizes = list(by_size)
        if batch in sizes or len(sizes) == 1:
            return at(batch if batch in sizes else sizes[0])
        below = [size for size in sizes if size < batch]
        above = [size for size in sizes if size > batch]
        if below and above:
            low, high = below[-1], above[0]
        else:  # outside the measured sizes: the nearest two, extended
            low, high = sizes[:2] if above else sizes[-2:]
        return at(low) + (at(high) - at(low)) * (batch - low) / (high - low)

    @cached_property
    def _by_size(self) -> dict[int, tuple[list[float], list[float]]]:
        """Batch size (ascending) → its measured ratios (ascending) and step times."""
        out: dict[int, tuple[list[float], list[float]]] = {}
        for size in sorted({p.batch for p in self.points}):
            measured = sorted((p.mask_ratio, p.step_s) for p in self.points if p.batch == size)
            out[size] = ([r for r, _ in measured], [t for _, t in measured])
        return out

    def cost_model(self) -> EditCostModel:
        """The edit cost model fitted on every point (b, b·m, seconds), with R²."""
        points = [(p.batch, p.batch * p.mask_ratio, p.step_s) for p in self.points]
        return fit_cost_model(points, f"{self.model} {self.width}x{self.height} batch curve")


@dataclass(frozen=True)
class BatchTable:
    curves: tuple[BatchCurve, ...]
    source: str = ""
    device: str = ""

    def curve(self, model: str, width: int, height: int) -> BatchCurve | None:
        for curve in self.curves:
            if (curve.model, curve.width, curve.height) == (model, width, height):
                return curve
        return None

    def bound(
        self,
        model: str,
        width: int,
        height: int,
        *,
        cap: int,
        mask_ratio: float = EXPECTED_MASK_RATIO,
        min_gain: float = MIN_GAIN,
    ) -> int:
        """The batch bound of ``model`` at ``width`` × ``height``: its curve's knee at most
        ``cap``; 1 where the table has no curve for it (one at a time)."""
        curve = self.curve(model, width, height)
        if curve is None:
            return 1
        return max(1, min(cap, curve.bound(mask_ratio, min_gain)))

    def cost_model(self, model: str, width: int, height: int) -> EditCostModel:
        """The cost model of ``model`` at ``width`` × ``height``: its curve's fit, or the
        first curve's where the table has none for it (the router scales it to each worker's
        measured speed; what it takes from the table is how a step's time splits)."""
        return (self.curve(model, width, height) or self.curves[0]).cost_model()


def load_batch_table(path: str | Path) -> BatchTable:
    """Read a table :func:`dump_batch_table` wrote; :class:`BatchTableError` names the field."""
    where = str(path)
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise BatchTableError(f"{where}: {err}") from err
    curves = []
    for index, entry in enumerate(raw.get("curve", [])):
        name = f"{where}: curve[{index}]"
        try:
            model = str(entry["model"])
            width, height = int(entry["width"]), int(entry["height"])
            steps = int(entry.get("steps", 0))
            points = tuple(CurvePoint(int(b), float(m), float(s)) for b, m, s in entry["points"])
        except (KeyError, TypeError, ValueError) as err:
            raise BatchTableError(f"{name}: {err!r}") from err
        _check(name, width, height, points)
        curves.append(BatchCurve(model, width, height, points, steps))
    if not curves:
        raise BatchTableError(f"{where}: no [[curve]]")
    return BatchTable(tuple(curves), str(raw.get("source", "")), str(raw.get("device", "")))


def _check(name: str, width: int, height: int, points: Sequence[CurvePoint]) -> None:
    if width <= 0 or height <= 0:
        raise BatchTableError(f"{name}: width and height must be > 0, got {width}x{height}")
    if not points:
        raise BatchTableError(f"{name}: points: none")
    for point in points:
        if point.batch < 1:
            raise BatchTableError(f"{name}: points: batch must be >= 1, got {point.batch}")
        if not 0.0 < point.mask_ratio <= 1.0:
            raise BatchTableError(f"{name}: points: mask ratio must be in (0, 1], got {point}")
        if not math.isfinite(point.step_s) or point.step_s <= 0.0:
            raise BatchTableError(f"{name}: points: seconds must be > 0, got {point}")


def dump_batch_table(curves: Iterable[BatchCurve], source: str, device: str) -> str:
    """The TOML text of a table (see the module's docstring)."""
    lines = [f"source = {_quote(source)}", f"device = {_quote(device)}", ""]
    for curve in curves:
        lines += [
            "[[curve]]",
            f"model = {_quote(curve.model)}",
            f"width = {curve.width}",
            f"height = {curve.height}",
            f"steps = {curve.steps}",
            "points = [",
            *(f"  [{p.batch}, {p.mask_ratio:g}, {p.step_s:.6f}]," for p in curve.points),
            "]",
            "",
        ]
    return "\n".join(lines)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
