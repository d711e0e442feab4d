"""``argus replay`` and ``argus evaluate`` on a tiny seeded setting, their written reports pinned
by sha256.

The fingerprints were taken from the code before the control plane's modules were split and
renamed (allocator, simulator workloads, CLI options): moving code must leave every number
these commands write as it was. They must change only on purpose: when a change is meant to
alter what a policy decides, what the simulator charges or what the reports say, update the
fingerprint in the same commit and say there why it changed. What depends on the machine is
left out: the wall-clock seconds in ``runs.csv`` and the evaluation's ``summary.json``, and
the PNG plots (matplotlib's rendering). They run with ``--cache perfect``, the cache as the
simulator modelled it when they were taken.
"""

import csv
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from argus.cli.main import main

pytestmark = pytest.mark.unit

SETTING = (
    *("--trace", "poisson", "--duration", "2", "--gpus", "2"),
    *("--classifier", "noisy-oracle@0.7", "--quiet"),
    # the cache as it was modelled when these were taken: every AC request a hit
    *("--cache", "perfect"),
)

CACHE_COLUMNS = {"cache", "cache_lookups", "hit_rate", "mean_similarity", "similarity_n"}
"""What the simulated cache added to the reports after the fingerprints were taken; left out,
so the pins show that ``--cache perfect`` still reproduces every number written before."""

REPLAY_PINNED = {
    "summary.json": "6cba1ef1aefeca35",
    "per_minute.csv": "ec7420d6a9b17147",
}

EVALUATE_PINNED = {
    "runs.csv": "224b121a592df8e3",
    "aggregate.csv": "ff9ac459e8ffefce",
    "paired.csv": "279483c88bb05743",
    "summary.json": "481fc16e9aa0c84e",
}


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def without_wall_times_csv(path: Path) -> str:
    rows = list(csv.DictReader(path.open(newline="")))
    out = io.StringIO()
    columns = [name for name in rows[0] if name != "wall_s" and name not in CACHE_COLUMNS]
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def without_cache_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_cache_keys(v) for k, v in value.items() if k not in CACHE_COLUMNS}
    if isinstance(value, list):
        return [without_cache_keys(item) for item in value]
    return value


def without_wall_times_json(path: Path) -> str:
    document = without_cache_keys(json.loads(path.read_text(encoding="utf-8")))
    document.pop("wall_s", None)
    return json.dumps(document, indent=2, sort_keys=True)


def fingerprints(out: Path, names: list[str]) -> dict[str, str]:
    found = {}
    for name in names:
        path = out / name
        if name == "runs.csv":
            text = without_wall_times_csv(path)
        elif name == "summary.json":
            text = without_wall_times_json(path)
        else:
            text = path.read_text(encoding="utf-8")
        found[name] = digest(text)
    return found


def test_replay_reports_are_pinned(tmp_path, capsys):
    policies = "argus,pac,clipper-ht,nirvana"
    code = main(["replay", *SETTING, "--policies", policies, "--seed", "3", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    assert fingerprints(tmp_path, list(REPLAY_PINNED)) == REPLAY_PINNED


def test_evaluate_reports_are_pinned(tmp_path, capsys):
    loads = ("--loads", "0.6,1.2", "--seeds", "1", "--policies", "argus,pac,clipper-ht")
    code = main(["evaluate", *SETTING, *loads, "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    assert fingerprints(tmp_path, list(EVALUATE_PINNED)) == EVALUATE_PINNED
