"""``argus profile``: real quality tables, every prompt at every level, scored with PickScore.

Writes ``quality-AC.csv`` and/or ``quality-SM.csv`` into ``--out`` in the quality-table format
that ``argus replay --quality`` and ``argus train-classifier`` read. With ``--model tiny`` the
images come from tiny random models: the pipeline runs end to end, but the scores mean nothing
about real image quality (the table's source line says which scorer and models were used).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from argus.cli.main import CLIError


class ProfileCommand:
    name = "profile"
    help = "Generate prompts at every level through the worker and score them with PickScore."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--scorer", required=True, help="PickScore/CLIP directory")
        parser.add_argument(
            "--prompts", default="parti", help="'parti' or a text file, one prompt per line"
        )
        parser.add_argument("--limit", type=int, default=100, help="first N prompts")
        parser.add_argument("--warmup", type=int, default=0, help="prompts that fill the cache")
        parser.add_argument("--strategy", default="AC,SM", help="AC, SM or AC,SM")
        parser.add_argument("--model", default="tiny", help="'tiny' or the base model directory")
        parser.add_argument("--variant", action="append", default=[], help="NAME=DIR (SM)")
        parser.add_argument("--profile", help="profile file (default: the embedded one)")
        parser.add_argument("--steps", type=int, default=50)
        parser.add_argument("--size", type=int, default=64, help="pixels")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--device", default="auto")
        parser.add_argument("--out", type=Path, required=True, help="output directory")

    def run(self, args: argparse.Namespace) -> int:
        from argus.cli.worker import parse_variant

        strategies = self._strategies(args.strategy)
        prompts = self._prompts(args.prompts, args.limit + args.warmup)
        warmup, prompts = prompts[: args.warmup], prompts[args.warmup :]
        if not prompts:
            raise CLIError("--prompts: no prompts to profile")
        from argus.contracts.quality import save_quality_table
        from argus.tools.profiler import ProfileReport, ProfileSettings, profile_ac, profile_sm
        from argus.types import Strategy
        from argus.worker.app import WorkerSettings, build_worker
        from argus.worker.scoring import PickScorer

        try:
            scorer = PickScorer(args.scorer)
        except (OSError, ValueError) as err:
            raise CLIError(f"--scorer: {err}") from None
        args.out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="argus-profile-") as cache_dir:
            settings = WorkerSettings(
                model=args.model,
                variants=tuple(parse_variant(v) for v in args.variant),
                profile=args.profile,
                device=args.device,
                cache_dir=cache_dir,
                default_size=args.size,
                default_steps=args.steps,
            )
            try:
                worker = build_worker(settings)
            except ValueError as err:
                raise CLIError(str(err)) from None
            run = ProfileSettings(
                steps=args.steps, size=args.size, seed=args.seed, scorer=str(args.scorer)
            )
            report = ProfileReport(tables={})

            def progress(line: str) -> None:
                print(line, file=sys.stderr)

            try:
                if Strategy.AC in strategies:
                    report.tables[Strategy.AC] = profile_ac(
                        worker,
                        scorer,
                        prompts,
                        run,
                        warmup=warmup,
                        report=report,
                        progress=progress,
                    )
                if Strategy.SM in strategies:
                    report.tables[Strategy.SM] = profile_sm(
                        worker, scorer, prompts, run, report=report, progress=progress
                    )
            except ValueError as err:
                raise CLIError(str(err)) from None
            finally:
                worker.close()
        for strategy, table in report.tables.items():
            path = args.out / f"quality-{strategy.value}.csv"
            save_quality_table(table, path)
            print(f"wrote {path} ({len(table.prompts)} prompts × {len(table.levels)} levels)")
        if report.cache:
            outcomes = ", ".join(f"{k}={v}" for k, v in sorted(report.cache.items()))
            print(f"AC cache outcomes at K > 0: {outcomes}")
        return 0

    @staticmethod
    def _strategies(text: str) -> set[object]:
        from argus.types import Strategy

        try:
            return {Strategy.parse(part) for part in text.split(",") if part.strip()}
        except ValueError as err:
            raise CLIError(f"--strategy: {err}") from None

    @staticmethod
    def _prompts(source: str, count: int) -> list[str]:
        if count <= 0:
            raise CLIError("--limit: must be positive")
        if source == "parti":
            from argus.traces import default_prompt_trace, load_prompts

            texts = [r.prompt for r in load_prompts(default_prompt_trace())]
        else:
            path = Path(source)
            if not path.is_file():
                raise CLIError(f"--prompts: {source}: no such file")
            texts = [line.strip() for line in path.read_text("utf-8").splitlines()]
        unique = list(dict.fromkeys(t for t in texts if t))
        return unique[:count]
