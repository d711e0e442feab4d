"""Tests of the utilisation caps from queueing (argus.allocator.queueing)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.allocator.queueing import UTILISATION_TOLERANCE, QueueModel, mmc_late_share

pytestmark = pytest.mark.unit


@settings(max_examples=300, deadline=None)
@given(
    service_ms=st.integers(100, 8000),
    servers=st.sampled_from([1, 2, 3, 7, 16, 64, 200, 512]),
    slo_factor=st.floats(1.05, 10.0),
    arrival_scv=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    late_share=st.sampled_from([0.001, 0.02, 0.3]),
)
def test_cap_is_the_largest_utilisation_whose_late_share_fits(
    service_ms: int, servers: int, slo_factor: float, arrival_scv: float, late_share: float
) -> None:
    service_s = service_ms / 1000.0
    slo_s = round(service_s * slo_factor, 6)
    queue = QueueModel(slo_s, arrival_scv=arrival_scv, service_scv=0.1, late_share=late_share)
    cap = queue.max_utilisation(service_s, servers)
    # the wait the SLO leaves, scaled as Allen–Cunneen does, on max_utilisation's rounding
    wait_s = round(slo_s - service_s, 6) / round((arrival_scv + 0.1) / 2.0, 6)
    assert 0.0 <= cap < 1.0
    assert mmc_late_share(service_s, servers, cap, wait_s) <= late_share
    above = cap + 2.0 * UTILISATION_TOLERANCE
    assert above >= 1.0 or mmc_late_share(service_s, servers, above, wait_s) > late_share


def test_no_budget_means_no_load() -> None:
    assert QueueModel(2.0).max_utilisation(2.5, 4) == 0.0


def test_a_model_answers_again_as_it_did_and_stays_equal_to_an_unused_one() -> None:
    """Answers are cached by the model's parameters: another SLO gets its own, a bad pool
    size is refused every time, and using a model changes nothing of its equality or hash."""
    used, other = QueueModel(12.6), QueueModel(4.0)
    first = used.max_utilisation(3.0, 4)
    assert used.max_utilisation(3.0, 4) == first
    assert other.max_utilisation(3.0, 4) != first
    assert used == QueueModel(12.6) and hash(used) == hash(QueueModel(12.6))
    for _ in range(2):
        with pytest.raises(ValueError, match="servers"):
            used.max_utilisation(3.0, 0)
