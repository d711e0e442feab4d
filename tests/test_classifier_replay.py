"""The trained classifier in replays, and argus train-classifier end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from argus.classifier.labels import labels_from_table
from argus.classifier.serving import default_classifier_dir, load_classifier_set
from argus.classifier.train import TrainConfig, save_trained, train_classifier
from argus.cli.main import main
from argus.profiles import default_profiles
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.sim import classifiers
from argus.sim.arrivals import poisson
from argus.sim.cluster import SimConfig, Simulation
from argus.sim.policies import (
    NoisyOracleClassifier,
    OracleClassifier,
    TrainedClassifier,
    make_classifier,
    make_policy,
)
from argus.sim.report import summarise
from argus.traces import default_prompt_trace, load_prompts
from argus.types import Strategy
from tests.classifier_factories import make_tiny_bert

pytestmark = pytest.mark.unit


PROMPTS = 60


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Classifiers for both strategies of the default profile, on a tiny random BERT."""
    root = tmp_path_factory.mktemp("replay-classifier")
    encoder = make_tiny_bert(root / "bert")
    profiles = default_profiles()
    records = load_prompts(default_prompt_trace())[:PROMPTS]
    for strategy in Strategy:
        levels = [lv.name for lv in profiles.levels_for(strategy)]
        table = synthetic_quality_table(records, strategy, levels)
        result = train_classifier(
            labels_from_table(table), TrainConfig(max_tokens=32, c_grid=(1.0,)), encoder_dir=encoder
        )
        save_trained(result, root / "clf" / strategy.value.lower())
    return root / "clf"


def test_make_classifier_specs() -> None:
    assert isinstance(make_classifier("oracle"), OracleClassifier)
    noisy = make_classifier("noisy-oracle@0.85")
    assert isinstance(noisy, NoisyOracleClassifier) and noisy.label == "noisy-oracle@0.85"
    assert isinstance(make_classifier("0.7"), NoisyOracleClassifier)
    default = make_classifier("default")
    assert isinstance(default, TrainedClassifier)
    assert default_classifier_dir().name in default.label and "SYNTHETIC" in default.label
    with pytest.raises(ValueError, match="'noisy-oracle@high'"):
        make_classifier("noisy-oracle@high")
    with pytest.raises(ValueError, match=r"'/no/such/classifier'.*does not exist"):
        make_classifier("/no/such/classifier")


def test_replay_predicts_once_per_unique_prompt(artifact: Path, monkeypatch) -> None:
    monkeypatch.setattr(classifiers, "_PREDICTIONS", {})
    profiles = default_profiles()
    records = load_prompts(default_prompt_trace())[:PROMPTS]
    workload = poisson(mean_qpm=120.0, duration_min=2.0, seed=0, prompts=records)
    quality = {
        s: synthetic_quality_table(records, s, [lv.name for lv in profiles.levels_for(s)])
        for s in Strategy
    }
    classifier = TrainedClassifier(artifact)
    classifier.prepare(quality)
    models = classifier._load()
    encoder = models.current(Strategy.AC).encoder
    assert models.current(Strategy.SM).encoder is encoder  # one frozen encoder, shared
    embedded: list[str] = []
    embed = encoder.embed

    def counting(texts):
        embedded.extend(texts)
        return embed(texts)

    monkeypatch.setattr(encoder, "embed", counting)
    sim = Simulation(profiles, quality, workload, SimConfig(gpus=4))
    for name in ("argus", "nirvana"):
        sim.run(make_policy(name, classifier=classifier))
    used = sorted({workload.prompts[i % PROMPTS].prompt for i in range(len(workload))})
    assert len(workload) > 2 * len(used)
    assert sorted(embedded) == used  # each prompt once, for both strategies and both runs
    again = TrainedClassifier(artifact)  # same artifact, same process: cached predictions
    sim.run(make_policy("nirvana", classifier=again))
    assert sorted(embedded) == used
    expected = load_classifier_set(artifact).predict(used)
    for strategy in Strategy:
        cache = classifier._cache[strategy]
        assert [cache[p][0] for p in used] == expected[strategy].tolist()  # (level, class)
        for request in range(0, len(workload), 7):
            text = workload.prompts[request % PROMPTS].prompt
            assert classifier.predict_level(strategy, request) == cache[text][0]
            assert again.predict_level(strategy, request) == cache[text][0]


def test_a_classifier_in_memory_replays_as_its_artifact(artifact: Path, monkeypatch) -> None:
    monkeypatch.setattr(classifiers, "_PREDICTIONS", {})
    profiles = default_profiles()
    records = load_prompts(default_prompt_trace())[:PROMPTS]
    workload = poisson(mean_qpm=120.0, duration_min=2.0, seed=0, prompts=records)
    quality = {
        s: synthetic_quality_table(records, s, [lv.name for lv in profiles.levels_for(s)])
        for s in Strategy
    }
    saved = TrainedClassifier(artifact)
    held = TrainedClassifier.in_memory(load_classifier_set(artifact), "on the fly")
    assert held.label.startswith("trained on the fly (AC: logistic regression")
    sim = Simulation(profiles, quality, workload, SimConfig(gpus=4))
    runs = [summarise(sim.run(make_policy("argus", classifier=c))) for c in (saved, held)]
    assert runs[0] == runs[1]
    assert held.class_quality() == saved.class_quality()
    for strategy in Strategy:
        for request in range(0, len(workload), 5):
            assert held.predict_level(strategy, request) == saved.predict_level(strategy, request)
            assert held.predict_class(strategy, request) == saved.predict_class(strategy, request)
    assert len(classifiers._PREDICTIONS) == len(Strategy)  # the artifact's only
    other = {Strategy.AC: replace(quality[Strategy.AC], levels=("a", "b", "c", "d", "e", "f"))}
    with pytest.raises(ValueError, match="classifier on the fly: AC labels"):
        held.prepare(other)


