"""Adapters on the worker's request path: LoRAs through BAL, ControlNets beside the UNet, the
latent-parallel peer, their interplay with the approximate cache, and their status codes."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from argus.contracts.generate import (
    Adapter,
    AdapterKind,
    CacheOutcome,
    GenerateCall,
    adapters_to_pb,
)
from argus.plumbing import rpc
from argus.request_limits import InvalidRequestError
from argus.worker.adapters.lora import LoraNotFoundError, write_tiny_lora
from argus.worker.adapters.workflow import AdapterSettings, WorkerAdapters
from argus.worker.service import create_server
from tests.lora_factories import write_unfit_lora
from tests.worker_factories import make_worker

pytestmark = pytest.mark.integration


worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")
INVALID = grpc.StatusCode.INVALID_ARGUMENT
STEPS = 4


def png(seed: int, size: int = 64) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def lora(name: str, scale: float = 1.0) -> Adapter:
    return Adapter(AdapterKind.LORA, name, scale)


def controlnet(name: str, seed: int = 1, scale: float = 1.0) -> Adapter:
    return Adapter(AdapterKind.CONTROLNET, name, scale, png(seed))


def unet_digest(worker: Any) -> str:
    model = worker.registry.active()
    digest = hashlib.sha256()
    for name, tensor in sorted(model.pipeline.unet.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("loras")
    base = make_worker(level="ac-k0", default_steps=STEPS)
    unet = base.registry.active().pipeline.unet
    write_tiny_lora(unet, directory / "ink.safetensors", seed=1, strength=2.0)
    write_tiny_lora(unet, directory / "film.safetensors", seed=2, strength=2.0)
    write_unfit_lora(unet, directory / "wrong.safetensors")
    base.close()
    return directory


@pytest.fixture(scope="module")
def worker(lora_dir: Path) -> Iterator[Any]:
    settings = AdapterSettings(lora_dir=str(lora_dir), lora_processes=1, controlnet="local")
    adapters = WorkerAdapters(settings, device="cpu", dtype=torch.float32)
    adapters.start()
    w = make_worker(level="ac-k0", default_steps=STEPS, adapters=adapters)
    yield w
    w.close()


def generate(worker: Any, *adapters: Any, **kw: Any) -> Any:
    kw.setdefault("seed", 3)
    return worker.generate(GenerateCall("a lighthouse at dusk", adapters=tuple(adapters), **kw))


def test_loras_change_the_image_and_leave_the_base_weights_bit_for_bit(worker: Any) -> None:
    pristine = unet_digest(worker)
    plain = generate(worker)
    styled = generate(worker, lora("ink"), lora("film", 0.5))
    assert styled.png != plain.png
    assert styled.adapter_path == "plain"
    assert unet_digest(worker) == pristine
    assert generate(worker).png == plain.png  # the next request sees the base model
    assert worker.adapters.stats()["lora_requests"] >= 1


def test_controlnets_run_beside_the_unet(worker: Any) -> None:
    plain = generate(worker)
    one = generate(worker, controlnet("canny"))
    two = generate(worker, controlnet("canny"), controlnet("depth", seed=2, scale=0.5))
    assert one.adapter_path == "controlnet"
    assert len({plain.png, one.png, two.png}) == 3
    assert one.timing.controlnet_wait_ms > 0.0
    both = generate(worker, controlnet("canny"), lora("ink"))
    assert both.adapter_path == "controlnet" and both.png != one.png


def test_bad_adapters_name_the_field(worker: Any) -> None:
    cases = [
        (Adapter(None, "x", 0.0), "adapters[0].kind"),
        (Adapter(AdapterKind.LORA, " ", 0.0), "adapters[0].name"),
        (Adapter(AdapterKind.CONTROLNET, "canny", 0.0), "adapters[0].control_image"),
        (Adapter(AdapterKind.LORA, "ink", 0.0, b"x"), "control_image"),
    ]
    for adapter, field in cases:
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            generate(worker, adapter)
    with pytest.raises(LoraNotFoundError):
        generate(worker, lora("nope"))
    assert generate(worker).png  # still serving


def test_adapters_are_part_of_the_cache_key(tmp_path: Path, lora_dir: Path) -> None:
    from prometheus_client import CollectorRegistry

    from argus.embedding import PromptEmbedder
    from argus.worker.approx_cache.cache import ApproximateCache, EdgeVectorIndex, LatentStore

    encoder = PromptEmbedder()
    cache = ApproximateCache(
        EdgeVectorIndex(tmp_path / "index", encoder.dim, optimize_after=None),
        LatentStore(tmp_path / "latents", fsync=False),
        max_entries=100,
        max_bytes=None,
        registry=CollectorRegistry(),
    )
    settings = AdapterSettings(lora_dir=str(lora_dir), lora_processes=1, controlnet="local")
    adapters = WorkerAdapters(settings, device="cpu", dtype=torch.float32)
    adapters.start()
    w = make_worker(cache=cache, encoder=encoder, default_steps=10, adapters=adapters)

    def run(*request: Adapter, level: str = "ac-k5") -> Any:
        result = generate(w, *request, level=level)
        w.flush()  # a full run's insert is written before the next request looks
        return result

    def outcome(result: Any) -> tuple[CacheOutcome, str, int]:
        return result.cache, result.cache_miss_reason, result.start_step

    hit = (CacheOutcome.HIT, "", 5)
    no_match = (CacheOutcome.MISS, "no-match", 0)
    try:
        run(level="ac-k0")  # the base model's latents, same prompt: similarity 1
        # a LoRA request never resumes from another adapter set's latent; its full run feeds
        # the cache under its own key, and the same set, in any order, resumes from it
        assert outcome(run(lora("ink"), lora("film", 0.5))) == no_match
        assert cache.stats().entries == 2
        assert outcome(run(lora("film", 0.5), lora("ink"))) == hit
        assert outcome(run(lora("film", 0.5))) == no_match  # another LoRA set
        assert outcome(run(lora("film"), lora("ink"))) == no_match  # another scale
        # a ControlNet request resumes only from latents made under the same control image
        assert outcome(run(controlnet("canny"))) == no_match
        assert outcome(run(controlnet("canny"))) == hit
        assert outcome(run(controlnet("canny", seed=2))) == no_match
    finally:
        w.close()


def test_a_worker_without_adapters_refuses_them() -> None:
    w = make_worker(level="ac-k0", default_steps=STEPS)
    try:
        with pytest.raises(InvalidRequestError, match="adapters"):
            generate(w, lora("ink"))
    finally:
        w.close()


def test_status_codes_over_grpc(worker: Any, lora_dir: Path) -> None:
    server, port, _ = create_server(worker, "127.0.0.1:0", threads=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    try:
        cases = [
            ([lora("nope")], grpc.StatusCode.INVALID_ARGUMENT, "adapters[0]: LoRA 'nope'"),
            ([lora("ink"), lora("wrong")], grpc.StatusCode.INVALID_ARGUMENT, "adapters[1]"),
            (
                [lora("ink"), controlnet("no-such-net")],
                grpc.StatusCode.INVALID_ARGUMENT,
                "adapters[1].name: unknown",
            ),
            (
                [Adapter(AdapterKind.CONTROLNET, "canny", 0.0, b"\x89PNG")],
                grpc.StatusCode.INVALID_ARGUMENT,
                "adapters[0].control_image",
            ),
        ]
        cases.append(([lora("ink")] * 10_000, INVALID, "adapters: 10000 adapters; at most 16"))
        for adapters, code, needle in cases:
            request = worker_pb2.GenerateRequest(
                prompt="a cat", seed=1, adapters=adapters_to_pb(adapters)
            )
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(request, timeout=60)
            assert err.value.code() == code, err.value.details()
            assert err.value.details().startswith(needle)
            assert str(lora_dir.parent) not in err.value.details()  # no server path leaks
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(worker_pb2.GenerateRequest(prompt=" \t", seed=1), timeout=60)
        assert err.value.code() == INVALID
        assert err.value.details().startswith("prompt: empty")
        ok = stub.Generate(
            worker_pb2.GenerateRequest(
                prompt="a cat", seed=1, adapters=adapters_to_pb([controlnet("canny")])
            ),
            timeout=60,
        )
        assert ok.png and ok.adapter_path == "controlnet"
    finally:
        channel.close()
        server.stop(grace=None)


def test_latent_parallel_worker_matches_the_single_device_image() -> None:
    settings = AdapterSettings(latent_parallel="cpu", controlnet="local")
    adapters = WorkerAdapters(settings, device="cpu", dtype=torch.float32)
    adapters.start()
    w = make_worker(level="ac-k0", default_steps=STEPS, adapters=adapters)
    single = make_worker(level="ac-k0", default_steps=STEPS)
    try:
        split = generate(w)
        assert split.adapter_path == "latent-parallel"
        one = generate(single)
        a = np.asarray(Image.open(io.BytesIO(split.png)), dtype=np.int16)
        b = np.asarray(Image.open(io.BytesIO(one.png)), dtype=np.int16)
        assert np.abs(a - b).max() <= 1  # same latents to 1e-5; PNG rounding at most 1
        assert generate(w, controlnet("canny")).adapter_path == "latent-parallel"
        # the peer dies: requests fall back to the single-device path, counted
        adapters.peer._process.kill()
        adapters.peer._process.join(10)
        fallback = generate(w, controlnet("canny"))
        assert fallback.adapter_path == "controlnet"
        plain = generate(w)
        assert plain.png == one.png and plain.adapter_path in ("", "plain")
    finally:
        w.close()
        single.close()


def test_argus_generate_sends_adapters(worker: Any, tmp_path: Path, capsys: Any) -> None:
    from argus.cli.main import main

    server, port, _ = create_server(worker, "127.0.0.1:0", threads=2)
    server.start()
    control = tmp_path / "edges.png"
    control.write_bytes(png(5))
    out = tmp_path / "out.png"
    try:
        base = ["generate", "--address", f"127.0.0.1:{port}", "--prompt", "a cat", "--out"]
        code = main([*base, str(out), "--lora", "ink=0.5", "--controlnet", f"canny={control}@0.8"])
        assert code == 0 and out.read_bytes()[:4] == b"\x89PNG"
        assert '"adapters": "controlnet"' in capsys.readouterr().out
        assert main([*base, str(out), "--lora", "nope"]) == 2
        assert "INVALID_ARGUMENT" in capsys.readouterr().err
        assert main([*base, str(out), "--controlnet", "canny"]) == 2
        assert "NAME=PNG" in capsys.readouterr().err
    finally:
        server.stop(grace=None)
