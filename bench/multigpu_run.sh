#!/usr/bin/env bash
# The multi-GPU measurement run in ONE command that fits one 10-minute device call:
#   bash bench/device_check.sh --multigpu [OPTIONS]     (the entry point; it runs this file)
# On a machine with >= 2 GPUs, from the repository root: builds UniEP once, runs the `multigpu`
# tests, then parts 1-4 of the issue, each step under its own `timeout`, all inside one deadline
# (--budget, default 580 s from the start, the build included), and writes a summary of every goal:
# met / missed / not-run and why. Later steps run when earlier ones fail.
#
# Parts 1, 2 and 3's TP overlap also record each variant's GPU time per kernel on rank 0
# (kernel_us_rank0: --profile with MGPU_PROFILE_ITERS calls, default 3; 0 turns it off): the
# issue asks what a profiler shows for each miss, and the machines have no nsys.
#
# Sizes: EP = min(4, GPUs) (the issue's EP4), TP in {2, 4} up to the GPU count, Parm at 4 and 8
# GPUs where there are that many, else at the GPU count (2 on nvidia-h100-x2), MP groups of 2.
#
# What comes back in $OUT (at most 4 files, as the device tool returns at most 8):
# console-KIND-COMMIT.log (everything printed), summary-KIND-COMMIT.json (each goal: target,
# measured figure, status, why; each step: status, seconds, timeout), summary-KIND-COMMIT.md (the
# same as tables), multigpu-KIND-COMMIT-DATE.tgz (every benchmark JSON/SVG, build.log,
# multigpu-tests.xml, steps.jsonl, meta.json). Every benchmark JSON names the device, the kind
# (env.kind), the GPU count, the date and the commit. The summary and the bundle are rewritten
# after every step, so a run cut short still returns what it measured. Without $OUT the summary
# JSON replaces bench/results/multigpu/multigpu.json (the run bench/RESULTS.md quotes) and the
# other three files go to a new folder under $TMPDIR; a --dry-run keeps all four there.
#
# KIND: $UNIEP_DEVICE_KIND if the caller sets it (the device tool's kind, e.g. nvidia-h100-x2),
# else derived from the GPU name and count (bench/harness/common.py kind_from_gpus). COMMIT:
# $UNIEP_COMMIT if set (the device copy's git HEAD is not this tree's), else git's HEAD.
#
# Time budget on nvidia-h100-x2 (seconds; "typical" estimated from each script's own settings,
# the 2x H200 device checks of 2026-11-23 (commits 5bd2db2 to 2a0c59e) and the ~90-140 s build;
# "cap" is the step's timeout unless less of the budget is left; later steps keep at least their
# "min" each):
#   step                      typical  cap  min  what sets it
#   environment + wheels           10   60    -  nvidia-smi, pip install of .whl/ (no network)
#   build                         130  240   60  pip install --no-build-isolation (16 jobs)
#   multigpu tests                130  200   30  pytest -m multigpu (test_gpu_ep, _collectives);
#                                                 10 of 12 took 90 s on H200x2
#   part 1 dispatch (EP2)          30   90   40  2 shapes, one spawn each (~8 s); 3 SM budgets x
#                                                 7 variants x (10 warm-up + 50) calls of <= 2 ms
#   part 2 MoE layer (EP2)         90  180  100  2 shapes, one spawn each; 9 variants x (3 + 15)
#                                                 calls of 5-40 ms; tuner 5 points x (2 + 9) calls,
#                                                 re-timed 3 rounds x 3 calls, twice (plain
#                                                 weights, packed experts with the MegaKernel)
#   part 3 TP overlap (TP2)        25   50   25  one spawn per TP size; 3 shapes x 2 kinds x 10
#                                                 variants x (5 + 30) calls of <= 2 ms; DP RS
#   part 3 Ulysses + DP AG (W2)    15   35   15  one spawn per size; 2 shapes x 2 ways x 3
#                                                 variants x 35 calls; DP AG 9 variants x 35 calls
#   part 4 Parm (2 GPUs)           45  100   35  2 spawns: the fit (3 collectives x 16 sizes x 6
#                                                 calls, a GEMM x 12 sizes) and 8 grid layers x 3
#                                                 schedules x (1 + 5) fwd+bwd calls; simulator ~3 s
#   summary + bundle (reserved)     5   20    -
#   total                        ~480 <= 580
# Parts 1 and 2 pass their step's seconds as one --budget for their shapes (bench/harness/common.py
# ShapeClock): a shape may use what the earlier ones left, less a floor per later shape, instead
# of a fixed half each. On 4 H100s (the runs of 2026-11-26 at commits 1995c58 and 072b748) the
# build took 112 s, the tests 163 s, part 1 39 s, part 2 103 s (DeepSeek-V3-like over 55 s,
# Mixtral-like under 48 s), part 3 59 s and part 4 46 s: ~540 s with the summary, inside 580 with
# little to spare; halves of part 2's step (44 and 55 s) had cut its DeepSeek-V3-like shape short
# twice there.
# On 4 GPUs part 3 runs TP2 and TP4 (caps per TP size) and part 4 runs at 4 GPUs; on 8 GPUs part 4
# runs at 4 and 8. Trim with --iters N (every timed-iteration count), --warmup N, --parts, or
# --skip-tests / --skip-build (a warm machine whose build is current); or the MGPU_* variables
# below, one count each.
#
# Options:
#   --parts LIST    parts to run, e.g. 1,3 (default 1,2,3,4; 5, across nodes with logical
#                   nodes and NCCL on sockets, only when named: bench_multinode.py; 6, the peer:
#                   DeepEP's own tests at the EP size, from a carried source tree, only when
#                   named: bench/peers/deepep.sh, its wheel copied to $OUT for the next call)
#   --budget S      seconds from the start to the end of the summary (default 580)
#   --iters N       timed iterations of every benchmark   --warmup N   warm-up calls of every one
#   --skip-build    use the installed uniep                --skip-tests  no pytest step
#   --ep N          EP size of parts 1-2 (default min(4, GPUs))
#   --dry-run       print the plan (each step, its timeout, its command) and a summary of
#                   not-run goals, executing nothing; --gpus N pretends N GPUs for the plan
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/.."

