"""``argus profile-lora``: find the BAL bound K of one LoRA on one model (Katz §6).

Runs every prompt twice, without the LoRA and with it merged from the first step, and compares
the latents after each step by cosine similarity. K is the index (from 0) of the first step
whose output falls below ``--threshold`` (0.99 in Katz), the smallest over all prompts: BAL may
run steps ``0 … K−1`` without the LoRA and must have merged it before step K. See
:mod:`argus.worker.adapters.lora.bound` for the exact definition.

Prints ``K = <k>`` and the lowest similarity per step; ``--json`` also writes the curves. With
``--model tiny`` (the tiny SDXL stand-in; ``tiny:<variant>`` picks another) the model has
random weights, so K says how the pipeline behaves, not what a real LoRA would need.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from argus.cli.main import CLIError

DEFAULT_PROMPTS = ("an owl standing on a wire", "racing game car, yellow Ferrari")


class ProfileLoraCommand:
    name = "profile-lora"
    help = "Find the LoRA bound K: the first step where the LoRA changes the latents."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--model", default="tiny", help="'tiny', 'tiny:<variant>' or a diffusers directory"
        )
        parser.add_argument("--lora", required=True, help="LoRA name (file NAME.safetensors)")
        parser.add_argument("--lora-dir", type=Path, required=True, help="LoRA directory")
        parser.add_argument(
            "--prompts",
            nargs="+",
            help="prompts to profile, or one text file with a prompt per line "
            "(default: two built-in prompts)",
        )
        parser.add_argument("--steps", type=int, default=50)
        parser.add_argument("--threshold", type=float, default=0.99)
        parser.add_argument("--scale", type=float, default=1.0, help="LoRA scale")
        parser.add_argument("--size", type=int, default=64, help="pixels")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
        parser.add_argument("--dtype", default="auto", help="auto, fp32, fp16 or bf16")
        parser.add_argument("--json", type=Path, help="write the profile as JSON here")

    def run(self, args: argparse.Namespace) -> int:
        self._check(args)
        prompts = self._prompts(args.prompts)
        from argus.worker.adapters.lora import (
            LoraError,
            LoraLibrary,
            check_fits,
            load_now,
            profile_bound,
        )

        try:
            library = LoraLibrary(args.lora_dir)
            lora = load_now(library, args.lora)
        except ValueError as err:  # not a directory
            raise CLIError(f"--lora-dir: {err}") from None
        except LoraError as err:
            raise CLIError(f"--lora: {err}") from None
        model = self._model(args)
        try:
            check_fits(lora, model.pipeline.unet)
        except LoraError as err:
            raise CLIError(f"--lora: does not fit {args.model}: {err}") from None
        profile = profile_bound(
            model,
            lora,
            prompts,
            steps=args.steps,
            threshold=args.threshold,
            scale=args.scale,
            seed=args.seed,
            size=args.size,
        )
        curve = " ".join(f"{value:.4f}" for value in profile.minimum())
        print(f"lowest cosine similarity after each step: {curve}")
        never = " (never below the threshold)" if profile.bound >= args.steps else ""
        print(
            f"K = {profile.bound}{never}: {args.lora} on {model.name}, {len(prompts)} prompts, "
            f"{args.steps} steps, threshold {args.threshold}"
        )
        if args.json is not None:
            payload = {"model": args.model, **profile.to_json()}
            args.json.write_text(json.dumps(payload, indent=2) + "\n", "utf-8")
            print(f"wrote {args.json}")
        return 0

    @staticmethod
    def _check(args: argparse.Namespace) -> None:
        if not 2 <= args.steps <= 1000:
            raise CLIError(f"--steps: {args.steps} outside 2..1000")
        if not 0.0 < args.threshold <= 1.0:
            raise CLIError(f"--threshold: {args.threshold} outside (0, 1]")
        if args.size <= 0 or args.size % 8:
            raise CLIError(f"--size: {args.size} is not a positive multiple of 8")
        if not -100.0 <= args.scale <= 100.0:
            raise CLIError(f"--scale: {args.scale} outside [-100, 100]")

    @staticmethod
    def _prompts(given: list[str] | None) -> list[str]:
        if not given:
            return list(DEFAULT_PROMPTS)
        if len(given) == 1 and Path(given[0]).is_file():
            lines = Path(given[0]).read_text("utf-8").splitlines()
            given = [line.strip() for line in lines]
        prompts = list(dict.fromkeys(p for p in given if p.strip()))
        if not prompts:
            raise CLIError("--prompts: no prompts")
        return prompts

    @staticmethod
    def _model(args: argparse.Namespace) -> Any:
        import torch

        from argus.worker.models.pipelines import DiffusionModel
        from argus.worker.models.registry import resolve_device, resolve_dtype
        from argus.worker.models.sources import (
            TINY_PREFIX,
            ModelSourceError,
            build_tiny_pipeline,
            is_tiny,
            load_pipeline_dir,
        )

        source = TINY_PREFIX + "sdxl" if args.model == "tiny" else args.model
        try:
            device = resolve_device(args.device)
            dtype = resolve_dtype(args.dtype, device)
            if is_tiny(source):
                pipeline = build_tiny_pipeline(source).to(device)  # built in float32
                if dtype != torch.float32:
                    pipeline.to(dtype)
                name = source[len(TINY_PREFIX) :]
            else:
                pipeline = load_pipeline_dir(source, dtype).to(device)
                name = Path(source).name
        except (ModelSourceError, ValueError) as err:
            raise CLIError(f"--model: {err}") from None
        return DiffusionModel(name, pipeline, device=device, source=source)
