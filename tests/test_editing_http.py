"""Edits through the router (issue 32, items 1 and 4): the official ``openai`` client's
``images.edit`` against the HTTP app, plain and streamed; the same edit over the router's
gRPC API; and each bad input refused naming its field, 400 over HTTP and INVALID_ARGUMENT
over gRPC, with the router serving on afterwards.

A real router core in front of a real worker (tiny random pipeline on the CPU, its gRPC
server), all on loopback.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from argus.cli.main import main
from argus.plumbing import rpc
from argus.request_limits import MAX_EDIT_IMAGE_BYTES
from argus.router.http_app import create_app
from argus.router.http_server import HttpServer
from argus.worker.engine import Worker
from tests.editing_factories import (
    SIZE,
    STEPS,
    declaring_png,
    encode,
    mask_png,
    pixels,
    region_of,
    short_png,
    template_rgb,
    with_alpha,
)
from tests.test_router_stream import PATIENT, RealWorkerCluster
from tests.test_worker_deadlines import BOUND_S
from tests.worker_factories import make_worker

pytestmark = pytest.mark.integration

router_pb2: Any = rpc.load("router_pb2")
TOKEN = "edit-token"
RGB = template_rgb()
REGION = region_of(0.25)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    made = make_worker(worker_id="worker-edit", default_steps=STEPS)
    yield made
    made.close()


@pytest.fixture(scope="module")
def cluster(worker: Worker) -> Iterator[RealWorkerCluster]:
    made = RealWorkerCluster()
    made.add_real_worker(worker)
    made.address = made.start_router(PATIENT)  # gRPC; its core serves the HTTP app too
    made.channel = grpc.insecure_channel(made.address)
    yield made
    made.close()


@pytest.fixture(scope="module")
def server(cluster: RealWorkerCluster) -> Iterator[HttpServer]:
    served = HttpServer(create_app(cluster.core, token=TOKEN), "127.0.0.1", 0)
    served.start()
    yield served
    served.stop()


@pytest.fixture(scope="module")
def api(server: HttpServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=TOKEN, max_retries=0, timeout=BOUND_S)


@pytest.fixture(scope="module")
def stub(cluster: RealWorkerCluster) -> Any:
    from argus.v1 import router_pb2_grpc

    return router_pb2_grpc.RouterStub(cluster.channel)


def named(data: bytes, name: str) -> tuple[str, bytes, str]:
    """A file as the openai client sends one (name, bytes, content type)."""
    return (name, data, "image/png")


# -- the openai client ---------------------------------------------------------------------


def test_the_openai_client_edits_and_gets_pngs_keeping_the_unmasked_pixels(
    api: openai.OpenAI,
) -> None:
    answer = api.images.edit(
        image=named(encode(RGB), "template.png"),
        mask=named(mask_png(REGION), "mask.png"),
        prompt="a lighthouse on the rocks",
        n=2,
        response_format="b64_json",
        extra_body={"steps": STEPS, "seed": 5},
    )
    assert answer.data is not None and len(answer.data) == 2
    images = [pixels(base64.b64decode(d.b64_json or "")) for d in answer.data]
    for image in images:
        assert image.shape == (SIZE, SIZE, 3)
        assert np.array_equal(image[~REGION], RGB[~REGION])
    assert not np.array_equal(images[0], images[1])  # seeds 5 and 6


def test_the_openai_client_streams_an_edit_with_partial_images(api: openai.OpenAI) -> None:
    events = list(
        api.images.edit(
            image=named(with_alpha(RGB, REGION), "template.png"),
            prompt="a lighthouse on the rocks",
            stream=True,
            partial_images=2,
            extra_body={"steps": STEPS},
        )
    )
    kinds = [e.type for e in events]
    assert kinds[-1] == "image_edit.completed"
    assert kinds.count("image_edit.partial_image") == 2
    steps = [(e.model_extra or {}).get("step") for e in events if e.type == "argus.progress"]
    assert steps[-STEPS - 1 : -1] == list(range(1, STEPS + 1))
    done: Any = events[-1]
    image = Image.open(io.BytesIO(base64.b64decode(done.b64_json)))
    assert (image.format, image.size) == ("PNG", (SIZE, SIZE))
    assert np.array_equal(np.asarray(image.convert("RGB"))[~REGION], RGB[~REGION])


def test_img2img_over_http_is_the_generation_at_strength_one(api: openai.OpenAI) -> None:
    fields = {"steps": STEPS, "seed": 9}
    edited = api.images.edit(
        image=named(encode(RGB, "JPEG"), "t.jpg"),
        prompt="a fox",
        extra_body={**fields, "strength": "1"},
    )
    made = api.images.generate(prompt="a fox", size=f"{SIZE}x{SIZE}", extra_body=fields)
    assert edited.data is not None and made.data is not None
    assert edited.data[0].b64_json == made.data[0].b64_json


# -- gRPC ----------------------------------------------------------------------------------


def test_an_edit_over_grpc_keeps_the_unmasked_pixels(stub: Any) -> None:
    request = router_pb2.RouterGenerateRequest(
        prompt="a lighthouse", steps=STEPS, image=encode(RGB), mask=mask_png(REGION)
    )
    reply = stub.Generate(request, timeout=BOUND_S)
    assert np.array_equal(pixels(reply.png)[~REGION], RGB[~REGION])
    assert reply.worker_response.cache == 1  # CACHE_NOT_USED


def test_argus_client_sends_an_edit_and_saves_the_image(
    cluster: RealWorkerCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "t.png").write_bytes(encode(RGB))
    (tmp_path / "m.png").write_bytes(mask_png(REGION))
    out = tmp_path / "out"
    argv = ["client", "--router", cluster.address, "--prompt", "a lighthouse", "--out", str(out)]
    argv += ["--steps", str(STEPS), "--image", str(tmp_path / "t.png")]
    assert main([*argv, "--mask", str(tmp_path / "m.png")]) == 0
    assert np.array_equal(pixels((out / "0000.png").read_bytes())[~REGION], RGB[~REGION])
    capsys.readouterr()
    assert main([*argv, "--mask", str(tmp_path / "m.png"), "--strength", "0.5"]) == 1
    line = json.loads(capsys.readouterr().out)
    assert (line["error"], line["details"].split(":")[0]) == ("INVALID_ARGUMENT", "strength")


# -- bad input -----------------------------------------------------------------------------

NOT_AN_IMAGE = b"GIF89a not really"
OPAQUE = encode(np.dstack([RGB, np.full((SIZE, SIZE), 255, np.uint8)]))  # alpha, never 0
BAD = {  # what is sent → the field the refusal names
    "mask of another size": (
        {"image": encode(RGB), "mask": mask_png(region_of(0.5, 32))},
        "mask",
    ),
    "mask not an image": ({"image": encode(RGB), "mask": NOT_AN_IMAGE}, "mask"),
    "mask a JPEG": ({"image": encode(RGB), "mask": encode(RGB, "JPEG")}, "mask"),
    "mask without alpha": ({"image": encode(RGB), "mask": encode(RGB)}, "mask"),
    "mask with nothing to edit": ({"image": encode(RGB), "mask": OPAQUE}, "mask"),
    "image without alpha or mask": ({"image": encode(RGB)}, "image"),
    "image not an image": ({"image": NOT_AN_IMAGE, "strength": 0.5}, "image"),
    "image whose pixel data covers 10 of its rows": ({"image": short_png(rows=10)}, "image"),
    "image declaring 30000x30000": (
        {"image": declaring_png(30000, 30000), "strength": 0.5},
        "image",
    ),
    "image over the byte limit": (
        {"image": b"\x89PNG" + bytes(MAX_EDIT_IMAGE_BYTES), "strength": 0.5},
        "image",
    ),
    "image over the pixel limit": (  # one colour: a small file of many pixels
        {"image": encode(np.zeros((2056, 2056, 3), np.uint8)), "strength": 0.5},
        "image",
    ),
    "image side not a multiple of 8": (
        {"image": encode(template_rgb(60)), "strength": 0.5},
        "image",
    ),
    "size other than the image's": ({"image": encode(RGB), "strength": 0.5, "width": 128}, "size"),
    "strength above 1": ({"image": encode(RGB), "strength": 1.5}, "strength"),
    "strength 0": ({"image": encode(RGB), "strength": 0.0}, "strength"),
    "strength with a mask": (
        {"image": encode(RGB), "mask": mask_png(REGION), "strength": 0.5},
        "strength",
    ),
}


def form(fields: dict[str, Any]) -> tuple[dict[str, str], dict[str, tuple[str, bytes]]]:
    """An edit's multipart form: files and text values (``width`` is sent as ``size``)."""
    files = {name: (f"{name}.png", fields[name]) for name in ("image", "mask") if name in fields}
    data = {"prompt": "a lighthouse", "steps": str(STEPS)}
    if "strength" in fields:
        data["strength"] = str(fields["strength"])
    if "width" in fields:
        data["size"] = f"{fields['width']}x{SIZE}"
    return data, files


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_over_http_naming_the_field(server: HttpServer, case: str) -> None:
    fields, param = BAD[case]
    data, files = form(fields)
    answer = httpx.post(
        f"{server.base_url}/images/edits",
        data=data,
        files=files,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=BOUND_S,
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_over_grpc_naming_the_field(stub: Any, case: str) -> None:
    fields, param = BAD[case]
    request = router_pb2.RouterGenerateRequest(prompt="a lighthouse", steps=STEPS, **fields)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request, timeout=BOUND_S)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    named_field = "width" if param == "size" else param
    assert refused.value.details().startswith(f"{named_field}:"), refused.value.details()


