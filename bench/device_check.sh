#!/usr/bin/env bash
# Everything the GPU machine has to prove, in one run from the repository root:
#   bash bench/device_check.sh            (where things go: see the end of this comment)
#   bash bench/device_check.sh --multigpu [OPTIONS]
#       the multi-GPU measurement run instead, sized for one 10-minute device call (build,
#       the multigpu tests, EP dispatch/combine, the MoE layer, TP/SP overlap, Parm on every GPU,
#       a summary of each goal): bench/multigpu_run.sh, whose header has its options and budget.
# 1. installs the carried CUTLASS headers wheel (.whl/nvidia_cutlass-*.whl; the machine has no
#    network, so any missing build/test requirement must be carried in .whl/ as well),
# 2. builds and installs UniEP with the CUDA kernels and the torch CUDA ops,
# 3. runs the gpu and multigpu tests (on a one-GPU machine also those that need an MPS server,
#    under one it starts and stops), 4. runs every benchmark (bench/run_all.sh),
# 5. writes $OUT/device_check.json: device, GPU count, commit, date, build/test/bench status.
# Later steps run even when earlier ones fail (the JSON always gets written); the exit status is
# non-zero if anything failed. $OUT holds at most: build.log, gpu-tests.xml, gpu-tests-mps.xml,
# bench.log, device_check.json and one folder per benchmark (NAME/NAME.json, and its plot).
# With $OUT set (the device tool's folder) all of it goes there. Without it the benchmarks replace
# bench/results/NAME/NAME.json, the results bench/RESULTS.md quotes, and the logs and
# device_check.json go to a new folder under $TMPDIR, named at the end.
set -euo pipefail

if [[ "${1:-}" == "--multigpu" ]]; then
  shift
  exec bash "$(dirname "${BASH_SOURCE[0]}")/multigpu_run.sh" "$@"
fi

# Multicast objects are not available on the lent machines (see KINDS.md): keep NCCL, torch
# symmetric memory and NVSHMEM off NVLink SHARP.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export MAX_JOBS=16 CMAKE_BUILD_PARALLEL_LEVEL=16
export PYTHON=python3  # for bench/run_all.sh

if [[ -n "${OUT:-}" ]]; then
  results=$OUT
else
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/uniep-device-check.XXXXXX")
  results=bench/results
fi
mkdir -p "$OUT"
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
failed=()

echo "== environment"
nvidia-smi -L || failed+=("nvidia-smi")
python3 - <<'EOF' || failed+=("versions")
import importlib.metadata as md
import torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), devices: {torch.cuda.device_count()}")
for dist in ("nvidia-nvshmem-cu13", "nvidia-cutlass", "scikit-build-core", "pybind11", "pytest"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} not installed")
EOF
command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "nvcc not on PATH"
cmake --version 2>/dev/null | head -n 1 || echo "cmake not on PATH"

