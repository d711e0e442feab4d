"""Every Grafana dashboard panel's PromQL, run through a real Prometheus scraping a live cluster.

A :class:`~argus.tools.local_cluster.LocalCluster` (allocator, ControlNet service, a worker and a
router, each a real process serving ``/metrics``) takes load while Debian's ``prometheus``
scrapes every part each second. Then every ``expr`` of every panel in
``helm/argus/dashboards/*.json`` goes through ``GET /api/v1/query``: each must succeed and
return at least one sample that is a number. An answer of NaN only (a quantile or a ratio over
no events) is what Grafana draws as no data, so it fails too. A number is not enough for a
counter or a histogram: ``rate`` of a counter nothing increments is a flat 0, which looks like
data. So every counter and histogram a panel plots must also have been incremented by the load
below, except those listed in ``NOT_YET_PRODUCED`` with the reason. All failures are reported
at once.

The load is what a busy cluster sees: a few prompts over and over from two clients (once the
allocator has moved the worker to a level K > 0, repeats hit the approximate cache), two
ControlNet requests (the second finds the ControlNet resident), one naming a ControlNet that
does not exist (a worker error), requests whose deadline the router predicts it cannot meet
(admission rejections) and one malformed router report at the allocator (its
rejected-requests counter). Requests run 30 steps: the AC levels
skip up to K = 25 steps, and the router never sends a request to a level that would skip all of
its steps.

Skipped when the ``prometheus`` binary is missing, except in CI (``CI=true``), which installs it
(``.ci/run``).
"""

from __future__ import annotations

import collections
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from PIL import Image

from argus.plumbing import rpc
from argus.plumbing.internal_tls import Identity, channel
from argus.tools.client import Connection, RequestFailed, RouterClient
from argus.tools.local_cluster import ClusterSpec, LocalCluster, free_port

common_pb2: Any = rpc.load("common_pb2")
router_pb2: Any = rpc.load("router_pb2")
worker_pb2: Any = rpc.load("worker_pb2")
allocator_pb2: Any = rpc.load("allocator_pb2")
allocator_pb2_grpc: Any = rpc.load("allocator_pb2_grpc")

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "helm" / "argus" / "dashboards"

STEPS = 30  # > 25, the largest K of the default profile's AC levels
SIZE = 64
SCRAPE_INTERVAL_S = 1
LOAD_MAX_S = 90.0  # stop the load here even if the cache has not hit yet
CACHE_HITS_WANTED = 3
PROMPTS = (
    "a red fox in the snow",
    "a blue car on a mountain road",
    "a lighthouse at dusk",
    "a bowl of fruit on a wooden table",
)
# Plotted counters and histograms that no code path increments yet, with the reason. Their
# panels stay, as what is coming; the test fails once one is produced, so the list shrinks.
NOT_YET_PRODUCED: dict[str, str] = {}  # none now; a panel on a metric nothing makes goes here
# Plotted counters the code increments, but only on events this load does not provoke (a
# worker dying, retrieval failing, a full cache). Named here so the gap is seen, each with the
# test that drives its code path; they may still be incremented by chance (a worker missing
# heartbeats on a loaded machine), which is not a failure.
NOT_IN_THIS_LOAD = {
    "argus_allocator_dead_workers_total": "test_allocator_service (dead workers)",
    "argus_allocator_strategy_switches_total": "test_allocator_service (retrieval outage)",
    "argus_router_retries_total": "test_router_edges (an UNAVAILABLE worker)",
    "argus_router_spills_total": "test_router_core (one worker: nothing to spill to here)",
    "argus_worker_cache_evictions_total": "test_cache (a full cache)",
    "argus_worker_cache_k_reduced_total": "test_worker_cache_path (a farther neighbour)",
    "argus_worker_substituted_total": "test_worker_engine (a level whose model is not loaded)",
    "argus_controlnet_cache_evictions_total": "none yet: one ControlNet never fills the cache",
    "argus_controlnet_cache_load_failures_total": "none yet: the tiny ControlNets always load",
    "argus_router_classifier_retrains_total": "test_router_drift (scores that fall)",
}
METRIC_NAME = re.compile(r"\bargus_[a-zA-Z0-9_]*[a-zA-Z0-9]\b")
# Grafana's own variables, as Grafana would expand them for a short time range
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "${__rate_interval}": "1m",
    "$__interval": "5s",
    "${__interval}": "5s",
    "$__range": "1h",
    "${__range}": "1h",
}


