"""Defaults that several parts of Argus read, each written once.

A config dataclass takes its field default from here, and so does the ``argus`` flag that maps
to the field, the process settings that copy it into the config, and ``argus up``'s cluster
spec; ``tests/test_defaults.py`` checks that the flags, the settings, the configs and the Helm
chart's values agree. This module imports nothing, so a command's argument parser reads it
without loading the code behind the command (torch, the solver).

Validation is not here: each value is checked once, in its config's ``__post_init__``.
"""

from __future__ import annotations

LOOPBACK = "127.0.0.1"
"""Where services bind unless told otherwise: internal endpoints stay off the network."""

# -- what the services and the simulator share ---------------------------------------------

SLO_FACTOR = 3.0
"""The latency objective is this × the best level's latency (Argus §5.1: 3 × SDXL's);
:func:`argus.slo.default_slo_s` applies it."""

DELTA = 0.9
"""A level is optimal for a prompt when its quality is within this share of the best level's
(Argus §3, following prior work); the classifiers' labels and drift checks use it."""

HISTOGRAM_WINDOW = 1000
"""Classified prompts the class histogram H looks back over (the paper: 1000)."""

QUALITY_WORLDS = ("synthetic", "uniform", "genai-bench")
"""Which per-prompt quality the simulator scores with (``argus evaluate``/``argus replay
--quality``; ``argus.profiles.quality_worlds.QualityWorld``): the SYNTHETIC model, the same
with every prompt degrading alike, or GenAI-Bench's human ratings; the first is the default."""

# -- the simulator's evaluation (argus replay, argus evaluate) -----------------------------

EVALUATION_POLICIES = (
    "argus",
    "pac",
    "proteus",
    "clipper-ha",
    "clipper-ht",
    "sommelier",
    "nirvana",
)
"""Policies ``argus replay`` and ``argus evaluate`` compare unless ``--policies`` names others
(``argus.sim.policies.make_policy``'s names)."""

EVALUATION_LOADS = (0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5)
"""Mean offered loads of ``argus evaluate``'s sweep, as multiples of the cluster's capacity."""

AC_ONLY_POLICIES = ("nirvana",)
"""Policies that serve AC levels only: they cannot run in a world without AC levels
(genai-bench), whose default policies leave them out."""

# -- allocator -----------------------------------------------------------------------------

PLANNING_PERIOD_S = 60.0
"""The allocator re-plans at least this often, seconds (the paper: every minute); also the
load forecast's counting period."""

PLANNERS = ("joint", "paper")
"""How a plan is made (``argus.allocator.planner.PlannerMode``): one program over (prompt
class × level), or the paper's Eq. 1 with level averages then ODA; the first is the default."""

STRATEGY_CHOICES = ("best", "ac-first")
"""Which strategy runs while retrieval is healthy (``argus.allocator.config.StrategyChoice``):
the better plan of AC and SM each period (§3.1, §4.6), or AC first as the paper's prototype;
the first is the default."""

CAPS = ("analytic", "measured")
"""Where the planner's utilisation caps come from (``argus.allocator.queueing.CapSource``):
Allen–Cunneen over Erlang C, or the simulated queue with the service-time spread; the first
is the default."""

HEARTBEAT_S = 1.0
"""Interval of the workers' heartbeats, seconds; a worker that misses 3 is dead."""

RETRIEVAL_THRESHOLD_S = 0.5
"""Cache retrieval p99 above this, seconds, switches the cluster from AC to SM."""

RETRIEVAL_WINDOW_S = 30.0
"""Window of that p99, and how long probes must stay healthy to switch back, seconds."""

MAX_WORKERS = 1024
"""Workers the allocator tracks at most; further joins are refused."""

MAX_WATCHERS = 64
"""Open WatchPlan streams at most (each holds one of the allocator's server threads)."""

# -- router --------------------------------------------------------------------------------

ROUTER_ID = "router-0"
"""A router's id in its reports to the allocator."""

DEFAULT_DEADLINE_MS = 30_000
"""Deadline of a request that sets none, milliseconds."""

MAX_IN_FLIGHT = 256
"""Requests a router serves at once; more are refused as busy."""

MAX_REQUEST_ID_CHARS = 128
"""Characters of a client's request id at most (the router keeps answers by it for retries)."""

MAX_ID_BYTES = 64 * 2**20
"""Bytes of answers a router keeps for retries by request id (oldest dropped first)."""

REPORT_PERIOD_S = 1.0
"""How often a router sends its arrivals and classifications to the allocator, seconds."""

# -- between the processes -----------------------------------------------------------------

MAX_WIRE_ID_CHARS = 256
"""Characters at most of a name in the internal messages: worker and router ids, addresses,
GPU classes, levels, classifier keys (:mod:`argus.contracts.wire`)."""

# -- worker --------------------------------------------------------------------------------

WORKER_ID = "worker-0"
DEFAULT_SIZE = 64
"""Image side of a request that sets none, pixels (the tiny models' size)."""

DEFAULT_STEPS = 50
"""Denoising steps of a request that sets none."""

SCHEDULER = "euler"
"""The workers' diffusion scheduler (``argus worker --scheduler``): part of every approximate
cache key, so a router that mirrors the caches keys its lookups by the same name
(``argus router --scheduler``)."""

MAX_IMAGE_SIDE = 2048
"""Widest or tallest image served, pixels (the router and the worker refuse larger)."""

MAX_IMAGE_PIXELS = MAX_IMAGE_SIDE * MAX_IMAGE_SIDE
"""Largest image served, pixels in all."""

MAX_QUEUE = 64
"""Requests waiting or running on a worker at most; more are refused."""

MAX_RESIDENT_MODELS = 1
"""Ready models a worker keeps resident at most (1: a switch unloads the previous model once
the new one is ready); more keep several UNets beside shared parts, so a switch back is free."""

EDIT_BATCH = 1
"""Edits a worker batches at most, joining at step boundaries (argus/worker/editing/lane.py); 1
serves one request at a time, today's path."""

DECODE_THREAD = False
"""Whether a worker's batched edits decode on a thread of their own instead of the device
thread (argus/worker/editing/lane.py)."""

CUDA_GRAPHS = 0
"""UNet step shapes a worker keeps captured as CUDA graphs (argus/worker/models/cuda_graphs.py); 0
runs
every step eagerly. CUDA only: 2.1-2.8x on SDXL's step on an H200 (docs/gpu.md)."""

EDIT_CACHE_HOST_BYTES = 2**30
"""Host memory a worker gives the mask-aware activation cache of edits (templates' recorded
transformer-block outputs, :mod:`argus.worker.editing.activation_cache`); 0: no cache."""

EDIT_CACHE_DISK_BYTES = 16 * 2**30
"""The activation cache's disk tier, bytes, when it has a directory."""

CACHE_MAX_ENTRIES = 100_000
"""Prompts the approximate cache keeps at most."""

SCORE_SAMPLE = 0.05
"""Share of a worker's images it scores for the router's drift monitor (0: none)."""

# requests the router sends a worker at once (late binding; the rest wait at the router)
LATE_BINDING_WINDOW = 2
