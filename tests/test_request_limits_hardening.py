"""The request limits the router and the workers share (argus/request_limits.py), hardened: a
prompt must say something, numbers given as text are ASCII digits, a request carries at most
``MAX_ADAPTERS`` adapters; and the worker's adapter errors name the request's field
(``adapters[i]``), whichever part of the worker raised them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from argus.contracts.router_api import RouterRequest
from argus.request_limits import (
    MAX_ADAPTERS,
    InvalidRequestError,
    check_adapters,
    check_prompts,
    parse_int,
    parse_size,
)
from argus.router.values import Refusal, RouterError
from argus.worker.adapters.controlnet.errors import ControlImageError, UnknownControlNetError
from argus.worker.adapters.workflow import (
    AdapterPlan,
    AdapterSettings,
    WorkerAdapters,
    at_request_field,
)
from tests.test_router_core import FakeWorkers, make_core

pytestmark = pytest.mark.unit


BLANK = ["", " ", "\t\n", "\u3000", " \u2003 "]  # the last two: Unicode spaces


def field_of(err: pytest.ExceptionInfo[InvalidRequestError]) -> str:
    return err.value.field


@pytest.mark.parametrize("prompt", BLANK)
def test_an_empty_or_blank_prompt_is_refused_naming_prompt(prompt: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        check_prompts(prompt, "")
    assert field_of(err) == "prompt"
    assert str(err.value).startswith("prompt: empty")


def test_an_empty_negative_prompt_is_fine() -> None:
    check_prompts("a lighthouse at dusk", "")
    check_prompts(" a fox ", "   ")


@pytest.mark.parametrize("prompt", BLANK)
def test_the_router_refuses_a_blank_prompt_before_its_classifier(prompt: str) -> None:
    workers = FakeWorkers()
    core = make_core(workers, ("w1",))
    with pytest.raises(RouterError) as err:
        core.generate(RouterRequest(prompt=prompt))
    assert err.value.kind is Refusal.INVALID
    assert err.value.details.startswith("prompt: empty")
    assert workers.calls == []


@pytest.mark.parametrize(
    ("text", "value"), [("0", 0), ("512", 512), ("000064", 64), ("999999999", 999_999_999)]
)
def test_parse_int_reads_ascii_digits(text: str, value: int) -> None:
    assert parse_int(text, "n") == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "５１２",  # fullwidth digits: int() takes them
        "٥١٢",  # Arabic-Indic digits: int() takes them
        "²",  # str.isdigit() says yes, int() raises
        "1_024",  # int() takes underscores
        " 512",  # int() strips spaces
        "+512",
        "-8",
        "1e3",
        "0x10",
        "1" * 10,  # more digits than any size or count
    ],
)
def test_parse_int_refuses_anything_else_naming_the_field(text: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_int(text, "n")
    assert field_of(err) == "n"


def test_parse_size_reads_width_x_height() -> None:
    assert parse_size("1024x768") == (1024, 768)
    for bad in ("1024", "1024X768", "１０２４x768", "1024x７６８", "1024x768x2", "x", "1024 x 768"):
        with pytest.raises(InvalidRequestError) as err:
            parse_size(bad)
        assert field_of(err) == "size", bad


class Entry:
    """An adapter entry as the worker reads it (a protobuf ``Adapter`` or alike)."""

    def __init__(self, name: str, kind: int = 1) -> None:
        self.name = name
        self.kind = kind
        self.scale = 1.0
        self.control_image = b""


@pytest.mark.parametrize("count", [MAX_ADAPTERS + 1, 10_000])
def test_too_many_adapters_are_refused_naming_adapters(count: int) -> None:
    check_adapters([Entry("ink")] * MAX_ADAPTERS)
    with pytest.raises(InvalidRequestError) as err:
        check_adapters([Entry("ink")] * count)
    assert field_of(err) == "adapters"
    assert f"{count} adapters; at most {MAX_ADAPTERS}" in str(err.value)


def test_the_worker_refuses_too_many_adapters_in_the_same_words() -> None:
    adapters = WorkerAdapters(AdapterSettings(), device="cpu", dtype=torch.float32)
    with pytest.raises(InvalidRequestError) as err:
        adapters.plan([Entry("ink")] * 10_000)  # before it looks at any entry
    assert field_of(err) == "adapters"


def test_controlnet_errors_are_renamed_to_the_requests_field() -> None:
    # adapters[0] is a LoRA, [1] and [3] ControlNets: controlnets[1] is adapters[3]
    plan = AdapterPlan(controls=(object(), object()), control_fields=("adapters[1]", "adapters[3]"))
    cases: list[tuple[Any, str]] = [
        (UnknownControlNetError("controlnets[1].name", "unknown 'x'"), "adapters[3].name"),
        (ControlImageError("controlnets[0].control_image", "no PNG"), "adapters[1].control_image"),
        (ControlImageError("controlnets[0]", "bad"), "adapters[1]"),
    ]  # fmt: skip
    for err, field in cases:
        renamed = at_request_field(err, plan)
        assert type(renamed) is type(err)
        assert renamed.field == field
        assert str(renamed) == f"{field}: {str(err).split(': ', 1)[1]}"
    for other in (
        UnknownControlNetError("name", "unknown"),  # no index: left as it is
        UnknownControlNetError("controlnets[5].name", "out of the plan"),
        ControlImageError("", "no field"),
    ):
        assert at_request_field(other, plan) is other
