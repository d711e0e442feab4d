"""Loaded LoRAs and the in-place patch of a UNet's weights.

Katz (§6, "efficient LoRA patching") merges LoRA weights into the base weights *in place*
instead of PEFT's create-and-replace of modules, which costs seconds and extra GPU memory for
a serving system that never trains. Here a patch is, per patched module,

    W ← W + scale · (alpha / r) · B @ A        (alpha / √r for rsLoRA files)

as one fused GEMM (``addmm_``) on ``W``'s device in ``W``'s dtype: no delta tensor is
allocated, and in fp16 the product is accumulated in fp32 by the GEMM and rounded once, into
the weight. Conv2d modules are patched
the same way with ``A`` flattened over its kernel: ``A`` is the ``[r, in, kh, kw]`` kernel
and ``B`` the ``[out, r, 1, 1]`` projection of PEFT's conv LoRA, whose product is exactly the
``[out, in, kh, kw]`` delta kernel.

Undoing a merge by subtracting the delta again would leave rounding residue in the weights
(and more of it in fp16), so instead :class:`WeightBackup` copies each weight once, before
its first patch in a request, and copies it back afterwards: the base model is restored bit
for bit. The copies live on the weight's device, for the duration of one request.

Everything is checked (:func:`check_fits`) before the first weight of a LoRA is touched: a
LoRA is merged completely or not at all.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from argus.worker.adapters.lora.errors import LoraMismatchError
from argus.worker.adapters.lora.fileformat import UNET_PREFIX, SharedRead, tensor_view


@dataclass(frozen=True)
class LoraModule:
    """The LoRA of one UNet module: ``W += scale · factor · up @ down``."""

    module: str  # path inside the UNet, e.g. "mid_block.attentions.0.proj_in"
    down: torch.Tensor  # lora_A: [r, in] (Linear) or [r, in, kh, kw] (Conv2d)
    up: torch.Tensor  # lora_B: [out, r] (Linear) or [out, r, 1, 1] (Conv2d)
    alpha: float
    factor: float  # alpha / r (or alpha / √r): the file's own scaling of B @ A

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def down_key(self) -> str:
        return f"{UNET_PREFIX}{self.module}.lora_A.weight"

    @property
    def up_key(self) -> str:
        return f"{UNET_PREFIX}{self.module}.lora_B.weight"


@dataclass(frozen=True)
class LoadedLora:
    """A LoRA ready to patch: its modules' tensors (views into one buffer) and their factors."""

    name: str
    path: str
    modules: tuple[LoraModule, ...]  # sorted by module path
    nbytes: int  # bytes of tensor data held (the cache's unit of account)
    read_s: float  # seconds the loader spent parsing, checking and reading the file
    shared: bool  # the tensors live in shared memory written by a loader process
    alpha_source: str  # "keys", "metadata" or "rank"


def loaded_from(name: str, path: str, read: SharedRead) -> LoadedLora:
    """Wrap a loader's read as a :class:`LoadedLora`; tensors are views, nothing is copied."""
    modules = []
    for entry in read.layout.modules:
        alpha = entry.alpha
        if entry.alpha_tensor is not None:
            alpha = float(tensor_view(read.data, entry.alpha_tensor).reshape(()).item())
        root = math.sqrt(entry.rank) if entry.rslora else float(entry.rank)
        modules.append(
            LoraModule(
                module=entry.module,
                down=tensor_view(read.data, entry.down),
                up=tensor_view(read.data, entry.up),
                alpha=alpha,
                factor=alpha / root,
            )
        )
    return LoadedLora(
        name=name,
        path=path,
        modules=tuple(modules),
        nbytes=int(read.data.numel()),
        read_s=read.read_s,
        shared=bool(read.data.is_shared()),
        alpha_source=read.layout.alpha_source,
    )


# -- the UNet side -----------------------------------------------------------------------------

_TARGETS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]] = (
    weakref.WeakKeyDictionary()
)


