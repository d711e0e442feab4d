"""Where ControlNets come from, and how a control image becomes the tensor they condition on.

A ControlNet fits one *base family*: its encoder copies the base UNet's down and mid blocks,
so its residuals have the shapes of that UNet's skip connections. ``sd15`` ControlNets fit
SD-1.x UNets, ``sdxl`` ones SDXL UNets. The catalog is keyed by family; a request names the
family of its base model, and a ControlNet of another family is refused before it runs
(:class:`~argus.worker.adapters.controlnet.errors.FamilyMismatchError`).

Two catalogs:

* ``tiny``: a dozen ControlNets per family, built with diffusers' ``ControlNetModel.from_unet``
  from the tiny base UNet of the family (``tiny:sd-1.5`` for ``sd15``, ``tiny:sdxl`` for
  ``sdxl``) and given seeded random weights, derived from the family and the name, *including
  the zero convolutions*: with the zeros a fresh ControlNet's residuals vanish and no test
  could tell a ControlNet run from a plain one. Names follow the public ControlNet sets
  (canny, depth, openpose, …); SDXL has fewer of them, as in practice, so asking for an
  SD-1.5-only ControlNet on SDXL is a real case. A dozen is enough for popularity skew and
  cache eviction to mean something (Katz §3.1: 47–94 ControlNets per service, 5–8 of them
  take 95–98 % of the calls).
* a directory ``ROOT/<family>/<name>/`` of diffusers-format ControlNets (``config.json`` and
  safetensors weights; pickled weights are refused). The directory is scanned once at start;
  request names are only ever looked up in that scan, never joined into paths.

:func:`build_controlnet` and :func:`prepare_control_image` are the two entry points other
modules use (the latent-parallel executor too); their names and signatures are stable.
"""

from __future__ import annotations

import functools
import io
import math
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from argus.plumbing.quoting import quoted
from argus.worker.adapters.controlnet.errors import (
    ControlImageError,
    ControlNetLoadError,
    FamilyMismatchError,
    InvalidControlNetRequest,
    UnknownControlNetError,
)

FAMILIES = ("sd15", "sdxl")
# the tiny base variant (argus.worker.models.sources.TINY_VARIANTS) whose UNet a family's tiny
# ControlNets are built from; tiny:sd-1.4 has the same shapes as tiny:sd-1.5
TINY_BASE_VARIANT = {"sd15": "sd-1.5", "sdxl": "sdxl"}
TINY_NAMES: dict[str, tuple[str, ...]] = {
    "sd15": (
        "canny",
        "depth",
        "openpose",
        "scribble",
        "softedge",
        "lineart",
        "normal",
        "mlsd",
        "seg",
        "tile",
        "shuffle",
        "inpaint",
    ),
    "sdxl": (
        "canny",
        "depth",
        "openpose",
        "scribble",
        "softedge",
        "lineart",
        "normal",
        "tile",
        "recolor",
        "blur",
    ),
}
TINY_SOURCE_PREFIX = "tiny:"
# the hint encoder's widths; four stages (three stride-2 convolutions) bring a control image
# down by 8, the VAE's factor, as in real ControlNets (whose widths are 16, 32, 96, 256)
TINY_CONDITIONING_CHANNELS = (8, 16, 16, 32)
# the zero convolutions' weights are drawn at this fraction of a unit-gain initialisation:
# large enough that residuals visibly steer the tiny UNet, small enough not to swamp it
TINY_ZERO_CONV_GAIN = 0.5

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_SIDE = 4096  # pixels, for the request size and for a control image
MAX_CONTROL_PIXELS = MAX_SIDE * MAX_SIDE
VAE_SCALE_FACTOR = 8  # Stable Diffusion VAEs (SD-1.x, SD-2.x, SDXL) all downsample by 8
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


@dataclass(frozen=True)
class CatalogEntry:
    """One ControlNet of a catalog: its family, name, and where its weights come from."""

    family: str
    name: str
    source: str  # "tiny:<family>/<name>" or a diffusers ControlNet directory

    @property
    def key(self) -> str:
        """``family/name``: the cache key and the label metrics use."""
        return f"{self.family}/{self.name}"

    @property
    def tiny(self) -> bool:
        return self.source.startswith(TINY_SOURCE_PREFIX)


