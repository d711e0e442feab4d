import copy
from pathlib import Path

import pytest
import yaml

from argus.profiles import ProfileError, default_profiles, load_profiles, parse_profiles
from argus.types import Strategy
from tests.factories import profile_document

pytestmark = pytest.mark.unit


def valid() -> dict:
    return profile_document({"a100": [10.0, 20.0, 30.0]}, [1.0, 0.95, 0.9])


def test_default_profiles_follow_the_paper():
    profiles = default_profiles()
    ac = profiles.levels_for(Strategy.AC)
    sm = profiles.levels_for(Strategy.SM)
    assert [level.skip_steps for level in ac] == [0, 5, 10, 15, 20, 25]
    assert [level.name for level in sm] == [
        "sm-sd-xl",
        "sm-sd-2.0",
        "sm-sd-1.5",
        "sm-sd-1.4",
        "sm-small-sd",
        "sm-tiny-sd",
    ]
    # Table 2 of the Argus paper (A100): SDXL 4.2 s, Tiny 2.18 s with 2.91 s load
    assert profiles.profile("a100", "ac-k0").latency_s == 4.2
    tiny = profiles.profile("a100", "sm-tiny-sd")
    assert (tiny.latency_s, tiny.load_time_s) == (2.18, 2.91)
    # batch size 1: throughput derived from latency
    assert profiles.profile("a100", "ac-k0").throughput_qpm == pytest.approx(60 / 4.2)
    # AC levels and the SM SDXL level share one model: an AC<->SM switch keeps SDXL loaded
    assert {level.model for level in ac} == {"sdxl"} == {sm[0].model}


def test_toml_and_yaml_files_load(tmp_path: Path):
    yaml_path = tmp_path / "p.yaml"
    yaml_path.write_text(yaml.safe_dump(valid()))
    profiles = load_profiles(yaml_path)
    assert [level.name for level in profiles.levels] == ["ac-0", "ac-1", "ac-2"]
    toml_path = tmp_path / "p.toml"
    toml_path.write_text(
        Path(__file__).parents[1].joinpath("argus/profiles/default.toml").read_text()
    )
    assert len(load_profiles(toml_path).levels) == 12


def mutate(change) -> dict:
    doc = copy.deepcopy(valid())
    change(doc)
    return doc


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(levels=[]), "levels"),
        (
            lambda d: d["levels"][1]["profiles"]["a100"].update(throughput_qpm=-1.0),
            "levels[1].profiles.a100.throughput_qpm",
        ),
        (
            lambda d: d["levels"][1]["profiles"]["a100"].update(throughput_qpm=0),
            "levels[1].profiles.a100.throughput_qpm",
        ),
        (
            lambda d: d["levels"][0]["profiles"]["a100"].update(latency_s=-2.0),
            "levels[0].profiles.a100.latency_s",
        ),
        (lambda d: d["levels"][2].update(name="ac-0"), "levels[2].name"),
        (lambda d: d["levels"][0].update(strategy="XX"), "levels[0].strategy"),
        (lambda d: d["levels"][0].update(quality=1.5), "levels[0].quality"),
        (lambda d: d["levels"][0]["profiles"].pop("a100"), "levels[0].profiles.a100"),
        (lambda d: d["levels"][0]["profiles"].update(v100={}), "levels[0].profiles.v100"),
        (
            lambda d: d["levels"][0]["profiles"]["a100"].update(load_time_s="slow"),
            "levels[0].profiles.a100.load_time_s",
        ),
        (lambda d: d.update(worker_classes=[]), "worker_classes"),
        (
            lambda d: d["levels"][2]["profiles"]["a100"].update(throughput_qpm=5.0),
            "levels[2].profiles.a100.throughput_qpm",
        ),
    ],
)
def test_invalid_profiles_name_the_field(change, field):
    with pytest.raises(ProfileError) as info:
        parse_profiles(mutate(change))
    assert str(info.value).startswith(field + ":")


def test_unreadable_and_unknown_format(tmp_path: Path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profiles(tmp_path / "missing.toml")
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    with pytest.raises(ProfileError, match="unknown profile format"):
        load_profiles(bad)
    broken = tmp_path / "p.toml"
    broken.write_text("levels = [")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profiles(broken)
