import pytest

from argus.allocator.strategy import StrategyConfig, StrategyMonitor
from argus.types import Strategy

CONFIG = StrategyConfig(threshold_s=0.5, window_s=30.0, min_samples=5, probe_interval_s=10.0)


def test_stays_on_ac_while_retrieval_is_fast():
    monitor = StrategyMonitor(CONFIG)
    for t in range(100):
        monitor.observe(float(t), 0.05)
        assert monitor.decide(float(t)) is Strategy.AC
    assert monitor.switches == 0


def test_slow_p99_switches_to_sm_only_with_enough_samples():
    monitor = StrategyMonitor(CONFIG)
    for t in range(4):
        monitor.observe(float(t), 2.0)
        assert monitor.decide(float(t)) is Strategy.AC  # fewer than min_samples
    monitor.observe(4.0, 2.0)
    assert monitor.decide(4.0) is Strategy.SM
    assert monitor.switches == 1


def test_a_failure_switches_at_once():
    monitor = StrategyMonitor(CONFIG)
    monitor.observe(1.0, None)
    assert monitor.decide(1.0) is Strategy.SM


def test_old_slow_samples_are_forgotten():
    monitor = StrategyMonitor(CONFIG)
    for t in range(4):
        monitor.observe(float(t), 2.0)
    for t in range(40, 50):
        monitor.observe(float(t), 0.05)
    assert monitor.decide(50.0) is Strategy.AC


def test_returns_to_ac_after_a_healthy_window_of_probes():
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
def test_config_validation_names_the_field(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        StrategyConfig(**kwargs)
