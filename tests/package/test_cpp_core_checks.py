"""Edge cases of the uniep::core C++ API (tests/cpp/core_checks.cpp), built against the CMake
package that ships in the installed uniep module (find_package(uniep), uniep::core) and run one
case per process: a case that crashes or hangs fails alone, with its name. Each case once
crashed, hung or answered wrong (a planner reading past its arrays on an unchecked MoeShape, the
SAA chunk search looping forever, rank_layout quadratic in the world size, ...); now it answers
right or throws uniep::Error(kInvalidArgument) naming the argument.

The cases exercise the installed library, so a change to cpp/core shows here once the module is
rebuilt. The header of core_checks.cpp gives the sanitized build from the sources, which also
catches what only ASan/UBSan see.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "cpp" / "core_checks.cpp"
CMAKE = shutil.which("cmake")
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

CASES = [
    "plan_slots_validates_shape",
    "plan_sender_rows_validates_shape",
    "plan_experts_checks_counts",
    "saa_huge_max_chunks",
    "rank_layout_linear",
    "gate_tile_base_huge_tile_m",
    "layout_tokens_bound",
    "price_checks_overlap_with",
    "collectives_without_shape",
    "executor_shares_a_failed_check",
    "executor_agrees_on_the_experts_precision",
    "fp8_weights_layout_and_errors",
]

pytestmark = pytest.mark.skipif(
    CMAKE is None or CXX is None or not SOURCE.is_file(),
    reason="needs cmake, a C++ compiler and tests/cpp/core_checks.cpp",
)


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def core_checks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The core_checks executable, linked to the installed module's uniep::core."""
    uniep = pytest.importorskip("uniep")
    prefix = Path(uniep.cmake_prefix_path())
    if not (prefix / "lib" / "cmake" / "uniep" / "uniepConfig.cmake").is_file():
        pytest.skip(f"the uniep module at {prefix} ships no C++ package")
    work = tmp_path_factory.mktemp("core_checks")
    (work / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.25)\n"
        "project(uniep_core_checks LANGUAGES CXX)\n"
        "find_package(uniep REQUIRED CONFIG)\n"
        "find_package(Threads REQUIRED)\n"
        f'add_executable(core_checks "{SOURCE.as_posix()}")\n'
        "target_link_libraries(core_checks PRIVATE uniep::core Threads::Threads)\n"
    )
    build = work / "build"
    for cmd in (
        [CMAKE, "-S", str(work), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}",
         "-DCMAKE_BUILD_TYPE=Release"],
        [CMAKE, "--build", str(build)],
    ):  # fmt: skip
        done = _run(cmd, timeout=300)
        if done.returncode != 0:
            out = (done.stdout + done.stderr)[-6000:]
            pytest.fail(f"{' '.join(cmd)} exited {done.returncode}:\n{out}")
    return build / "core_checks"


def test_cases_listed_here_are_the_programs(core_checks: Path) -> None:
    done = _run([str(core_checks), "--list"], timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == CASES


@pytest.mark.parametrize("case", CASES)
def test_case(core_checks: Path, case: str) -> None:
    try:
        done = _run([str(core_checks), case], timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: still running after 60 s (a hang)")
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{case} exited {done.returncode}:\n{out[-4000:]}"
    assert out.rstrip().endswith("OK"), out
