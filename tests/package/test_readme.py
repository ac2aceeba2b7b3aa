"""README.md's Python blocks run as written, and the documentation's links resolve.

Each ```python block of README.md runs on CPU in a process of its own, forked from one runner
that imported what the blocks import once, as one rank of `torchrun --nproc-per-node 1` would
(RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set), so a block that calls
`init_process_group` runs too. A block whose first line is `# readme-test: skip (<reason>)`, or
that imports a package this environment lacks, is not run; the counts are printed.

Every `](target)` link of README.md, CHANGELOG.md and docs/*.md that is not http(s), mailto or
a bare anchor must name an existing file or folder, and an anchor into a Markdown file must name
one of its headings (GitHub's slugs). Those pages name runs by date and commit, never by work
session, and hold no paths into dated bench/results folders.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SKIP_MARKER = "# readme-test: skip"
BLOCK_TIMEOUT_S = 120

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, source) of every ```python block of a Markdown text."""
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(2))
        for m in _FENCE.finditer(text)
        if m.group(1).strip() == "python"
    ]


# Runs in one interpreter: imports what the blocks import once (torch, uniep and transformers
# take seconds each), then forks a fresh child per block, which runs it in a new namespace as
# __main__ with its output in a file. Nothing has computed in the parent, so forking is safe.
_RUNNER = r"""
import ast, json, os, signal, socket, sys, time, traceback

blocks = json.load(open(sys.argv[1]))
out_dir = sys.argv[2]
timeout = float(sys.argv[3])
for _, src in blocks:
    for node in ast.parse(src).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            try:
                __import__(name)
            except Exception:
                pass

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

results = {}
for line, src in blocks:
    log = os.path.join(out_dir, f"line{line}.log")
    port = str(free_port())
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ["MASTER_PORT"] = port
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            exec(compile(src, f"README.md:{line}", "exec"), {"__name__": "__main__"})
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    status = None
    while status is None and time.monotonic() - start < timeout:
        done, raw = os.waitpid(pid, os.WNOHANG)
        status = os.waitstatus_to_exitcode(raw) if done else None
        time.sleep(0.02)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        status = "timeout"
    results[str(line)] = {"status": status, "seconds": round(time.monotonic() - start, 2)}
print(json.dumps(results))
"""


def _one_rank_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        UNIEP_TUNE_CACHE=str(tmp / "tune.json"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    return env


def missing_modules(source: str) -> list[str]:
    """Top-level packages a block imports that are not installed (transformers is a test extra)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


_BLOCKS = python_blocks(README.read_text())
_TO_RUN = [
    (n, src)
    for n, src in _BLOCKS
    if not src.lstrip().startswith(SKIP_MARKER) and not missing_modules(src)
]


@pytest.fixture(scope="module")
def block_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("readme")
    (tmp / "blocks.json").write_text(json.dumps(_TO_RUN))
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(tmp / "blocks.json"), str(tmp), str(BLOCK_TIMEOUT_S)],
        cwd=tmp,
        env=_one_rank_env(tmp),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S * (len(_TO_RUN) + 1),
    )
    assert proc.returncode == 0, f"runner failed\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for line, r in results.items():
        r["log"] = (tmp / f"line{line}.log").read_text()
    return results


def test_readme_is_a_front_page() -> None:
    """The README is what a user reads first: at most 12 KiB, history and reference elsewhere
    (CHANGELOG.md, docs/)."""
    size = len(README.read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes; move detail to docs/ (limit 12 KiB)"


def test_readme_has_python_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(
            f"\nREADME.md: {len(_BLOCKS)} python blocks: {len(_TO_RUN)} run, "
            f"{len(_BLOCKS) - len(_TO_RUN)} not run (marked, or a package missing)"
        )
    assert _TO_RUN


@pytest.mark.parametrize("line, source", _BLOCKS, ids=[f"line{n}" for n, _ in _BLOCKS])
def test_readme_block_runs(line: int, source: str, block_results: dict[str, dict]) -> None:
    if source.lstrip().startswith(SKIP_MARKER):
        pytest.skip(f"README.md line {line}: {source.strip().splitlines()[0]}")
    if missing_modules(source):
        pytest.skip(f"README.md line {line} needs {', '.join(missing_modules(source))}")
    r = block_results[str(line)]
    assert r["status"] == 0, (
        f"README.md block at line {line}: exit status {r['status']} after {r['seconds']} s\n"
        f"--- source\n{source}--- output\n{r['log'][-6000:]}"
    )


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        m = None if in_fence else _HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _doc_files() -> list[Path]:
    files = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [f for f in files if f.exists()]


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link outside code fences and code spans that is not a URL."""
    out = []
    in_fence = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"(https?|mailto):", target):
                continue
            out.append((n, target))
    return out


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    bad = []
    for line, target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        where = f"{doc.relative_to(ROOT)}:{line}: {target}"
        if not dest.exists():
            bad.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: no heading with that anchor")
    assert not bad, "\n".join(bad)


def test_no_development_log_words() -> None:
    """The front page and the docs name runs by date and commit, never by work session."""
    bad = []
    for doc in _doc_files():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if re.search(r"\b(session|issue)[ -]?\d+", line, re.I) or re.search(
                r"bench/results/\d{4}-\d\d-\d\d", line
            ):
                bad.append(f"{doc.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not bad, "\n".join(bad)
