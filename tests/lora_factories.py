"""LoRA files for the tests: one that does not fit a model's UNet, for the error paths (the
ones that fit are the product's own, :mod:`argus.worker.adapters.lora.synthetic`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from argus.worker.adapters.lora.synthetic import tiny_lora_tensors


def write_unfit_lora(
    target: Any, path: str | Path, *, problem: str = "shape", rank: int = 4, seed: int = 0
) -> tuple[Path, str]:
    """Write a LoRA that does not fit ``target``'s UNet; returns the path and the bad key.

    ``problem`` "shape": the first module's ``lora_A`` takes one input too many; "key": an
    extra module path that the UNet does not have.
    """
    from safetensors.torch import save_file

    tensors = tiny_lora_tensors(target, rank=rank, seed=seed)
    first = min(k for k in tensors if k.endswith(".lora_A.weight"))
    if problem == "shape":
        down = tensors[first]
        tensors[first] = torch.zeros((down.shape[0], down.shape[1] + 1, *down.shape[2:]))
        bad = first
    elif problem == "key":
        bad = "unet.down_blocks.0.no_such_module.to_q.lora_A.weight"
        tensors[bad] = tensors[first].clone()
        tensors[bad.replace("lora_A", "lora_B")] = tensors[
            first.replace("lora_A", "lora_B")
        ].clone()
    else:
        raise ValueError(f"problem {problem!r}: expected 'shape' or 'key'")
    out = Path(path)
    save_file(tensors, str(out), metadata={"format": "pt"})
    return out, bad
