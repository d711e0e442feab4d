"""``argus up``: a whole cluster on this machine, as local processes, until Ctrl-C.

Starts the allocator, the ControlNet service, ``--workers`` workers and a router on the
embedded defaults (tiny models with seeded random weights, Qdrant Edge, a local latent store
under ``--workdir``), prints each part as it gets ready (a worker once its pipeline has run
once; the cluster once the router serves on a plan with every worker) and where each listens,
and with ``--demo N`` then sends N prompts from the bundled prompt set through the router and
saves the images in ``--out``. Ctrl-C (or
SIGTERM) stops the parts in order: router, workers, ControlNet, allocator.

The parts talk mutual TLS with certificates of a CA made for the run (in ``WORKDIR/tls``; see
:mod:`argus.tools.local_cluster`). A router ``--port`` another process holds stops ``argus up``
before anything starts, naming the port. The router also serves the OpenAI-compatible images
API over HTTP on ``--http-port`` (default 0: any free port; -1: off) and ``argus up`` prints
its base URL ``http://HOST:PORT/v1``.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from argus import defaults
from argus.cli.main import CLIError

if TYPE_CHECKING:
    from argus.tools.local_cluster import LocalCluster


def demo_prompts(count: int) -> list[str]:
    """``count`` prompts spread over the bundled prompt set (PartiPrompts)."""
    from argus.traces import default_prompt_trace, load_prompts

    records = load_prompts(default_prompt_trace())
    stride = max(1, len(records) // max(count, 1))
    return [record.prompt for record in records[::stride][:count]]


DEMO_RETRIES = 3  # the demo follows the router's retry hints, as a client should
GAVE_UP_EXIT = 3  # a part died --max-restarts times within the window


def _edit_args(args: argparse.Namespace, part: str) -> tuple[str, ...]:
    """The edit batching flags of ``part`` ("worker" or "router"), left out at their defaults;
    a bad value is refused here, naming the flag, before anything starts."""
    from argus.router.config import EDIT_BALANCERS

    if args.edit_batch < 1:
        raise CLIError(f"--edit-batch: must be >= 1, got {args.edit_batch}")
    if args.edit_balancer not in EDIT_BALANCERS:
        raise CLIError(
            f"--edit-balancer: {args.edit_balancer!r} is not one of {', '.join(EDIT_BALANCERS)}"
        )
    flags: tuple[str, ...] = ()
    if args.edit_batch > 1:
        flags = ("--edit-batch", str(args.edit_batch))
    if part == "router" and args.edit_balancer != "plan":
        flags += ("--edit-balancer", args.edit_balancer)
    return flags


def say(message: str) -> None:
    """The supervisor's lines (a part died, restarted) on argus up's output."""
    print(f"argus up: {message}", flush=True)


def print_ready(name: str, seconds: float) -> None:
    """``argus up: worker-0 ready (21.3 s)``: one line as each part gets ready."""
    print(f"argus up: {name} ready ({seconds:.1f} s)", flush=True)


class UpCommand:
    name = "up"
    help = "Run a whole cluster (allocator, ControlNet, workers, router) as local processes."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from argus.plumbing.supervision import RestartPolicy
        from argus.tools.local_cluster import ClusterSpec  # what --help's defaults come from

        parser.add_argument("--workers", type=int, default=ClusterSpec.workers)
        parser.add_argument("--port", type=int, default=50051, help="router port (0: any)")
        parser.add_argument(
            "--http-port",
            type=int,
            default=ClusterSpec.router_http_port,
            help="router's OpenAI-compatible HTTP API port (0: any free port; -1: off)",
        )
        parser.add_argument(
            "--workdir", type=Path, help="caches and logs, kept (default: a temp dir, removed)"
        )
        parser.add_argument(
            "--steps",
            type=int,
            default=ClusterSpec.default_steps,
            help="default denoising steps (default: %(default)s)",
        )
        parser.add_argument(
            "--model",
            default="tiny",
            help="every worker's AC base model: 'tiny' (random weights: images are noise) or "
            "a diffusers directory",
        )
        parser.add_argument(
            "--variant",
            action="append",
            default=[],
            help="NAME=DIR of a smaller model for the SM levels (repeatable; as argus worker)",
        )
        parser.add_argument(
            "--edit-batch",
            type=int,
            default=defaults.EDIT_BATCH,
            help="edits each worker runs together (argus worker --edit-batch; the router prices "
            "with it too; default 1: one at a time)",
        )
        parser.add_argument(
            "--edit-balancer",
            default="plan",
            help="how the router places inpainting edits (argus router --edit-balancer; default "
            "plan)",
        )
        parser.add_argument("--no-controlnet", action="store_true", help="no ControlNet service")
        parser.add_argument(
            "--compute-nice",
            type=int,
            default=ClusterSpec.compute_nice,
            help="nice value added to the workers and the ControlNet service, so the router "
            "and the allocator on the same cores go first (0: none; default: %(default)s)",
        )
        parser.add_argument("--no-metrics", action="store_true", help="no /metrics endpoints")
        parser.add_argument(
            "--period-s",
            type=float,
            default=ClusterSpec.period_s,
            help="allocator re-plans (default: %(default)s)",
        )
        parser.add_argument(
            "--classifier",
            help="classifier directory of the router and the allocator "
            "(default: classifiers/minilm-l2-logistic-int8)",
        )
        parser.add_argument("--auth-token-file", help="the router requires this bearer token")
        parser.add_argument("--tls-cert", help="PEM certificate of the router's endpoint")
        parser.add_argument("--tls-key", help="PEM key of the router's endpoint")
        parser.add_argument(
            "--max-restarts",
            type=int,
            default=RestartPolicy.max_deaths,
            help="a part that dies is restarted with backoff; dying this many times within "
            f"{RestartPolicy.window_s:g} s stops the cluster with exit code 3 "
            "(default: %(default)s)",
        )
        parser.add_argument("--demo", type=int, default=0, help="send N prompts once up")
        parser.add_argument("--out", type=Path, default=Path("demo-out"), help="demo images")
        parser.add_argument(
            "--exit-after-demo", action="store_true", help="stop the cluster after the demo"
        )

    def run(self, args: argparse.Namespace) -> int:
        if args.demo < 0:
            raise CLIError(f"--demo: {args.demo} must be >= 0")
        if args.max_restarts < 1:
            raise CLIError(f"--max-restarts: {args.max_restarts} must be >= 1")
        if not -1 <= args.http_port < 65536:
            raise CLIError(f"--http-port: {args.http_port} outside -1..65535 (-1: off)")
        if args.port != 0:
            check_port_free("127.0.0.1", args.port)
        if args.http_port > 0:
            check_port_free("127.0.0.1", args.http_port, "--http-port")
        if args.workdir is not None:
            return self._serve(args, args.workdir)
        # caches and logs of one run, useless after it: a temp dir left behind per run adds
        # up; --workdir keeps them
        workdir = Path(tempfile.mkdtemp(prefix="argus-up-"))
        try:
            return self._serve(args, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _serve(self, args: argparse.Namespace, workdir: Path) -> int:
        """Start the cluster in ``workdir``, run the demo, serve until asked to stop."""
        from argus.plumbing.grpc_server import shutdown_signals
        from argus.plumbing.supervision import RestartPolicy, Supervisor
        from argus.tools.local_cluster import ClusterError, ClusterSpec, LocalCluster, describe

        try:
            spec = ClusterSpec(
                workdir=workdir,
                workers=args.workers,
                controlnet=not args.no_controlnet,
                router_port=args.port,
                router_http_port=None if args.http_port == -1 else args.http_port,
                metrics=not args.no_metrics,
                default_steps=args.steps,
                compute_nice=args.compute_nice,
                period_s=args.period_s,
                classifier=args.classifier,
                auth_token_file=args.auth_token_file,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                worker_args=(*_model_args(args.model, args.variant), *_edit_args(args, "worker")),
                router_args=_edit_args(args, "router"),
            )
        except ValueError as err:
            raise CLIError(str(err)) from None
        cluster = LocalCluster(spec)
        kept = "" if args.workdir is not None else " (removed on exit; --workdir keeps them)"
        print(
            f"argus up: starting {args.workers} workers; logs in {workdir}/logs{kept}", flush=True
        )
        supervisor = Supervisor(cluster, RestartPolicy(max_deaths=args.max_restarts), say=say)
        failed = 0
        # the signal handlers stay until every part has stopped: a second Ctrl-C (or a
        # supervisor's SIGINT to the whole group) while the cluster stops is absorbed, so the
        # parts are always stopped in order and none is left running
        with shutdown_signals() as stop:
            try:
                try:
                    cluster.start(on_ready=print_ready)
                except ClusterError as err:
                    raise CLIError(str(err)) from None
                supervisor.start()
                for line in describe(cluster):
                    print(f"  {line}", flush=True)
                print(f"argus up: router listening on {cluster.router}", flush=True)
                if cluster.router_http:
                    print(f"argus up: router http on {cluster.router_http}", flush=True)
                if args.demo:
                    failed = self._demo(cluster, args)
                if not args.exit_after_demo:
                    print("argus up: serving; Ctrl-C stops the cluster", flush=True)
                    while not stop.wait(0.2) and not supervisor.failed.is_set():
                        pass
            finally:
                supervisor.stop()
                codes = cluster.stop()
                print(f"argus up: stopped ({', '.join(f'{n} {c}' for n, c in codes.items())})")
        if supervisor.failure is not None:
            print(f"argus up: {supervisor.failure}; stopped the cluster", file=sys.stderr)
            return GAVE_UP_EXIT
        return 1 if failed else 0

    def _demo(self, cluster: LocalCluster, args: argparse.Namespace) -> int:
        from argus.cli.client import send_prompts
        from argus.plumbing.grpc_server import read_token
        from argus.tools.client import Connection, RouterClient

        token = None if args.auth_token_file is None else read_token(args.auth_token_file)
        connection = Connection(cluster.router, token=token, tls_ca=args.tls_cert)
        print(
            f"argus up: demo: {args.demo} prompts → {args.out}/ (a request the router refuses "
            f"for now or that runs out of time is sent again after its retry hint, up to "
            f"{DEMO_RETRIES} times, as a client following the hint would)",
            flush=True,
        )
        with RouterClient(connection) as client:
            failed: int = send_prompts(
                client,
                demo_prompts(args.demo),
                args.out,
                count=args.demo,
                concurrency=2,
                retries=DEMO_RETRIES,
            )
        return failed


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """CLIError naming ``port`` when another process holds it (checked before any part starts;
    the router's own bind, without port sharing, fails too should it be taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as gRPC binds: a port left in TIME_WAIT by a previous run is free, a listening one not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise CLIError(
                f"{flag}: {host}:{port} is taken ({err.strerror or err}); stop what holds it "
                f"or pass another {flag} (0: any free port)"
            ) from None


def _model_args(model: str, variants: list[str]) -> tuple[str, ...]:
    """The workers' model flags: nothing for the tiny default, else ``--model`` and each
    ``--variant`` as ``argus worker`` takes them (it checks the directories)."""
    if model == "tiny" and not variants:
        return ()
    args = ["--model", model]
    for variant in variants:
        args += ["--variant", variant]
    return tuple(args)
