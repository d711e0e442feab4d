"""ControlNet catalogs, tiny ControlNets, control images and the tensor codec."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from argus.worker.adapters.controlnet.errors import (
    ControlImageError,
    ControlNetLoadError,
    FamilyMismatchError,
    InvalidControlNetRequest,
    TensorCodecError,
    UnknownControlNetError,
)
from argus.worker.adapters.controlnet.models import (
    TINY_NAMES,
    ControlNetCatalog,
    base_family,
    build_controlnet,
    build_tiny_controlnet,
    estimate_bytes,
    load_entry,
    model_bytes,
    prepare_control_image,
    tiny_unet_config,
)
from argus.worker.adapters.controlnet.transport import tensor_from_pb, tensor_to_pb
from tests.package_helpers import export_tiny_catalog

pytestmark = pytest.mark.unit


def png(seed: int = 0, size: tuple[int, int] = (64, 64), mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}
    shape = (size[1], size[0], channels[mode]) if mode in channels else (size[1], size[0])
    image = Image.fromarray((rng.random(shape) * 255).astype(np.uint8), mode=mode)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# -- catalog -------------------------------------------------------------------------------


def test_tiny_catalog_is_keyed_by_family() -> None:
    catalog = ControlNetCatalog.tiny()
    assert catalog.families() == ("sd15", "sdxl")
    assert len(catalog.names("sd15")) == 12
    assert len(catalog.names("sdxl")) == 10
    entry = catalog.resolve("canny", "sdxl")
    assert (entry.key, entry.tiny) == ("sdxl/canny", True)


def test_lookup_errors_name_the_field_and_the_choices() -> None:
    catalog = ControlNetCatalog.tiny()
    with pytest.raises(UnknownControlNetError, match=r"^controlnets\[1\]\.name: .*'nope'.*canny"):
        catalog.resolve("nope", "sd15", field="controlnets[1].name")
    with pytest.raises(FamilyMismatchError, match="'shuffle' is for sd15 base models, not sdxl"):
        catalog.resolve("shuffle", "sdxl")
    with pytest.raises(InvalidControlNetRequest, match=r"^base_family: 'sd3'"):
        catalog.resolve("canny", "sd3")
    only_xl = catalog.restrict("sdxl")
    assert only_xl.families() == ("sdxl",)
    with pytest.raises(InvalidControlNetRequest, match=r"^base_family: this catalog serves sdxl"):
        only_xl.resolve("canny", "sd15")
    with pytest.raises(ValueError, match="sd2"):
        catalog.restrict("sd2")


def test_tiny_controlnets_are_seeded_and_distinct_with_live_zero_convs() -> None:
    a = build_tiny_controlnet("sd15", "canny")
    b = build_controlnet("canny", base="sd15", catalog="tiny")
    c = build_tiny_controlnet("sd15", "depth")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.controlnet_mid_block.weight, c.controlnet_mid_block.weight)
    # the zero convolutions are not zero: a fresh ControlNet would return zero residuals
    for conv in (*a.controlnet_down_blocks, a.controlnet_mid_block):
        assert conv.weight.abs().max() > 0
    assert a.config.block_out_channels == tiny_unet_config("sd15")["block_out_channels"]
    assert base_family(tiny_unet_config("sdxl")) == "sdxl"
    assert base_family(tiny_unet_config("sd15")) == "sd15"


def test_a_tiny_controlnet_returns_residuals_shaped_like_the_unet_skips() -> None:
    model = build_controlnet("depth", base="sdxl", dtype=torch.float32)
    sample = torch.randn(2, 4, 8, 8)
    added = {"text_embeds": torch.randn(2, 32), "time_ids": torch.randn(2, 6)}
    with torch.inference_mode():
        down, mid = model(
            sample,
            torch.tensor(500.0),
            encoder_hidden_states=torch.randn(2, 77, 64),
            controlnet_cond=torch.rand(2, 3, 64, 64),
            added_cond_kwargs=added,
            return_dict=False,
        )
    # tiny SDXL UNet: conv_in + 2 resnets + downsampler, then 2 resnets (32 and 64 channels)
    assert [tuple(t.shape[1:]) for t in down] == [
        (32, 8, 8),
        (32, 8, 8),
        (32, 8, 8),
        (32, 4, 4),
        (64, 4, 4),
        (64, 4, 4),
    ]
    assert tuple(mid.shape) == (2, 64, 4, 4)
    assert all(t.abs().mean() > 1e-3 for t in (*down, mid))


def test_directory_catalog_loads_what_was_exported(tmp_path: Path) -> None:
    catalog = export_tiny_catalog(tmp_path, {"sd15": ["canny", "tile"], "sdxl": ["blur"]})
    assert catalog.names("sd15") == ("canny", "tile")
    entry = catalog.resolve("blur", "sdxl")
    loaded = load_entry(entry, device="cpu", dtype=torch.float32)
    built = build_tiny_controlnet("sdxl", "blur")
    for p, q in zip(loaded.parameters(), built.parameters(), strict=True):
        assert torch.equal(p, q)
    assert estimate_bytes(entry, torch.float32) == model_bytes(loaded)
    assert estimate_bytes(ControlNetCatalog.tiny().resolve("blur", "sdxl"), torch.float16) * 2 == (
        model_bytes(built)
    )
    half = build_controlnet("canny", base="sd15", catalog=str(tmp_path), dtype=torch.float16)
    assert half.dtype == torch.float16


def test_directory_catalog_refuses_pickles_and_empty_roots(tmp_path: Path) -> None:
    catalog = export_tiny_catalog(tmp_path, {"sd15": ["canny"]})
    (tmp_path / "sd15" / "canny" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ControlNetLoadError, match="pickled weights"):
        load_entry(catalog.resolve("canny", "sd15"), device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="no ControlNets"):
        ControlNetCatalog.directory(tmp_path / "sd15")
    with pytest.raises(ValueError, match="not a directory"):
        ControlNetCatalog.directory(tmp_path / "missing")


def test_every_tiny_name_builds() -> None:
    sizes = {
        family: model_bytes(build_tiny_controlnet(family, names[0]))
        for family, names in TINY_NAMES.items()
    }
    assert sizes["sdxl"] > sizes["sd15"] > 0


# -- control images ------------------------------------------------------------------------


def test_control_image_matches_diffusers_preprocessing() -> None:
    from diffusers.image_processor import VaeImageProcessor

    data = png(3, size=(80, 48), mode="RGBA")
    tensor = prepare_control_image(data, 32, 64, "cpu", torch.float32)
    assert tuple(tensor.shape) == (1, 3, 32, 64)
    assert tensor.min() >= 0.0 and tensor.max() <= 1.0
    processor = VaeImageProcessor(vae_scale_factor=8, do_convert_rgb=True, do_normalize=False)
    reference = processor.preprocess(Image.open(io.BytesIO(data)), height=32, width=64)
    torch.testing.assert_close(tensor, reference, rtol=0, atol=0)
    gray = prepare_control_image(png(4, mode="L"), 64, 64, "cpu", torch.float16)
    assert gray.dtype == torch.float16 and tuple(gray.shape) == (1, 3, 64, 64)


def jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="JPEG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "missing"),
        (b"not an image", "not a PNG"),
        (jpeg(), "not a PNG"),
        (png()[:60], "cannot decode PNG"),
    ],
)
def test_bad_control_images_are_refused_naming_the_field(data: bytes, message: str) -> None:
    with pytest.raises(ControlImageError, match=f"^controlnets\\[0\\].control_image: .*{message}"):
        prepare_control_image(
            data, 64, 64, "cpu", torch.float32, field="controlnets[0].control_image"
        )


@pytest.mark.parametrize(("height", "width", "field"), [(0, 64, "height"), (64, 12, "width")])
def test_bad_sizes_are_refused(height: int, width: int, field: str) -> None:
    with pytest.raises(InvalidControlNetRequest, match=f"^{field}:"):
        prepare_control_image(png(), height, width, "cpu", torch.float32)


# -- the tensor codec ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(2, 4, 8, 8),
        torch.randn(3, 5).to(torch.float16),
        torch.randn(7).to(torch.bfloat16),
        torch.tensor(981.5),
        torch.tensor(999, dtype=torch.int64),
        torch.randn(4, 4).t(),  # not contiguous
        torch.empty(0, 3),
    ],
)
def test_tensor_codec_round_trips_bit_exactly(tensor: torch.Tensor) -> None:
    message = tensor_to_pb(tensor)
    back = tensor_from_pb(message, "x")
    assert back.dtype == tensor.dtype
    assert back.shape == tensor.shape
    assert torch.equal(back, tensor)
    assert len(message.data) == tensor.numel() * tensor.element_size()


def raw(**fields: Any) -> Any:
    message = tensor_to_pb(torch.zeros(2, 3))
    for key, value in fields.items():
        if key == "shape":
            del message.shape[:]
            message.shape.extend(value)
        else:
            setattr(message, key, value)
    return message


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "complex64"}, "dtype 'complex64'"),
        ({"dtype": ""}, "dtype ''"),
        ({"data": b"\x00" * 5}, "5 bytes"),
        ({"shape": [2, -3]}, "not a tensor shape"),
        ({"shape": [1] * 9}, "not a tensor shape"),
        ({"shape": [4, 3]}, "24 bytes"),
    ],
)
def test_malformed_tensors_are_refused_naming_the_field(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(TensorCodecError, match=f"^step.sample: .*{message}"):
        tensor_from_pb(raw(**fields), "step.sample")
