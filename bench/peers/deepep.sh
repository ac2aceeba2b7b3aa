#!/usr/bin/env bash
# DeepEP (v1.2.1: the peer ANCHORS.md quotes) beside UniEP on the same machine, built from a
# source tree carried to the GPU machine (never committed to this repository; that machine has no
# network): installs the wheel found in --wheel-dir or builds one there, runs DeepEP's own
# tests/test_intranode.py and tests/test_low_latency.py at EP N on the ANCHORS.md shapes, keeps
# their logs, and writes what they measured as JSON (bench/harness/deepep_log.py).
#
#   bash bench/peers/deepep.sh --src DIR --out-dir DIR [--ep N] [--wheel-dir DIR] [--timeout S]
#
# --src        DeepEP's source tree (default $UNIEP_DEEPEP_SRC, else .peers/DeepEP)
# --wheel-dir  where a built deep_ep wheel is looked for and a new one is put (default
#              <out-dir>/wheel): carry it back to later calls to skip the build
# --ep N       processes, one per GPU (default 4, the ANCHORS.md EP4)
# --timeout S  seconds for the build and for each test (default 300)
# Exit status: 0 when the JSON was written (it lists the figures it lacks under "missing"),
# 2 for bad arguments, 1 when DeepEP could not be built or installed.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
src=${UNIEP_DEEPEP_SRC:-$repo/.peers/DeepEP} out="" wheels="" ep=4 limit=300
while [[ $# -gt 0 ]]; do
  case "$1" in
    --src) src="${2:?--src needs a directory}"; shift 2 ;;
    --out-dir) out="${2:?--out-dir needs a directory}"; shift 2 ;;
    --wheel-dir) wheels="${2:?--wheel-dir needs a directory}"; shift 2 ;;
    --ep) ep="${2:?--ep needs a count}"; shift 2 ;;
    --timeout) limit="${2:?--timeout needs seconds}"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "deepep.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$out" ]] || { echo "deepep.sh: --out-dir is required" >&2; exit 2; }
for n in "$ep" "$limit"; do
  [[ "$n" =~ ^[0-9]+$ && "$n" -gt 0 ]] || { echo "deepep.sh: '$n' is not a positive count" >&2; exit 2; }
done
src="$(cd "$src" 2>/dev/null && pwd)" || { echo "deepep.sh: no DeepEP source at the --src given" >&2; exit 1; }
[[ -f "$src/setup.py" && -f "$src/tests/test_intranode.py" ]] ||
  { echo "deepep.sh: $src is not a DeepEP source tree (setup.py, tests/test_intranode.py)" >&2; exit 1; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
wheels=${wheels:-$out/wheel}
mkdir -p "$wheels"

# No NVLink multicast on the lent machines (KINDS.md), as for UniEP's own runs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}

shopt -s nullglob
found=("$wheels"/deep_ep-*.whl)
if ((${#found[@]} == 0)); then
  echo "== deepep: building a wheel from $src"
  # Outside this repository's work tree: DeepEP's version string asks git about the cwd's tree.
  (cd "$src" && timeout -k 10 "$limit" python3 -m pip wheel --no-build-isolation --no-deps \
    -w "$wheels" . >"$out/deepep-build.log" 2>&1) ||
    { tail -n 30 "$out/deepep-build.log"; echo "deepep.sh: the build failed" >&2; exit 1; }
  found=("$wheels"/deep_ep-*.whl)
fi
python3 -m pip install -q --no-index --no-deps --force-reinstall "${found[0]}" ||
  { echo "deepep.sh: ${found[0]} did not install" >&2; exit 1; }

# DeepEP's tests import their helpers from their own folder.
run_test() {  # run_test NAME ARGS...
  local name=$1
  shift
  echo "== deepep: $name $*"
  (cd "$src/tests" && MASTER_PORT=$((20000 + RANDOM % 20000)) timeout -k 10 "$limit" \
    python3 "$name.py" "$@") >"$out/deepep-${name#test_}.log" 2>&1
  echo "== deepep: $name exit $?"
  tail -n 5 "$out/deepep-${name#test_}.log"
}
run_test test_intranode --num-processes "$ep" --num-tokens 4096 --hidden 7168 --num-topk 8 \
  --num-experts 256
run_test test_low_latency --num-processes "$ep" --num-tokens 128 --hidden 7168 --num-topk 8 \
  --num-experts 288

version=$(python3 -c 'import importlib.metadata as m; print(m.version("deep_ep"))' 2>/dev/null)
python3 "$repo/bench/harness/deepep_log.py" --intranode "$out/deepep-intranode.log" \
  --low-latency "$out/deepep-low_latency.log" --out "$out/deepep.json" \
  version="\"${version:-unknown}\"" ep="$ep" kind="\"${UNIEP_DEVICE_KIND:-unknown}\"" \
  commit="\"${UNIEP_COMMIT:-unknown}\"" date="\"$(date -u +%Y-%m-%dT%H:%M:%SZ)\""
