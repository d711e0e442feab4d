"""Step time of a batch of masked edits against batch size and mask ratio: the measured points
that argus/sim/edits.py fits its edit cost model on (issue 33, item 3).

SD-1.5's full-width UNet (the configuration in benchmarks/bench_editing.py, random seeded
weights, float32, CPU, nothing downloaded) at ``--size`` pixels. A batch of b edits is one UNet
call on 2b rows (each edit's CFG pair). For each b and mask ratio m a template record of that
batch is taken once, then the replay step (the mask-aware activation cache: every block computes
the region's tokens only) is timed ``--repeats`` times and the median printed; m = 1 is the full
step (a miss). Every edit in a batch has the same m here, so the batch's mask sum is b·m.

    .venv/bin/python benchmarks/bench_edit_cost.py            # 256 px, b 1/2/4, 3 repeats
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import load_line, machine_line
from bench_editing import build_unet, centred_region

from argus.profiles.edit_cost import fit_cost_model
from argus.worker.masked_blocks import ActivationRecord, Replay, recording


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=256, help="image side (256)")
    parser.add_argument("--batches", default="1,2,4", help="batch sizes (edits, CFG 2 each)")
    parser.add_argument("--ratios", default="0.1,0.2,0.4,1.0", help="mask ratios")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    print(machine_line(), flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.size} px, CFG 2")
    unet = build_unet(args.seed)
    side = args.size // 8
    t = torch.tensor(500)
    points: list[tuple[int, float, float]] = []
    with torch.inference_mode():
        for b in batches:
            generator = torch.Generator().manual_seed(args.seed + b)
            latents = torch.randn(2 * b, 4, side, side, generator=generator)
            embeds = torch.randn(2 * b, 77, 768, generator=generator)

            def step(latents: torch.Tensor = latents, embeds: torch.Tensor = embeds) -> None:
                unet(latents, t, encoder_hidden_states=embeds, return_dict=False)

            step()  # warm-up
            record = ActivationRecord((side, side))
            with recording(unet, record, 0, None, keys_values=False):
                step()
            for ratio in ratios:
                seconds = []
                replay = Replay(unet, record, centred_region(side, side, ratio), keys_values=False)
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    if ratio >= 1.0:
                        step()
                    else:
                        with replay.step(0):
                            step()
                    seconds.append(time.perf_counter() - start)
                median = statistics.median(seconds)
                points.append((b, b * ratio, median))
                print(
                    f"b={b} m={ratio:.2f} sum_m={b * ratio:.2f}: {median * 1e3:.1f} ms", flush=True
                )
    model = fit_cost_model(points)
    print(
        f"fit t = a + p*b + c*sum_m: a={model.base_s * 1e3:.1f} ms, p={model.per_edit_s * 1e3:.1f} "
        f"ms, c={model.per_mask_s * 1e3:.1f} ms, R2={model.r2:.4f}"
    )
    print("points (b, sum_m, seconds):", [(b, round(s, 3), round(x, 4)) for b, s, x in points])
    print(load_line("end"))


if __name__ == "__main__":
    main()
