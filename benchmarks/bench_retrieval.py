"""Approximate-cache retrieval: Qdrant Edge top-1 search at 10k / 100k / 1M cached prompts, and
latent fetch from the LatentStore.

Search: ``EdgeVectorIndex.search`` exactly as the cache calls it (top-1, cosine, the payload
filter on the keyword ``key`` field, the payload returned), over N 384-d unit vectors (the
MiniLM prompt-embedding size) with a realistic payload (prompt, key fields, five latent
digests). ``--data real`` (the default): the real prompts at hand (the bundled PartiPrompts,
1,632, and any other prompt TSV given with ``--prompts``) embedded with all-MiniLM-L6-v2
(``argus.embedding.PromptEmbedder``, as the worker embeds); a fifth of them, held out, are
the queries (cycled to ``--queries`` searches), the rest are cached, and the cache is filled
up to N with SYNTHETIC neighbours of those real embeddings: each a real embedding plus
Gaussian noise of norm ``--neighbour-noise`` (0.35: cosine ≈ 0.94 to it, a paraphrase),
renormalised onto the unit sphere (embedding a million prompts on 2 CPUs would take hours).
Other data is all SYNTHETIC: ``clustered`` draws points around 1,000 random centres (cosine
to the centre ≈ 0.86), ``random`` is uniform on the sphere (the hardest case for HNSW), with
fresh points from the same distribution as queries. recall@1 compares the
returned point with exact search (numpy, all N) on the first ``--recall`` queries; a tie in
score counts as found. Beside it, what the cache's hit threshold sees: the cosine by which
the returned point falls short of the exact top-1 (p50, p99; a miss counts as 2), and the
share of queries within 0.01 of it. With the SYNTHETIC neighbours, hundreds of points lie at
nearly the same cosine to a query, so recall@1 counts near-ties as misses that no threshold
could tell apart. Build: upserts in batches, then ``optimize()`` (HNSW) in process; the
"load" column is reopening the built shard, which is what a serving worker pays (holding the
GIL) once per background rebuild. Search latencies are single-threaded, after a warm-up.

Fetch: ``LatentStore.get`` (read, sha256 check, safetensors parse, fp16 → fp32) of an SDXL-sized
latent (1×4×96×96 fp16, 768 px) and a tiny one (1×4×8×8), on local disk with a warm page cache.

    python benchmarks/bench_retrieval.py --size 20k [--data real|clustered|random] [--int8]
        [--hnsw-ef default,64] [--search-threads default,1] [--queries 2000] [--recall 200]
        [--workdir DIR] [--keep]

Each built shard is measured for every (hnsw_ef, search_threads) pair; the pairs take turns
over ``--rounds`` slices of the queries (reopening the shard each turn), so load from other
processes on a shared machine falls on all of them alike. ``--keep`` with ``--workdir`` keeps
the shards; ``--reuse`` then measures them again without rebuilding.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _machine import load_line, machine_line

from argus.worker.approx_cache.cache import CacheKey
from argus.worker.approx_cache.latent_store import LatentStore
from argus.worker.approx_cache.vector_index import EdgeIndexConfig, EdgeVectorIndex, IndexMatch

DIM = 384
CENTRES = 1000
HELD_OUT = 0.2  # share of the real prompts kept out of the cache, as queries
SPREAD = 0.6  # noise norm relative to the centre: cosine to the centre ≈ 1/√(1+0.36) ≈ 0.86
KEY = CacheKey("sd-xl", "euler", 768, 768, 50)


def parse_size(text: str) -> int:
    text = text.strip().lower().replace("_", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1], 1)
    return int(float(text.rstrip("km")) * scale)


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def sample(n: int, data: str, rng: np.random.Generator, centres: np.ndarray) -> np.ndarray:
    noise = rng.standard_normal((n, DIM), dtype=np.float32)
    if data == "random":
        return unit(noise)
    picks = centres[rng.integers(0, len(centres), n)]
    return unit(picks + SPREAD * noise / np.sqrt(DIM))


def real_embeddings(prompt_files: list[Path]) -> np.ndarray:
    """The unique prompts of PartiPrompts and ``prompt_files``, embedded, in a fixed order."""
    from argus.embedding import PromptEmbedder
    from argus.sim.workloads import default_prompts, load_prompt_file

    texts = [r.prompt for r in default_prompts()]
    for path in prompt_files:
        texts += [r.prompt for r in load_prompt_file(path)]
    unique = sorted(set(texts))
    began = time.perf_counter()
    vectors = PromptEmbedder().embed(unique)
    print(
        f"  embedded {len(unique):,} unique real prompts with all-MiniLM-L6-v2 in "
        f"{time.perf_counter() - began:.1f} s",
        flush=True,
    )
    return unit(np.asarray(vectors, dtype=np.float32))


def real_data(
    real: np.ndarray, n: int, queries: int, noise: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(cache of n vectors, queries): held-out real embeddings as queries; the real rest and
    SYNTHETIC neighbours of it (noise of norm ``noise``, renormalised) as the cache."""
    order = rng.permutation(len(real))
    held = max(1, int(HELD_OUT * len(real)))
    query_rows, cached_rows = order[:held], order[held:]
    base = real[cached_rows][:n]
    extra = n - len(base)
    chunks = [base]
    for start in range(0, extra, 100_000):
        count = min(100_000, extra - start)
        picks = real[cached_rows[rng.integers(0, len(cached_rows), count)]]
        jitter = rng.standard_normal((count, DIM), dtype=np.float32) * (noise / np.sqrt(DIM))
        chunks.append(unit(picks + jitter))
    cache = np.concatenate(chunks)
    return cache, real[query_rows][np.arange(queries) % held]


