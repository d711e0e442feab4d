"""``argus generate``: send one prompt to a worker and save the PNG it returns."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from argus.cli.main import CLIError


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
        parser.add_argument("--out", type=Path, default=Path("image.png"))
        parser.add_argument("--timeout", type=float, default=300.0, help="seconds")

    def run(self, args: argparse.Namespace) -> int:
        import grpc

        from argus import rpc

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
        with grpc.insecure_channel(args.address) as channel:
            try:
                reply = worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=args.timeout)
            except grpc.RpcError as err:
                raise CLIError(f"{err.code().name}: {err.details()}") from None
        args.out.write_bytes(reply.png)
        summary = {
            "out": str(args.out),
            "level": reply.level,
            "model": reply.model,
            "steps_run": reply.steps_run,
            "cache": worker_pb2.CacheOutcome.Name(reply.cache),
            "total_ms": round(reply.timing.total_ms, 1),
        }
        print(json.dumps(summary))
        return 0