def patch_targets(unet: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module path → module, for every module a LoRA may patch: Linear and ungrouped Conv2d.

    Computed once per UNet (the module tree of a loaded model does not change).
    """
    targets = _TARGETS.get(unet)
    if targets is None:
        targets = {
            name: module
            for name, module in unet.named_modules()
            if isinstance(module, torch.nn.Linear)
            or (isinstance(module, torch.nn.Conv2d) and module.groups == 1)
        }
        _TARGETS[unet] = targets
    return targets


def weight_of(module: torch.nn.Module) -> torch.Tensor:
    """The ``weight`` parameter of a patchable module."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor")
    return weight


def _shape_problems(entry: LoraModule, module: torch.nn.Module) -> list[tuple[str, str]]:
    """(key, message) for each way ``entry`` does not fit ``module``."""
    down, up = list(entry.down.shape), list(entry.up.shape)
    weight = weight_of(module)
    if isinstance(module, torch.nn.Linear):
        if len(down) != 2:
            return [(entry.down_key, f"lora_A {down} is not 2-D, but the module is a Linear")]
        problems = []
        if down[1] != module.in_features:
            problems.append(
                (entry.down_key, f"lora_A {down}: the module takes {module.in_features} inputs")
            )
        if up[0] != module.out_features:
            problems.append(
                (entry.up_key, f"lora_B {up}: the module has {module.out_features} outputs")
            )
        return problems
    kernel = list(weight.shape[1:])  # [in, kh, kw]
    if len(down) != 4:
        return [(entry.down_key, f"lora_A {down} is not 4-D, but the module is a Conv2d")]
    problems = []
    if down[1:] != kernel:
        problems.append(
            (entry.down_key, f"lora_A {down}: the module's kernel is [in, kh, kw] = {kernel}")
        )
    if up[0] != weight.shape[0]:
        problems.append((entry.up_key, f"lora_B {up}: the module has {weight.shape[0]} outputs"))
    return problems


def check_fits(lora: LoadedLora, unet: torch.nn.Module) -> None:
    """Raise :class:`LoraMismatchError` for the first key (sorted) that does not fit ``unet``.

    Every key must name a Linear or ungrouped Conv2d module of the UNet, with ``lora_A``'s
    input side and ``lora_B``'s output side matching the module's weight.
    """
    targets = patch_targets(unet)
    unknown = any(m.module not in targets for m in lora.modules)
    modules = dict(unet.named_modules()) if unknown else {}
    problems: list[tuple[str, str]] = []
    for entry in lora.modules:
        target = targets.get(entry.module)
        if target is None:
            found = modules.get(entry.module)
            reason = (
                "names no module of the UNet"
                if found is None
                else f"names a {type(found).__name__}; only Linear and Conv2d can be patched"
            )
            problems.append((entry.down_key, reason))
            continue
        problems.extend(_shape_problems(entry, target))
    if problems:
        key, message = min(problems)
        raise LoraMismatchError(lora.name, key, message)


class WeightBackup:
    """Copies of weights taken before their first patch; :meth:`restore` puts them back."""

    def __init__(self) -> None:
        self._saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._saved)

    def keep(self, name: str, weight: torch.Tensor) -> None:
        """Copy ``weight`` unless this backup already holds it (it is about to change)."""
        if name not in self._saved:
            with torch.inference_mode(False), torch.no_grad():
                self._saved[name] = (weight, weight.detach().clone())

    def restore(self) -> int:
        """Copy every saved weight back, bit for bit, and forget them; returns how many."""
        count = len(self._saved)
        with torch.no_grad():
            for weight, original in self._saved.values():
                weight.copy_(original)
        self._saved.clear()
        return count


def merge(unet: torch.nn.Module, lora: LoadedLora, scale: float, backup: WeightBackup) -> int:
    """Patch ``lora`` into ``unet`` in place (after :func:`check_fits`); returns modules patched.

    Each weight is saved in ``backup`` before it first changes.
    """
    check_fits(lora, unet)
    targets = patch_targets(unet)
    with torch.no_grad():
        for entry in lora.modules:
            weight = weight_of(targets[entry.module])
            backup.keep(entry.module, weight)
            # one fused GEMM into the weight seen as [out, in·kh·kw]: W += (scale·factor)·B @ A
            up = entry.up.to(weight.device, weight.dtype).flatten(1)
            down = entry.down.to(weight.device, weight.dtype).flatten(1)
            weight.view(weight.shape[0], -1).addmm_(up, down, alpha=scale * entry.factor)
    return len(lora.modules)