def test_replay_reports_the_classifier(artifact: Path, capsys, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.tsv"
    records = load_prompts(default_prompt_trace())[:PROMPTS]
    prompts.write_text("Prompt\n" + "".join(f"{r.prompt}\n" for r in records))
    args = ["replay", "--quiet", "--trace", "poisson", "--duration", "2", "--prompts", str(prompts)]
    code = main(
        [
            *args,
            "--policies",
            "argus,nirvana",
            "--classifier",
            str(artifact),
            "--out",
            str(tmp_path / "a"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["description"]["classifier"].startswith("trained clf (AC: logistic regression")
    assert "classifier (argus, nirvana): trained clf" in out
    code = main(
        [*args, "--policies", "argus", "--classifier", "oracle", "--out", str(tmp_path / "b")]
    )
    capsys.readouterr()
    assert code == 0
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["description"]["classifier"] == "oracle"


def test_replay_refuses_a_classifier_with_other_levels(
    artifact: Path, capsys, tmp_path: Path
) -> None:
    profile = tmp_path / "profiles.toml"
    default = Path(__file__).resolve().parent.parent / "argus" / "profiles" / "default.toml"
    profile.write_text(default.read_text().replace('"ac-k25"', '"ac-k24"'))
    code = main(
        [
            "replay",
            "--quiet",
            "--trace",
            "poisson",
            "--duration",
            "1",
            "--policies",
            "argus",
            "--profiles",
            str(profile),
            "--classifier",
            str(artifact),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    _, err = capsys.readouterr()
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "ac-k24" in err and "--classifier" in err


def test_train_classifier_cli_is_reproducible(tmp_path: Path, capsys) -> None:
    encoder = make_tiny_bert(tmp_path / "bert")
    prompts = tmp_path / "prompts.tsv"
    records = load_prompts(default_prompt_trace())[:80]
    prompts.write_text("Prompt\n" + "".join(f"{r.prompt}\n" for r in records))
    runs = []
    for name in ("one", "two"):
        out = tmp_path / name
        code = main(
            [
                "train-classifier",
                "--quiet",
                "--encoder",
                str(encoder),
                "--prompts",
                str(prompts),
                "--max-tokens",
                "32",
                "--seed",
                "3",
                "--out",
                str(out),
            ]
        )
        printed, err = capsys.readouterr()
        assert code == 0, err
        assert "SYNTHETIC" in printed and "eval: accuracy" in printed
        runs.append(out)
    for strategy in ("ac", "sm"):
        files = ("model.safetensors", "metrics.json", "config.json", "labels.json")
        for file in (*files, "calibration.json"):
            first = (runs[0] / strategy / file).read_bytes()
            assert first == (runs[1] / strategy / file).read_bytes(), file
        metrics = json.loads((runs[0] / strategy / "metrics.json").read_text())
        assert metrics["labels"]["synthetic"] is True
        assert metrics["split"]["validation"]["seed"] == 3
        assert set(metrics["eval"]) >= {"accuracy", "macro_f1", "confusion", "quality"}
        assert np.array(metrics["eval"]["confusion"]).sum() == metrics["split"]["eval"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--strategies", "XY"], "unknown strategy 'XY'"),
        (["--encoder", "/no/such/bert"], "/no/such/bert"),
        (["--quality-table", "/no/such/table.csv"], "table.csv"),
        (["--prompts", "/no/such/prompts.tsv"], "prompts.tsv"),
        (["--epochs", "0"], "epochs"),
    ],
)
def test_train_classifier_bad_input_exits_2(capsys, tmp_path: Path, args, needle) -> None:
    code = main(["train-classifier", "--quiet", "--out", str(tmp_path), *args])
    _, err = capsys.readouterr()
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert needle in err


def test_text_ceiling_predicts_from_the_synthetic_feature_it_was_fitted_on() -> None:
    """The text-ceiling classifier is a fit of the TRAIN prompts' optimal levels on the
    synthetic model's own text feature: on EVAL prompts it agrees with the optimal level far
    more often than the most frequent level does, and a prompt the synthetic world has no
    feature for is refused by name."""
    from argus.prompt_split import PromptSet, prompt_set
    from argus.sim.classifiers import TextCeilingClassifier, text_ceiling_head, text_features

    assert isinstance(make_classifier("text-ceiling"), TextCeilingClassifier)
    profiles = default_profiles()
    records = [
        r for r in load_prompts(default_prompt_trace()) if prompt_set(r.prompt) is PromptSet.EVAL
    ]
    for strategy in Strategy:
        levels = tuple(lv.name for lv in profiles.levels_for(strategy))
        table = synthetic_quality_table(records, strategy, levels, seed=0)
        optimal = table.optimal_levels()
        head = text_ceiling_head(strategy, levels)
        predicted = np.argmax(head.logits(text_features(table.prompts)), axis=1)
        accuracy = float(np.mean(predicted == optimal))
        majority = float(np.bincount(optimal).max() / len(optimal))
        assert accuracy > majority + 0.2, (strategy, accuracy, majority)
    with pytest.raises(ValueError, match=r"text-ceiling.*not PartiPrompts"):
        text_features(["a prompt nobody wrote"])
