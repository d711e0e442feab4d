"""``argus generate``: send one prompt to a worker and save the PNG it returns."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from argus.cli.main import CLIError
from argus.plumbing.quoting import quoted


def parse_lora(text: str) -> tuple[str, float]:
    """``NAME`` or ``NAME=SCALE``."""
    name, sep, scale = text.partition("=")
    if not name or (sep and not scale):
        raise CLIError(f"--lora: expected NAME or NAME=SCALE, got {quoted(text)}")
    try:
        return name, float(scale) if sep else 1.0
    except ValueError:
        raise CLIError(f"--lora: scale {quoted(scale)} is not a number") from None


def parse_controlnet(text: str) -> tuple[str, Path, float]:
    """``NAME=PNG`` or ``NAME=PNG@SCALE``."""
    name, sep, rest = text.partition("=")
    image, at, scale = rest.rpartition("@") if "@" in rest else (rest, "", "")
    if not name or not sep or not image:
        raise CLIError(f"--controlnet: expected NAME=PNG[@SCALE], got {quoted(text)}")
    try:
        return name, Path(image), float(scale) if at else 1.0
    except ValueError:
        raise CLIError(f"--controlnet: scale {quoted(scale)} is not a number") from None


class GenerateCommand:
    name = "generate"
    help = "Send a prompt to a worker (gRPC) and save the image."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--address", required=True, help="HOST:PORT of a worker")
        parser.add_argument("--prompt", required=True)
        parser.add_argument("--negative-prompt", default="")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--size", type=int, help="width and height in pixels")
        parser.add_argument("--steps", type=int)
        parser.add_argument("--level", default="", help="a profile level, e.g. ac-k10")
        parser.add_argument(
            "--lora", action="append", default=[], help="NAME[=SCALE] from the worker's library"
        )
        parser.add_argument(
            "--controlnet", action="append", default=[], help="NAME=PNG[@SCALE]: a control image"
        )
        parser.add_argument("--out", type=Path, default=Path("image.png"))
        parser.add_argument("--timeout", type=float, default=300.0, help="seconds")
        parser.add_argument(
            "--internal-tls-dir",
            help="a router's certificate directory (ca.crt, router.crt, router.key): a worker "
            "of a cluster answers routers only (default: plaintext, a standalone worker)",
        )

    def run(self, args: argparse.Namespace) -> int:
        import grpc

        from argus.plumbing import rpc

        common_pb2 = rpc.load("common_pb2")
        worker_pb2 = rpc.load("worker_pb2")
        worker_pb2_grpc = rpc.load("worker_pb2_grpc")
        request = worker_pb2.GenerateRequest(
            prompt=args.prompt,
            negative_prompt=args.negative_prompt,
            seed=args.seed,
            level=args.level,
        )
        if args.size is not None:
            request.width = request.height = args.size
        if args.steps is not None:
            request.steps = args.steps
        kind = common_pb2.Adapter.Kind
        for name, image, scale in map(parse_controlnet, args.controlnet):
            try:
                png = image.read_bytes()
            except OSError as err:
                raise CLIError(
                    f"--controlnet {name}: cannot read {image}: {err.strerror}"
                ) from None
            request.adapters.add(kind=kind.CONTROLNET, name=name, scale=scale, control_image=png)
        for name, scale in map(parse_lora, args.lora):
            request.adapters.add(kind=kind.LORA, name=name, scale=scale)
        from argus.plumbing.internal_tls import InternalTLS, channel

        try:
            tls = None
            if args.internal_tls_dir is not None:  # workers of a cluster take routers only
                tls = InternalTLS.load(args.internal_tls_dir, "router")
        except OSError as err:
            raise CLIError(str(err)) from None
        with channel(args.address, tls) as worker_channel:
            try:
                reply = worker_pb2_grpc.WorkerStub(worker_channel).Generate(
                    request, timeout=args.timeout
                )
            except grpc.RpcError as err:
                raise CLIError(f"{err.code().name}: {err.details()}") from None
        args.out.write_bytes(reply.png)
        summary = {
            "out": str(args.out),
            "level": reply.level,
            "model": reply.model,
            "steps_run": reply.steps_run,
            "cache": worker_pb2.CacheOutcome.Name(reply.cache),
            "adapters": reply.adapter_path,
            "total_ms": round(reply.timing.total_ms, 1),
        }
        print(json.dumps(summary))
        return 0
