#!/usr/bin/env bash
# Builds the grouped GEMM variants of this folder in parallel and times them against the engine's
# grouped GEMM and torch._grouped_mm on the expert loads (prefill and decode):
#   bash bench/grouped_variants/build_run.sh [g0,g1,...]     (on the GPU machine; JSON to $OUT)
# Needs nvcc, the nvidia-cutlass wheel's headers and the installed uniep; not part of the package
# or of CI.
set -u
cd "$(dirname "$0")"
V=${1:-g0,g1,g2,g3,g4,g5,g6,g7,d0,s0,s1,s2,s3}
CU=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
mkdir -p build
for v in ${V//,/ } problems; do
  nvcc -std=c++17 -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
    -Xcompiler -fPIC -I. -I"$CU" -I/usr/local/cuda/include/cccl -c "$v.cu" -o "build/$v.o" \
    > "build/$v.log" 2>&1 &
done
wait
built=""
for v in ${V//,/ }; do
  if [[ -s build/$v.o ]]; then built="$built,$v"; else echo "FAILED $v"; tail -n 5 "build/$v.log"; fi
done
built=${built#,}
nvcc -shared -o build/libgv.so build/problems.o $(for v in ${built//,/ }; do echo "build/$v.o"; done) -lcudart
python3 run.py "${OUT:-/tmp}/grouped_variants.json" "$PWD/build/libgv.so" "$built"
