"""The router's protobuf conversion (argus.router.convert): messages with every field set
survive message → typed value → message, and each refusal is answered with its own status."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from argus.contracts import generate, router_api
from argus.contracts.generate import AdapterKind, Stage
from argus.contracts.router_api import RouterReply, RouterTiming
from argus.plumbing import rpc
from argus.router import convert
from argus.router.core import check_request
from argus.router.values import Refusal, RouterError
from argus.types import Strategy

pytestmark = pytest.mark.unit


common_pb2: Any = rpc.load("common_pb2")
router_pb2: Any = rpc.load("router_pb2")
worker_pb2: Any = rpc.load("worker_pb2")

EXPECTED_CODES = {
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Refusal.ID_CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    Refusal.ANSWER_DROPPED: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Refusal.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Refusal.CANCELLED: grpc.StatusCode.CANCELLED,
    Refusal.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Refusal.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Refusal.FAILED: grpc.StatusCode.INTERNAL,
}


def full_request() -> Any:
    """A RouterGenerateRequest with every field set to something other than its default."""
    return router_pb2.RouterGenerateRequest(
        request_id="r-1",
        prompt="a red fox",
        negative_prompt="blurry",
        seed=2**63 + 5,
        width=512,
        height=768,
        steps=30,
        adapters=[
            common_pb2.Adapter(kind=common_pb2.Adapter.LORA, name="ink", scale=0.75),
            common_pb2.Adapter(
                kind=common_pb2.Adapter.CONTROLNET, name="canny", scale=1.5, control_image=b"png"
            ),
        ],
        guidance_scale=6.5,
        deadline_ms=1234,
        max_level_index=2,
        previews=3,
        image=b"\x89PNG template",
        mask=b"\x89PNG mask",
        strength=0.5,
    )


def full_worker_response() -> Any:
    return worker_pb2.GenerateResponse(
        request_id="r-1",
        png=b"\x89PNG worker",
        level="ac-k10",
        strategy=common_pb2.Strategy.AC,
        model="tiny-sd",
        steps_run=20,
        start_step=10,
        cache=worker_pb2.CACHE_HIT,
        cache_miss_reason="none",
        similarity=0.875,
        timing=worker_pb2.Timing(
            queue_ms=1.0,
            search_ms=2.0,
            fetch_ms=3.0,
            encode_ms=4.0,
            denoise_ms=5.0,
            decode_ms=6.0,
            total_ms=7.0,
            lora_wait_ms=8.0,
            controlnet_wait_ms=9.0,
        ),
        worker_id="w1",
        substituted=True,
        scheduler="ddim",
        adapter_path="controlnet",
        scores=[worker_pb2.QualityScore(prompt="a cat", level="ac-k0", score=0.5, request_id="q")],
        routed_step=15,
        cache_events=[
            worker_pb2.CacheEvent(
                insert=worker_pb2.CacheInsert(entry_id="e1", tag="t", embedding=[0.5])
            ),
            worker_pb2.CacheEvent(evict=worker_pb2.CacheEvict(entry_id="e0")),
        ],
        cache_events_truncated=True,
        cache_log_id="log-1",
        cache_events_last=7,
    )


def set_fields(message: Any) -> set[str]:
    """The fields of ``message`` that hold something other than their default."""
    return {field.name for field, _ in message.ListFields()}


def test_a_request_with_every_field_set_round_trips() -> None:
    message = full_request()
    assert set_fields(message) == set(message.DESCRIPTOR.fields_by_name)
    typed = router_api.request_from_pb(message)
    assert typed.width == 512 and typed.deadline_ms == 1234 and typed.max_level_index == 2
    assert [a.kind for a in typed.adapters] == [AdapterKind.LORA, AdapterKind.CONTROLNET]
    assert router_api.request_to_pb(typed) == message
    assert router_api.request_from_pb(router_api.request_to_pb(typed)) == typed


def test_unset_optional_fields_are_none_and_stay_unset() -> None:
    message = router_pb2.RouterGenerateRequest(prompt="x")
    typed = router_api.request_from_pb(message)
    optional = ("width", "height", "steps", "guidance_scale", "deadline_ms", "max_level_index")
    assert all(getattr(typed, name) is None for name in optional)
    again = router_api.request_to_pb(typed)
    assert not any(again.HasField(name) for name in optional)
    # zero is a value, not an absence: a width of 0 reaches the check that names it
    zero = router_api.request_from_pb(router_pb2.RouterGenerateRequest(prompt="x", width=0))
    assert zero.width == 0 and router_api.request_to_pb(zero).HasField("width")


def test_an_unknown_adapter_kind_is_refused_by_the_core_naming_the_adapter() -> None:
    message = router_pb2.RouterGenerateRequest(prompt="x")
    message.adapters.add(kind=7, name="ink", scale=1.0)
    typed = router_api.request_from_pb(message)
    assert typed.adapters[0].kind is None
    with pytest.raises(RouterError) as caught:
        check_request(typed)
    assert caught.value.kind is Refusal.INVALID
    assert caught.value.details.startswith("adapters[0]:")


def test_a_reply_with_every_field_set_round_trips() -> None:
    message = router_pb2.RouterGenerateResponse(
        request_id="r-1",
        png=b"\x89PNG router",
        level="ac-k10",
        level_index=1,
        strategy=common_pb2.Strategy.AC,
        worker_id="w1",
        classified_level="ac-k0",
        target_level="ac-k10",
        plan_version=42,
        timing=router_pb2.RouterTiming(
            classify_ms=1.5,
            route_ms=0.25,
            forward_ms=30.0,
            total_ms=32.0,
            worker=worker_pb2.Timing(queue_ms=1.0, total_ms=29.0),
            attempts=2,
        ),
        worker_response=full_worker_response(),
    )
    assert set_fields(message) == set(message.DESCRIPTOR.fields_by_name)
    worker = full_worker_response()
    assert set_fields(worker) == set(worker.DESCRIPTOR.fields_by_name)
    typed = RouterReply(
        request_id="r-1",
        png=b"\x89PNG router",
        level="ac-k10",
        level_index=1,
        strategy=Strategy.AC,
        worker_id="w1",
        classified_level="ac-k0",
        target_level="ac-k10",
        plan_version=42,
        timing=RouterTiming(
            classify_ms=1.5,
            route_ms=0.25,
            forward_ms=30.0,
            total_ms=32.0,
            worker=generate.timing_from_pb(message.timing.worker),
            attempts=2,
        ),
        worker_response=generate.result_from_pb(worker),
    )
    assert typed.worker_response.scores[0].prompt == "a cat"
    assert router_api.reply_to_pb(typed) == message
    assert generate.result_to_pb(generate.result_from_pb(worker)) == worker


def test_progress_events_round_trip_with_their_stage() -> None:
    for stage, value in worker_pb2.Progress.Stage.items():
        message = worker_pb2.Progress(
            stage=value,
            queue_position=3,
            step=4,
            total_steps=20,
            level="ac-k0",
            worker_id="w1",
            preview_png=b"preview",
            elapsed_ms=12.5,
        )
        typed = generate.progress_from_pb(message)
        assert typed.stage.value == stage.lower()  # the HTTP stream's stage names
        assert generate.progress_to_pb(typed) == message
    names = {name.lower() for name, _ in worker_pb2.Progress.Stage.items()}
    assert {s.value for s in Stage} == names


def test_every_refusal_has_its_own_status_and_comes_back_from_it() -> None:
    assert set(EXPECTED_CODES) == set(Refusal)
    for refusal, code in EXPECTED_CODES.items():
        assert convert.status_code(refusal) is code
        assert convert.refusal_of(code) is refusal
        assert refusal.status_name == code.name  # the metrics label and the HTTP error code
    assert len(set(EXPECTED_CODES.values())) == len(Refusal)
    # a worker's status that no refusal is answered with is the worker failing
    for code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED):
        assert convert.refusal_of(code) is Refusal.FAILED


def test_the_retry_hint_survives_as_whole_milliseconds() -> None:
    assert convert.retry_after_metadata(0.25) == ((convert.RETRY_AFTER_KEY, "250"),)
    assert convert.retry_after_metadata(1.2344) == (("retry-after-ms", "1234"),)
    assert convert.retry_after_metadata(0.0001) == (("retry-after-ms", "1"),)  # never 0
