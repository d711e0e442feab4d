"""benchmarks/predictability_sweep.py at a tiny setting: a quarter of PartiPrompts, ρ = 0 and 1,
one seed of two simulated minutes, the real all-MiniLM-L6-v2 through an empty embedding cache.

What could break: the text share not reaching the classifier's labels, or the classes not
following it (flat Q(v | c) when the text says nothing, distinct classes when it says all)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from argus.classifier.embedding_cache import CACHE_ENV
from argus.traces import default_prompt_trace, load_prompts
from argus.types import Strategy
from tests.benchmark_modules import benchmark_module

pytestmark = pytest.mark.unit


@pytest.fixture
def sweep() -> Iterator[Any]:
    """The benchmark module; benchmarks/ is a folder of scripts that import `_machine`."""
    with benchmark_module("predictability_sweep") as module:
        yield module


def test_classes_follow_the_text_share(
    sweep: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.tsv"
    records = load_prompts(default_prompt_trace())[::2]  # every category, not the first ones
    rows = (f"{r.prompt}\t{r.category}\t{r.challenge}\n" for r in records)  # the text features
    prompts.write_text("Prompt\tCategory\tChallenge\n" + "".join(rows))
    argv = ["--rhos", "0,1", "--seeds", "1", "--duration", "2", "--prompts", str(prompts)]

    blind, reading = sweep.main(argv)

    for strategy in Strategy:
        assert "text share 0," in blind.training[strategy].data.source
        assert "text share 1," in reading.training[strategy].data.source
        assert abs(blind.q_spread(strategy)) < 0.08
        assert reading.q_spread(strategy) > 0.15
    for point in (blind, reading):
        runs = point.aggregates()
        assert list(runs) == ["argus", "pac", "argus-oracle"]
        assert all(run.metrics["quality_n"].mean > 0 for run in runs.values())
    printed = capsys.readouterr().out.splitlines()
    table_rows = [line for line in printed if re.match(r" *[01]\.00 ", line)]
    assert len(table_rows) == 2 * len(Strategy) + 2  # the classifier's and the serving table's
    assert all(row.endswith("SYNTHETIC") for row in table_rows)
