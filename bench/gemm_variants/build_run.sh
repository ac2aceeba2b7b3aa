#!/usr/bin/env bash
# Builds the GEMM variants of this folder in parallel and times them against torch.mm:
#   bash bench/gemm_variants/build_run.sh [v0,v4,...]     (on the GPU machine; JSON to $OUT)
# Needs nvcc and the nvidia-cutlass wheel's headers; not part of the package or of CI.
set -u
cd "$(dirname "$0")"
V=${1:-v0,v1,v2,v3,v4,v5,v6,v7,v8,v9}
CU=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
mkdir -p build
for v in ${V//,/ }; do
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
nvcc -shared -o build/libv.so $(for v in ${built//,/ }; do echo "build/$v.o"; done) -lcudart
python3 run.py "${OUT:-/tmp}/gemm_variants.json" "$PWD/build/libv.so" "$built"
