"""``argus client``: send prompts to a cluster's router and save the images.

Prompts come from ``--prompt`` (repeatable) or ``--prompts-file`` (one per line); ``--count``
sends the list round-robin up to that many requests, ``--concurrency`` at a time. Each image
is saved as ``OUT/NNNN.png`` and described by one JSON line (level served, worker, strategy,
timing). A failed request prints a JSON line with its status and retry hint; the exit code is
1 if any failed.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from argus.cli.main import CLIError
from argus.quoting import shorten


def read_prompts(prompts: list[str], prompts_file: Path | None) -> list[str]:
    found = list(prompts)
    if prompts_file is not None:
        try:
            lines = prompts_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise CLIError(f"--prompts-file: cannot read {prompts_file}: {err}") from None
        found += [line.strip() for line in lines if line.strip()]
    if not found:
        raise CLIError("no prompt: give --prompt or --prompts-file")
    return found


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auth-token-file", help="file with the router's bearer token")
    parser.add_argument("--tls-ca", help="PEM certificate to trust (the router serves TLS)")


def read_connection(address: str, args: argparse.Namespace) -> Any:
    from argus.client import Connection
    from argus.grpc_server import check_address, read_token

    try:
        check_address(address, "--router")
        token = None if args.auth_token_file is None else read_token(args.auth_token_file)
        if args.tls_ca is not None and not Path(args.tls_ca).is_file():
            raise OSError(f"--tls-ca: {args.tls_ca} is not a file")
    except (ValueError, OSError) as err:
        raise CLIError(str(err)) from None
    return Connection(address, token=token, tls_ca=args.tls_ca)


def send_prompts(
    client: Any,
    prompts: list[str],
    out: Path,
    *,
    count: int,
    concurrency: int,
    **options: Any,
) -> int:
    """Send ``count`` requests, save images under ``out``, print a JSON line each; returns the
    number that failed."""
    from argus.client import RequestFailed, summary

    out.mkdir(parents=True, exist_ok=True)

    def one(i: int) -> dict[str, Any]:
        prompt = prompts[i % len(prompts)]
        try:
            response = client.generate(prompt, seed=i, **options)
        except RequestFailed as err:
            return {
                "index": i,
                "prompt": shorten(prompt),
                "error": err.code.name,
                "details": err.details,
                "retry_after_ms": err.retry_after_ms,
            }
        path = out / f"{i:04d}.png"
        path.write_bytes(response.png)
        return {"index": i, "prompt": shorten(prompt), **summary(response, path)}

    failed = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for line in pool.map(one, range(count)):
            failed += "error" in line
            print(json.dumps(line), flush=True)
    return failed


class ClientCommand:
    name = "client"
    help = "Send prompts to a cluster's router (gRPC) and save the images."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--router", required=True, help="router HOST:PORT")
        parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
        parser.add_argument("--prompts-file", type=Path, help="one prompt per line")
        parser.add_argument("--count", type=int, help="requests to send (default: one each)")
        parser.add_argument("--concurrency", type=int, default=4, help="requests at once")
        parser.add_argument("--size", type=int, help="width and height in pixels")
        parser.add_argument("--steps", type=int, help="denoising steps (default: the worker's)")
        parser.add_argument("--deadline-ms", type=int, help="give up after this long")
        parser.add_argument(
            "--max-level-index",
            type=int,
            help="minimum quality: never serve a level faster than this index (0 = best)",
        )
        parser.add_argument("--out", type=Path, default=Path("images"), help="directory")
        add_connection_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        from argus.client import RouterClient

        prompts = read_prompts(args.prompt, args.prompts_file)
        count = len(prompts) if args.count is None else args.count
        for flag, value in (("--count", count), ("--concurrency", args.concurrency)):
            if value < 1:
                raise CLIError(f"{flag}: {value} must be positive")
        if args.max_level_index is not None and args.max_level_index < 0:
            raise CLIError(f"--max-level-index: {args.max_level_index} must be >= 0")
        connection = read_connection(args.router, args)
        with RouterClient(connection) as client:
            failed = send_prompts(
                client,
                prompts,
                args.out,
                count=count,
                concurrency=args.concurrency,
                size=args.size,
                steps=args.steps,
                deadline_ms=args.deadline_ms,
                max_level_index=args.max_level_index,
            )
        return 1 if failed else 0
