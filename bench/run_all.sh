#!/usr/bin/env bash
# Run every bench/bench_*.py, then print a Markdown table of the JSON they wrote.
#   bash bench/run_all.sh [--quick] [--out-dir DIR]
# --quick runs the CPU configurations only (what CI and a laptop can do). Exits non-zero if any
# benchmark failed; the others still run.
# Each benchmark NAME replaces DIR/NAME/NAME.json (default bench/results, the committed results
# that bench/RESULTS.md quotes): give --quick runs a scratch DIR.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out_dir="$here/results"
flags=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) flags+=(--quick); shift ;;
    --out-dir)
      [[ $# -ge 2 ]] || { echo "run_all.sh: --out-dir needs a directory" >&2; exit 2; }
      out_dir="$2"; shift 2 ;;
    --out-dir=*) out_dir="${1#--out-dir=}"; shift ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "run_all.sh: unknown argument '$1' (expected --quick, --out-dir DIR)" >&2; exit 2 ;;
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
  echo "== $name ${flags[*]-}" >&2
  if ! "$python" "$script" ${flags[@]+"${flags[@]}"} --out-dir "$out_dir"; then
    echo "== $name FAILED" >&2
    failed+=("$name")
  fi
done

echo
"$python" "$here/summarize.py" --out-dir "$out_dir" --since "$start" || failed+=("summarize")

if [[ ${#failed[@]} -gt 0 ]]; then
  echo "run_all.sh: failed: ${failed[*]}" >&2
  exit 1
fi
