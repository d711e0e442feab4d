#!/usr/bin/env bash
# The one script a GPU session runs: every figure of docs/gpu.md's summary and the measured
# profile, from the repository root, everything written under $OUT.
#
#   1. the packages: the wheels carried in .whl/ (benchmarks/gpu_wheels.sh makes them where
#      there is a network; for python3 3.12, the GPU image's) installed with --no-index into
#      /tmp/site (not with ARGUS_CHECK_TINY, which runs .venv's python); the gRPC code generated;
#      an import check that fails in seconds rather than minutes in;
#   1b. the tests marked gpu (tests/cuda_marks.py: CUDA graphs of plain, LoRA, ControlNet and
#      edit runs bit for bit, the pinned side-stream staging, the device tier, torch.compile),
#      which skip on a CPU                                               -> $OUT/gpu-tests.xml
#   2. the floors, in process: the guided SDXL UNet step at 1024 px replayed from a CUDA graph,
#      alone and with one ControlNet (gpu_profile.py --floor-only)     -> $OUT/floor/gpu_profile.json
#   3. the worker's default path: `python -m argus worker` processes and gRPC, SDXL plain,
#      with a LoRA, with a ControlNet, an edit at m = 0.2 recorded, replayed and with the cache
#      off, hits at K, the SM variants (gpu_profile.py --worker --worker-via cli)
#                                                                     -> $OUT/cli/gpu_profile.json
#   4. both merged, with the edit bound's s from docs/gpu/h200-bench-editing-sdxl.json:
#      $OUT/gpu_profile.json, $OUT/measured.toml (for argus/profiles/h200-measured.toml),
#      $OUT/gpu.md (the summary lines first, then the tables), $OUT/summary.json (the summary
#      read back by gpu_profile.read_summary); the log in $OUT/log.txt.
#
# Each part runs under `timeout` (TESTS_S, FLOOR_S, CLI_S seconds, defaults 75, 100 and 270,
# and 45 for the writing: under 9 minutes in all with the setup); a part that fails or runs out leaves what it measured, and
# the later parts still run. ARGUS_WORKER_ARGS passes flags on to `argus worker` (for example
# "--compile default").
#
# GPU session (device tool), carrying .whl:
#     bash benchmarks/gpu_device_check.sh
# This machine, on the tiny variants on the CPU (the same code end to end, a minute or two):
#     ARGUS_CHECK_TINY=1 OUT=/tmp/check bash benchmarks/gpu_device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder the results go to}"
TINY=${ARGUS_CHECK_TINY:-0}
TESTS_S=${TESTS_S:-75}
FLOOR_S=${FLOOR_S:-100}
CLI_S=${CLI_S:-270}
if [ "$TINY" = 1 ] && [ -x .venv/bin/python ]; then
    PY=${PYTHON:-.venv/bin/python}  # this machine's environment; the wheels are the GPU's
else
    PY=${PYTHON:-python3}
fi
mkdir -p "$OUT/floor" "$OUT/cli"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1

say() { echo "[check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

# -- 1. packages -------------------------------------------------------------------------------
SITE=""
if [ "$TINY" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
    say "installing the carried wheels: $(ls .whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG"
    SITE=/tmp/site
fi
export PYTHONPATH="${SITE:+$SITE:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m argus.plumbing.rpc 2>&1 | tee -a "$LOG"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import diffusers, grpc, grpc_health.v1.health, qdrant_edge, cryptography.x509, torch
import argus.worker.app, argus.router.worker_calls, argus.plumbing.internal_tls
print("imports ok: torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "diffusers", diffusers.__version__, "grpc", grpc.__version__)
EOF

if [ "$TINY" = 1 ]; then
    DEVICE=(--tiny --device cpu --steps 8 --repeats 1)
    WORKER=(--worker-steps 8 --worker-repeats 1 --worker-sm-models sd-1.5)
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 |
        tee -a "$LOG" || true
    DEVICE=(--device cuda --steps 50 --repeats 3)
    WORKER=(--worker-steps 30 --worker-repeats 3)
fi
if [ -n "${ARGUS_WORKER_ARGS:-}" ]; then
    WORKER+=(--worker-args "$ARGUS_WORKER_ARGS")
fi

part() {  # part NAME SECONDS COMMAND...: run under timeout, log it, carry on when it fails
    local name=$1 seconds=$2 began=$SECONDS status=0
    shift 2
    say "$name: started (at most ${seconds} s)"
    timeout -k 20 "$seconds" "$@" 2>&1 | tee -a "$LOG" || status=$?
    say "$name: exit $status after $((SECONDS - began)) s"
}

# -- 1b. the tests that need a GPU ------------------------------------------------------------
TEST_ARGS=(-p no:cacheprovider -o addopts= -v -rfE -m gpu --junitxml "$OUT/gpu-tests.xml")
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    TEST_ARGS+=(--timeout 45)  # one stuck test must not take the others' time
fi
part gpu-tests "$TESTS_S" "$PY" -m pytest "${TEST_ARGS[@]}" tests/test_cuda_graphs.py \
    tests/test_edit_cache_staging.py tests/test_masked_blocks.py tests/test_worker_compile.py

# -- 2. the floor, in process ------------------------------------------------------------------
part floor "$FLOOR_S" "$PY" benchmarks/gpu_profile.py "${DEVICE[@]}" --models sdxl \
    --floor-only --no-load --budget-s $((FLOOR_S - 20)) --out "$OUT/floor"

# -- 3. the worker's default path through its CLI process and gRPC -----------------------------
part worker-cli "$CLI_S" "$PY" benchmarks/gpu_profile.py "${DEVICE[@]}" --models "" --no-load \
    --worker --worker-via cli "${WORKER[@]}" --budget-s $((CLI_S - 45)) --out "$OUT/cli"

# -- 4. the profile, the markdown and the summary ----------------------------------------------
RUNS=()
for run in floor cli; do
    if [ -f "$OUT/$run/gpu_profile.json" ]; then
        RUNS+=(--from-json "$OUT/$run/gpu_profile.json")
    fi
done
part write 45 "$PY" benchmarks/gpu_profile.py "${RUNS[@]}" \
    --edit-share-json docs/gpu/h200-bench-editing-sdxl.json --write-json "$OUT/gpu_profile.json" \
    --write-profile "$OUT/measured.toml" --write-markdown "$OUT/gpu.md" >/dev/null
"$PY" - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
from gpu_profile import read_summary

out = Path(sys.argv[1])
got = read_summary(out / "gpu.md")
(out / "summary.json").write_text(json.dumps(got, indent=1))
print("\n".join((out / "gpu.md").read_text().splitlines()[:8]))
print(json.dumps(got))
EOF
say "done: $(ls "$OUT" | tr '\n' ' ')"
