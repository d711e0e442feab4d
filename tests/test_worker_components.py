"""The worker's component registry: models of one family share their text encoder and VAE by
the weights' digest, a switch among them loads only the UNet, a switch back to a resident
model loads nothing, and the byte budget unloads the least recently used model first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from argus.worker.metrics import WorkerMetrics
from argus.worker.models.components import part_bytes, source_digests
from argus.worker.models.registry import ModelRegistry
from argus.worker.models.sources import TINY_PREFIX, build_tiny_pipeline, estimate_part_bytes
from tests.worker_factories import make_registry

pytestmark = pytest.mark.unit

FP32 = torch.float32


@pytest.fixture
def registry() -> Iterator[ModelRegistry]:
    reg = make_registry(max_resident=4)
    try:
        yield reg
    finally:
        reg.close()


def test_digests_follow_the_weights_not_the_names() -> None:
    sd15 = source_digests("tiny:sd-1.5")
    for variant in ("sd-1.4", "small-sd", "tiny-sd"):
        other = source_digests(f"tiny:{variant}")
        assert other["text_encoder"] == sd15["text_encoder"], variant
        assert other["vae"] == sd15["vae"], variant
        assert other["unet"] != sd15["unet"], variant
    for variant in ("sd-2.0", "sdxl"):
        other = source_digests(f"tiny:{variant}")
        assert other["text_encoder"] != sd15["text_encoder"], variant
        assert other["vae"] != sd15["vae"], variant


def test_two_levels_of_one_family_hold_one_copy_of_the_shared_parts(
    registry: ModelRegistry,
) -> None:
    registry.activate("sd-1.5").result(timeout=60)
    registry.activate("sd-1.4").result(timeout=60)
    sd15, sd14 = registry.get("sd-1.5"), registry.get("sd-1.4")
    assert sd15 is not None and sd14 is not None
    a, b = sd15.pipeline, sd14.pipeline
    assert a.text_encoder is b.text_encoder
    assert a.vae is b.vae
    assert a.unet is not b.unet
    # the same tensors, not equal copies
    assert a.vae.decoder.conv_in.weight.data_ptr() == b.vae.decoder.conv_in.weight.data_ptr()
    # the memory guard counts each part once
    distinct = {id(m): m for p in (a, b) for m in (p.text_encoder, p.vae, p.unet)}
    assert registry.used_bytes() == sum(part_bytes(m) for m in distinct.values())
    assert registry.used_bytes() == sd15.parameter_bytes() + part_bytes(b.unet)
    shared = [c for c in registry.components() if c.models == ("sd-1.4", "sd-1.5")]
    assert sorted(c.part for c in shared) == ["text_encoder", "tokenizer", "vae"]


def test_a_switch_within_a_family_loads_only_the_unet(registry: ModelRegistry) -> None:
    registry.activate("sd-1.5").result(timeout=60)
    registry.activate("tiny-sd").result(timeout=60)
    loaded = {m.name: m.loaded_parts for m in registry.infos()}
    assert sorted(loaded["sd-1.5"]) == ["text_encoder", "tokenizer", "unet", "vae"]
    assert list(loaded["tiny-sd"]) == ["unet"]
    assert loaded["tiny-sd"]["unet"] > 0
    # another family shares nothing with it but the tokenizer
    registry.activate("sd-2.0").result(timeout=60)
    loaded = {m.name: m.loaded_parts for m in registry.infos()}
    assert sorted(loaded["sd-2.0"]) == ["text_encoder", "unet", "vae"]


def test_a_switch_back_to_a_resident_unet_loads_nothing(registry: ModelRegistry) -> None:
    registry.activate("sd-1.5").result(timeout=60)
    first = registry.get("sd-1.5")
    registry.activate("sd-1.4").result(timeout=60)
    before = registry.components()
    back = registry.activate("sd-1.5")
    assert back.done()  # no background load
    assert back.result() is first
    assert registry.active_name == "sd-1.5"
    assert registry.components() == before


def test_the_budget_unloads_the_least_recently_used_model_first() -> None:
    variants = ("sd-1.5", "sd-1.4", "small-sd", "tiny-sd")
    unet = {v: estimate_part_bytes(f"tiny:{v}", FP32)["unet"] for v in variants}
    shared = sum(estimate_part_bytes("tiny:sd-1.5", FP32).values()) - unet["sd-1.5"]
    # the shared parts and any three UNets fit, not all four
    budget = shared + sum(unet.values()) - 1
    registry = make_registry(max_resident=4, memory_budget_bytes=budget)
    try:
        registry.index().result(timeout=120)  # the guard counts only the parts not resident
        for variant in variants[:3]:
            registry.activate(variant).result(timeout=60)
        assert [m.name for m in registry.infos()] == ["sd-1.4", "sd-1.5", "small-sd"]
        registry.get("sd-1.5")  # a request at sd-1.5: sd-1.4 is now the least recently used
        registry.activate("tiny-sd").result(timeout=60)
        assert [m.name for m in registry.infos()] == ["sd-1.5", "small-sd", "tiny-sd"]
        assert registry.used_bytes() <= budget
    finally:
        registry.close()


def test_diffusers_directories_share_parts_by_their_files(tmp_path: Path) -> None:
    # two checkpoints on disk under unrelated names: sharing comes from the parts' files
    sources = {"first": tmp_path / "a", "second": tmp_path / "b"}
    for variant, path in zip(("sd-1.5", "sd-1.4"), sources.values(), strict=True):
        build_tiny_pipeline(TINY_PREFIX + variant).save_pretrained(path, safe_serialization=True)
    registry = ModelRegistry(
        {name: str(path) for name, path in sources.items()}, device="cpu", max_resident=2
    )
    try:
        registry.activate("first").result(timeout=60)
        registry.activate("second").result(timeout=60)
        loaded = {m.name: sorted(m.loaded_parts) for m in registry.infos()}
        assert loaded == {"first": ["text_encoder", "tokenizer", "unet", "vae"], "second": ["unet"]}
        first, second = registry.get("first"), registry.get("second")
        assert first is not None and second is not None
        assert first.pipeline.vae is second.pipeline.vae
        assert first.pipeline.text_encoder is second.pipeline.text_encoder
    finally:
        registry.close()


def test_each_part_a_load_loads_is_observed_in_the_metrics() -> None:
    prom = CollectorRegistry()
    registry = make_registry(max_resident=2, on_load=WorkerMetrics(prom).observe_load)
    try:
        registry.activate("sd-1.5").result(timeout=60)
        registry.activate("sd-1.4").result(timeout=60)
    finally:
        registry.close()

    def loads(part: str) -> float | None:
        return prom.get_sample_value("argus_worker_part_load_seconds_count", {"part": part})

    assert (loads("unet"), loads("vae"), loads("text_encoder")) == (2, 1, 1)
    assert prom.get_sample_value("argus_worker_model_loads_total", {"model": "sd-1.4"}) == 1


def test_the_max_resident_flag_reaches_the_registry() -> None:
    """``argus worker --max-resident 2`` gives the worker's registry room for two ready models:
    after a switch the previous one stays resident."""
    import argparse

    from argus.cli.main import OneLineParser
    from argus.cli.worker import WorkerCommand
    from argus.worker.app import build_worker
    from argus.worker.models.registry import LoadState

    command = WorkerCommand()
    parser = OneLineParser(prog="argus worker")
    command.add_arguments(parser)
    args = parser.parse_args(
        ["--max-resident", "2", "--no-cache", "--device", "cpu", "--level", "sm-sd-1.5"]
    )
    assert isinstance(args, argparse.Namespace)
    worker = build_worker(command._settings(args, None))
    try:
        registry = worker.registry
        assert registry.max_resident == 2
        registry.activate("sd-1.4").result(timeout=60)
        ready = {m.name for m in registry.infos() if m.state is LoadState.READY}
        assert ready == {"sd-1.5", "sd-1.4"}
    finally:
        worker.close()
