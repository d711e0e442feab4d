"""The Generate contract (argus.contracts.generate): every value survives protobuf both ways,
every enum maps by name to its own protobuf value and back, and the contract is defined once:
no other module of ``argus`` defines one of its classes or copies enum numbers by hand."""

from __future__ import annotations

import ast
import enum
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import argus
from argus.contracts import generate
from argus.contracts.generate import (
    Adapter,
    AdapterKind,
    CacheCursor,
    CacheEvents,
    CacheEvict,
    CacheInsert,
    CacheKey,
    CacheOutcome,
    GenerateCall,
    GenerateResult,
    Progress,
    QualityScore,
    Stage,
    Timing,
)
from argus.contracts.plans import REASON_FROM_PB, REASON_TO_PB, ReplanReason
from argus.contracts.wire import STRATEGY_FROM_PB, STRATEGY_TO_PB, pb_numbers
from argus.plumbing import rpc
from argus.types import Strategy

common_pb2: Any = rpc.load("common_pb2")
worker_pb2: Any = rpc.load("worker_pb2")
allocator_pb2: Any = rpc.load("allocator_pb2")

pytestmark = pytest.mark.unit

PACKAGE = Path(argus.__file__).parent
# the contract's classes, and the names they had before they were one set
CONTRACT_CLASSES = {
    "CacheOutcome",
    "Stage",
    "Progress",
    "QualityScore",
    "GenerateCall",
    "WorkerCall",
    "GenerateResult",
    "WorkerReply",
    "Timing",
    "WorkerTiming",
    "CacheKey",
    "CacheCursor",
    "CacheInsert",
    "CacheEvict",
    "CacheEvents",
}

CALL = GenerateCall(
    prompt="a red fox",
    level="ac-k10",
    negative_prompt="blurry",
    seed=2**63 + 5,
    width=512,
    height=768,
    steps=30,
    guidance_scale=6.5,
    adapters=(
        Adapter(AdapterKind.LORA, "ink", 0.75),
        Adapter(AdapterKind.CONTROLNET, "canny", 1.5, b"png"),
    ),
    request_id="r-1",
    previews=3,
    image=b"\x89PNG template",
    mask=b"\x89PNG mask",
    strength=0.5,
    cache_cursor=CacheCursor("log-1", 41),
    prompt_embedding=(0.5, -0.75),
    prompt_encoder="minilm-1",
)
RESULT = GenerateResult(
    request_id="r-1",
    png=b"\x89PNG worker",
    level="ac-k10",
    strategy=Strategy.AC,
    model="tiny-sd",
    steps_run=20,
    start_step=10,
    cache=CacheOutcome.HIT,
    cache_miss_reason="none",
    similarity=0.875,
    timing=Timing(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0),
    worker_id="w1",
    substituted=True,
    scheduler="ddim",
    adapter_path="controlnet",
    scores=(QualityScore("a cat", "ac-k0", 0.5, "q"),),
    routed_step=15,
    cache_events=CacheEvents(
        log_id="log-1",
        last=43,
        events=(CacheInsert("e1", '["sdxl"]', (0.5, -0.25)), CacheEvict("e0")),
        truncated=True,
    ),
)


def set_fields(message: Any) -> set[str]:
    return {field.name for field, _ in message.ListFields()}


# -- (a) every value round-trips --------------------------------------------------------------


def test_a_call_with_every_field_set_round_trips() -> None:
    message = generate.call_to_pb(CALL)
    assert set_fields(message) == set(message.DESCRIPTOR.fields_by_name)
    assert generate.call_from_pb(message) == CALL
    assert generate.call_to_pb(generate.call_from_pb(message)) == message


def test_a_call_with_unset_optional_fields_keeps_them_unset() -> None:
    message = generate.call_to_pb(GenerateCall("x"))
    assert not any(message.HasField(n) for n in ("width", "height", "steps", "guidance_scale"))
    assert generate.call_from_pb(message) == GenerateCall("x")


