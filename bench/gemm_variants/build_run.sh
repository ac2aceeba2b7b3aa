#!/usr/bin/env bash
# Builds the GEMM variants of this folder in parallel and times them against torch.mm:
#   bash bench/gemm_variants/build_run.sh [v0,v4,...]     (on the GPU machine; JSON to $OUT)
# Needs nvcc and the nvidia-cutlass wheel's headers; not part of the package or of CI.
set -u
cd "$(dirname "$0")"
source ../harness/build_variants.sh
build_variants "${1:-v0,v1,v2,v3,v4,v5,v6,v7,v8,v9}" libv
python3 run.py "${OUT:-/tmp}/gemm_variants.json" "$PWD/build/libv.so" "$BUILT"
