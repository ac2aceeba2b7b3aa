#!/usr/bin/env bash
# Builds the grouped GEMM variants of this folder in parallel and times them against the engine's
# grouped GEMM and torch._grouped_mm on the expert loads (prefill and decode):
#   bash bench/grouped_variants/build_run.sh [g0,g1,...] [LOAD,...]
# on the GPU machine; the JSON goes under $OUT.
# Needs nvcc, the nvidia-cutlass wheel's headers and the installed uniep; not part of the package
# or of CI.
set -u
cd "$(dirname "$0")"
source ../harness/build_variants.sh
build_variants "${1:-g0,g1,g2,g3,g4,g5,g6,g7,d0,s0,s1,s2,s3}" libgv problems
python3 run.py "${OUT:-/tmp}" "$PWD/build/libgv.so" "$BUILT" ${2:-}
