"""Quality worlds: which per-prompt quality the simulator scores requests with.

``argus evaluate --quality WORLD`` and ``argus replay --quality WORLD`` choose one; the names
are :data:`argus.defaults.QUALITY_WORLDS` (the parsers read them there, without this module).

* ``synthetic`` (the default): the calibrated SYNTHETIC model of
  :mod:`argus.profiles.synthetic_quality`, on the default profile's AC and SM ladders.
* ``uniform``: the synthetic tables with every prompt's per-level drop replaced by the mean
  drop of that level (:func:`uniform_quality_table`). Each prompt keeps its own score at the
  best level, and every prompt loses the same amount at each level, so a prompt's text says
  nothing about how much approximation it tolerates: a policy that routes by prompt cannot
  gain over one that does not. Argus − PAC must be zero within its interval here; a gain
  measured in the synthetic world comes from the prompt only as far as this world removes it.
  Labelled SYNTHETIC too (it is built from the synthetic tables).
* ``genai-bench``: real human ratings (:func:`genai_quality_table`): GenAI-Bench's 527 prompts,
  each rendered once by SDXL-Base, SD-2.1 and SDXL-Turbo and rated 1 to 5 by three people.
  A prompt's score at a level is the mean of its three ratings, on the ratings' own 1–5
  scale (not PickScore's, so its numbers do not compare with the other worlds'). The world is
  SM-only: the profile set :data:`GENAI_PROFILE_PATH` has the three models as SM levels,
  slowest first (SDXL-Base, SD-2.1, SDXL-Turbo), with their latencies' sources in the file.
  Its prompts are the GenAI-Bench prompts, split by :mod:`argus.prompt_split` (a keyed hash
  of the text, 60 / 20 / 20): a classifier is trained on TRAIN (and calibrated on
  CALIBRATION) prompts only, :func:`genai_training_table`, and a simulation draws EVAL prompts
  only. The δ rule (within 90 % of the best) is applied to the 1–5 means as they are.

The ratings are vendored in ``argus/profiles/data/genai_bench_ratings.csv`` (a derived
subset of GenAI-Bench's ``genai_image.json``), with the licence text and attribution in that
folder: "GenAI-Bench, Li, Lin et al., 2024, Apache-2.0".
"""

from __future__ import annotations

import csv
import enum
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from argus import defaults
from argus.contracts.quality import QualityTable
from argus.prompt_split import PromptSet, prompt_set
from argus.traces import PromptRecord
from argus.types import ProfileSet, Strategy

if TYPE_CHECKING:
    from argus.profiles.synthetic_quality import SyntheticModel


class QualityWorld(enum.StrEnum):
    """The quality worlds by name (:data:`argus.defaults.QUALITY_WORLDS`, in that order)."""

    SYNTHETIC = "synthetic"
    UNIFORM = "uniform"
    GENAI_BENCH = "genai-bench"


DEFAULT_WORLD = QualityWorld(defaults.QUALITY_WORLDS[0])

DATA_DIR = Path(__file__).with_name("data")
RATINGS_PATH = DATA_DIR / "genai_bench_ratings.csv"
GENAI_PROFILE_PATH = Path(__file__).with_name("genai_bench.toml")
GENAI_MODELS = ("SDXL_Base", "SDXL_2_1", "SDXL_Turbo")
"""The rated models of the ladder, slowest first (``SDXL_2_1`` is Stable Diffusion 2.1)."""
GENAI_LEVELS = ("sm-sd-xl", "sm-sd-2.1", "sm-sdxl-turbo")
"""Their SM levels in :data:`GENAI_PROFILE_PATH`, in the same order."""
RATERS = 3
GENAI_LABEL = "GenAI-Bench human ratings (Apache-2.0)"
GENAI_SOURCE = (
    f"{GENAI_LABEL}: mean of {RATERS} raters per prompt and model, 1-5 scale; "
    "GenAI-Bench, Li, Lin et al., 2024"
)

LABELS: dict[QualityWorld, str] = {
    QualityWorld.SYNTHETIC: "SYNTHETIC (argus/profiles/synthetic_quality.py)",
    QualityWorld.UNIFORM: (
        "SYNTHETIC uniform: the synthetic tables with every prompt losing its level's mean "
        "drop (argus/profiles/quality_worlds.py)"
    ),
    QualityWorld.GENAI_BENCH: GENAI_LABEL,
}
"""The quality model's name wherever results are shown."""


