#!/usr/bin/env bash
# Run every bench/bench_*.py, then print one headline table per benchmark of the JSON they wrote
# (bench/harness/summarize.py: ours, the peer's from the same run, the ratio, the goal and whether met).
#   bash bench/run_all.sh [--quick] [--detail] [--out-dir DIR]
# --quick runs the CPU configurations only (what CI and a laptop can do); --detail adds the table
# of every field of each result after the headlines. Exits non-zero if any benchmark failed; the
# others still run.
# Each benchmark NAME replaces DIR/NAME/NAME.json (default bench/results, the committed results
# that bench/RESULTS.md quotes): give --quick runs a scratch DIR.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out_dir="$here/results"
flags=()
summary=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) flags+=(--quick); shift ;;
    --detail) summary+=(--detail); shift ;;
    --out-dir)
      [[ $# -ge 2 ]] || { echo "run_all.sh: --out-dir needs a directory" >&2; exit 2; }
      out_dir="$2"; shift 2 ;;
    --out-dir=*) out_dir="${1#--out-dir=}"; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "run_all.sh: unknown argument '$1' (expected --quick, --detail, --out-dir DIR)" >&2
       exit 2 ;;
  esac
done
mkdir -p "$out_dir"
python="${PYTHON:-python}"
# Files written from now on belong to this run (mtime compared by summarize.py).
start="$("$python" -c 'import time; print(time.time() - 1)')"

failed=()
shopt -s nullglob
for script in "$here"/bench_*.py; do
  name="$(basename "$script")"
  # summarize.py says which of them wrote no result (a benchmark that needs a GPU on a CPU).
  summary+=(--expect "${name%.py}")
  echo "== $name ${flags[*]-}" >&2
  if ! "$python" "$script" ${flags[@]+"${flags[@]}"} --out-dir "$out_dir"; then
    echo "== $name FAILED" >&2
    failed+=("$name")
  fi
done

echo
"$python" "$here/harness/summarize.py" --out-dir "$out_dir" --since "$start" ${summary[@]+"${summary[@]}"} \
  || failed+=("summarize")

if [[ ${#failed[@]} -gt 0 ]]; then
  echo "run_all.sh: failed: ${failed[*]}" >&2
  exit 1
fi