def test_a_result_with_every_field_set_round_trips() -> None:
    message = generate.result_to_pb(RESULT)
    assert set_fields(message) == set(message.DESCRIPTOR.fields_by_name)
    assert set_fields(message.timing) == set(message.timing.DESCRIPTOR.fields_by_name)
    assert set_fields(message.scores[0]) == set(message.scores[0].DESCRIPTOR.fields_by_name)
    assert generate.result_from_pb(message) == RESULT
    assert generate.result_to_pb(generate.result_from_pb(message)) == message


def test_a_result_with_unset_enums_reads_none_and_writes_them_unset() -> None:
    message = worker_pb2.GenerateResponse(request_id="r", timing=worker_pb2.Timing())
    typed = generate.result_from_pb(message)
    assert typed.strategy is None and typed.cache is None
    assert generate.result_to_pb(typed) == message
    unknown = generate.result_from_pb(worker_pb2.GenerateResponse(strategy=9, cache=9))
    assert unknown.strategy is None and unknown.cache is None


def test_a_result_without_a_neighbour_or_events_leaves_them_unset() -> None:
    message = generate.result_to_pb(GenerateResult(similarity=None, cache_events=None))
    assert not message.HasField("similarity") and not message.cache_log_id
    typed = generate.result_from_pb(message)
    assert typed.similarity is None and typed.cache_events is None
    # a neighbour at similarity 0 is a neighbour
    assert (
        generate.result_from_pb(generate.result_to_pb(GenerateResult(similarity=0.0))).similarity
        == 0.0
    )


def test_a_call_without_a_cursor_asks_for_no_events() -> None:
    message = generate.call_to_pb(GenerateCall("x"))
    assert not message.HasField("cache_events_after")
    assert generate.call_from_pb(message).cache_cursor is None
    fresh = generate.call_to_pb(GenerateCall("x", cache_cursor=CacheCursor()))
    assert generate.call_from_pb(fresh).cache_cursor == CacheCursor("", 0)


def test_an_event_of_an_unknown_kind_makes_the_batch_truncated() -> None:
    message = generate.result_to_pb(GenerateResult(cache_events=CacheEvents("log", 3)))
    message.cache_events.add()  # an event with no kind this reader knows
    message.cache_events.add().evict.entry_id = "e9"
    events = generate.result_from_pb(message).cache_events
    assert events is not None and events.truncated
    assert events.events == (CacheEvict("e9"),)


def test_the_adapters_digest_ignores_order_and_tells_sets_apart() -> None:
    ink, film = Adapter(AdapterKind.LORA, "ink", 0.75), Adapter(AdapterKind.LORA, "film", 1.0)
    canny = Adapter(AdapterKind.CONTROLNET, "canny", 1.0, b"edges")
    digest = generate.adapters_digest
    assert digest([]) == ""
    assert digest([ink, film, canny]) == digest([canny, film, ink])
    assert digest([Adapter(AdapterKind.LORA, "film", 0.0)]) == digest([film])  # 0: default 1
    others = [
        [ink],
        [ink, film],
        [Adapter(AdapterKind.LORA, "ink", 0.5), film],
        [ink, film, Adapter(AdapterKind.CONTROLNET, "canny", 1.0, b"other edges")],
        [ink, film, Adapter(AdapterKind.CONTROLNET, "depth", 1.0, b"edges")],
    ]
    assert len({digest(a) for a in [*others, [ink, film, canny]]}) == len(others) + 1
    plain = CacheKey("sdxl", "euler", 64, 64, 10)
    assert plain.tag == '["sdxl", "euler", 64, 64, 10]'  # the tag caches were written with
    styled = CacheKey("sdxl", "euler", 64, 64, 10, digest([ink]))
    assert styled.tag != plain.tag and digest([ink]) in styled.tag


@pytest.mark.parametrize("stage", list(Stage))
def test_progress_round_trips_at_every_stage(stage: Stage) -> None:
    progress = Progress(stage, 3, 4, 20, "ac-k0", "w1", b"preview", 12.5)
    message = generate.progress_to_pb(progress)
    if stage is not Stage.UNSPECIFIED:
        assert set_fields(message) == set(message.DESCRIPTOR.fields_by_name)
    assert generate.progress_from_pb(message) == progress
    assert generate.progress_to_pb(generate.progress_from_pb(message)) == message