def point_id(row: int) -> str:
    return str(uuid.UUID(int=row + 1))


def row_of(point: str) -> int:
    return uuid.UUID(point).int - 1


def payload(row: int) -> dict[str, Any]:
    digests = {str(k): f"{row:016x}".ljust(64, str(k % 10)) for k in (5, 10, 15, 20, 25)}
    return {
        "key": KEY.tag,
        "prompt": f"synthetic prompt number {row}, a cat in a hat, oil painting",
        "model": KEY.model,
        "scheduler": KEY.scheduler,
        "height": KEY.height,
        "width": KEY.width,
        "steps": KEY.steps,
        "latents": digests,
        "latent_bytes": 5 * 73_800,
        "last_used": row,
        "schema": 1,
    }


def build(path: Path, x: np.ndarray, config: EdgeIndexConfig, batch: int) -> dict[str, float]:
    index = EdgeVectorIndex(path, DIM, config=config, optimize_after=None)
    began = time.perf_counter()
    for start in range(0, len(x), batch):
        rows = range(start, min(len(x), start + batch))
        index.upsert_many([(point_id(r), x[r], payload(r)) for r in rows])
    upsert_s = time.perf_counter() - began
    print(f"  upserted {len(x):,} points in {upsert_s:.1f} s; building HNSW", flush=True)
    began = time.perf_counter()
    index.optimize()
    optimize_s = time.perf_counter() - began
    info = index.info()
    print(
        f"  built: {info.points_count} points, {info.indexed_vectors_count} in HNSW, "
        f"{info.segments_count} segments",
        flush=True,
    )
    index.close()
    return {"upsert_s": upsert_s, "optimize_s": optimize_s}


