"""``argus client``: send prompts to a cluster's router and save the images.

Prompts come from ``--prompt`` (repeatable) or ``--prompts-file`` (one per line); ``--count``
sends the list round-robin up to that many requests, ``--concurrency`` at a time. Each image
is saved as ``OUT/NNNN.png`` and described by one JSON line (level served, worker, strategy,
timing). A failed request prints a JSON line with its status and retry hint; the exit code is
1 if any failed. ``--retries N`` sends a request the router refused for now (with a retry
hint) or that ran out of its deadline again, after the hint, up to N times.

``--image FILE`` makes each request an edit of that image (PNG, JPEG or WebP; the size is
the image's): inpainting where ``--mask FILE`` (a PNG of its size) is fully transparent, or
where the image's own alpha is when no mask is given, or img2img at ``--strength S`` in
(0, 1]. The router checks them and answers a bad one naming the field.

``--stream`` sends the requests one at a time through GenerateStream and draws each one's
progress on stderr: the level and worker chosen, its place in the worker's queue, then a bar
of the denoising steps (redrawn in place on a terminal, one line per stage otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from argus.cli.main import CLIError
from argus.plumbing.quoting import shorten


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
    from argus.plumbing.grpc_server import check_address, read_token
    from argus.tools.client import Connection

    try:
        check_address(address, "--router")
        token = None if args.auth_token_file is None else read_token(args.auth_token_file)
        if args.tls_ca is not None and not Path(args.tls_ca).is_file():
            raise OSError(f"--tls-ca: {args.tls_ca} is not a file")
    except (ValueError, OSError) as err:
        raise CLIError(str(err)) from None
    return Connection(address, token=token, tls_ca=args.tls_ca)


RETRY_PAUSE_S = 1.0  # before sending again a request that was refused without a hint
MAX_RETRY_PAUSE_S = 10.0  # a hint longer than this is waited only this long


def retryable(err: Any) -> bool:
    """A failure worth sending again: the router said when (a retry hint), or the request ran
    out of time (its deadline passed while the cluster was busy)."""
    import grpc

    return err.retry_after_ms is not None or err.code is grpc.StatusCode.DEADLINE_EXCEEDED


def retry_pause_s(err: Any) -> float:
    if err.retry_after_ms is None:
        return RETRY_PAUSE_S
    pause_s: float = min(max(err.retry_after_ms / 1e3, 0.0), MAX_RETRY_PAUSE_S)
    return pause_s


def send_prompts(
    client: Any,
    prompts: list[str],
    out: Path,
    *,
    count: int,
    concurrency: int,
    stream: TextIO | None = None,
    retries: int = 0,
    sleep: Callable[[float], None] = time.sleep,
    **options: Any,
) -> int:
    """Send ``count`` requests, save images under ``out``, print a JSON line each; returns the
    number that failed. ``stream``: send them one at a time through GenerateStream and draw
    their progress there. ``retries``: a request the router refused for now (a retry hint:
    overloaded, no plan yet) or that ran out of its deadline is sent again, up to this many
    times, after the hint (or :data:`RETRY_PAUSE_S` without one, at most
    :data:`MAX_RETRY_PAUSE_S`); its line says how many retries it took."""
    from argus.tools.client import RequestFailed, summary

    out.mkdir(parents=True, exist_ok=True)
    if stream is not None:
        concurrency = 1  # one progress bar

    def attempt(i: int, prompt: str) -> Any:
        if stream is None:
            return client.generate(prompt, seed=i, **options)
        bar = ProgressBar(stream, f"[{i:04d}]")
        try:
            return client.generate_stream(prompt, bar.update, seed=i, **options)
        finally:
            bar.close()

    def one(i: int) -> dict[str, Any]:
        prompt = prompts[i % len(prompts)]
        tried = 0
        while True:
            try:
                response = attempt(i, prompt)
                break
            except RequestFailed as err:
                if tried < retries and retryable(err):
                    tried += 1
                    sleep(retry_pause_s(err))
                    continue
                return {
                    "index": i,
                    "prompt": shorten(prompt),
                    "error": err.code.name,
                    "details": err.details,
                    "retry_after_ms": err.retry_after_ms,
                    **({"retries": tried} if retries else {}),
                }
        path = out / f"{i:04d}.png"
        path.write_bytes(response.png)
        line = {"index": i, "prompt": shorten(prompt), **summary(response, path)}
        return {**line, "retries": tried} if retries else line

    failed = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for line in pool.map(one, range(count)):
            failed += "error" in line
            print(json.dumps(line), flush=True)
    return failed


class ProgressBar:
    """One request's progress, drawn on ``out``: redrawn in place on a terminal; elsewhere
    (a log, a pipe) one line per stage and none per step, so logs stay short."""

    def __init__(self, out: TextIO, label: str, width: int = 30) -> None:
        self.out = out
        self.label = label
        self.width = width
        self.live = out.isatty()
        self.where = ""
        self.started = time.monotonic()
        self.drawn = False
        self._stage = ""

    def update(self, progress: Any) -> None:
        from argus.tools.client import worker_pb2

        stage = worker_pb2.Progress.Stage.Name(progress.stage).lower()
        if stage == "routed":
            self.where = f"{progress.level} on {progress.worker_id}"
        if stage == "queued":
            text = f"queued, {progress.queue_position} ahead"
        elif stage in ("running", "step", "decoding") and progress.total_steps:
            done = round(self.width * progress.step / progress.total_steps)
            bar = "#" * done + "-" * (self.width - done)
            text = f"{stage:8} {progress.step:4}/{progress.total_steps} |{bar}|"
        else:
            text = stage
        line = f"{self.label} {text} {self.where} {time.monotonic() - self.started:.1f} s"
        if self.live:
            self.out.write(f"\r{line}\x1b[K")
            self.drawn = True
        elif stage != self._stage:
            self.out.write(line + "\n")
        self._stage = stage
        self.out.flush()

    def close(self) -> None:
        if self.drawn:
            self.out.write("\n")
            self.out.flush()


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
            "--retries",
            type=int,
            default=0,
            help="send a refused (retry hint) or timed-out request again up to N times, "
            "after the router's hint",
        )
        parser.add_argument(
            "--max-level-index",
            type=int,
            help="minimum quality: never serve a level faster than this index (0 = best)",
        )
        parser.add_argument(
            "--stream",
            action="store_true",
            help="one request at a time through GenerateStream, with a progress bar on stderr",
        )
        parser.add_argument(
            "--image", type=Path, help="edit this image (PNG, JPEG or WebP) instead of generating"
        )
        parser.add_argument(
            "--mask",
            type=Path,
            help="with --image: a PNG of its size, fully transparent where to edit "
            "(default: the image's own alpha)",
        )
        parser.add_argument(
            "--strength", type=float, help="with --image and no mask: img2img strength in (0, 1]"
        )
        parser.add_argument("--out", type=Path, default=Path("images"), help="directory")
        add_connection_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        from argus.tools.client import RouterClient

        prompts = read_prompts(args.prompt, args.prompts_file)
        count = len(prompts) if args.count is None else args.count
        for flag, value in (("--count", count), ("--concurrency", args.concurrency)):
            if value < 1:
                raise CLIError(f"{flag}: {value} must be positive")
        if args.retries < 0:
            raise CLIError(f"--retries: {args.retries} must be >= 0")
        if args.max_level_index is not None and args.max_level_index < 0:
            raise CLIError(f"--max-level-index: {args.max_level_index} must be >= 0")
        edit = read_edit(args.image, args.mask, args.strength)
        connection = read_connection(args.router, args)
        with RouterClient(connection) as client:
            failed = send_prompts(
                client,
                prompts,
                args.out,
                count=count,
                concurrency=args.concurrency,
                stream=sys.stderr if args.stream else None,
                retries=args.retries,
                size=args.size,
                steps=args.steps,
                deadline_ms=args.deadline_ms,
                max_level_index=args.max_level_index,
                **edit,
            )
        return 1 if failed else 0


def read_edit(image: Path | None, mask: Path | None, strength: float | None) -> dict[str, Any]:
    """The edit fields of the requests (none without ``--image``); the files' bytes are sent
    as they are, for the router to check."""
    if image is None:
        for flag, value in (("--mask", mask), ("--strength", strength)):
            if value is not None:
                raise CLIError(f"{flag}: needs --image (the image to edit)")
        return {}
    fields: dict[str, Any] = {"image": _read_file(image, "--image"), "strength": strength}
    if mask is not None:
        fields["mask"] = _read_file(mask, "--mask")
    return fields


def _read_file(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise CLIError(f"{flag}: cannot read {path} ({err.strerror})") from None
