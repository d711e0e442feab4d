"""Quality worlds: synthetic, uniform and genai-bench tables, the GenAI-Bench split and the
classifier's training prompts, and ``--quality`` on ``argus evaluate`` and ``argus replay``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from argus import defaults
from argus.cli.main import main
from argus.profiles import default_profiles
from argus.profiles.quality_worlds import (
    DATA_DIR,
    GENAI_LABEL,
    GENAI_LEVELS,
    GENAI_PROFILE_PATH,
    RATINGS_PATH,
    QualityWorld,
    genai_eval_records,
    genai_prompts,
    genai_quality_table,
    genai_split,
    genai_training_table,
    parse_world,
    uniform_quality_table,
    world_profiles,
)
from argus.prompt_split import PromptSet, prompt_set
from argus.sim.evaluate import EvaluationConfig, eval_prompts, quality_tables
from argus.sim.genai_classifier import drop_correlations
from argus.sim.offered_load import EvaluationError
from argus.types import Strategy
from tests.factories import same_quality_table

pytestmark = pytest.mark.unit

PROFILES = default_profiles()


# -- the names ---------------------------------------------------------------------------------


def test_the_parsers_choices_are_the_enums_and_synthetic_is_the_default():
    assert tuple(world.value for world in QualityWorld) == defaults.QUALITY_WORLDS
    assert defaults.QUALITY_WORLDS[0] == "synthetic"
    assert EvaluationConfig().quality == "synthetic"
    assert parse_world(" Genai-Bench ") is QualityWorld.GENAI_BENCH
    with pytest.raises(ValueError, match="unknown quality world 'real'; choose one of synthetic"):
        parse_world("real")


# -- the tables --------------------------------------------------------------------------------


def test_every_world_builds_tables_of_the_right_shape():
    prompts = eval_prompts(None)[:20]
    for world in ("synthetic", "uniform"):
        tables = quality_tables(PROFILES, prompts, 0, quality=world)
        assert set(tables) == set(Strategy)
        for strategy, table in tables.items():
            levels = tuple(lv.name for lv in PROFILES.levels_for(strategy))
            assert table.levels == levels
            assert table.scores.shape == (20, len(levels))
            assert table.prompts == tuple(p.prompt for p in prompts)
    genai = eval_prompts(None, "genai-bench")[:15]
    profiles = world_profiles("genai-bench")
    assert profiles.levels_for(Strategy.AC) == ()
    tables = quality_tables(profiles, genai, 0, quality="genai-bench")
    assert set(tables) == {Strategy.SM}
    assert tables[Strategy.SM].levels == GENAI_LEVELS
    assert tables[Strategy.SM].scores.shape == (15, 3)
    assert GENAI_LABEL in tables[Strategy.SM].source and "1-5 scale" in tables[Strategy.SM].source


def test_synthetic_world_is_todays_tables():
    prompts = eval_prompts(None)[:30]
    today = quality_tables(PROFILES, prompts, 2)
    world = quality_tables(PROFILES, prompts, 2, quality="synthetic")
    assert all(same_quality_table(today[s], world[s]) for s in Strategy)


def test_uniform_drops_are_the_same_for_every_prompt():
    prompts = eval_prompts(None)
    synthetic = quality_tables(PROFILES, prompts, 1)
    uniform = quality_tables(PROFILES, prompts, 1, quality="uniform")
    for strategy in Strategy:
        table, flat = synthetic[strategy], uniform[strategy]
        drops = flat.scores[:, :1] - flat.scores
        assert np.ptp(drops, axis=0) == pytest.approx(np.zeros(len(flat.levels)), abs=1e-9)
        # the synthetic drops differ by prompt; the uniform ones are their mean
        assert np.ptp(table.scores[:, :1] - table.scores, axis=0).max() > 1.0
        assert drops[0] == pytest.approx((table.scores[:, :1] - table.scores).mean(axis=0))
        assert flat.scores.mean(axis=0) == pytest.approx(table.scores.mean(axis=0))
        assert np.array_equal(flat.scores[:, 0], table.scores[:, 0])  # each prompt's base
        assert "uniform" in flat.source and "synthetic" in flat.source


def test_a_uniform_score_at_or_below_zero_is_refused():
    from argus.contracts.quality import QualityTable

    table = QualityTable(Strategy.SM, ("a", "b"), ("p", "q"), [[1.0, 0.5], [9.0, 1.0]], "x")
    with pytest.raises(ValueError, match="score <= 0"):
        uniform_quality_table(table)  # mean drop 4.25 > p's best 1.0


# -- genai-bench ---------------------------------------------------------------------------------


def test_the_vendored_ratings_carry_their_licence_and_attribution():
    assert len(genai_prompts()) == 527
    assert (DATA_DIR / "GenAI-Bench.LICENSE").read_text().lstrip().startswith("Apache License")
    readme = (DATA_DIR / "README.md").read_text()
    assert "GenAI-Bench, Li, Lin et al., 2024, Apache-2.0" in readme
    assert GENAI_PROFILE_PATH.is_file()


def test_genai_splits_are_disjoint_and_deterministic():
    first, again = genai_split(), genai_split()
    sets = {which: {p.prompt for p in first[which]} for which in PromptSet}
    assert first == again
    assert not sets[PromptSet.TRAIN] & sets[PromptSet.CALIBRATION]
    assert not sets[PromptSet.TRAIN] & sets[PromptSet.EVAL]
    assert not sets[PromptSet.CALIBRATION] & sets[PromptSet.EVAL]
    assert sum(len(s) for s in sets.values()) == 527
    for which, texts in sets.items():
        assert texts and all(prompt_set(t) is which for t in texts)
    # the simulation serves EVAL prompts only
    assert {r.prompt for r in eval_prompts(None, "genai-bench")} == sets[PromptSet.EVAL]
    assert {r.prompt for r in genai_eval_records()} == sets[PromptSet.EVAL]


def test_genai_table_is_the_mean_of_the_three_raters():
    # genai_image.json: "00001" SDXL_Base [3, 3, 2], SDXL_2_1 [3, 2, 2], SDXL_Turbo [2, 4, 3];
    # "00002" SDXL_Base [4, 5, 5], SDXL_2_1 [3, 4, 3], SDXL_Turbo [3, 5, 5]
    baker = "A baker pulling freshly baked bread out of an oven in a bakery."
    photographer = "A photographer capturing a fleeting moment in a vibrant city street."
    table = genai_quality_table([photographer, baker, baker])
    assert table.strategy is Strategy.SM and table.levels == GENAI_LEVELS
    assert table.scores[0] == pytest.approx([14 / 3, 10 / 3, 13 / 3])
    assert table.scores[1] == pytest.approx([8 / 3, 7 / 3, 3.0])
    assert table.scores[2] == pytest.approx(table.scores[1])
    one_rater = genai_quality_table([baker], raters=[1])
    assert one_rater.scores[0] == pytest.approx([3.0, 2.0, 4.0])
    with pytest.raises(KeyError, match="not a GenAI-Bench prompt"):
        genai_quality_table(["a red bus"])


def test_the_ratings_file_is_read_strictly(tmp_path):
    path = tmp_path / "ratings.csv"
    with RATINGS_PATH.open(encoding="utf-8") as handle:
        header = next(csv.reader(handle))
    path.write_text(",".join(header) + "\n00001,a prompt,1,2,3,4,5,6,1,2,3\n", encoding="utf-8")
    with pytest.raises(ValueError, match=":2: ratings must be 1 to 5"):
        genai_prompts(path)


def test_the_genai_classifier_learns_from_no_eval_prompt(monkeypatch):
    split = genai_split()
    eval_texts = {p.prompt for p in split[PromptSet.EVAL]}
    allowed = {p.prompt for p in split[PromptSet.TRAIN] + split[PromptSet.CALIBRATION]}
    table = genai_training_table()
    assert set(table.prompts) == allowed and not set(table.prompts) & eval_texts

    given: list[tuple[str, ...]] = []

    class Stop(Exception):
        pass

    def fake_train(data, config=None, **_):
        given.append(data.split_keys)
        raise Stop

    import argus.classifier.train as train
    from argus.sim import genai_classifier

    monkeypatch.setattr(train, "train_classifier", fake_train)
    with pytest.raises(Stop):
        genai_classifier.train_genai_classifier()
    [keys] = given
    assert set(keys) == allowed and not set(keys) & eval_texts
    assert {prompt_set(k) for k in keys} == {PromptSet.TRAIN, PromptSet.CALIBRATION}


def test_drop_correlations_of_a_perfect_and_a_blind_prediction():
    rng = np.random.default_rng(0)
    ratings = rng.integers(1, 6, size=(60, 3, 3)).astype(float)
    drops = (ratings[:, 0, :] - ratings[:, 2, :]).mean(axis=1)
    perfect = drop_correlations(drops, ratings)
    assert perfect.models == ("SDXL_2_1", "SDXL_Turbo")
    assert perfect.with_mean[1] == pytest.approx(1.0)
    assert 0.0 < perfect.per_rater[1] < 1.0  # each rater alone is noisier than their mean
    blind = drop_correlations(rng.standard_normal(60), ratings)
    assert abs(blind.with_mean[1]) < 0.4
    assert "held-out" in perfect.lines()[0]


def test_genai_bench_refuses_ac_only_policies_and_other_prompts():
    with pytest.raises(EvaluationError, match="'nirvana' serves AC levels only"):
        EvaluationConfig(quality="genai-bench", policies=("argus", "nirvana"))
    with pytest.raises(EvaluationError, match="--prompts does not apply"):
        EvaluationConfig(quality="genai-bench", policies=("pac",), prompts_path="x.tsv")
    with pytest.raises(EvaluationError, match="quality: unknown quality world"):
        EvaluationConfig(quality="pickscore")


# -- the commands ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["evaluate", "replay"])
def test_an_unknown_world_is_refused_naming_the_choices(capsys, command):
    with pytest.raises(SystemExit) as exited:
        main([command, "--quality", "pickscore"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--quality" in err and "'pickscore'" in err
    assert "synthetic" in err and "uniform" in err and "genai-bench" in err


def evaluate(capsys, out: Path, *args: str) -> tuple[int, str, str]:
    code = main(
        [
            "evaluate",
            "--quiet",
            *("--loads", "0.6", "--seeds", "2", "--duration", "2", "--gpus", "2"),
            *("--adapters", "none", "--out", str(out), *args),
        ]
    )
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_evaluate_in_the_uniform_world(capsys, tmp_path):
    code, out, err = evaluate(
        capsys,
        tmp_path,
        "--quality",
        "uniform",
        "--policies",
        "argus,pac",
        "--classifier",
        "oracle",
    )
    assert code == 0, err
    assert "quality model: SYNTHETIC uniform" in out
    document = json.loads((tmp_path / "summary.json").read_text())
    assert "uniform" in document["quality"] and "SYNTHETIC" in document["quality"]
    assert document["quality_world"] == "uniform" and document["quality_notes"] == []
    assert "(PartiPrompts)" in document["prompts"] and "fastest AC level" in document["capacity"]
    with (tmp_path / "runs.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 2 * 3  # seeds x (argus, pac, argus-oracle)


def test_evaluate_in_the_genai_bench_world(capsys, tmp_path):
    code, out, err = evaluate(
        capsys, tmp_path, "--quality", "genai-bench", "--classifier", "oracle"
    )
    assert code == 0, err
    assert f"quality model: {GENAI_LABEL}" in out
    assert "no predictability measured" in out
    with (tmp_path / "runs.csv").open() as handle:
        runs = list(csv.DictReader(handle))
    assert "nirvana" not in {r["policy"] for r in runs}  # AC only: left out of the default
    assert {r["policy"] for r in runs} >= {"argus", "pac", "proteus", "sommelier"}
    turbo = world_profiles("genai-bench").profile("a100", "sm-sdxl-turbo").throughput_qpm
    document = json.loads((tmp_path / "summary.json").read_text())
    assert document["capacity_qpm"] == pytest.approx(2 * turbo)  # the fastest SM level
    assert GENAI_LABEL in document["quality"] and "1-5 scale" in document["quality"]
    assert document["quality_world"] == "genai-bench"
    assert "(GenAI-Bench)" in document["prompts"] and "fastest SM level" in document["capacity"]
    assert document["quality_notes"] == ["classifier 'oracle' given: no predictability measured"]
    assert (tmp_path / "quality_world.txt").is_file()


def test_replay_in_the_genai_bench_world(capsys, tmp_path):
    code = main(
        [
            "replay",
            "--quiet",
            *("--quality", "genai-bench", "--trace", "poisson", "--duration", "2"),
            *("--policies", "pac,clipper-ht", "--classifier", "oracle"),
            *("--gpus", "1", "--out", str(tmp_path)),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"quality model: {GENAI_LABEL}" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["description"]["quality_world"] == "genai-bench"
    assert "GenAI-Bench EVAL prompts" in summary["description"]["trace"]
    code = main(["replay", "--quiet", "--quality", "genai-bench", "--policies", "nirvana"])
    assert code == 2
    assert "nirvana serves AC levels only" in capsys.readouterr().err


def test_in_the_uniform_world_the_trained_classifiers_classes_all_degrade_alike():
    """The committed classifier plans the uniform world with Q(v | c) measured on that world's
    CALIBRATION tables: every class loses the same at each level (the synthetic world's Q, where
    classes differ, made Argus lose to PAC there by the mismatch alone)."""
    from argus.sim.evaluate import _classifier

    artifact = _classifier("default")._load()
    uniform = _classifier("default", "uniform", PROFILES)
    assert "uniform world" in uniform.label
    for strategy, q in uniform.class_quality().items():
        rows = [row for row, share in zip(q.quality, q.prior, strict=True) if share > 0]
        assert len(rows) > 1
        drops = np.array([[row[0] - value for value in row] for row in rows])
        assert np.allclose(drops, drops[0], atol=1e-9)
        other = artifact.class_quality(strategy)
        seen = [row for row, share in zip(other.quality, other.prior, strict=True) if share > 0]
        synthetic_drops = np.array([[row[0] - value for value in row] for row in seen])
        assert not np.allclose(synthetic_drops, synthetic_drops[0], atol=1e-3)