# -- the dashboards' queries -------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    board: str
    panel: str
    ref_id: str
    expr: str

    def __str__(self) -> str:
        return f"{self.board} / {self.panel} / {self.ref_id}: {self.expr}"


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside (collapsed) rows included."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def expand_grafana_variables(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def dashboard_queries() -> list[PanelQuery]:
    queries = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in panels(board["panels"]):
            for target in panel.get("targets", []):
                expr = expand_grafana_variables(target["expr"])
                queries.append(PanelQuery(path.name, panel["title"], target["refId"], expr))
    return queries


@pytest.mark.unit
def test_dashboard_queries_are_found() -> None:
    """The integration test below checks something: every board has queries."""
    boards = {q.board for q in dashboard_queries()}
    assert boards == {p.name for p in DASHBOARDS.glob("*.json")}
    assert {"argus-overview.json", "argus-quality.json", "argus-cache.json"} <= boards


def plotted_metrics(queries: list[PanelQuery]) -> dict[str, list[PanelQuery]]:
    """Each ``argus_*`` series name the queries read, with the queries that read it."""
    used: dict[str, list[PanelQuery]] = {}
    for query in queries:
        for name in sorted(set(METRIC_NAME.findall(query.expr))):
            used.setdefault(name, []).append(query)
    return used


# the series Prometheus scrapes of each metric family type (the ``_created`` ones aside)
SERIES_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def exported_series() -> set[str]:
    """Every ``argus_*`` series name the processes' metrics modules export, each module built
    on a registry of its own as its process builds it."""
    from prometheus_client import CollectorRegistry

    from argus.allocator.metrics import AllocatorMetrics
    from argus.profiles import default_profiles
    from argus.router.metrics import RouterMetrics
    from argus.worker.adapters.controlnet.cache import CacheStats
    from argus.worker.adapters.controlnet.executor import ExecutorStats
    from argus.worker.adapters.controlnet.metrics import ControlNetMetrics
    from argus.worker.approx_cache.cache import CacheMetrics
    from argus.worker.metrics import WorkerMetrics

    registries = [CollectorRegistry() for _ in range(4)]
    AllocatorMetrics(default_profiles(), registries[0])
    RouterMetrics(default_profiles(), registries[1])
    WorkerMetrics(registries[2])
    CacheMetrics(registries[2])  # the worker's approximate cache
    idle = ExecutorStats(CacheStats("lru", 0, 0, 0, 0, 0, 0.0, (), 0, 0), 0, 0, 0)
    ControlNetMetrics(lambda: idle, registries[3])
    return {
        family.name + suffix
        for registry in registries
        for family in registry.collect()
        for suffix in SERIES_SUFFIXES.get(family.type, ("",))
    }


@pytest.mark.unit
def test_every_plotted_metric_is_one_argus_exports() -> None:
    """A panel on a name no process exports (a typo, a metric renamed or removed) draws
    nothing forever; every name the panels plot is one a metrics module defines, and the
    exception lists name only plotted metrics."""
    used = plotted_metrics(dashboard_queries())
    missing = {
        name: [str(q) for q in queries]
        for name, queries in used.items()
        if name not in exported_series()
    }
    assert missing == {}
    assert set(NOT_YET_PRODUCED) | set(NOT_IN_THIS_LOAD) <= set(used)  # none is stale


# -- Prometheus --------------------------------------------------------------------------------


def prometheus_binary() -> str:
    """The ``prometheus`` command; skips the test without it, fails it in CI."""
    binary = shutil.which("prometheus")
    if binary is not None:
        return binary
    message = "the prometheus binary is not installed (Debian: apt-get install prometheus)"
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{message}; CI must install it (.ci/run)")
    pytest.skip(message)


