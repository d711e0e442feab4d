"""argus profile end to end: tiny pipelines through the worker engine, a tiny random CLIP as
the PickScore stand-in, a quality table in the replay format."""

from __future__ import annotations

from pathlib import Path

import pytest

from argus.cli.main import main
from argus.contracts.quality import load_quality_table
from argus.types import Strategy
from argus.worker.scoring import PickScorer
from tests.worker_factories import make_tiny_clip

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_clip(tmp_path_factory.mktemp("clip")))


def test_pickscorer_scores_depend_on_the_image(scorer_dir: Path) -> None:
    from PIL import Image

    scorer = PickScorer(scorer_dir)
    red = Image.new("RGB", (64, 64), (255, 0, 0))
    noise = Image.effect_noise((64, 64), 80).convert("RGB")
    scores = scorer.score("a red square", [red, noise])
    assert len(scores) == 2
    assert all(s > 0 for s in scores)
    assert scores[0] != scores[1]
    # batching does not change a score beyond float rounding
    assert scorer.score("a red square", [red])[0] == pytest.approx(scores[0], rel=1e-5)


def test_profile_writes_replayable_quality_tables(scorer_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red bus\na lighthouse at dusk\n\na red bus\na bowl of ramen\n")
    out = tmp_path / "out"
    code = main(
        [
            "profile", "--scorer", str(scorer_dir), "--prompts", str(prompts),
            "--limit", "2", "--warmup", "1", "--strategy", "AC,SM", "--steps", "30",
            "--size", "32", "--device", "cpu", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    ac = load_quality_table(out / "quality-AC.csv")
    sm = load_quality_table(out / "quality-SM.csv")
    assert ac.strategy is Strategy.AC
    assert ac.levels == ("ac-k0", "ac-k5", "ac-k10", "ac-k15", "ac-k20", "ac-k25")
    # the first unique prompt warmed the cache; the next two were profiled
    assert ac.prompts == ("a lighthouse at dusk", "a bowl of ramen")
    assert sm.strategy is Strategy.SM
    assert sm.levels[0] == "sm-sd-xl"
    assert sm.prompts == ac.prompts
    for table in (ac, sm):
        assert (table.scores > 0).all()
        assert table.source == f"pickscore: {scorer_dir}"
    # different levels give different images, hence different scores
    assert len({round(float(v), 6) for v in ac.scores[0]}) > 1


def test_profile_rejects_a_missing_scorer(tmp_path: Path) -> None:
    code = main(["profile", "--scorer", str(tmp_path / "none"), "--out", str(tmp_path)])
    assert code == 2
