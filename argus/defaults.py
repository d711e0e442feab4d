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

CUDA_GRAPHS: int | None = None
"""UNet work shapes a worker keeps captured as CUDA graphs (argus/worker/models/cuda_graphs.py);
None: :data:`CUDA_GRAPHS_ON_CUDA` on a CUDA device and 0 (every step eager) elsewhere. On an
H200 a graph halved SDXL's and SD-1.5's whole-image times (docs/gpu.md)."""

CUDA_GRAPHS_ON_CUDA = 8
"""Graphs kept by default on a CUDA device: a worker's few serving sizes, plain and with
ControlNets, and its recent edits' shapes, least recently used leaving first. They share one
memory pool, so a graph more costs its static inputs, not another step's activations."""

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The ``torch.compile`` modes ``argus worker --compile`` accepts
(argus/worker/models/compiled.py); a worker compiles nothing unless given one."""

COMPILE_BACKEND = "inductor"
"""``torch.compile``'s backend with ``--compile``; eager and aot_eager skip code generation."""

EDIT_CACHE_HOST_BYTES: int | str = "auto"
"""Host memory a worker gives the mask-aware activation cache of edits (templates' recorded
transformer-block outputs, :mod:`argus.worker.editing.activation_cache`), bytes; 0: no cache;
"auto": :data:`EDIT_CACHE_HOST_SHARE` of the machine's memory (its cgroup limit when lower), at
least :data:`EDIT_CACHE_HOST_FLOOR`.

What a record costs: per step, 2 bytes (float16) × CFG branches × the sum over transformer
blocks of covered tokens × channels. The tiny SDXL at 128 px (6 blocks of 64 tokens × 64
channels) records 98,304 bytes a step, 393,296 for 4 steps with its coverage masks (measured).
SDXL at 1024 px has 10 blocks of 4,096 tokens × 640 channels and 60 of 1,024 × 1,280: 400 MiB a
step, 19.5 GiB for 50 steps, as measured on an H200 (``docs/gpu.md``; keys and values too: 58.6
GiB). A quarter of a 128 GiB machine (32 GiB) holds one such record, or two of 30 steps; 1 GiB
holds none. Several workers on one machine without per-worker memory limits each take the
share: give them explicit bytes."""

EDIT_CACHE_HOST_SHARE = 0.25
"""Share of the machine's memory the "auto" host tier takes: the rest is the process's (a
model's weights pass through host memory as it loads; pinned staging buffers), the page cache
the disk tier reads through, and other processes'."""

EDIT_CACHE_HOST_FLOOR = 2**30
"""The "auto" host tier's least bytes, on a machine with little memory."""

EDIT_CACHE_DISK_BYTES: int | str = "auto"
"""The activation cache's disk tier, bytes, when it has a directory; "auto":
:data:`EDIT_CACHE_DISK_SHARE` of the directory's free space plus the records already in it,
measured when the worker starts (a 50-step SDXL record at 1024 px is a 19.5 GiB file, so a
1 TB disk half free holds a dozen)."""

EDIT_CACHE_DISK_SHARE = 0.5
"""Share of the disk tier directory's free space the "auto" disk tier takes."""

EDIT_CACHE_DEVICE_BYTES: int | str = "auto"
"""Device memory a worker keeps templates' records in (the activation cache's device tier:
a repeated template's rows never cross PCIe), bytes; 0: none; "auto": on CUDA
:data:`EDIT_CACHE_DEVICE_SHARE` of the memory free once the model has loaded, on a CPU 0 (its
device is the host memory the host tier holds)."""

EDIT_CACHE_DEVICE_SHARE = 0.25
"""Share of the free device memory the "auto" device tier takes. The rest is left for a
batch's activations (SDXL at 1024 px peaks 2.4 GiB above its weights at batch 1,
``docs/gpu.md``), which the memory guard does not see, the CUDA graphs captured after the
tier was sized, and two steps of staged rows. The guard counts the tier's bound and the
graphs' pools, and lowers the bound for a model load that would not fit. On an H200 with SDXL
loaded (about 130 GiB free) it is about 33 GiB: one 50-step SDXL record at 1024 px, or fifteen
50-step SD-1.5 records at 512 px (2.2 GiB each); on a 24 GiB GPU with SDXL it holds no SDXL
record at 1024 px."""

CACHE_MAX_ENTRIES = 100_000
"""Prompts the approximate cache keeps at most."""

SCORE_SAMPLE = 0.05
"""Share of a worker's images it scores for the router's drift monitor (0: none)."""

# requests the router sends a worker at once (late binding; the rest wait at the router)
LATE_BINDING_WINDOW = 2
