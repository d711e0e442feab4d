"""A whole Argus cluster as local processes: allocator, ControlNet service, N workers, router.

``argus up`` runs one; the integration tests (faults, dashboards) start them too. Every part
is the real ``argus`` command in its own process, talking gRPC on loopback: the same commands
the Helm chart runs in pods. Each process logs to ``WORKDIR/logs/NAME.log``; their Prometheus
endpoints are listed in ``WORKDIR/prometheus-targets.json`` (Prometheus ``file_sd`` format).

Start order follows the dependencies (allocator, ControlNet, workers, router); the router
starts while the workers warm up. The cluster is ready when every worker has run its pipeline
once (it prints ``ready``, then joins the allocator) and the router is SERVING on a plan with
every worker; ``start`` reports each part as it gets there. ``stop`` goes the other way: the
router stops taking requests first, the allocator goes last. Children run in their own
sessions, so a Ctrl-C in the terminal reaches ``argus up`` alone, which then stops them in
order.

``router_cpus`` and ``compute_cpus`` pin the parts to CPU sets, as a node that gives the router
cores of its own (the Helm chart's CPU requests) would: the router on one set; the workers,
the ControlNet service and the allocator on the other. A part is pinned from its first
instruction (:func:`inherited_affinity`), so every thread it ever starts runs on its set.

The internal plane is mutual TLS, as in a deployment: the cluster creates a CA in
``WORKDIR/tls/ca`` and gives each part a directory ``WORKDIR/tls/NAME`` holding ``ca.crt`` and
its own certificate (``argus://worker/worker-0``, ...), never the CA key. The cluster's own
calls (the plan it waits on) use an ``operator`` certificate (:meth:`LocalCluster.internal_tls`,
which also issues a caller the certificate of another identity).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc

from argus import defaults
from argus.plumbing.internal_tls import CA_KEY, Identity, InternalTLS, generate_ca, issue

LISTENING = re.compile(r"listening on (\S+)")
HTTP_ON = re.compile(r"argus router http on (\S+)")  # the router's OpenAI-compatible API
WORKER_READY = re.compile(r"argus worker \S+ ready")  # printed after the worker's warm-up


class ClusterError(RuntimeError):
    """A part did not start; the message names it and quotes the end of its log."""


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. Ports 0 are picked free at start."""

    workdir: Path
    workers: int = 2
    controlnet: bool = True
    host: str = defaults.LOOPBACK
    router_port: int = 0
    router_http_port: int | None = 0  # the router's HTTP API; 0: any free port; None: off
    metrics: bool = True  # each part serves /metrics on a free port
    default_steps: int = 30  # more than the largest skip (K = 25) so every AC level can run
    default_size: int = defaults.DEFAULT_SIZE
    heartbeat_s: float = defaults.HEARTBEAT_S
    period_s: float = defaults.PLANNING_PERIOD_S
    retrieval_threshold_s: float = defaults.RETRIEVAL_THRESHOLD_S
    retrieval_window_s: float = defaults.RETRIEVAL_WINDOW_S
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    index_outage_file: str | None = None  # fault injection, passed to every worker
    profile: str | None = None
    classifier: str | None = None  # given to the router and the allocator alike; None: default
    router_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    allocator_args: tuple[str, ...] = ()  # e.g. ("--strategy-choice", "ac-first")
    start_timeout_s: float = 300.0
    # the workers' and the ControlNet service's --nice: on one machine the control plane
    # (router, allocator) runs ahead of denoising, as on cores of its own
    compute_nice: int = 10
    # CPU sets (Linux CPU numbers, each among this process's): the router's, and the one the
    # workers, the ControlNet service and the allocator share; None: the part runs anywhere
    router_cpus: tuple[int, ...] | None = None
    compute_cpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers: need at least 1, got {self.workers}")
        if not 0 <= self.router_port < 65536:
            raise ValueError(f"router_port: {self.router_port} outside 0..65535")
        if self.router_http_port is not None and not 0 <= self.router_http_port < 65536:
            raise ValueError(f"router_http_port: {self.router_http_port} outside 0..65535")
        if not 0 <= self.compute_nice <= 19:
            raise ValueError(f"compute_nice: {self.compute_nice} outside 0..19")
        check_cpus("router_cpus", self.router_cpus)
        check_cpus("compute_cpus", self.compute_cpus)

    def cpus_for(self, name: str) -> tuple[int, ...] | None:
        """The CPU set of the part ``name`` (``router``, ``worker-0``, ...)."""
        return self.router_cpus if name == "router" else self.compute_cpus