# what each refusal says, the same over both APIs: the limit, not "not an image"
SAID = {
    "image whose pixel data covers 10 of its rows": (
        f"image: a damaged PNG image: its pixel data stops short of its {SIZE}×{SIZE} pixels"
    ),
    "image declaring 30000x30000": (
        "image: 30000×30000 exceeds this deployment's 2048 pixels a side or 4194304 pixels"
    ),
}


@pytest.mark.parametrize("case", sorted(SAID))
def test_damaged_or_huge_images_are_refused_in_the_same_words_on_both_apis(
    server: HttpServer, stub: Any, case: str
) -> None:
    fields, _ = BAD[case]
    data, files = form(fields)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{server.base_url}/images/edits"
    answer = httpx.post(url, data=data, files=files, headers=headers, timeout=BOUND_S)
    message = answer.json()["error"]["message"]
    assert answer.status_code == 400 and message.startswith(SAID[case]), message
    request = router_pb2.RouterGenerateRequest(prompt="a lighthouse", steps=STEPS, **fields)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request, timeout=BOUND_S)
    assert refused.value.details() == message


def test_form_errors_name_their_field_and_the_router_serves_on(
    server: HttpServer, api: openai.OpenAI
) -> None:
    def post(**kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return httpx.post(
            f"{server.base_url}/images/edits", headers=headers, timeout=BOUND_S, **kwargs
        )

    as_json = post(json={"prompt": "x", "image": "aGVsbG8="})
    assert (as_json.status_code, as_json.json()["error"]["param"]) == (400, "body")
    no_image = post(data={"prompt": "x"}, files={"mask": ("m.png", mask_png(REGION))})
    assert (no_image.status_code, no_image.json()["error"]["param"]) == (400, "image")
    image_as_text = post(data={"prompt": "x", "image": "pixels"}, files={"mask": ("m", b"")})
    assert (image_as_text.status_code, image_as_text.json()["error"]["param"]) == (400, "image")
    steps = post(data={"prompt": "x", "steps": "٤"}, files={"image": ("i.png", encode(RGB))})
    assert (steps.status_code, steps.json()["error"]["param"]) == (400, "steps")
    adapters = post(data={"prompt": "x", "adapters": "[]"}, files={"image": ("i", encode(RGB))})
    assert (adapters.status_code, adapters.json()["error"]["param"]) == (400, "adapters")
    three_files = {"image": ("i.png", encode(RGB)), "mask": ("m.png", mask_png(REGION))}
    prompt_file = post(files={**three_files, "prompt": ("prompt.txt", b"a boat")})
    assert (prompt_file.status_code, prompt_file.json()["error"]) == (
        400,
        {
            "message": "prompt: must be a text field, not a file",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "invalid_value",
        },
    )
    # and an edit still goes through
    after = api.images.edit(
        image=named(with_alpha(RGB, REGION), "t.png"), prompt="x", extra_body={"steps": 2}
    )
    assert after.data is not None and len(after.data) == 1