def test_unknown_adapter_kinds_and_stages_read_as_unknown() -> None:
    (adapter,) = generate.adapters_from_pb([common_pb2.Adapter(kind=7, name="ink")])
    assert adapter.kind is None
    assert generate.adapters_to_pb([adapter])[0].kind == 0
    assert generate.progress_from_pb(worker_pb2.Progress(stage=42)).stage is Stage.UNSPECIFIED


# -- (b) every enum maps by name to its own protobuf value ---------------------------------------


ENUMS = [  # (Python enum, its map to protobuf, the protobuf enum, the protobuf name of a member)
    (Stage, generate.codec().stage_to_pb, worker_pb2.Progress.Stage, lambda m: m.value.upper()),
    (
        CacheOutcome,
        generate.codec().cache_to_pb,
        worker_pb2.CacheOutcome,
        lambda m: f"CACHE_{m.name}",
    ),
    (AdapterKind, generate.codec().adapter_to_pb, common_pb2.Adapter.Kind, lambda m: m.name),
    (Strategy, STRATEGY_TO_PB, common_pb2.Strategy, lambda m: m.name),
    (ReplanReason, REASON_TO_PB, allocator_pb2.PlanReason, lambda m: f"PLAN_REASON_{m.name}"),
]


@pytest.mark.parametrize(("members", "to_pb", "pb_enum", "pb_name"), ENUMS)
def test_every_enum_maps_to_a_distinct_protobuf_value_of_its_name(
    members: type[enum.Enum], to_pb: dict[Any, int], pb_enum: Any, pb_name: Any
) -> None:
    assert set(to_pb) == set(members)
    assert len(set(to_pb.values())) == len(to_pb)
    for member, number in to_pb.items():
        assert pb_enum.Name(number) == pb_name(member)


def test_the_maps_back_from_protobuf_invert_them() -> None:
    c = generate.codec()
    for to_pb, from_pb in (
        (c.stage_to_pb, c.stage_from_pb),
        (c.cache_to_pb, c.cache_from_pb),
        (c.adapter_to_pb, c.adapter_from_pb),
        (c.strategy_to_pb, c.strategy_from_pb),
        (STRATEGY_TO_PB, STRATEGY_FROM_PB),
        (REASON_TO_PB, REASON_FROM_PB),
    ):
        assert {from_pb[number] for number in to_pb.values()} == set(to_pb)


def test_a_member_without_a_protobuf_value_fails_naming_it() -> None:
    class Grown(enum.Enum):
        HIT = "hit"
        STALE = "stale"  # added on one side only

    with pytest.raises(ValueError, match="STALE"):
        pb_numbers(Grown, worker_pb2.CacheOutcome, lambda m: f"CACHE_{m.name}")


# -- (c) one definition, no hand-copied numbers --------------------------------------------------


def texts() -> dict[str, str]:
    """Every module of the package, as text (the generated protobuf code excluded)."""
    return {
        str(path.relative_to(PACKAGE.parent)): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
        if "v1" not in path.relative_to(PACKAGE).parts
    }


def sources() -> dict[str, ast.Module]:
    """Every module of the package, parsed."""
    return {name: ast.parse(text, name) for name, text in texts().items()}


def contract_class_homes(modules: dict[str, ast.Module]) -> dict[str, list[str]]:
    """Each contract class name → the modules that define a class of that name."""
    homes: dict[str, list[str]] = {}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in CONTRACT_CLASSES:
                homes.setdefault(node.name, []).append(name)
    return homes