def parse_world(text: str) -> QualityWorld:
    """The world named ``text``; ValueError quoting it and listing the worlds otherwise."""
    try:
        return QualityWorld(text.strip().lower())
    except ValueError:
        known = ", ".join(defaults.QUALITY_WORLDS)
        raise ValueError(f"unknown quality world {text!r}; choose one of {known}") from None


def world_label(world: QualityWorld | str) -> str:
    """What the results say the quality model is."""
    return LABELS[QualityWorld(world)]


# -- the uniform world ----------------------------------------------------------------------


def uniform_quality_table(table: QualityTable) -> QualityTable:
    """``table`` with every prompt's drop at each level set to that level's mean drop.

    Score of prompt ``p`` at level ``j``: ``s_p0 − mean_q(s_q0 − s_qj)``, where level 0 is the
    best (slowest) level. The level means are ``table``'s exactly; the per-prompt base is kept,
    so prompts still differ in how good they are, but not in what approximation costs them.
    ValueError when a score would fall to 0 or below (the δ rule compares ratios)."""
    scores = table.scores
    drops = (scores[:, :1] - scores).mean(axis=0)
    uniform = scores[:, :1] - drops[None, :]
    if not np.all(uniform > 0.0):
        raise ValueError(
            f"the uniform {table.strategy} table would have a score <= 0 "
            f"(lowest best score {scores[:, 0].min():g}, largest mean drop {drops.max():g})"
        )
    return QualityTable(
        strategy=table.strategy,
        levels=table.levels,
        prompts=table.prompts,
        scores=uniform,
        source=f"uniform drops of {table.source}",
    )


# -- the genai-bench world ------------------------------------------------------------------


@dataclass(frozen=True)
class GenaiPrompt:
    """One GenAI-Bench prompt with its ratings: ``ratings[m][k]`` is rater ``k``'s rating of
    model ``GENAI_MODELS[m]``'s image (1 to 5)."""

    id: str
    prompt: str
    ratings: tuple[tuple[int, ...], ...]

    @property
    def record(self) -> PromptRecord:
        """As a workload's prompt (GenAI-Bench gives no PartiPrompts category or challenge)."""
        return PromptRecord(self.prompt, "GenAI-Bench", "")

    @property
    def prompt_set(self) -> PromptSet:
        return prompt_set(self.prompt)


@functools.cache
def genai_prompts(path: Path = RATINGS_PATH) -> tuple[GenaiPrompt, ...]:
    """The vendored ratings, in file order; ValueError names the file and line of bad input."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the GenAI-Bench ratings: {exc.strerror}") from None
    reader = csv.reader(text.splitlines())
    header = next(reader, [])
    expected = ["id", "prompt"] + [f"{m}_{k}" for m in GENAI_MODELS for k in range(1, RATERS + 1)]
    if header != expected:
        raise ValueError(f"{path}:1: expected the columns {','.join(expected)}")
    out = []
    for line, row in enumerate(reader, start=2):
        if len(row) != len(expected):
            raise ValueError(f"{path}:{line}: expected {len(expected)} columns, got {len(row)}")
        try:
            values = [int(cell) for cell in row[2:]]
        except ValueError:
            raise ValueError(f"{path}:{line}: a rating is not a whole number") from None
        if any(not 1 <= v <= 5 for v in values):
            raise ValueError(f"{path}:{line}: ratings must be 1 to 5")
        ratings = tuple(
            tuple(values[m * RATERS : (m + 1) * RATERS]) for m in range(len(GENAI_MODELS))
        )
        out.append(GenaiPrompt(row[0], row[1], ratings))
    if len({p.prompt for p in out}) != len(out):
        raise ValueError(f"{path}: a prompt text appears twice")
    return tuple(out)


def genai_split(
    prompts: Sequence[GenaiPrompt] | None = None,
) -> dict[PromptSet, tuple[GenaiPrompt, ...]]:
    """The GenAI-Bench prompts by set of :mod:`argus.prompt_split` (disjoint, and the same on
    every run and machine: the set is a keyed hash of the text)."""
    chosen = genai_prompts() if prompts is None else prompts
    return {which: tuple(p for p in chosen if p.prompt_set is which) for which in PromptSet}


def genai_ratings(prompts: Sequence[str]) -> np.ndarray:
    """Ratings ``[prompt, model, rater]`` of the given GenAI-Bench prompt texts; KeyError
    quoting the first text that is not a GenAI-Bench prompt."""
    by_text = {p.prompt: p for p in genai_prompts()}
    rows = []
    for text in prompts:
        if text not in by_text:
            raise KeyError(f"{text[:60]!r} is not a GenAI-Bench prompt")
        rows.append(by_text[text].ratings)
    return np.array(rows, dtype=np.float64).reshape(len(rows), len(GENAI_MODELS), RATERS)


def genai_quality_table(
    prompts: Sequence[str], raters: Sequence[int] | None = None
) -> QualityTable:
    """The SM table of the genai-bench world for ``prompts`` (GenAI-Bench texts, repeats
    allowed, in the given order): per prompt and level, the mean of the ``raters`` (indices
    0–2; default all three) ratings of that level's model, on the 1–5 scale."""
    if not prompts:
        raise ValueError("no prompts given")
    chosen = list(range(RATERS)) if raters is None else list(raters)
    if not chosen or any(not 0 <= k < RATERS for k in chosen):
        raise ValueError(f"raters: indices 0 to {RATERS - 1}, got {raters!r}")
    scores = genai_ratings(prompts)[:, :, chosen].mean(axis=2)
    source = GENAI_SOURCE if raters is None else f"{GENAI_SOURCE}; raters {chosen}"
    return QualityTable(Strategy.SM, GENAI_LEVELS, tuple(prompts), scores, source)