def check_cpus(name: str, cpus: tuple[int, ...] | None) -> None:
    """ValueError naming ``name`` unless ``cpus`` is None or a non-empty set of CPUs this
    process may run on."""
    if cpus is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{name}: pinning to CPUs needs Linux's sched_setaffinity")
    if not cpus:
        raise ValueError(f"{name}: an empty CPU set (None runs the parts unpinned)")
    allowed = os.sched_getaffinity(0)
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise ValueError(
            f"{name}: CPU {', '.join(map(str, outside))} is not among this process's CPUs "
            f"{sorted(allowed)}"
        )


@contextmanager
def inherited_affinity(cpus: Sequence[int] | None) -> Iterator[None]:
    """While inside, the calling thread runs on ``cpus`` only, so that a process it starts
    inherits that set; the thread's own set is back on exit. None changes nothing.

    On Linux a CPU set belongs to a thread: fork copies the forking thread's set to the child,
    exec keeps it, and every thread inherits its creator's. A child started here is therefore
    pinned before its first instruction, with every thread it will have (torch's and
    OpenBLAS's pools start while modules import, before any code of ours could pin them).
    ``preexec_fn`` would do the same in the child, but it is unsafe in a process with threads
    (the benchmarks hold gRPC threads), and ``taskset -c`` needs a binary a slim image may lack.
    The other threads of this process keep their sets.
    """
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass
class Part:
    """One running process of the cluster."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""
    http_url: str = ""  # the router's HTTP API base URL (http://HOST:PORT/v1), when it has one
    metrics_port: int | None = None
    args: tuple[str, ...] = field(default_factory=tuple)
    log_offset: int = 0  # where this process's output starts in the log (restarts append)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        """What this process has written to its log so far."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def free_port(host: str = "127.0.0.1") -> int:
    """A port free at the time of asking (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalCluster:
    """Starts, watches and stops the parts; use as a context manager or call start/stop."""

    def __init__(self, spec: ClusterSpec, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.parts: dict[str, Part] = {}
        self._logs: list[IO[bytes]] = []
        self._clock = clock
        (spec.workdir / "logs").mkdir(parents=True, exist_ok=True)

    # -- addresses -----------------------------------------------------------------------

    @property
    def router(self) -> str:
        return self.parts["router"].address

    @property
    def router_http(self) -> str:
        """The router's HTTP API base URL ``http://HOST:PORT/v1``; "" when it serves none."""
        return self.parts["router"].http_url

    @property
    def allocator(self) -> str:
        return self.parts["allocator"].address

    def worker_names(self) -> list[str]:
        return [name for name in self.parts if name.startswith("worker-")]

    # -- the internal plane's certificates -------------------------------------------------

    def tls_dir(self, identity: Identity) -> Path:
        """The certificate directory of ``identity``, issued on first use (the CA too)."""
        root = self.spec.workdir / "tls"
        ca = root / "ca"
        if not (ca / CA_KEY).exists():
            generate_ca(ca)
        out = root / identity.name
        if not (out / f"{identity.role}.crt").exists():
            issue(ca, identity, out)
        return out

    def internal_tls(self, identity: Identity | None = None) -> InternalTLS:
        """Credentials for calls into the cluster; by default its own operator certificate
        (which may read plans and stats, nothing else)."""
        who = identity or Identity("operator", "argus-up")
        return InternalTLS.load(self.tls_dir(who), who.role)

    # -- start ---------------------------------------------------------------------------

    def start(self, on_ready: Callable[[str, float], None] | None = None) -> None:
        """Start every part and wait until the router serves on a plan with every worker.

        ``on_ready(name, seconds)`` is called as each part gets ready (the allocator, the
        ControlNet service, each worker after its warm-up, the router, then "cluster"), with
        the seconds since ``start`` was called.
        """
        began = self._clock()

        def ready(name: str) -> None:
            if on_ready is not None:
                on_ready(name, self._clock() - began)

        try:
            self._start_all(ready)
        except BaseException:
            self.stop()
            raise

    def _start_all(self, ready: Callable[[str], None]) -> None:
        spec = self.spec
        self._launch(
            "allocator",
            "allocator",
            "--heartbeat-s", str(spec.heartbeat_s),
            "--period-s", str(spec.period_s),
            "--retrieval-threshold-s", str(spec.retrieval_threshold_s),
            "--retrieval-window-s", str(spec.retrieval_window_s),
            *self._profile_args(),
            *self._classifier_args(),
            *spec.allocator_args,
        )  # fmt: skip
        self._wait_address("allocator")
        ready("allocator")
        if spec.controlnet:
            self._launch("controlnet", "controlnet", "--catalog", "tiny", *self._nice_args())
            self._wait_address("controlnet")  # workers are told where it is
            ready("controlnet")
        for i in range(spec.workers):
            self.start_worker(i, wait=False)
        self._launch_router()  # it needs only the allocator: it starts while workers warm up
        self._wait_workers_ready(ready)
        self._wait_address("router")
        if spec.router_http_port is not None:
            self._wait_http_url()
        self.wait_for_workers(spec.workers)
        ready("router")
        self._write_targets()
        ready("cluster")

    def _launch_router(self) -> None:
        spec = self.spec
        router_args: list[str] = ["--allocator", self.allocator, "--port", str(spec.router_port)]
        # as the workers run: requests that leave steps or size to them are priced so
        router_args += ["--default-steps", str(spec.default_steps)]
        router_args += ["--default-size", str(spec.default_size)]
        if spec.router_http_port is not None:
            router_args += ["--http-port", str(spec.router_http_port)]
        for flag, value in (
            ("--auth-token-file", spec.auth_token_file),
            ("--tls-cert", spec.tls_cert),
            ("--tls-key", spec.tls_key),
        ):
            if value is not None:
                router_args += [flag, value]
        self._launch(
            "router",
            "router",
            *router_args,
            *self._profile_args(),
            *self._classifier_args(),
            *spec.router_args,
        )

    def _wait_workers_ready(self, ready: Callable[[str], None]) -> None:
        """Wait until every worker printed ``ready`` (its warm-up ran), reporting each."""
        waiting = self.worker_names()
        deadline = time.monotonic() + self.spec.start_timeout_s
        while waiting:
            for name in list(waiting):
                part = self.parts[name]
                text = part.log_text()
                if not part.address and LISTENING.search(text):
                    part.address = LISTENING.findall(text)[-1]
                if WORKER_READY.search(text):
                    waiting.remove(name)
                    ready(name)
                elif not part.alive():
                    raise ClusterError(
                        f"{name} exited with code {part.process.returncode} before it was "
                        f"ready:\n{part.log_tail()}"
                    )
            for name in ("allocator", "router"):
                if name in self.parts and not self.parts[name].alive():
                    raise ClusterError(f"{name} exited:\n{self.parts[name].log_tail()}")
            if waiting and time.monotonic() > deadline:
                raise ClusterError(
                    f"{', '.join(waiting)} not ready in {self.spec.start_timeout_s:.0f} s"
                )
            time.sleep(0.1)

    def start_worker(self, index: int, *, wait: bool = True) -> Part:
        """Start (or restart) worker ``index``; its cache directory survives restarts."""
        spec = self.spec
        name = f"worker-{index}"
        args = [
            "--worker-id", name,
            "--allocator", self.allocator,
            "--cache-dir", str(spec.workdir / name),
            "--default-steps", str(spec.default_steps),
            "--default-size", str(spec.default_size),
            *self._profile_args(),
            *self._nice_args(),
        ]  # fmt: skip
        if "controlnet" in self.parts:
            args += ["--controlnet", self.parts["controlnet"].address]
        if spec.index_outage_file is not None:
            args += ["--index-outage-file", spec.index_outage_file]
        part = self._launch(name, "worker", *args, *spec.worker_args)
        if wait:
            self._wait_address(name)
        return part

    def _nice_args(self) -> list[str]:
        return ["--nice", str(self.spec.compute_nice)] if self.spec.compute_nice else []

    def _profile_args(self) -> list[str]:
        return [] if self.spec.profile is None else ["--profile", self.spec.profile]

    def _classifier_args(self) -> list[str]:
        """The router classifies with it and the allocator prices those classes with its
        Q(v | c): both must read the same artifacts."""
        return [] if self.spec.classifier is None else ["--classifier", self.spec.classifier]

    def _launch(self, name: str, command: str, *args: str) -> Part:
        """Start ``argus COMMAND ARGS`` as part ``name``, with the certificate COMMAND/NAME."""
        spec = self.spec
        metrics_port = free_port(spec.host) if spec.metrics else None
        tls_dir = self.tls_dir(Identity(command, name))
        full = [command, "--host", spec.host, "--internal-tls-dir", str(tls_dir)]
        if command != "router" or "--port" not in args:
            full += ["--port", "0"]
        full += list(args)
        if metrics_port is not None:
            full += ["--metrics-port", str(metrics_port)]
        return self._spawn(name, full, metrics_port)

    def _spawn(self, name: str, full: Sequence[str], metrics_port: int | None) -> Part:
        """Run ``argus FULL...`` as the part ``name``, its output appended to its log."""
        spec = self.spec
        log_path = spec.workdir / "logs" / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        offset = log.seek(0, os.SEEK_END)
        self._logs.append(log)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with inherited_affinity(spec.cpus_for(name)):  # restarts too land on the part's set
            process = subprocess.Popen(
                [sys.executable, "-m", "argus", *full],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches `argus up` only
            )
        part = Part(
            name, process, log_path, metrics_port=metrics_port, args=tuple(full), log_offset=offset
        )
        self.parts[name] = part
        return part

    def _wait_address(self, name: str) -> str:
        part = self.parts[name]
        part.address = self._wait_log(part, LISTENING, "serving")
        return part.address

    def _wait_http_url(self) -> str:
        """The router's HTTP base URL from its log (printed right after its gRPC address)."""
        part = self.parts["router"]
        part.http_url = self._wait_log(part, HTTP_ON, "serving HTTP")
        return part.http_url

    def _wait_log(self, part: Part, pattern: re.Pattern[str], what: str) -> str:
        """The last match of ``pattern`` in ``part``'s log, once there is one; ClusterError if
        the process exits first or nothing matches within the start timeout."""
        deadline = time.monotonic() + self.spec.start_timeout_s
        while time.monotonic() < deadline:
            found = pattern.findall(part.log_text())
            if found:
                return str(found[-1])
            if not part.alive():
                raise ClusterError(
                    f"{part.name} exited with code {part.process.returncode} before {what}:\n"
                    f"{part.log_tail()}"
                )
            time.sleep(0.1)
        raise ClusterError(f"{part.name} did not start {what} in {self.spec.start_timeout_s:.0f} s")

    def wait_for_workers(self, count: int, timeout_s: float | None = None) -> Any:
        """Wait until the allocator's plan holds ``count`` workers and the router is SERVING;
        returns the plan."""
        from argus.contracts.allocator_client import AllocatorClient

        deadline = time.monotonic() + (timeout_s or self.spec.start_timeout_s)
        client = AllocatorClient(self.allocator, timeout_s=5.0, tls=self.internal_tls())
        try:
            while time.monotonic() < deadline:
                try:
                    plan = client.get_plan()
                except grpc.RpcError:
                    plan = None
                if plan is not None and len(plan.workers) == count and self.router_serving():
                    return plan
                for part in self.parts.values():
                    if not part.alive() and part.name in ("allocator", "router"):
                        raise ClusterError(f"{part.name} exited:\n{part.log_tail()}")
                time.sleep(0.2)
        finally:
            client.close()
        raise ClusterError(f"the plan did not reach {count} workers in time")

    def router_serving(self) -> bool:
        """The router's standard health check says SERVING (no credentials needed)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with self.channel() as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2.0
                )
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def channel(self) -> grpc.Channel:
        """A channel to the router (TLS when the cluster serves it, trusting its certificate)."""
        if self.spec.tls_cert is None:
            return grpc.insecure_channel(self.router)
        credentials = grpc.ssl_channel_credentials(Path(self.spec.tls_cert).read_bytes())
        return grpc.secure_channel(self.router, credentials)

    def _write_targets(self) -> None:
        targets = [
            {
                "targets": [f"{self.spec.host}:{part.metrics_port}"],
                "labels": {"job": f"argus-{part.name.split('-')[0]}", "part": part.name},
            }
            for part in self.parts.values()
            if part.metrics_port is not None
        ]
        (self.spec.workdir / "prometheus-targets.json").write_text(json.dumps(targets, indent=2))

    # -- faults and stop -----------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL one part (a crash: no leave message, no cleanup)."""
        part = self.parts[name]
        if part.alive():
            part.process.kill()
        part.process.wait()

    def dead(self) -> list[tuple[str, int | None]]:
        """Parts whose process has exited, with its exit code (what a supervisor watches)."""
        return [
            (name, part.process.returncode) for name, part in self.parts.items() if not part.alive()
        ]

    def restart(self, name: str) -> Part:
        """Start a part that exited again with the same arguments on the same port: the other
        parts keep its address (workers know the allocator's and the ControlNet service's,
        clients the router's), so it must come back where it was."""
        old = self.parts[name]
        if old.alive():
            raise ClusterError(f"{name} is running (pid {old.process.pid}); not restarting it")
        args = list(old.args)
        if old.address and "--port" in args:
            args[args.index("--port") + 1] = old.address.rpartition(":")[2]
        if old.http_url and "--http-port" in args:
            port = old.http_url.removesuffix("/v1").rpartition(":")[2]
            args[args.index("--http-port") + 1] = port
        part = self._spawn(name, args, old.metrics_port)
        part.address = old.address
        part.http_url = old.http_url
        return part

    def stop(self, timeout_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM the parts router first, allocator last; SIGKILL what outlives ``timeout_s``.

        Returns each part's exit code.
        """
        order = ["router", *self.worker_names(), "controlnet", "allocator"]
        for group in (order[:1], order[1:-1], order[-1:]):
            parts = [self.parts[n] for n in group if n in self.parts]
            for part in parts:
                if part.alive():
                    part.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for part in parts:
                try:
                    part.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    part.process.kill()
                    part.process.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()
        return {name: part.process.returncode for name, part in self.parts.items()}

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def describe(cluster: LocalCluster) -> Sequence[str]:
    """One line per part: name, pid, gRPC address, the router's HTTP API, metrics endpoint."""
    lines = []
    for part in cluster.parts.values():
        metrics = f"  metrics http://{cluster.spec.host}:{part.metrics_port}/metrics"
        http = f"  http {part.http_url}" if part.http_url else ""
        lines.append(
            f"{part.name:<11} pid {part.process.pid:<7} {part.address:<21}"
            + http
            + (metrics if part.metrics_port is not None else "")
        )
    return lines
