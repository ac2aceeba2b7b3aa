# Sourced by the CUTLASS sweeps' build_run.sh (bench/gemm_variants, bench/grouped_variants), run
# in the sweep's folder on the GPU machine:
#   build_variants NAMES LIB [OBJECT ...]
# compiles NAMES (comma-separated NAME.cu files) and the OBJECTs' .cu files in parallel for
# sm_90a against the nvidia-cutlass wheel's headers, reports the variants that failed, links the
# rest with the OBJECTs into build/LIB.so, and sets BUILT to the variants that built.
build_variants() {
  local names=$1 lib=$2
  shift 2
  local cu
  cu=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")
  cu=$cu/source/include
  mkdir -p build
  local v
  for v in ${names//,/ } "$@"; do
    nvcc -std=c++17 -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
      -Xcompiler -fPIC -I. -I"$cu" -I/usr/local/cuda/include/cccl -c "$v.cu" -o "build/$v.o" \
      > "build/$v.log" 2>&1 &
  done
  wait
  BUILT=""
  for v in ${names//,/ }; do
    if [[ -s build/$v.o ]]; then
      BUILT="$BUILT,$v"
    else
      echo "FAILED $v"
      tail -n 5 "build/$v.log"
    fi
  done
  BUILT=${BUILT#,}
  local objects=()
  for v in "$@" ${BUILT//,/ }; do objects+=("build/$v.o"); done
  nvcc -shared -o "build/$lib.so" "${objects[@]}" -lcudart
}