parts="1,2,3,4" budget=580 dry=0 skip_build=0 skip_tests=0 ep="" gpus_override="" all_iters=""
all_warmup=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --parts) parts="${2:?--parts needs a list}"; shift 2 ;;
    --budget) budget="${2:?--budget needs seconds}"; shift 2 ;;
    --iters) all_iters="${2:?--iters needs a count}"; shift 2 ;;
    --warmup) all_warmup="${2:?--warmup needs a count}"; shift 2 ;;
    --ep) ep="${2:?--ep needs a size}"; shift 2 ;;
    --gpus) gpus_override="${2:?--gpus needs a count}"; shift 2 ;;
    --skip-build) skip_build=1; shift ;;
    --skip-tests) skip_tests=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,73p' "$0"; exit 0 ;;
    *) echo "multigpu_run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for n in "$budget" ${all_iters:+"$all_iters"} ${all_warmup:+"$all_warmup"} ${ep:+"$ep"} \
    ${gpus_override:+"$gpus_override"}; do
  [[ "$n" =~ ^[0-9]+$ ]] || { echo "multigpu_run.sh: '$n' is not a count" >&2; exit 2; }
done

# Iteration counts (timed / warm-up), each overridable; --iters / --warmup set them all.
DISPATCH_ITERS=${all_iters:-${MGPU_DISPATCH_ITERS:-50}}
DISPATCH_WARMUP=${all_warmup:-${MGPU_DISPATCH_WARMUP:-10}}
MOE_ITERS=${all_iters:-${MGPU_MOE_ITERS:-15}}
MOE_WARMUP=${all_warmup:-${MGPU_MOE_WARMUP:-3}}
TUNE_CANDIDATES=${MGPU_TUNE_CANDIDATES:-4}
TUNE_ITERS=${all_iters:-${MGPU_TUNE_ITERS:-9}}
OVERLAP_ITERS=${all_iters:-${MGPU_OVERLAP_ITERS:-30}}
OVERLAP_WARMUP=${all_warmup:-${MGPU_OVERLAP_WARMUP:-5}}
UA_ITERS=${all_iters:-${MGPU_UA_ITERS:-30}}
UA_WARMUP=${all_warmup:-${MGPU_UA_WARMUP:-5}}
PARM_ITERS=${all_iters:-${MGPU_PARM_ITERS:-5}}
PARM_LAYERS=${MGPU_PARM_LAYERS:-8}
PARM_MP=${MGPU_PARM_MP:-2}
MN_ITERS=${all_iters:-${MGPU_MN_ITERS:-10}}
MN_WARMUP=${all_warmup:-${MGPU_MN_WARMUP:-3}}
# Per-kernel GPU time (rank 0) of each variant over this many extra calls, for the misses:
# the machines have no nsys, and this is what CUPTI gives through torch's profiler.
PROFILE_ITERS=${MGPU_PROFILE_ITERS:-3}

