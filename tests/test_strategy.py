import math
import random
from typing import Any

import pytest

from argus.allocator.strategy import StrategyConfig, StrategyMonitor
from argus.types import Strategy

pytestmark = pytest.mark.unit


CONFIG = StrategyConfig(threshold_s=0.5, window_s=30.0, min_samples=5, probe_interval_s=10.0)


def test_stays_on_ac_while_retrieval_is_fast() -> None:
    monitor = StrategyMonitor(CONFIG)
    for t in range(100):
        monitor.observe(float(t), 0.05)
        assert monitor.decide(float(t)) is Strategy.AC
    assert monitor.switches == 0


def test_slow_p99_switches_to_sm_only_with_enough_samples() -> None:
    monitor = StrategyMonitor(CONFIG)
    for t in range(4):
        monitor.observe(float(t), 2.0)
        assert monitor.decide(float(t)) is Strategy.AC  # fewer than min_samples
    monitor.observe(4.0, 2.0)
    assert monitor.decide(4.0) is Strategy.SM
    assert monitor.switches == 1


def test_a_failure_switches_at_once() -> None:
    monitor = StrategyMonitor(CONFIG)
    monitor.observe(1.0, None)
    assert monitor.decide(1.0) is Strategy.SM


def test_old_slow_samples_are_forgotten() -> None:
    monitor = StrategyMonitor(CONFIG)
    for t in range(4):
        monitor.observe(float(t), 2.0)
    for t in range(40, 50):
        monitor.observe(float(t), 0.05)
    assert monitor.decide(50.0) is Strategy.AC


def test_returns_to_ac_after_a_healthy_window_of_probes() -> None:
    monitor = StrategyMonitor(CONFIG)
    monitor.observe(0.0, None)
    assert monitor.decide(0.0) is Strategy.SM
    # probes fail for a while: stay on SM
    for t in (10.0, 20.0):
        monitor.observe(t, None)
        assert monitor.decide(t) is Strategy.SM
    # healthy probes, but the failure at t=20 is still inside the 30 s window
    for t in (30.0, 40.0, 50.0):
        monitor.observe(t, 0.05)
        assert monitor.decide(t) is Strategy.SM
    monitor.observe(60.0, 0.05)
    assert monitor.decide(60.0) is Strategy.AC
    assert monitor.switches == 2


@pytest.mark.parametrize(
    "kwargs",
    [{"threshold_s": 0}, {"window_s": -1}, {"min_samples": 0}, {"probe_interval_s": 0}],
)
def test_config_validation_names_the_field(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        StrategyConfig(**kwargs)


class SortingMonitor:
    """The monitor's rule as first written: sort the whole window on every decision."""

    def __init__(self, config: StrategyConfig) -> None:
        self.config = config
        self.strategy = Strategy.AC
        self.since = -math.inf
        self.samples: list[tuple[float, float]] = []

    def observe(self, now: float, latency: float | None) -> None:
        self.samples.append((now, math.inf if latency is None else latency))

    def decide(self, now: float) -> Strategy:
        self.samples = [(t, v) for t, v in self.samples if t >= now - self.config.window_s]
        values = sorted(v for _, v in self.samples)
        p99 = values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)] if values else 0.0
        if self.strategy is Strategy.AC:
            failed = bool(values) and math.isinf(values[-1])
            slow = len(values) >= self.config.min_samples and p99 > self.config.threshold_s
            wanted = Strategy.SM if failed or slow else Strategy.AC
        else:
            done = now - self.since >= self.config.window_s
            needed = max(1, int(self.config.window_s / self.config.probe_interval_s) - 1)
            healthy = len(values) >= needed and p99 <= self.config.threshold_s
            wanted = Strategy.AC if done and healthy else Strategy.SM
        if wanted is not self.strategy:
            self.strategy, self.since, self.samples = wanted, now, []
        return self.strategy


@pytest.mark.parametrize("seed", range(8))
def test_the_kept_sorted_window_decides_as_sorting_it_each_time(seed: int) -> None:
    # latencies drawn from few values (ties), around the threshold (the p99 decides), with
    # rare failures; bursts of samples at one instant and gaps longer than the window
    rng = random.Random(seed)
    config = StrategyConfig(threshold_s=0.5, window_s=5.0, min_samples=30, probe_interval_s=1.0)
    monitor, reference = StrategyMonitor(config), SortingMonitor(config)
    now, decisions = 0.0, []
    for _ in range(3000):
        now += rng.choice([0.0, 0.01, 0.1, 0.5, 7.0])
        for _ in range(rng.randrange(4)):
            latency = None if rng.random() < 0.002 else rng.choice([0.1, 0.3, 0.5, 0.6, 0.9])
            monitor.observe(now, latency)
            reference.observe(now, latency)
        for _ in range(rng.randrange(1, 3)):  # asked again at the same instant, too
            decisions.append(monitor.decide(now))
            assert decisions[-1] is reference.decide(now)
    assert monitor.switches >= 4  # both ways were exercised
    assert Strategy.AC in decisions and Strategy.SM in decisions


def test_a_nan_latency_is_refused() -> None:
    monitor = StrategyMonitor(CONFIG)
    with pytest.raises(ValueError, match="latency_s"):
        monitor.observe(0.0, math.nan)