class ControlNetCatalog:
    """The ControlNets a service (or a worker's local executor) can load, by family and name."""

    def __init__(self, entries: Iterable[CatalogEntry], description: str) -> None:
        self.description = description
        self._entries: dict[tuple[str, str], CatalogEntry] = {}
        for entry in entries:
            if entry.family not in FAMILIES:
                raise ValueError(f"{entry.source}: family {entry.family!r} not one of {FAMILIES}")
            self._entries[(entry.family, entry.name)] = entry

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def tiny(cls) -> ControlNetCatalog:
        return cls(
            (
                CatalogEntry(family, name, f"{TINY_SOURCE_PREFIX}{family}/{name}")
                for family, names in TINY_NAMES.items()
                for name in names
            ),
            "tiny",
        )

    @classmethod
    def directory(cls, root: str | Path) -> ControlNetCatalog:
        """Every ``ROOT/<family>/<name>/`` holding a ``config.json``; other entries are ignored."""
        base = Path(root)
        if not base.is_dir():
            raise ValueError(f"catalog {base}: not a directory")
        entries = []
        for family in FAMILIES:
            folder = base / family
            if not folder.is_dir():
                continue
            for path in sorted(folder.iterdir()):
                if path.is_dir() and (path / "config.json").is_file() and _NAME.match(path.name):
                    entries.append(CatalogEntry(family, path.name, str(path)))
        if not entries:
            raise ValueError(
                f"catalog {base}: no ControlNets (expected {base}/<family>/<name>/config.json"
                f" with family one of {', '.join(FAMILIES)})"
            )
        return cls(entries, str(base))

    @classmethod
    def from_source(cls, source: str) -> ControlNetCatalog:
        """``"tiny"`` or a catalog directory."""
        return cls.tiny() if source == "tiny" else cls.directory(source)

    def restrict(self, family: str) -> ControlNetCatalog:
        """The same catalog with only ``family``'s ControlNets (a service for one base family)."""
        if family not in FAMILIES:
            raise ValueError(f"base family {family!r}: expected one of {', '.join(FAMILIES)}")
        kept = [e for e in self._entries.values() if e.family == family]
        if not kept:
            raise ValueError(f"catalog {self.description}: no {family} ControlNets")
        return ControlNetCatalog(kept, f"{self.description} ({family})")

    # -- lookup ----------------------------------------------------------------------------

    def families(self) -> tuple[str, ...]:
        return tuple(f for f in FAMILIES if any(k[0] == f for k in self._entries))

    def names(self, family: str) -> tuple[str, ...]:
        return tuple(sorted(name for fam, name in self._entries if fam == family))

    def entries(self) -> tuple[CatalogEntry, ...]:
        return tuple(self._entries.values())

    def resolve(self, name: str, family: str, *, field: str = "name") -> CatalogEntry:
        """The entry for ``name`` in ``family``; raises with a message naming ``field``."""
        if family not in FAMILIES:
            raise InvalidControlNetRequest(
                "base_family", f"{quoted(family)} is not a base family (expected sd15 or sdxl)"
            )
        if family not in self.families():
            served = ", ".join(self.families())
            raise InvalidControlNetRequest(
                "base_family", f"this catalog serves {served} ControlNets, not {family}"
            )
        entry = self._entries.get((family, name))
        if entry is not None:
            return entry
        others = [fam for fam in FAMILIES if (fam, name) in self._entries]
        if others:
            raise FamilyMismatchError(
                field, f"ControlNet {quoted(name)} is for {others[0]} base models, not {family}"
            )
        known = ", ".join(self.names(family))
        raise UnknownControlNetError(
            field, f"unknown {family} ControlNet {quoted(name)} (known: {known})"
        )


# -- building and loading ------------------------------------------------------------------


