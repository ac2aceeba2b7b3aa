"""Print Markdown tables of benchmark JSON files (those written by bench/common.write_result).

python bench/summarize.py [--out-dir DIR] [--since EPOCH_SECONDS] [FILE ...]

Without FILEs: every DIR/NAME/NAME.json (default bench/results), one result per benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path(__file__).resolve().parent / "results"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e3 else f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value).replace("|", "\\|")


def table(payload: dict[str, Any]) -> list[str]:
    """One Markdown table for one result file: a column per key seen in any row."""
    rows = payload.get("rows", [])
    env = payload.get("env", {})
    title = (
        f"### {payload.get('name', '?')} on {env.get('device', '?')} "
        f"(torch {env.get('torch', '?')}, CUDA {env.get('cuda') or 'none'}, "
        f"commit {env.get('commit', '?')}, {env.get('date', '?')})"
    )
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    if not keys:
        return [title, "", "(no rows)"]
    lines = [title, "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |")
    return lines


def result_files(out_dir: Path) -> list[Path]:
    """The benchmark results in ``out_dir``: ``NAME/NAME.json``, by name."""
    return sorted(p for p in out_dir.glob("*/*.json") if p.stem == p.parent.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="JSON files (default: those in --out-dir)")
    parser.add_argument(
        "--out-dir", default=str(DEFAULT_DIR), help="results folder, read as DIR/NAME/NAME.json"
    )
    parser.add_argument("--since", type=float, default=0.0, help="only files modified after this")
    args = parser.parse_args(argv)

    paths = [Path(f) for f in args.files] or result_files(Path(args.out_dir))
    paths = [p for p in paths if p.stat().st_mtime >= args.since]
    blocks = []
    for path in paths:
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"{path}: unreadable ({exc})", file=sys.stderr)
            return 1
        if "rows" not in payload:  # not a write_result file (the multi-GPU run's summary)
            continue
        blocks.append("\n".join(table(payload)))
    if not blocks:
        print(f"no benchmark results in {args.out_dir}", file=sys.stderr)
        return 1
    print("\n\n".join(blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