echo "== dependencies from .whl/"
shopt -s nullglob
cutlass_wheels=(.whl/nvidia_cutlass-*.whl)
if [[ ${#cutlass_wheels[@]} -gt 0 ]]; then
  # --no-deps: only the headers are needed; the wheel's Python dependencies are not.
  python3 -m pip install -q --no-index --no-deps "${cutlass_wheels[@]}" || failed+=("cutlass-wheel")
else
  echo "no .whl/nvidia_cutlass-*.whl carried; relying on an installed nvidia-cutlass"
fi
for req in scikit_build_core:scikit-build-core pybind11:pybind11 pytest:pytest; do
  module=${req%%:*} dist=${req#*:}
  if ! python3 -c "import $module" 2>/dev/null; then
    echo "$dist missing: installing it from .whl/"
    python3 -m pip install -q --no-index --find-links .whl "$dist" || failed+=("install-$dist")
  fi
done

echo "== build (log: $OUT/build.log)"
build_rc=0
python3 -m pip install --no-build-isolation --no-deps -v . 2>&1 | tee "$OUT/build.log" || build_rc=$?
[[ $build_rc -eq 0 ]] || failed+=("build")

pytest_rc=-1
mps_rc=-1
bench_rc=-1
if [[ $build_rc -eq 0 ]]; then
  python3 -c "import json, uniep; print(json.dumps(uniep.build_info(), indent=1))" ||
    failed+=("import")

  echo "== gpu and multigpu tests"
  pytest_rc=0
  python3 -m pytest -m "gpu or multigpu" -v --junitxml "$OUT/gpu-tests.xml" tests || pytest_rc=$?
  [[ $pytest_rc -eq 0 ]] || failed+=("pytest")

  # Processes that share one GPU have NVSHMEM's teams, which torch's symmetric memory needs, only
  # under MPS: on a one-GPU machine where an MPS server can be started, the tests that need one
  # run under it, and it is stopped again before the benchmarks.
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [[ $gpus -eq 1 ]] && command -v nvidia-cuda-mps-control >/dev/null; then
    echo "== one-GPU tests under MPS"
    CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
    export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    if nvidia-cuda-mps-control -d; then
      mps_rc=0
      UNIEP_TEST_MPS=1 python3 -m pytest -m gpu -v -k under_mps --junitxml "$OUT/gpu-tests-mps.xml" \
        tests/moe/test_gpu_on_one_gpu.py || mps_rc=$?
      echo quit | nvidia-cuda-mps-control || true
      sleep 2  # the server exits after the quit returns
      [[ $mps_rc -eq 0 ]] || failed+=("pytest-mps")
    else
      echo "no MPS server could be started: the MPS tests did not run"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi

  echo "== benchmarks (log: $OUT/bench.log)"
  bench_rc=0
  bash bench/run_all.sh --out-dir "$results" 2>&1 | tee "$OUT/bench.log" || bench_rc=$?
  [[ $bench_rc -eq 0 ]] || failed+=("bench")
fi

# The copy on the GPU machine may have no git history: UNIEP_COMMIT can name the commit instead.
commit=${UNIEP_COMMIT:-$(git rev-parse --verify --quiet HEAD 2>/dev/null)} || true
commit=${commit:-unknown}
export OUT started commit build_rc pytest_rc mps_rc bench_rc
export failed_steps="${failed[*]-}"
python3 - <<'EOF' || failed+=("device_check.json")
import json
import os
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

import torch

out = Path(os.environ["OUT"])
count = torch.cuda.device_count() if torch.cuda.is_available() else 0


def junit_counts(junit: Path) -> dict[str, int]:
    tests = {"tests": 0, "passed": 0, "failures": 0, "errors": 0, "skipped": 0}
    if junit.exists():
        root = ET.parse(junit).getroot()
        for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            for key in ("tests", "failures", "errors", "skipped"):
                tests[key] += int(suite.get(key, 0))
        tests["passed"] = tests["tests"] - tests["failures"] - tests["errors"] - tests["skipped"]
    return tests


tests = junit_counts(out / "gpu-tests.xml")
try:
    import uniep

    build_info = uniep.build_info()
except Exception as exc:  # the build may have failed: record why instead of stopping
    build_info = {"error": repr(exc)}
failed = os.environ["failed_steps"].split()
report = {
    "device": torch.cuda.get_device_name(0) if count else "none",
    "gpu_count": count,
    "torch": torch.__version__,
    "cuda": torch.version.cuda or "",
    "commit": os.environ["commit"],
    "started": os.environ["started"],
    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    "build_ok": os.environ["build_rc"] == "0",
    "build_info": build_info,
    "pytest_exit_code": int(os.environ["pytest_rc"]),
    "pytest": tests,
    # -1: not run (more than one GPU, where the multi-GPU tests cover it, or no MPS server).
    "mps_pytest_exit_code": int(os.environ["mps_rc"]),
    "mps_pytest": junit_counts(out / "gpu-tests-mps.xml"),
    "bench_exit_code": int(os.environ["bench_rc"]),
    "failed_steps": failed,
    "ok": not failed,
}
(out / "device_check.json").write_text(json.dumps(report, indent=2) + "\n")
print(json.dumps(report, indent=2))
EOF

echo "device_check: logs and device_check.json in $OUT, benchmark results in $results"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "device_check: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "device_check: all steps passed"