class Prometheus:
    """A Prometheus server on loopback, scraping the targets of a ``file_sd`` file every second."""

    def __init__(self, binary: str, workdir: Path, targets_file: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
            },
            "scrape_configs": [
                {"job_name": "argus", "file_sd_configs": [{"files": [str(targets_file)]}]}
            ],
        }
        config_path = workdir / "prometheus.yml"
        config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.address = f"127.0.0.1:{free_port()}"
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={self.address}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params: str) -> Any:
        """GET an API path; returns the decoded JSON (error answers included)."""
        url = f"http://{self.address}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as err:  # 400/422/503 carry a JSON error body
            return json.load(err)

    def query(self, expr: str) -> Any:
        return self.get("/api/v1/query", query=expr)

    def wait(self, what: str, ready: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited while waiting for {what}:\n{self.tail()}")
            try:
                if ready():
                    return
            except (OSError, ValueError, KeyError):
                pass  # not listening or not ready yet
            time.sleep(0.2)
        raise AssertionError(f"prometheus: no {what} in {timeout_s:.0f} s:\n{self.tail()}")

    def wait_for_targets(self, count: int) -> None:
        """Until ``count`` targets are up, each scraped at least once."""

        def up() -> bool:
            active = self.get("/api/v1/targets")["data"]["activeTargets"]
            return len(active) == count and all(t["health"] == "up" for t in active)

        self.wait(f"{count} targets up", up)

    def wait_for_scrapes(self, since: float, count: int) -> None:
        """Until every target has been scraped ``count`` times after the wall time ``since``."""

        def scraped() -> bool:
            window = math.floor(time.time() - since)
            if window < count * SCRAPE_INTERVAL_S:
                return False
            reply = self.query(f"min(count_over_time(up[{window}s]))")
            result = reply["data"]["result"]
            return bool(result) and float(result[0]["value"][1]) >= count

        self.wait(f"{count} scrapes of every target", scraped)

    def tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def has_data(reply: Any) -> str | None:
    """None when a query's answer holds a number; otherwise what is wrong with it."""
    if reply.get("status") != "success":
        return f"{reply.get('errorType')}: {reply.get('error')}"
    data = reply["data"]
    if data["resultType"] == "vector":
        values = [series["value"][1] for series in data["result"]]
    elif data["resultType"] == "scalar":
        values = [data["result"][1]]
    else:
        return f"a {data['resultType']} (a panel needs an instant vector or a scalar)"
    if not values:
        return "no series"
    if all(math.isnan(float(value)) for value in values):
        return f"NaN only ({len(values)} series)"
    return None


def failing(prometheus: Prometheus, queries: list[PanelQuery]) -> list[str]:
    """Each query that returns no data, with the reason."""
    failures = []
    for query in queries:
        problem = has_data(prometheus.query(query.expr))
        if problem is not None:
            failures.append(f"{query}\n    -> {problem}")
    return failures


def counted_series(name: str, metadata: dict[str, Any]) -> str | None:
    """For a plotted series name, the series that counts its events: the counter itself, or
    the ``_count`` of its histogram or summary; None for a gauge (0 may be its true value).
    Prometheus scrapes OpenMetrics, whose metadata names a counter without ``_total``."""

    def kinds(family: str) -> set[str]:
        return {entry["type"] for entry in metadata.get(family, [])}

    if "counter" in kinds(name) | kinds(name.removesuffix("_total")):
        return name
    for suffix in ("_bucket", "_count", "_sum"):
        family = name.removesuffix(suffix)
        if family != name and {"histogram", "summary"} & kinds(family):
            return f"{family}_count"
    return None


@pytest.mark.unit
def test_counted_series_reads_openmetrics_metadata() -> None:
    """As Prometheus keeps it for OpenMetrics scrapes (checked against Prometheus 2.42):
    counters without ``_total``, histograms by family."""
    metadata = {
        "argus_x": [{"type": "counter"}],
        "argus_z_seconds": [{"type": "histogram"}],
        "argus_g": [{"type": "gauge"}],
    }
    assert counted_series("argus_x_total", metadata) == "argus_x_total"
    assert counted_series("argus_z_seconds_bucket", metadata) == "argus_z_seconds_count"
    assert counted_series("argus_z_seconds_sum", metadata) == "argus_z_seconds_count"
    assert counted_series("argus_g", metadata) is None


def never_incremented(prometheus: Prometheus, queries: list[PanelQuery]) -> list[str]:
    """Each plotted counter or histogram still at 0 after the load, unless excused by
    NOT_YET_PRODUCED or NOT_IN_THIS_LOAD; and each not-yet-produced one incremented after all
    (so the list shrinks). A plotted name Prometheus has no metadata for fails too."""
    metadata = prometheus.get("/api/v1/metadata")["data"]
    failures = []
    for name, uses in sorted(plotted_metrics(queries).items()):
        series = counted_series(name, metadata)
        if series is None:
            if not any(name.removesuffix(s) in metadata for s in ("", "_bucket", "_count", "_sum")):
                failures.append(f"{name}: no process exports it")
            continue  # a gauge: the queries above check it has a value
        reply = prometheus.query(f"sum({series})")
        result = reply.get("data", {}).get("result", [])
        total = float(result[0]["value"][1]) if result else 0.0
        if name in NOT_YET_PRODUCED:
            if total > 0:
                failures.append(f"{name} is produced now: take it out of NOT_YET_PRODUCED")
        elif total <= 0 and name not in NOT_IN_THIS_LOAD:
            panels = "; ".join(sorted({f"{q.board} / {q.panel}" for q in uses}))
            failures.append(f"{name} was never incremented, yet plotted by: {panels}")
    return failures


# -- the cluster and its load ------------------------------------------------------------------


def control_png() -> bytes:
    pixels = np.random.default_rng(1).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def controlnet_request(name: str) -> Any:
    request = router_pb2.RouterGenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt="a house by a lake",
        seed=7,
        steps=STEPS,
        width=SIZE,
        height=SIZE,
        # the ControlNet panels need this one served: on a loaded machine it outlived the
        # router's default 30 s deadline, and the worker now stops work past its deadline
        deadline_ms=110_000,
    )
    request.adapters.add(
        kind=common_pb2.Adapter.Kind.CONTROLNET, name=name, scale=1.0, control_image=control_png()
    )
    return request


