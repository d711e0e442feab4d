"""Builders for control-plane tests: profile sets, clusters and random solver instances; and
the value comparison of quality tables."""

from __future__ import annotations

import random
from typing import Any

from argus.contracts.quality import QualityTable
from argus.profiles import parse_profiles
from argus.types import ClusterView, ProfileSet, Strategy, WorkerState


def profile_document(
    throughputs: dict[str, list[float]],
    qualities: list[float],
    *,
    strategy: str = "AC",
    models: list[str] | None = None,
    load_times: list[float] | None = None,
) -> dict[str, Any]:
    """A profile document (the parsed form of a TOML file) for one strategy.

    ``throughputs[class]`` lists QPM per level, slowest first.
    """
    count = len(qualities)
    models = models or ["base"] * count
    load_times = load_times or [5.0] * count
    levels = []
    for v in range(count):
        levels.append(
            {
                "name": f"{strategy.lower()}-{v}",
                "strategy": strategy,
                "model": models[v],
                "skip_steps": 5 * v if strategy == "AC" else 0,
                "quality": qualities[v],
                "profiles": {
                    c: {
                        "latency_s": 60.0 / qpm[v],
                        "throughput_qpm": qpm[v],
                        "load_time_s": load_times[v],
                        "gpu_memory_gib": 4.0,
                    }
                    for c, qpm in throughputs.items()
                },
            }
        )
    return {"worker_classes": list(throughputs), "levels": levels}


def make_profiles(
    throughputs: dict[str, list[float]], qualities: list[float], **kw: Any
) -> ProfileSet:
    return parse_profiles(profile_document(throughputs, qualities, **kw))


def random_instance(
    rng: random.Random, *, max_workers: int = 8, switching: bool = False
) -> tuple[ProfileSet, ClusterView, float]:
    """A random solvable instance: profiles, a cluster (some dead workers) and a load."""
    level_count = rng.randint(2, 6)
    classes = [f"gpu{c}" for c in range(rng.randint(1, 3))]
    throughputs = {}
    for c in classes:
        base = rng.uniform(5.0, 20.0)
        steps = sorted(rng.uniform(0.0, 25.0) for _ in range(level_count))
        throughputs[c] = [base + s for s in steps]
    qualities = sorted((rng.uniform(0.5, 1.0) for _ in range(level_count)), reverse=True)
    models = [rng.choice(["m0", "m1", "m2"]) for _ in range(level_count)]
    load_times = [rng.uniform(0.0, 30.0) for _ in range(level_count)]
    profiles = make_profiles(
        throughputs, qualities, strategy="SM", models=models, load_times=load_times
    )
    names = [level.name for level in profiles.levels]
    workers = []
    for i in range(rng.randint(1, max_workers)):
        current = rng.choice([*names, None]) if switching else None
        workers.append(
            WorkerState(f"w{i:02d}", rng.choice(classes), alive=rng.random() > 0.15, level=current)
        )
    capacity = sum(throughputs[w.worker_class][-1] for w in workers if w.alive)
    load = rng.uniform(0.0, 1.3 * capacity + 1.0)
    return profiles, ClusterView(tuple(workers)), load


STRATEGY_SM = Strategy.SM


def same_quality_table(table: QualityTable, other: QualityTable) -> bool:
    """Whether two quality tables hold the same values: every field equal and the scores
    bit-identical (tables compare by identity, ``eq=False``)."""
    return (
        table.strategy is other.strategy
        and table.levels == other.levels
        and table.prompts == other.prompts
        and table.source == other.source
        and table.scores.shape == other.scores.shape
        and table.scores.tobytes() == other.scores.tobytes()
    )