def exact_top1(x: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    best = np.full(len(queries), -np.inf, dtype=np.float32)
    arg = np.zeros(len(queries), dtype=np.int64)
    for start in range(0, len(x), 200_000):
        scores = x[start : start + 200_000] @ queries.T
        top = scores.argmax(axis=0)
        value = scores[top, np.arange(len(queries))]
        better = value > best
        best[better], arg[better] = value[better], top[better] + start
    return arg, best


def parse_settings(ef_list: str, threads_list: str) -> list[tuple[int | None, int | None]]:
    """The (hnsw_ef, search_threads) pairs to measure; "default" is None: the product's
    (``EdgeIndexConfig``'s) value."""

    def values(text: str) -> list[int | None]:
        return [None if v.strip() == "default" else int(v) for v in text.split(",")]

    return [(ef, t) for ef in values(ef_list) for t in values(threads_list)]


def search_once(
    path: Path, queries: np.ndarray, config: EdgeIndexConfig
) -> tuple[float, list[float], list[IndexMatch | None]]:
    """Open the built shard with ``config``, warm up, time one search per query."""
    began = time.perf_counter()
    index = EdgeVectorIndex(path, DIM, config=config, optimize_after=None)
    load_s = time.perf_counter() - began
    for q in queries[:50]:  # warm-up
        index.search(q, KEY.tag)
    latencies, found = [], []
    for q in queries:
        began = time.perf_counter()
        found.append(index.search(q, KEY.tag))
        latencies.append(time.perf_counter() - began)
    index.close()
    return load_s, latencies, found


def measure_search(
    path: Path,
    x: np.ndarray,
    queries: np.ndarray,
    configs: list[EdgeIndexConfig],
    rounds: int,
    recall_n: int,
) -> list[dict[str, float]]:
    """Latency and recall@1 of each config. The configs take turns over ``rounds`` slices of
    the queries, so load from other processes falls on all of them alike."""
    loads: list[list[float]] = [[] for _ in configs]
    latencies: list[list[float]] = [[] for _ in configs]
    found: list[list[IndexMatch | None]] = [[] for _ in configs]
    for part in np.array_split(np.arange(len(queries)), rounds):
        for i, config in enumerate(configs):
            load_s, lat, matches = search_once(path, queries[part], config)
            loads[i].append(load_s)
            latencies[i] += lat
            found[i] += matches
    exact, exact_score = exact_top1(x, queries[:recall_n])
    rows = []
    for i in range(len(configs)):
        hits = 0
        gaps = []  # exact top-1 cosine minus the returned one's: what a hit threshold sees
        for q in range(recall_n):
            match = found[i][q]
            if match is not None and (
                row_of(match.id) == exact[q] or match.score >= exact_score[q] - 1e-5
            ):
                hits += 1
            gaps.append(float(exact_score[q]) - (match.score if match is not None else -1.0))
        gap = np.maximum(np.array(gaps), 0.0)
        ms = np.array(latencies[i]) * 1e3
        rows.append(
            {
                "load_s": float(np.median(loads[i])),
                "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99)),
                "mean_ms": float(ms.mean()),
                "max_ms": float(ms.max()),
                "recall": hits / recall_n,
                "gap_p50": float(np.percentile(gap, 50)),
                "gap_p99": float(np.percentile(gap, 99)),
                "within_001": float(np.mean(gap <= 0.01)),
            }
        )
    return rows


def measure_fetch(root: Path, shape: tuple[int, ...], files: int, reads: int) -> dict[str, float]:
    store = LatentStore(root, fsync=False)
    torch.manual_seed(0)
    digests = [store.put(torch.randn(shape)).digest for _ in range(files)]
    nbytes = store.path(digests[0]).stat().st_size
    rng = np.random.default_rng(0)
    latencies = []
    for i in rng.integers(0, files, reads):
        began = time.perf_counter()
        store.get(digests[i])
        latencies.append(time.perf_counter() - began)
    ms = np.array(latencies) * 1e3
    return {
        "bytes": nbytes,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
    }


def peak_rss_mib() -> float:
    """The process's peak resident memory so far (ru_maxrss is KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", "--sizes", dest="sizes", default="20k", help="comma-separated: 20k,100k,1M"
    )
    parser.add_argument("--data", choices=["real", "clustered", "random"], default="real")
    parser.add_argument(
        "--prompts", type=Path, action="append", default=[], help="more prompt TSVs (real)"
    )
    parser.add_argument(
        "--neighbour-noise", type=float, default=0.35, help="real: noise norm of the neighbours"
    )
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--recall", type=int, default=200, help="queries checked exactly")
    parser.add_argument("--rounds", type=int, default=4, help="turns the search settings take")
    parser.add_argument("--reuse", action="store_true", help="measure a kept shard, no build")
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--ef-construct", type=int, default=100)
    parser.add_argument(
        "--hnsw-ef",
        default="default",
        help="search ef values, comma-separated; 'default': the product's (EdgeIndexConfig)",
    )
    parser.add_argument(
        "--search-threads",
        default="default",
        help="Edge search-pool sizes, comma-separated; 'default': one per CPU",
    )
    parser.add_argument("--int8", action="store_true", help="scalar int8 quantisation + rescore")
    parser.add_argument("--batch", type=int, default=50_000, help="points per upsert")
    parser.add_argument("--fetch-files", type=int, default=200)
    parser.add_argument("--fetch-reads", type=int, default=2000)
    parser.add_argument("--no-fetch", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the built shards")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()

    config = EdgeIndexConfig(m=args.m, ef_construct=args.ef_construct, int8=args.int8)
    settings = parse_settings(args.hnsw_ef, args.search_threads)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="argus-bench-retrieval-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(machine_line())
    what = {
        "real": (
            "real prompt embeddings (all-MiniLM-L6-v2) and SYNTHETIC neighbours of them; "
            "queries: held-out real prompts"
        ),
        "clustered": "SYNTHETIC clustered unit vectors",
        "random": "SYNTHETIC uniform unit vectors",
    }[args.data]
    print(
        f"Qdrant Edge top-1, {DIM}-d {what}, payload filter on `key`; HNSW m={config.m} "
        f"ef_construct={config.ef_construct} full_scan_threshold=10000 (kB), vectors "
        f"{'int8+rescore' if config.int8 else 'f32'}; upserts of {args.batch:,} points; "
        f"{args.queries} queries, recall@1 on {args.recall}",
        flush=True,
    )
    real = real_embeddings(args.prompts) if args.data == "real" else None
    results: dict[str, Any] = {
        "machine": machine_line(),
        "config": {k: str(v) for k, v in vars(args).items()},
        "search": {},
    }
    rows = []
    for size_text in args.sizes.split(","):
        n = parse_size(size_text)
        rng = np.random.default_rng(n)
        if real is not None:
            x, queries = real_data(real, n, args.queries, args.neighbour_noise, rng)
            synthetic = max(0, n - int((1 - HELD_OUT) * len(real)))
            print(
                f"N={n:,}: {n - synthetic:,} real embeddings + {synthetic:,} SYNTHETIC "
                f"neighbours of them; {len(np.unique(queries, axis=0)):,} held-out real "
                "prompts as queries",
                flush=True,
            )
        else:
            centres = unit(rng.standard_normal((CENTRES, DIM), dtype=np.float32))
            x = sample(n, args.data, rng, centres)
            queries = sample(args.queries, args.data, rng, centres)
        path = workdir / f"edge-{args.data}-{n}{'-int8' if config.int8 else ''}"
        if args.reuse and (path / "CURRENT").exists():
            print(f"N={n:,}: reusing {path}", flush=True)
            built = {"upsert_s": float("nan"), "optimize_s": float("nan")}
        else:
            shutil.rmtree(path, ignore_errors=True)
            print(f"N={n:,}: building in {path}", flush=True)
            built = build(path, x, config, args.batch)
            built["disk_mib"] = (
                sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
            )
            built["peak_rss_mib"] = peak_rss_mib()
            print(
                f"  build: upsert {built['upsert_s']:.1f} s + HNSW {built['optimize_s']:.1f} s; "
                f"shard {built['disk_mib']:,.0f} MiB on disk; process peak RSS "
                f"{built['peak_rss_mib']:,.0f} MiB",
                flush=True,
            )
        variants = [
            replace(
                config,
                hnsw_ef=config.hnsw_ef if ef is None else ef,
                search_threads=config.search_threads if t is None else t,
            )
            for ef, t in settings
        ]
        measured = measure_search(
            path, x, queries, variants, args.rounds, min(args.recall, args.queries)
        )
        for (ef, threads), m in zip(settings, measured, strict=True):
            row = {"n": n, "ef": ef or "default", "threads": threads or "default"} | built | m
            rows.append(row)
            results["search"][f"{n} ef={row['ef']} threads={row['threads']}"] = row
            print(f"  {json.dumps(row)}", flush=True)
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
        del x

    print()
    print(
        f"{'N':>10} {'upsert s':>9} {'optimize s':>10} {'ef':>8} {'threads':>8} {'load s':>7} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'mean ms':>8} {'max ms':>7} {'recall@1':>8} "
        f"{'gap p50':>8} {'gap p99':>8} {'<=0.01':>7}"
    )
    for r in rows:
        print(
            f"{r['n']:>10,} {r['upsert_s']:>9.1f} {r['optimize_s']:>10.1f} {r['ef']:>8} "
            f"{r['threads']:>8} {r['load_s']:>7.2f} {r['p50_ms']:>7.3f} {r['p99_ms']:>7.3f} "
            f"{r['mean_ms']:>8.3f} {r['max_ms']:>7.2f} {r['recall']:>8.3f} "
            f"{r['gap_p50']:>8.4f} {r['gap_p99']:>8.4f} {r['within_001']:>7.3f}"
        )
    if not args.no_fetch:
        print()
        print("latent fetch: LatentStore.get (read + sha256 + safetensors + fp32), warm page cache")
        print(f"{'latent':>18} {'bytes':>8} {'p50 ms':>7} {'p99 ms':>7} {'mean ms':>8}")
        results["fetch"] = {}
        for name, shape in (("sdxl 1x4x96x96", (1, 4, 96, 96)), ("tiny 1x4x8x8", (1, 4, 8, 8))):
            f = measure_fetch(workdir / "latents", shape, args.fetch_files, args.fetch_reads)
            results["fetch"][name] = f
            print(
                f"{name:>18} {f['bytes']:>8,} {f['p50_ms']:>7.3f} {f['p99_ms']:>7.3f} "
                f"{f['mean_ms']:>8.3f}"
            )
        shutil.rmtree(workdir / "latents", ignore_errors=True)
    print(load_line("end"))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if not args.keep and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
