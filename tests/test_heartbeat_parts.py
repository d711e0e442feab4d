"""A heartbeat's part figures (issue 35): the last load's parts with their seconds and the
parts resident survive the protobuf round trip the worker and the allocator make."""

from __future__ import annotations

from typing import Any

import pytest

from argus.contracts.wire import FieldError
from argus.contracts.worker_control import ComponentInfo
from argus.contracts.workers import (
    MAX_PART_LOADS,
    WorkerReport,
    allocator_pb2,
    heartbeat_from_pb,
    heartbeat_to_pb,
)
from argus.profiles import default_profiles
from argus.types import Strategy

pytestmark = pytest.mark.unit

PROFILES = default_profiles()


def across_the_wire(report: WorkerReport) -> WorkerReport:
    """What the allocator reads of what the worker sent: serialised bytes, parsed back."""
    message: Any = allocator_pb2.WorkerHeartbeat.FromString(
        heartbeat_to_pb(report).SerializeToString()
    )
    return heartbeat_from_pb(message, PROFILES)


def test_the_last_loads_parts_and_the_resident_parts_round_trip() -> None:
    clip = ComponentInfo("c" * 64, "text_encoder", 246_000_000, 0.64, ("sd-1.4", "sd-1.5"))
    unet = ComponentInfo("u" * 64, "unet", 1_719_000_000, 4.48, ("sd-1.4",))
    report = WorkerReport(
        worker_id="w1",
        address="10.0.0.1:50053",
        worker_class="a100",
        strategy=Strategy.SM,
        level="sm-sd-1.4",
        model="sd-1.4",
        loaded_models=("sd-1.4", "sd-1.5"),
        last_load_model="sd-1.4",
        last_load_parts=(("unet", 4.48),),
        resident_parts=(clip, unet),
    )
    assert across_the_wire(report) == report


def test_a_report_without_part_figures_reads_as_nothing_loaded() -> None:
    bare = WorkerReport("w1", "10.0.0.1:50053", "a100")
    back = across_the_wire(bare)
    assert (back.last_load_model, back.last_load_parts, back.resident_parts) == ("", (), ())


def test_too_many_part_loads_are_refused_naming_the_field() -> None:
    report = WorkerReport(
        "w1",
        "10.0.0.1:50053",
        "a100",
        last_load_parts=tuple((f"p{i}", 0.1) for i in range(MAX_PART_LOADS + 1)),
    )
    with pytest.raises(FieldError, match="last_load_parts: at most 64"):
        across_the_wire(report)