def hand_copied_numbers(modules: dict[str, ast.Module]) -> list[str]:
    """Dict literals whose keys are enum members (``Name.MEMBER``) and whose values are
    integer literals, in a module that loads generated protobuf code: protobuf numbers copied
    by hand. (Elsewhere such a map is the module's own numbering, e.g. the simulator's random
    streams per strategy.)"""
    found = []
    for name, tree in modules.items():
        if "_pb2" not in ast.unparse(tree):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Dict) or not node.keys:
                continue
            members = all(
                isinstance(k, ast.Attribute) and k.attr.isupper() and isinstance(k.value, ast.Name)
                for k in node.keys
            )
            numbers = all(isinstance(v, ast.Constant) and type(v.value) is int for v in node.values)
            if members and numbers:
                found.append(f"{name}:{node.lineno}")
    return found


# a name that says it holds a protobuf enum's number: KIND_LORA, ADAPTER_KIND_CONTROLNET, X_PB
_PB_NAME = re.compile(r"^_?(ADAPTER_)?KIND_|_PB$")


def hand_copied_constants(modules: dict[str, str]) -> list[str]:
    """Module-level ``NAME = <int>`` constants that hold a protobuf enum's number: named as
    one (:data:`_PB_NAME`) or commented with the enum (``# argus.v1.Adapter.Kind``). The
    generated enum, or the contract's enum mapped by name, says the same without a copy."""
    found = []
    for name, text in modules.items():
        lines = text.splitlines()
        for node in ast.parse(text, name).body:
            if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            if not (isinstance(value, ast.Constant) and type(value.value) is int):
                continue
            comment = lines[node.lineno - 1].partition("#")[2]
            for target in targets:
                if isinstance(target, ast.Name) and (
                    _PB_NAME.search(target.id) or "argus.v1." in comment
                ):
                    found.append(f"{name}:{node.lineno}")
    return found


def test_each_contract_class_is_defined_in_one_module() -> None:
    homes = contract_class_homes(sources())
    twice = {name: where for name, where in homes.items() if len(where) > 1}
    assert twice == {}, f"defined more than once: {twice}"
    assert all(where == ["argus/contracts/generate.py"] for where in homes.values()), homes


def test_no_module_copies_enum_numbers_by_hand() -> None:
    assert hand_copied_numbers(sources()) == []
    assert hand_copied_constants(texts()) == []


def test_the_scans_find_what_they_look_for() -> None:
    """The scans are not vacuous: a second definition and a hand-copied map are found."""
    copied = ast.parse(
        "worker_pb2 = rpc.load('worker_pb2')\n"
        "class CacheOutcome:\n    pass\n"
        "_CACHE_TO_PB = {CacheOutcome.NOT_USED: 1, CacheOutcome.HIT: 2}\n"
        "PLAIN = {'a': 1}\n"
    )
    own = ast.parse("STREAMS = {Strategy.AC: 1, Strategy.SM: 2}\n")  # no protobuf here
    modules = {**sources(), "argus/copy.py": copied, "argus/own.py": own}
    assert contract_class_homes(modules)["CacheOutcome"] == [
        "argus/contracts/generate.py",
        "argus/copy.py",
    ]
    assert hand_copied_numbers(modules) == ["argus/copy.py:4"]
    constants = {
        **texts(),
        "argus/kinds.py": (
            "KIND_LORA = 1  # argus.v1.Adapter.Kind\n"
            "KIND_CONTROLNET = 2\n"
            "LORA: int = 1  # argus.v1.Adapter.Kind.LORA\n"
            "STATE_PB = 3\n"
            "MAX_KINDS = 2  # not a protobuf number\n"
            "def f() -> None:\n    KIND_LOCAL = 1\n"
        ),
    }
    assert hand_copied_constants(constants) == [
        "argus/kinds.py:1",
        "argus/kinds.py:2",
        "argus/kinds.py:3",
        "argus/kinds.py:4",
    ]


def test_the_service_contracts_load_neither_torch_nor_a_service_package() -> None:
    """A servicer's conversions live in argus.contracts (its docstring's rule), which a fresh
    process imports without torch or any service package."""
    code = (
        "import sys\n"
        "import argus.contracts.controlnet, argus.contracts.generate\n"
        "import argus.contracts.worker_control\n"
        "services = ('argus.worker', 'argus.router', 'argus.allocator', 'argus.sim')\n"
        "print([m for m in sys.modules if m == 'torch' or m.startswith(services)])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
