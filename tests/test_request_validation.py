"""Bad input an outside tester sent the router, each refused naming its field, in the limit's
own words: an edit's image whose pixel data stops short of its rows or whose header declares
a huge size, previews and ``max_level_index`` beyond the bounds both APIs share, an adapter of
a kind this router does not know, an oversized gRPC request, and an edit form whose prompt is
a file. The end-to-end answers (HTTP 400, INVALID_ARGUMENT) are in tests/test_editing_http.py,
tests/test_router_http.py and tests/test_router_service.py; these check the rules themselves.
"""

from __future__ import annotations

import asyncio
import io
import struct
import zlib
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image, ImageFile
from starlette.datastructures import Headers

from argus.contracts.generate import Adapter, AdapterKind
from argus.contracts.router_api import MAX_REQUEST_BYTES, RouterRequest
from argus.plumbing import rpc
from argus.request_limits import (
    MAX_LEVEL_INDEX,
    MAX_PREVIEWS,
    ImageLimits,
    InvalidRequestError,
    check_edit,
)
from argus.router.core import check_request
from argus.router.openai_wire import ApiError, parse_edit_request, parse_form
from argus.router.service import check_size
from argus.router.values import Refusal, RouterError
from tests.editing_factories import (
    PNG_SIGNATURE,
    SIZE,
    declaring_png,
    encode,
    region_of,
    short_png,
    template_rgb,
    with_alpha,
)

pytestmark = pytest.mark.unit

router_pb2: Any = rpc.load("router_pb2")
common_pb2: Any = rpc.load("common_pb2")
LIMITS = ImageLimits()


def refusal(image: bytes, strength: float | None = None) -> str:
    with pytest.raises(InvalidRequestError) as err:
        check_edit(image, b"", strength, LIMITS)
    assert err.value.field == "image"
    return str(err.value)


# -- an edit's image -----------------------------------------------------------------------


def test_a_png_whose_pixel_data_stops_short_of_its_rows_is_refused_naming_image() -> None:
    short = short_png(rows=10)
    decoded = Image.open(io.BytesIO(short))
    decoded.load()  # PIL itself takes it: the rows it lacks come back black
    assert np.asarray(decoded)[SIZE - 1].max() == 0
    message = refusal(short)
    assert message.startswith("image: a damaged PNG image")
    assert f"{SIZE}×{SIZE}" in message
    whole = short_png(rows=SIZE)  # the same file with all its rows passes
    edit = check_edit(whole, b"", None, LIMITS)
    assert edit is not None and edit.height == SIZE


def test_a_png_cut_off_or_damaged_inside_its_pixel_data_is_refused() -> None:
    png = encode(template_rgb(), "PNG")
    idat = png.index(b"IDAT") + 4
    assert refusal(png[: idat + 100], strength=0.5).startswith("image: a damaged PNG image")
    garbled = png[: idat + 2] + bytes(b ^ 0x5A for b in png[idat + 2 : idat + 40])
    assert "image: a damaged PNG image" in refusal(garbled + png[idat + 40 :], strength=0.5)


def test_an_interlaced_png_and_every_png_colour_type_pass_the_pixel_data_check() -> None:
    rng = np.random.default_rng(3)
    rgba = rng.integers(0, 256, (SIZE, SIZE, 4), dtype=np.uint8)
    for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16"):
        out = io.BytesIO()
        opaque = mode not in ("LA", "RGBA")  # a palette keeps no alpha without a warning
        Image.fromarray(rgba[..., :3] if opaque else rgba).convert(mode).save(out, "PNG")
        edit = check_edit(out.getvalue(), b"", 0.5, LIMITS)
        assert edit is not None and (edit.width, edit.height) == (SIZE, SIZE), mode
    edit = check_edit(_interlaced_rgb_png(40, 24), b"", 0.5, LIMITS)
    assert edit is not None and (edit.width, edit.height) == (40, 24)


def _interlaced_rgb_png(width: int, height: int) -> bytes:
    """A grey Adam7-interlaced PNG (PIL writes none): each pass's rows, filter byte 0."""
    passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4)]
    passes += [(1, 0, 2, 2), (0, 1, 1, 2)]
    raw = b""
    for x0, y0, dx, dy in passes:
        cols, rows = len(range(x0, width, dx)), len(range(y0, height, dy))
        if cols:
            raw += (b"\x00" + b"\x80" * 3 * cols) * rows

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 1)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    return PNG_SIGNATURE + body


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # 12000: PIL warns
@pytest.mark.parametrize("side", [30000, 12000, 4096])
def test_a_header_declaring_a_huge_image_is_refused_naming_the_pixel_limit(side: int) -> None:
    message = refusal(declaring_png(side, side), strength=0.5)
    assert message == (
        f"image: {side}×{side} exceeds this deployment's {LIMITS.max_side} pixels a side "
        f"or {LIMITS.max_pixels} pixels"
    )


