"""Print Markdown tables of benchmark JSON files (those written by bench/common.write_result).

python bench/harness/summarize.py [--out-dir DIR] [--since EPOCH_SECONDS] [--detail] [--expect NAME]
                          [FILE ...]

Without FILEs: every DIR/NAME/NAME.json (default bench/results), one result per benchmark.
First one headline table per benchmark (bench/harness/headlines.py: our figure, the peer's from the
same run, their ratio, the goal and whether it is met); a benchmark without a spec there, or whose
result lacks a field its spec names, gets the generic table, with the reason under it.
``--detail`` adds the generic table of every result (every field that holds one value).
``--expect NAME`` (run_all.sh passes every benchmark it ran): a line for each one that wrote no
result.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import headlines

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "results"


# A string cell longer than this becomes a numbered note under its table.
_NOTE_AFTER = 48


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e3 else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def _flat(row: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A row's scalar cells, a dict of scalars spread into ``key.sub`` columns (``ms.ours``,
    ``ms.nccl``); the keys left out (lists, nested dicts: per-rank and per-round detail, which
    the JSON keeps)."""
    flat: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in row.items():
        if (
            isinstance(value, dict)
            and value
            and all(not isinstance(v, dict | list) for v in value.values())
        ):
            flat.update({f"{key}.{sub}": v for sub, v in value.items()})
        elif isinstance(value, dict | list):
            if value:
                dropped.append(key)
        else:
            flat[key] = value
    return flat, dropped


def table(payload: dict[str, Any]) -> list[str]:
    """One readable Markdown table for one result file: what every row shares on one line above
    it, a column per key that varies (a dict of scalars spread into named columns), long strings
    as numbered notes below, and the per-rank or per-round detail (lists, nested dicts) named as
    left in the JSON, never dumped into a cell."""
    rows = [r for r in payload.get("rows", []) if isinstance(r, dict)]
    env = payload.get("env", {}) if isinstance(payload.get("env"), dict) else {}
    title = (
        f"### {payload.get('name', '?')} on {env.get('device', '?')} "
        f"(torch {env.get('torch', '?')}, CUDA {env.get('cuda') or 'none'}, "
        f"commit {env.get('commit', '?')}, {env.get('date', '?')})"
    )
    flat_rows, dropped = [], []
    for row in rows:
        flat, left = _flat(row)
        flat_rows.append(flat)
        dropped += [k for k in left if k not in dropped]
    keys: list[str] = []
    for row in flat_rows:
        keys += [k for k in row if k not in keys]
    if not keys:
        return [title, "", "(no rows)"]
    shared = [
        k
        for k in keys
        if len(flat_rows) > 1
        and all(k in r for r in flat_rows)
        and len({json.dumps(r[k], sort_keys=True, default=str) for r in flat_rows}) == 1
        and len(_cell(flat_rows[0][k])) <= _NOTE_AFTER
    ]
    lines = [title, ""]
    if len(flat_rows) == 1:  # one row reads best as a column of named values
        lines += ["| field | value |", "|---|---|"]
        lines += [f"| {k} | {_cell(flat_rows[0][k])} |" for k in keys]
        if dropped:
            lines += ["", "in the JSON only (per rank, per round or nested): " + ", ".join(dropped)]
        return lines
    columns = [k for k in keys if k not in shared]
    if shared:
        lines += ["all rows: " + ", ".join(f"{k} {_cell(flat_rows[0][k])}" for k in shared), ""]
    notes: list[str] = []
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in flat_rows:
        cells = []
        for k in columns:
            text = _cell(row.get(k, ""))
            if len(text) > _NOTE_AFTER:
                if text not in notes:
                    notes.append(text)
                text = f"[{notes.index(text) + 1}]"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    if notes or dropped:
        lines.append("")
    lines += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    if dropped:
        lines.append("in the JSON only (per rank, per round or nested): " + ", ".join(dropped))
    return lines


def render(payload: dict[str, Any]) -> list[str]:
    """The headline table of one result, else (no spec, or a result the spec does not fit) the
    generic :func:`table` with a line under it that says why."""
    name = payload.get("name", "?")
    spec = headlines.SPECS.get(str(name))
    if spec is None:
        return table(payload) + ["", f"(no headline spec for {name} in bench/harness/headlines.py)"]
    try:
        return headlines.headline(payload, spec)
    except headlines.SpecMismatch as exc:
        reason = str(exc)
    except Exception as exc:  # a summary must not crash on an odd result
        reason = f"{type(exc).__name__}: {exc}"
    return table(payload) + [
        "",
        f"(no headline table: {reason}; bench/harness/headlines.py's spec for {name} does not "
        "fit this result)",
    ]


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
    parser.add_argument(
        "--detail", action="store_true", help="also the generic table of every result"
    )
    parser.add_argument(
        "--expect",
        action="append",
        default=[],
        metavar="NAME",
        help="a benchmark that ran: say so if it wrote no result (repeatable)",
    )
    args = parser.parse_args(argv)

    paths = [Path(f) for f in args.files] or result_files(Path(args.out_dir))
    paths = [p for p in paths if p.stat().st_mtime >= args.since]
    payloads = []
    for path in paths:
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"{path}: unreadable ({exc})", file=sys.stderr)
            return 1
        if not isinstance(payload, dict) or "rows" not in payload:
            continue  # not a write_result file (the multi-GPU run's summary)
        payloads.append(payload)
    if not payloads:
        print(f"no benchmark results in {args.out_dir}", file=sys.stderr)
        return 1
    blocks = [(str(p.get("name", "?")), "\n".join(render(p))) for p in payloads]
    for name in dict.fromkeys(args.expect).keys() - {name for name, _ in blocks}:
        blocks.append(
            (
                name,
                f"### {name}\n\nno result from this run: it wrote no JSON (its own output above "
                "says why, e.g. no GPU of the kind it needs)",
            )
        )
    print("## Headline tables\n")
    print("\n\n".join(block for _, block in sorted(blocks, key=lambda b: b[0])))
    if args.detail:
        print("\n## Detail: every field of each result\n")
        print("\n\n".join("\n".join(table(p)) for p in payloads))
    else:
        print("\n(every field of each result: bench/harness/summarize.py --detail)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