def genai_training_table() -> QualityTable:
    """What a genai-bench classifier may learn from: the TRAIN and CALIBRATION prompts'
    table (the EVAL prompts, which the simulation serves, are not in it)."""
    split = genai_split()
    kept = split[PromptSet.TRAIN] + split[PromptSet.CALIBRATION]
    return genai_quality_table([p.prompt for p in kept])


def genai_eval_records() -> tuple[PromptRecord, ...]:
    """The EVAL prompts of the genai-bench world, as workload prompts."""
    return tuple(p.record for p in genai_split()[PromptSet.EVAL])


# -- per world ------------------------------------------------------------------------------


def world_profiles(world: QualityWorld | str, spec: str = "default") -> ProfileSet:
    """The profile set of a world: ``spec`` (``default`` or a file) for synthetic and uniform;
    for genai-bench :data:`GENAI_PROFILE_PATH` when ``spec`` is ``default``, else the file,
    whose SM levels must then be :data:`GENAI_LEVELS`."""
    from argus.profiles import ProfileError, load_profiles

    if QualityWorld(world) is not QualityWorld.GENAI_BENCH:
        return load_profiles(spec)
    profiles = load_profiles(GENAI_PROFILE_PATH if spec == "default" else spec)
    names = tuple(level.name for level in profiles.levels_for(Strategy.SM))
    if names != GENAI_LEVELS:
        raise ProfileError(
            f"{spec}: the genai-bench world needs the SM levels {', '.join(GENAI_LEVELS)}, "
            f"got {', '.join(names) or 'none'}"
        )
    return profiles


def world_quality_tables(
    world: QualityWorld | str,
    profiles: ProfileSet,
    prompts: Sequence[PromptRecord],
    seed: int,
    models: Mapping[Strategy, SyntheticModel] | None = None,
) -> dict[Strategy, QualityTable]:
    """Quality tables of ``prompts`` in ``world``: synthetic and uniform for every strategy of
    ``profiles`` drawn with ``seed`` (``models``: the synthetic model per strategy, default the
    calibrated one); genai-bench the SM table of the ratings (``seed`` and ``models`` unused:
    the ratings are what they are)."""
    from argus.profiles.synthetic_quality import synthetic_quality_table

    chosen = QualityWorld(world)
    if chosen is QualityWorld.GENAI_BENCH:
        return {Strategy.SM: genai_quality_table([r.prompt for r in prompts])}
    tables = {
        s: synthetic_quality_table(
            prompts,
            s,
            [lv.name for lv in profiles.levels_for(s)],
            seed=seed,
            model=None if models is None else models[s],
        )
        for s in Strategy
        if profiles.levels_for(s)
    }
    if chosen is QualityWorld.UNIFORM:
        return {s: uniform_quality_table(t) for s, t in tables.items()}
    return tables