class Load:
    """Requests through the router from a few threads; ``outcomes`` counts how each ended."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.client = RouterClient(Connection(cluster.router))
        self.outcomes: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def count(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def cache_hits(self) -> int:
        with self._lock:
            return self.outcomes["cache hits"]

    def lookup_misses(self) -> int:
        with self._lock:
            return self.outcomes["other-steps misses"]

    def summary(self) -> str:
        with self._lock:
            return ", ".join(f"{name} {n}" for name, n in sorted(self.outcomes.items()))

    def send(self, label: str, call: Callable[[], Any]) -> None:
        try:
            reply = call()
        except RequestFailed as err:
            self.count(f"{label} {err.code.name}")
            return
        cache = worker_pb2.CacheOutcome.Name(reply.worker_response.cache)
        self.count(f"{label} OK {reply.level} {cache}")
        if cache == "CACHE_HIT":
            self.count("cache hits")
        elif cache == "CACHE_MISS" and label == "other-steps":
            self.count("other-steps misses")

    def steady(self, client: int) -> None:
        """Back-to-back requests over a few prompts: repeats find each other in the cache."""
        i = 0
        while not self._stop.is_set():
            prompt = PROMPTS[(i + client) % len(PROMPTS)]
            seed = i
            self.send(
                "plain",
                lambda p=prompt, s=seed: self.client.generate(p, seed=s, steps=STEPS, size=SIZE),
            )
            i += 1

    def events(self) -> None:
        """The requests whose series exist only once something happened."""
        for _ in range(2):  # the second finds the ControlNet resident: a device cache hit
            self.send("controlnet", lambda: self.client.call(controlnet_request("canny"), 120.0))
        self.send("bad-controlnet", lambda: self.client.call(controlnet_request("nosuch"), 60.0))
        # admission rejections: even an idle worker takes more than 1 ms. A 1 s deadline did
        # not do it: a 64-pixel, 30-step request is about 10 ms of the profile's GPU time, so
        # the router admitted it and argus_router_admissions_rejected stayed at 0.
        for _ in range(3):
            self.send(
                "deadline",
                lambda: self.client.generate(PROMPTS[0], steps=STEPS, size=SIZE, deadline_ms=1),
            )
        # a lookup that misses: the repeated prompts all hit once cached, so once the plan
        # serves K > 0 (hits seen), requests of steps no earlier request used find no entry
        # of their key, whenever the PASM sends one to a K > 0 level
        deadline = time.monotonic() + LOAD_MAX_S
        while self.cache_hits() < 1 and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.2)
        for steps in (STEPS - 2, *range(STEPS + 1, STEPS + 10)):
            self.send(
                "other-steps",
                lambda n=steps: self.client.generate(PROMPTS[0], steps=n, size=SIZE),
            )
            if self.lookup_misses():
                break
        router = Identity("router", "dashboards")  # reports come from routers only
        tls = self.cluster.internal_tls(router)
        with channel(self.cluster.allocator, tls) as allocator:
            stub = allocator_pb2_grpc.AllocatorStub(allocator)
            try:  # router_id must not be empty
                stub.ReportRouter(allocator_pb2.RouterReport(router_id=""), timeout=10)
                self.count("bad-report OK")
            except grpc.RpcError as err:
                self.count(f"bad-report {err.code().name}")

    def run(self) -> None:
        """Load until the one-off requests are done and the cache has hit a few times (the
        allocator has re-planned for the load by then); LOAD_MAX_S at most, after which the
        queries tell what is missing."""
        threads = [threading.Thread(target=self.steady, args=(c,)) for c in range(2)]
        threads.append(threading.Thread(target=self.events))
        started = time.monotonic()
        for thread in threads:
            thread.start()
        try:
            while time.monotonic() - started < LOAD_MAX_S:
                if self.cache_hits() >= CACHE_HITS_WANTED and not threads[-1].is_alive():
                    break
                time.sleep(0.2)
        finally:
            self._stop.set()
            for thread in threads:
                thread.join()
        try:
            self.late()
        finally:
            self.client.close()

    def late(self) -> None:
        """An SLO violation: admitted, then not served in time. The router admits on the
        speed it learned from the worker's replies, so once the load is over the request gets
        a deadline the idle worker would meet (8 × the last request's service time: the
        levels' speeds differ up to 6 ×), and the worker is stopped (SIGSTOP, our own
        process) until the request has ended DEADLINE after admission."""
        timing = self.client.generate(PROMPTS[1], steps=STEPS, size=SIZE).worker_response.timing
        deadline_ms = max(1500, int(8 * (timing.total_ms - timing.queue_ms)))
        worker = self.cluster.parts["worker-0"].process
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            self.send(
                "late",
                lambda: self.client.generate(
                    PROMPTS[1], seed=1, steps=STEPS, size=SIZE, deadline_ms=deadline_ms
                ),
            )
        finally:
            os.kill(worker.pid, signal.SIGCONT)


# -- the test ----------------------------------------------------------------------------------


@pytest.mark.e2e
def test_every_dashboard_query_returns_data(tmp_path: Path) -> None:
    binary = prometheus_binary()
    queries = dashboard_queries()
    spec = ClusterSpec(
        workdir=tmp_path / "cluster",
        workers=1,
        default_steps=STEPS,
        default_size=SIZE,
        period_s=5.0,  # re-plan for the load within the test
        # AC throughout: the ControlNet and the cached latents this load counts are SDXL's;
        # ``best`` may move the one worker to an SD-1.x model, which serves neither
        allocator_args=("--strategy-choice", "ac-first"),
    )
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        prometheus = Prometheus(
            binary, tmp_path / "prometheus", spec.workdir / "prometheus-targets.json"
        )
        try:
            targets = json.loads((spec.workdir / "prometheus-targets.json").read_text())
            prometheus.wait_for_targets(len(targets))  # the file_sd list Prometheus reads
            load = Load(cluster)
            load.run()
            # counters a request created at the very end need two samples for rate()
            prometheus.wait_for_scrapes(since=time.time(), count=2)
            failures = failing(prometheus, queries) + never_incremented(prometheus, queries)
        finally:
            prometheus.stop()
    finally:
        cluster.stop()
    assert not failures, (
        f"{len(failures)} dashboard queries or plotted counters failed:\n"
        + "\n".join(failures)
        + f"\nthe load: {load.summary()}\nlogs of the cluster and Prometheus: {tmp_path}"
    )