# Multicast objects are not available on the lent machines (KINDS.md): NCCL, torch's symmetric
# memory and NVSHMEM stay off NVLink SHARP, in every process the steps start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MAX_JOBS=16 CMAKE_BUILD_PARALLEL_LEVEL=16
export UNIEP_TIMEOUT_S=${UNIEP_TIMEOUT_S:-60}
RESERVE=20  # the summary and the bundle at the end

start=$(date +%s)
deadline=$((start + budget))
virtual=0  # --dry-run: the typical seconds the steps so far would have taken

if [[ -n "$gpus_override" ]]; then
  gpus=$gpus_override
else
  gpus=$(timeout 20 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
gpus=${gpus:-0}
gpu_name=$(timeout 20 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
gpu_name=${gpu_name:-none}
if [[ -n "${UNIEP_DEVICE_KIND:-}" ]]; then
  kind=$UNIEP_DEVICE_KIND
elif [[ "$gpus" -gt 0 && "$gpu_name" != none ]]; then
  kind=$(python3 -c 'import sys; sys.path.insert(0, "bench"); from common import kind_from_gpus
print(kind_from_gpus(sys.argv[1], int(sys.argv[2])))' "$gpu_name" "$gpus" 2>/dev/null)
  kind=${kind:-unknown-x$gpus}
else
  kind="no-gpu-x$gpus"
fi
commit=${UNIEP_COMMIT:-$(git rev-parse --short --verify --quiet HEAD 2>/dev/null)}
commit=${commit:-unknown}
export UNIEP_DEVICE_KIND=$kind UNIEP_COMMIT=$commit
stamp=$(date -u +%Y%m%dT%H%M%SZ)
tag="${kind}-${commit}"

if [[ -n "${OUT:-}" ]]; then
  summary_json="$OUT/summary-${tag}.json"
else
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/uniep-mgpu-out.XXXXXX")
  summary_json=bench/results/multigpu/multigpu.json
  ((dry)) && summary_json="$OUT/summary-${tag}.json"
fi
mkdir -p "$OUT"
WORK=${MGPU_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/uniep-mgpu.XXXXXX")}
mkdir -p "$WORK"
summary_md="$OUT/summary-${tag}.md"
bundle="$OUT/multigpu-${tag}-${stamp}.tgz"
exec > >(tee -a "$OUT/console-${tag}.log") 2>&1
tee_pid=$!

ep=${ep:-$((gpus < 4 ? gpus : 4))}
tps=() parm_worlds=()
((gpus >= 2)) && tps+=(2)
((gpus >= 4)) && tps+=(4)
if ((gpus >= 8)); then parm_worlds=(4 8)
elif ((gpus >= 4)); then parm_worlds=(4)
elif ((gpus >= 2)); then parm_worlds=("$gpus")
fi
tp_csv=$(IFS=,; echo "${tps[*]-}")
want() { [[ ",$parts," == *",$1,"* ]]; }

py() { python3 bench/harness/multigpu_summary.py "$@"; }
py meta --work "$WORK" kind="$kind" device="$gpu_name" gpu_count="$gpus" commit="$commit" \
  started="$(date -u -d "@$start" +%Y-%m-%dT%H:%M:%SZ)" started_epoch="$start" \
  budget_s="$budget" parts="\"$parts\"" ep_size="$ep" tp_sizes="[${tp_csv}]" \
  parm_worlds="[$(IFS=,; echo "${parm_worlds[*]-}")]" parm_mp="$PARM_MP" dry_run="$dry" \
  iters="{\"dispatch\": $DISPATCH_ITERS, \"moe\": $MOE_ITERS, \"tune\": $TUNE_ITERS, \"overlap\": $OVERLAP_ITERS, \"ulysses_ag\": $UA_ITERS, \"parm\": $PARM_ITERS}" \
  warmup="{\"dispatch\": $DISPATCH_WARMUP, \"moe\": $MOE_WARMUP, \"overlap\": $OVERLAP_WARMUP, \"ulysses_ag\": $UA_WARMUP}"

echo "== multigpu_run: kind $kind ($gpus x $gpu_name), commit $commit, budget ${budget}s"
echo "== EP $ep, TP ${tp_csv:-none}, Parm at ${parm_worlds[*]-none} GPUs; parts $parts; work $WORK"

# The minimum seconds each planned step keeps for itself: a step before it may use only what is
# left after them (so a slow build cannot starve part 4).
pending_min=0
plan() { pending_min=$((pending_min + $1)); }
((skip_build)) || plan 60
((skip_tests)) || plan 30
want 1 && plan 40
want 2 && plan 100
want 3 && plan $((25 * ${#tps[@]} + 15 * ${#tps[@]}))
want 4 && plan $((35 * ${#parm_worlds[@]}))
want 6 && plan 60

# A dry run's clock is the typical seconds alone, so its plan does not depend on how fast this
# machine runs the planning itself.
now() {
  if ((dry)); then echo $((start + virtual)); else date +%s; fi
}

# budget_for CAP MIN: sets T, the seconds this step gets (0: not enough left), and releases MIN
# from the pending minimum.
budget_for() {
  local cap=$1 min=$2 left
  pending_min=$((pending_min - min))
  left=$((deadline - $(now) - RESERVE - pending_min))
  if ((left < min)); then T=0
  elif ((left < cap)); then T=$left
  else T=$cap
  fi
}

refresh() {
  py build --work "$WORK" --out "$summary_json" >"$summary_md" 2>>"$WORK/summary-errors.log" ||
    echo "(summary failed: $WORK/summary-errors.log)"
  tar -czf "$bundle.tmp" -C "$WORK" . 2>/dev/null && mv "$bundle.tmp" "$bundle"
}

# run_step NAME T TYPICAL OUTDIR CMD...: CMD under `timeout T` (its whole process group is
# stopped when time is up), recorded in steps.jsonl; the summary and the bundle rewritten after.
run_step() {
  local name=$1 t=$2 typical=$3 outdir=$4
  shift 4
  local left=$((deadline - $(now)))
  if ((t <= 0)); then
    LAST_STATUS=skipped
    echo "== [$name] skipped: only ${left}s of the ${budget}s budget left"
    py record --work "$WORK" --step "$name" --status skipped --timeout 0 \
      --why="only ${left}s of the ${budget}s budget were left" --command="$*"
    refresh
    return 0
  fi
  echo "== [$name] +$(($(now) - start))s, timeout ${t}s (typical ${typical}s): $*"
  if ((dry)); then
    virtual=$((virtual + (typical < t ? typical : t)))
    py record --work "$WORK" --step "$name" --status dry-run --timeout "$t" --out-dir "$outdir" \
      --command="$*"
    return 0
  fi
  mkdir -p "$outdir"
  local t0 rc status why=""
  t0=$(date +%s)
  timeout -k 10 "$t" "$@"
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status=timeout; why="stopped at its ${t}s timeout" ;;
    *) status=failed; why="exit status $rc" ;;
  esac
  LAST_STATUS=$status
  echo "== [$name] $status after $(($(date +%s) - t0))s"
  py record --work "$WORK" --step "$name" --status "$status" --rc "$rc" \
    --seconds "$(($(date +%s) - t0))" --timeout "$t" --out-dir "$outdir" --why="$why" \
    --command="$*"
  # A step's ranks are stopped with it; anything still on the GPUs is worth knowing about.
  local left_over
  left_over=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader \
    2>/dev/null || true)
  [[ -z "$left_over" ]] || echo "== [$name] still on the GPUs: $left_over"
  refresh
}

skip_step() {  # skip_step NAME WHY [MIN]: MIN, the step's planned minimum, goes to the others
  echo "== [$1] skipped: $2"
  pending_min=$((pending_min - ${3:-0}))
  py record --work "$WORK" --step "$1" --status skipped --why="$2"
}

# ---- environment and build ----
built=1
if ((!dry)); then
  echo "== environment"
  timeout 20 nvidia-smi -L || true
  shopt -s nullglob
  wheels=(.whl/nvidia_cutlass-*.whl)
  if ((!skip_build)) && [[ ${#wheels[@]} -gt 0 ]]; then
    timeout 60 python3 -m pip install -q --no-index --no-deps "${wheels[@]}" ||
      echo "== the carried CUTLASS wheel did not install"
  fi
  # As device_check.sh: build and test requirements missing there come from .whl/ (no network).
  for req in scikit_build_core:scikit-build-core pybind11:pybind11 pytest:pytest; do
    if ! python3 -c "import ${req%%:*}" 2>/dev/null; then
      timeout 60 python3 -m pip install -q --no-index --find-links .whl "${req#*:}" ||
        echo "== ${req#*:} is missing and not in .whl/"
    fi
  done
  # After the wheels: the versions recorded are the ones the build uses.
  timeout 60 python3 - "$WORK" <<'EOF' || true
import importlib.metadata as md, json, sys
from pathlib import Path
import torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda or ""}
for dist in ("nvidia-nvshmem-cu13", "nvidia-cutlass", "pytest"):
    try:
        info[dist] = md.version(dist)
    except md.PackageNotFoundError:
        info[dist] = "not installed"
print(json.dumps(info))
meta = Path(sys.argv[1]) / "meta.json"
meta.write_text(json.dumps({**json.loads(meta.read_text()), "versions": info}, indent=1) + "\n")
EOF
fi
if ((skip_build)); then
  skip_step build "--skip-build: the installed uniep is used"
else
  budget_for 240 60
  LAST_STATUS=ok
  run_step build "$T" 130 "$WORK" \
    bash -c "python3 -m pip install --no-build-isolation --no-deps -v . >'$WORK/build.log' 2>&1"
  if [[ "$LAST_STATUS" != ok ]]; then
    built=0
    ((dry)) || tail -n 40 "$WORK/build.log"
  fi
fi
((dry)) || python3 -c "import json, uniep; print(json.dumps(uniep.build_info()))" || built=0

not_built="the build failed (see build.log in the bundle)"
too_few="needs >= 2 GPUs, found $gpus"

# ---- the multigpu tests ----
if ((skip_tests)); then
  skip_step multigpu-tests "--skip-tests"
elif ((!built)); then skip_step multigpu-tests "$not_built" 30
elif ((gpus < 2)); then skip_step multigpu-tests "$too_few" 30
else
  # -v and the durations: the first H200x2 run stopped at 90 s in the 11th test with nothing to
  # say which; faulthandler prints every thread's stack of a test still running after 120 s.
  budget_for 200 30
  run_step multigpu-tests "$T" 130 "$WORK" python3 -m pytest -m multigpu -v -rs --durations=0 \
    -o faulthandler_timeout=120 -p no:cacheprovider --junitxml "$WORK/multigpu-tests.xml" tests
fi

# ---- part 1: dispatch / combine, DeepSeek-V3 and low-latency shapes, EP=min(4, GPUs) ----
if want 1; then
  if ((!built)); then skip_step part1-dispatch "$not_built" 40
  elif ((gpus < 2)); then skip_step part1-dispatch "$too_few" 40
  else
    budget_for 90 40
    run_step part1-dispatch "$T" 30 "$WORK/part1" python3 bench/bench_dispatch.py \
      --world-size "$ep" --iters "$DISPATCH_ITERS" --warmup "$DISPATCH_WARMUP" \
      --profile "$PROFILE_ITERS" --timeout "$T" --budget $((T - 10)) --out-dir "$WORK/part1"
  fi
fi

# ---- part 2: the MoE layer, forward and backward, expert GEMMs alone, the tuner ----
if want 2; then
  if ((!built)); then skip_step part2-moe "$not_built" 100
  elif ((gpus < 2)); then skip_step part2-moe "$too_few" 100
  else
    budget_for 180 100
    run_step part2-moe "$T" 90 "$WORK/part2" python3 bench/bench_moe_ep.py \
      --world-size "$ep" --iters "$MOE_ITERS" --warmup "$MOE_WARMUP" \
      --tune-candidates "$TUNE_CANDIDATES" --tune-iters "$TUNE_ITERS" \
      --profile "$PROFILE_ITERS" --timeout "$T" --budget $((T - 10)) --out-dir "$WORK/part2"
  fi
fi

# ---- part 3: TP overlap at TP=2 (and 4), DP reduce-scatter; Ulysses and the DP all-gather ----
if want 3; then
  ntp=${#tps[@]}
  if ((!built)); then
    skip_step part3-overlap "$not_built" $((25 * ntp))
    skip_step part3-ulysses-dp-ag "$not_built" $((15 * ntp))
  elif ((ntp == 0)); then
    skip_step part3-overlap "$too_few"; skip_step part3-ulysses-dp-ag "$too_few"
  else
    budget_for $((50 * ntp)) $((25 * ntp))
    run_step part3-overlap "$T" $((25 * ntp)) "$WORK/part3" python3 bench/bench_overlap.py \
      --tp "$tp_csv" --shapes anchors --iters "$OVERLAP_ITERS" --warmup "$OVERLAP_WARMUP" \
      --profile "$PROFILE_ITERS" --timeout $(((T - 10) / ntp)) --out-dir "$WORK/part3"
    budget_for $((35 * ntp)) $((15 * ntp))
    run_step part3-ulysses-dp-ag "$T" $((15 * ntp)) "$WORK/part3" python3 bench/bench_ulysses_ag.py \
      --tp "$tp_csv" --iters "$UA_ITERS" --warmup "$UA_WARMUP" \
      --timeout $(((T - 10) / ntp)) --out-dir "$WORK/part3"
  fi
fi

# ---- part 4: Parm's three schedules, one rank per GPU, predicted against measured ----
if want 4; then
  if ((${#parm_worlds[@]} == 0)); then skip_step part4-parm-w4 "$too_few"
  fi
  for w in ${parm_worlds[@]+"${parm_worlds[@]}"}; do
    if ((!built)); then skip_step "part4-parm-w$w" "$not_built" 35; continue; fi
    budget_for 100 35
    run_step "part4-parm-w$w" "$T" 45 "$WORK/part4-w$w" python3 bench/bench_parm.py \
      --device cuda --ranks-per-gpu 1 --world-size "$w" --mp-size "$PARM_MP" \
      --grid-sample "$PARM_LAYERS" --iters "$PARM_ITERS" --no-plot \
      --timeout $(((T - 10) / 2)) --out-dir "$WORK/part4-w$w"
  done
fi

# ---- part 5 (when named): across nodes, logical nodes of one machine, the rail on sockets ----
if want 5; then
  if ((!built)); then skip_step part5-multinode "$not_built" 40
  elif ((gpus < 4)); then skip_step part5-multinode "needs 4 GPUs (two logical nodes of two)" 40
  else
    layouts="4x2"
    ((gpus >= 8)) && layouts="4x2,8x4,8x2"
    budget_for 150 40
    run_step part5-multinode "$T" 60 "$WORK/part5" python3 bench/bench_multinode.py \
      --layouts "$layouts" --rail-sockets --iters "$MN_ITERS" --warmup "$MN_WARMUP" \
      --out-dir "$WORK/part5"
  fi
fi

# ---- part 6 (when named): the peer, DeepEP's own tests at EP $ep, built from carried source ----
if want 6; then
  deepep_src=${UNIEP_DEEPEP_SRC:-.peers/DeepEP}
  deepep_wheels=${MGPU_DEEPEP_WHEELS:-.peers/wheel}
  if ((gpus < 2)); then skip_step part6-deepep "$too_few" 60
  elif [[ ! -f "$deepep_src/setup.py" ]]; then
    skip_step part6-deepep "no DeepEP source tree at $deepep_src (carry one there, or set UNIEP_DEEPEP_SRC)" 60
  else
    budget_for 420 60
    run_step part6-deepep "$T" 300 "$WORK/part6" bash bench/peers/deepep.sh --src "$deepep_src" \
      --ep "$ep" --out-dir "$WORK/part6" --wheel-dir "$deepep_wheels" --timeout $(((T - 20) / 3))
    # The wheel back to the caller, to carry to the next call instead of building again.
    ((dry)) || cp "$deepep_wheels"/deep_ep-*.whl "$OUT/" 2>/dev/null || true
  fi
fi

refresh
cat "$summary_md"
rc=0
grep -qE '"status": "(failed|timeout)"' "$WORK/steps.jsonl" 2>/dev/null && rc=1
echo "== multigpu_run: done in $(($(now) - start))s of ${budget}s; $summary_json, $bundle"
# Let tee write the last lines before the device tool collects $OUT.
exec >&- 2>&-
wait "$tee_pid" 2>/dev/null || true
exit $rc
