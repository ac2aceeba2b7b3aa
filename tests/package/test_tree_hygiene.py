"""No tracked file refers to a work session or an issue by its number.

Such a number means nothing to a reader of the repository: the tracker or log it points into is
not part of it. A comment or a doc says why the code is as it is, and a measurement it cites is
named by device, date and commit ("one H200, 2026-11-26, commit 1a2b3c4"), which anyone with the
repository can look up. Skipped: binary files and bench/results (recorded data, quoted as
measured). The check reads the working tree's copies of the files git tracks, so it needs a git
checkout; outside one (an unpacked sdist) it is skipped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HISTORY = re.compile(r"\bsession ?\d+\b|\bsessions? \d+|\bissue ?#?\d+\b", re.IGNORECASE)
SKIPPED_DIRS = ("bench/results/",)


def _tracked_files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip(f"not a git checkout: {ROOT} has no .git")
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    # safe.directory: a checkout owned by another user (a CI container) is still read.
    done = subprocess.run(
        [git, "-c", f"safe.directory={ROOT}", "-C", str(ROOT), "ls-files", "-z"],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, f"git ls-files failed: {done.stderr.decode(errors='replace')}"
    return [p for p in done.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def _hits(rel: str) -> list[str]:
    path = ROOT / rel
    # In the index but not on disk (deleted, not yet committed), or a link: nothing to read.
    if path.is_symlink() or not path.is_file():
        return []
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return []
    text = data.decode("utf-8", errors="replace")
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if HISTORY.search(line):
            out.append(f"{rel}:{number}: {line.strip()[:160]}")
    return out


def test_pattern_matches_what_it_is_for() -> None:
    # The numbered examples are formatted here so that this file does not match itself.
    for form in ("Session %d results", "sessions %d-21", "(issue %d)", "Issue #%d", "issue%d"):
        assert HISTORY.search(form % 20), form
    for text in ("nvshmem_session", "NVSHMEM session", "tissue 5", "the issue's goal", "issues"):
        assert not HISTORY.search(text), text


def test_no_session_or_issue_numbers_in_tracked_files() -> None:
    hits = []
    for rel in _tracked_files():
        if not rel.startswith(SKIPPED_DIRS):
            hits += _hits(rel)
    files = {h.split(":", 1)[0] for h in hits}
    assert not hits, (
        f"{len(hits)} line(s) in {len(files)} file(s) name a session or an issue by number; say "
        "why instead, and name a measurement by device, date and commit:\n" + "\n".join(hits)
    )