def build_controlnet(
    name: str,
    *,
    base: str,
    catalog: ControlNetCatalog | str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Any:
    """The ``ControlNetModel`` ``name`` of base family ``base``, in eval mode on ``device``.

    ``catalog`` is a :class:`ControlNetCatalog`, ``"tiny"`` or a catalog directory. Raises
    :class:`UnknownControlNetError`, :class:`FamilyMismatchError` or
    :class:`ControlNetLoadError`.
    """
    if isinstance(catalog, str):
        catalog = ControlNetCatalog.from_source(catalog)
    return load_entry(catalog.resolve(name, base), device=device, dtype=dtype)


def load_entry(entry: CatalogEntry, *, device: str | torch.device, dtype: torch.dtype) -> Any:
    """Build (tiny) or load (directory) one catalog entry onto ``device`` in ``dtype``."""
    if entry.tiny:
        model = build_tiny_controlnet(entry.family, entry.name)
    else:
        model = load_controlnet_dir(entry.source, dtype=dtype)
    if model.dtype != dtype:  # tiny builds are fp32; directory loads already have ``dtype``
        model = model.to(dtype=dtype)
    return model.to(device=device).eval()


@functools.cache
def tiny_unet_config(family: str) -> Mapping[str, Any]:
    """The config of the tiny base UNet a family's tiny ControlNets are built from."""
    from argus.worker.models.sources import TINY_PREFIX, build_tiny_pipeline

    unet = build_tiny_pipeline(TINY_PREFIX + TINY_BASE_VARIANT[family]).unet
    return {k: v for k, v in unet.config.items() if not k.startswith("_")}


def _tiny_skeleton(family: str, *, meta: bool = False) -> Any:
    """A tiny ControlNet of ``family`` with diffusers' initialisation (zero convs at zero)."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    config = dict(tiny_unet_config(family))  # outside the meta device: it builds a pipeline
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    with torch.device("meta" if meta else "cpu"):
        return ControlNetModel.from_unet(
            unet,
            load_weights_from_unet=False,  # the meta UNet has no weights; ours are drawn below
            conditioning_embedding_out_channels=TINY_CONDITIONING_CHANNELS,
        )


def build_tiny_controlnet(family: str, name: str) -> Any:
    """A tiny ControlNet whose weights depend only on ``family/name``.

    The weights are drawn from a generator seeded with a CRC of the key, not from torch's
    global generator, so concurrent loads in several threads (the cache loads in parallel)
    cannot interleave their draws and every process builds the same network.
    """
    if name not in TINY_NAMES.get(family, ()):
        raise UnknownControlNetError("name", f"no tiny {family} ControlNet {quoted(name)}")
    model = _tiny_skeleton(family)
    generator = torch.Generator().manual_seed(zlib.crc32(f"{family}/{name}".encode()))
    zero_convs = (
        "controlnet_down_blocks",
        "controlnet_mid_block",
        "controlnet_cond_embedding.conv_out",
    )
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            _draw(param, param_name, generator, zero=param_name.startswith(zero_convs))
    return model.eval()


def _draw(param: torch.Tensor, name: str, generator: torch.Generator, *, zero: bool) -> None:
    """Seeded values for one parameter: unit-gain weights, small biases, norms near 1."""
    if param.dim() >= 2:  # linear and convolution weights
        fan_in = param[0].numel()
        gain = TINY_ZERO_CONV_GAIN if zero else 1.0
        param.normal_(0.0, gain / math.sqrt(fan_in), generator=generator)
    elif name.endswith("bias"):
        param.normal_(0.0, 0.02, generator=generator)
    else:  # normalisation scales
        param.normal_(1.0, 0.05, generator=generator)


def check_controlnet_dir(root: Path) -> None:
    """Refuse a directory that is not a diffusers ControlNet or that carries pickled weights."""
    if not root.is_dir():
        raise ControlNetLoadError("", f"{root}: not a directory")
    if not (root / "config.json").is_file():
        raise ControlNetLoadError("", f"{root}: no config.json (not a diffusers ControlNet)")
    pickled = sorted(p.name for pattern in _PICKLES for p in root.glob(pattern))
    if pickled:
        raise ControlNetLoadError(
            "", f"{root}: pickled weights are not loaded ({', '.join(pickled)})"
        )
    if not any(root.glob("*.safetensors")):
        raise ControlNetLoadError("", f"{root}: no .safetensors weights")


def load_controlnet_dir(path: str | Path, *, dtype: torch.dtype) -> Any:
    """A ``ControlNetModel`` from a local diffusers directory; safetensors only, no hub."""
    root = Path(path)
    check_controlnet_dir(root)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import ControlNetModel

    try:
        return ControlNetModel.from_pretrained(
            str(root), torch_dtype=dtype, use_safetensors=True, local_files_only=True
        )
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise ControlNetLoadError("", f"{root}: cannot load ControlNet: {err}") from err


def estimate_bytes(entry: CatalogEntry, dtype: torch.dtype) -> int:
    """Bytes of weights loading ``entry`` in ``dtype`` will place on the device."""
    from argus.worker.models.sources import safetensors_numel

    itemsize = torch.empty((), dtype=dtype).element_size()
    if entry.tiny:
        model: torch.nn.Module = _tiny_skeleton(entry.family, meta=True)
        return sum(p.numel() for p in model.parameters()) * itemsize
    root = Path(entry.source)
    return sum(safetensors_numel(p) for p in root.glob("*.safetensors")) * itemsize


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes a loaded model holds in parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def base_family(unet_config: Mapping[str, Any]) -> str:
    """The family of a base UNet: SDXL conditions on text and time ids, SD-1.x does not.

    SD-2.x UNets read as ``sd15`` here; their ControlNets would not fit and are not served,
    and the shape checks on the first step say so.
    """
    return "sdxl" if unet_config.get("addition_embed_type") == "text_time" else "sd15"


# -- control images ------------------------------------------------------------------------


def check_size(height: int, width: int) -> None:
    """A request size the ControlNets can run at: positive multiples of 8 up to MAX_SIDE."""
    for field, value in (("height", height), ("width", width)):
        if not 0 < value <= MAX_SIDE or value % VAE_SCALE_FACTOR:
            raise InvalidControlNetRequest(
                field, f"{value} is not a multiple of {VAE_SCALE_FACTOR} in 8..{MAX_SIDE}"
            )


@functools.cache
def _control_image_processor() -> Any:
    # the processor diffusers' ControlNet pipelines build: RGB, resize, [0, 1], no normalising
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(
        vae_scale_factor=VAE_SCALE_FACTOR, do_convert_rgb=True, do_normalize=False
    )


def decode_png(png: bytes, *, field: str = "control_image") -> Image.Image:
    """A PNG's pixels, decoded in full and in the file's own mode; anything else raises.

    The mode is kept (not converted to RGB here) because diffusers resizes before it
    converts, and an RGBA or palette image resizes differently from its RGB conversion.
    """
    if not png:
        raise ControlImageError(field, "missing (a PNG image is required)")
    if not png.startswith(PNG_SIGNATURE):
        raise ControlImageError(field, "not a PNG image (bad signature)")
    try:
        image = Image.open(io.BytesIO(png), formats=["PNG"])
        width, height = image.size
        if width * height > MAX_CONTROL_PIXELS:
            raise ControlImageError(
                field, f"{width}x{height} pixels exceed the limit of {MAX_SIDE}x{MAX_SIDE}"
            )
        image.load()
        return image
    except ControlImageError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ControlImageError(field, f"cannot decode PNG: {err}") from err


def prepare_control_image(
    png_bytes: bytes,
    height: int,
    width: int,
    device: str | torch.device,
    dtype: torch.dtype,
    *,
    field: str = "control_image",
) -> torch.Tensor:
    """Decode a PNG, resize it to ``height`` × ``width``, convert to RGB, scale to [0, 1].

    Returns a contiguous ``(1, 3, height, width)`` tensor on ``device`` in ``dtype`` with the
    values diffusers' ControlNet pipelines feed their ControlNets for the same image (same
    processor, same order: resize, then RGB). A bad PNG or size raises
    :class:`ControlImageError` / :class:`InvalidControlNetRequest` naming ``field``.
    """
    check_size(height, width)
    image = decode_png(png_bytes, field=field)
    try:
        tensor: torch.Tensor = _control_image_processor().preprocess(
            image, height=height, width=width
        )
    except (OSError, ValueError) as err:  # a mode PIL cannot resize or convert
        raise ControlImageError(field, f"cannot convert {image.mode} PNG: {err}") from err
    # contiguous NCHW: the processor's tensor is an NHWC view of a numpy array, and diffusers
    # passes it on as is, so its ControlNets (and, through the residuals, the UNet's up
    # blocks) run channels-last, which on a CPU makes each small convolution ~10x slower.
    # The values are the same either way (tested against diffusers).
    return tensor.to(dtype=torch.float32).to(device=device, dtype=dtype).contiguous()