def test_no_serving_module_lets_pil_load_truncated_images() -> None:
    """The router's and the worker's stacks (diffusers and transformers too) leave PIL's
    process-wide LOAD_TRUNCATED_IMAGES off: with it on, load() fills a cut file in."""
    import argus.router.app
    import argus.router.http_app
    import argus.worker.app
    import argus.worker.models.pipelines  # noqa: F401  (diffusers, transformers)

    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


# -- bounds both APIs share ----------------------------------------------------------------


def refused(request: RouterRequest) -> str:
    with pytest.raises(RouterError) as err:
        check_request(request)
    assert err.value.kind is Refusal.INVALID
    return err.value.details


def test_previews_stop_at_the_http_bound() -> None:
    check_request(RouterRequest(prompt="a fox", previews=MAX_PREVIEWS))
    message = refused(RouterRequest(prompt="a fox", previews=MAX_PREVIEWS + 1))
    assert message == f"previews: {MAX_PREVIEWS + 1} outside 0..{MAX_PREVIEWS}"


def test_max_level_index_names_its_real_bound() -> None:
    check_request(RouterRequest(prompt="a fox", max_level_index=MAX_LEVEL_INDEX))
    message = refused(RouterRequest(prompt="a fox", max_level_index=2**31))
    assert message == "max_level_index: 2147483648 outside 0..2147483647"


def test_an_adapter_of_an_unknown_kind_is_told_so_with_the_known_kinds() -> None:
    message = refused(RouterRequest(prompt="a fox", adapters=(Adapter(None, "sketch", 1.0),)))
    assert message == "adapters[0]: unknown or unset kind; known kinds: LORA, CONTROLNET"


def test_an_adapter_without_a_name_is_told_it_needs_one() -> None:
    adapter = Adapter(AdapterKind.LORA, "", 1.0)
    message = refused(RouterRequest(prompt="a fox", adapters=(adapter,)))
    assert message == "adapters[0]: needs a name"


# -- an oversized gRPC request ---------------------------------------------------------------


def test_a_request_over_the_byte_bound_names_its_largest_field_and_the_bound() -> None:
    check_size(router_pb2.RouterGenerateRequest(prompt="x" * (MAX_REQUEST_BYTES - 100)))
    with pytest.raises(RouterError) as err:
        check_size(router_pb2.RouterGenerateRequest(prompt="x" * 20_000_000, image=b"\x01" * 9))
    assert err.value.kind is Refusal.INVALID and err.value.retry_after_s is None
    assert err.value.details.startswith("prompt: 20000000 bytes of a ")
    assert err.value.details.endswith(f"a request has at most {MAX_REQUEST_BYTES} bytes")
    adapter = common_pb2.Adapter(kind=2, name="canny", control_image=b"\x01" * (1 << 20))
    with pytest.raises(RouterError) as err:
        check_size(router_pb2.RouterGenerateRequest(prompt="a fox", adapters=[adapter] * 9))
    assert err.value.details.startswith("adapters: ")


# -- an edit's form ----------------------------------------------------------------------------


def form_of(files: dict[str, Any], data: dict[str, str]) -> dict[str, str | bytes]:
    request = httpx.Request("POST", "http://router/v1/images/edits", files=files, data=data)
    headers = Headers(raw=[(k.encode(), v.encode()) for k, v in request.headers.items()])
    return asyncio.run(parse_form(request.read(), headers))


@pytest.mark.parametrize("with_mask", [False, True])
def test_a_prompt_sent_as_a_file_is_named_and_told_to_be_a_text_field(with_mask: bool) -> None:
    files = {"image": ("i.png", with_alpha(template_rgb(), region_of(0.25)))}
    if with_mask:  # three files: the parser's own file bound once answered "body" here
        files["mask"] = ("m.png", encode(np.zeros((SIZE, SIZE, 4), np.uint8)))
    files["prompt"] = ("prompt.txt", b"a lighthouse")
    form = form_of(files, {"steps": "2"})
    with pytest.raises(ApiError) as err:
        parse_edit_request(form, "argus", core=None)  # type: ignore[arg-type]
    assert (err.value.status, err.value.param) == (400, "prompt")
    assert err.value.message == "prompt: must be a text field, not a file"
