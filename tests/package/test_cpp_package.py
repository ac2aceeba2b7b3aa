"""The C++ package: a C++-only build of uniep::core (no Python, torch or pybind11) installed to
a prefix, and the example consumer (examples/cpp) configured against that prefix with
find_package(uniep), built and run; then the same consumer against the C++ package that ships
in the installed uniep module (with uniep::cuda where the module was built with CUDA: its
GPU example is built, and without a GPU it exits 0 saying so).

The C++-only build with CUDA is too slow for this run (the kernels compile for minutes on two
cores); .ci/run builds, installs and runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _hardware import cuda_device_count

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cpp"
CMAKE = shutil.which("cmake")
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

pytestmark = pytest.mark.skipif(
    CMAKE is None or CXX is None or not (ROOT / "CMakeLists.txt").is_file(),
    reason="needs cmake, a C++ compiler and the source tree",
)


def _run(cmd: list[str], timeout: float = 300, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}")
    return out


def _project_version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(uniep\b[^)]*VERSION\s+([0-9.]+)", text)
    assert match, "project(uniep ... VERSION x.y.z) not found in CMakeLists.txt"
    return match.group(1)


@pytest.fixture(scope="module")
def cpp_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(build folder, install prefix) of a C++-only build of the core library."""
    work = tmp_path_factory.mktemp("cpp_package")
    build, prefix = work / "build", work / "prefix"
    _run(
        [
            CMAKE, "-S", str(ROOT), "-B", str(build),
            "-DUNIEP_BUILD_PYTHON=OFF", "-DUNIEP_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Release",
            # A REQUIRED find_package of a disabled package is an error: proof that the C++
            # build asks for neither.
            "-DCMAKE_DISABLE_FIND_PACKAGE_Python=ON", "-DCMAKE_DISABLE_FIND_PACKAGE_pybind11=ON",
            "-DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON",
        ]
    )  # fmt: skip
    _run([CMAKE, "--build", str(build), "--parallel", "2"])
    _run([CMAKE, "--install", str(build), "--prefix", str(prefix)])
    return build, prefix


def _build_example(prefix: Path, build: Path) -> str:
    out = _run([CMAKE, "-S", str(EXAMPLE), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}"])
    _run([CMAKE, "--build", str(build), "--parallel", "2"])
    return out


def test_the_cuda_component_of_a_package_without_cuda_says_why(
    cpp_build: tuple[Path, Path], tmp_path: Path
) -> None:
    """find_package(uniep REQUIRED COMPONENTS cuda) on a package built without CUDA fails naming
    the cause (CMake alone said only that uniep_FOUND was set to FALSE)."""
    _, prefix = cpp_build
    src = tmp_path / "src"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(wants_cuda CXX)\n"
        "find_package(uniep REQUIRED COMPONENTS cuda)\n"
    )
    proc = subprocess.run(
        [CMAKE, "-S", str(src), "-B", str(tmp_path / "build"), f"-DCMAKE_PREFIX_PATH={prefix}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "built without CUDA" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_install_layout(cpp_build: tuple[Path, Path]) -> None:
    _, prefix = cpp_build
    headers = {p.name for p in (prefix / "include" / "uniep").iterdir()}
    assert {"plan.hpp", "cpu_executor.hpp", "tuning.hpp", "status.hpp", "version.hpp"} <= headers
    # The GPU API comes with the library that defines it, and this build has none.
    assert "ep.hpp" not in headers and "cuda" not in headers
    libdir = next(d for d in (prefix / "lib", prefix / "lib64") if d.is_dir())
    assert (libdir / "libuniep_core.a").is_file()
    assert not list(libdir.glob("libuniep_cuda*"))
    cmake_dir = libdir / "cmake" / "uniep"
    for name in ("uniepConfig.cmake", "uniepConfigVersion.cmake", "uniepCoreTargets.cmake"):
        assert (cmake_dir / name).is_file(), name
    assert not (cmake_dir / "uniepCudaTargets.cmake").exists()


def test_version_header_matches_project(cpp_build: tuple[Path, Path]) -> None:
    _, prefix = cpp_build
    text = (prefix / "include" / "uniep" / "version.hpp").read_text()
    major, minor, patch = _project_version().split(".")
    assert f"#define UNIEP_VERSION_MAJOR {major}\n" in text
    assert f"#define UNIEP_VERSION_MINOR {minor}\n" in text
    assert f"#define UNIEP_VERSION_PATCH {patch}\n" in text
    assert f'#define UNIEP_VERSION_STRING "{_project_version()}"' in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{_project_version()}"' in pyproject, "pyproject.toml and CMake disagree"


def test_core_needs_no_python_or_torch(cpp_build: tuple[Path, Path]) -> None:
    build, prefix = cpp_build
    cache = (build / "CMakeCache.txt").read_text()
    for name in ("Python_EXECUTABLE", "pybind11_DIR", "UNIEP_TORCH_DIR"):
        assert f"{name}:" not in cache, name
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list libuniep_core.a's undefined symbols")
    libdir = next(d for d in (prefix / "lib", prefix / "lib64") if d.is_dir())
    undefined = _run([nm, "-C", "--undefined-only", str(libdir / "libuniep_core.a")])
    for word in ("Py", "pybind11", "torch", "c10::", "at::", "cuda"):
        assert not re.search(rf"\b{re.escape(word)}", undefined), f"needs {word}"


def test_find_package_version_check(cpp_build: tuple[Path, Path], tmp_path: Path) -> None:
    _, prefix = cpp_build
    version = _project_version()
    major = int(version.split(".")[0])
    (tmp_path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.25)\n"
        "project(version_check LANGUAGES NONE)\n"
        f"find_package(uniep {version} CONFIG QUIET)\n"
        'message(STATUS "same: ${uniep_FOUND} ${uniep_VERSION}")\n'
        "unset(uniep_DIR CACHE)\n"
        f"find_package(uniep {major + 1}.0 CONFIG QUIET)\n"
        'message(STATUS "next major: ${uniep_FOUND}")\n'
    )
    out = _run(
        [CMAKE, "-S", str(tmp_path), "-B", str(tmp_path / "b"), f"-DCMAKE_PREFIX_PATH={prefix}"]
    )
    assert f"same: 1 {version}" in out
    assert "next major: 0" in out


def test_example_against_cpp_install(cpp_build: tuple[Path, Path], tmp_path: Path) -> None:
    _, prefix = cpp_build
    out = _build_example(prefix, tmp_path / "example")
    assert "uniep::cuda: FALSE" in out
    assert not (tmp_path / "example" / "uniep_gpu_example").exists()
    assert not (tmp_path / "example" / "uniep_decode_example").exists()
    assert not (tmp_path / "example" / "uniep_decode_ep_example").exists()
    run = _run([str(tmp_path / "example" / "uniep_cpu_example")], timeout=60)
    assert run.rstrip().endswith("OK"), run


def test_example_against_installed_module(tmp_path: Path) -> None:
    uniep = pytest.importorskip("uniep")
    prefix = Path(uniep.cmake_prefix_path())
    if not (prefix / "lib" / "cmake" / "uniep" / "uniepConfig.cmake").is_file():
        pytest.skip(f"the uniep module at {prefix} ships no C++ package")
    out = _build_example(prefix, tmp_path / "example")
    run = _run([str(tmp_path / "example" / "uniep_cpu_example")], timeout=60)
    assert run.rstrip().endswith("OK"), run
    built_cuda = bool(uniep.build_info().get("cuda_kernels"))
    assert f"uniep::cuda: {'TRUE' if built_cuda else 'FALSE'}" in out
    if built_cuda:
        env = None
        if not (prefix.parent / "nvidia" / "nvshmem" / "lib").is_dir():
            # NVSHMEM's wheel is not beside the module (a venv over system site-packages), so
            # libuniep_cuda.so's RPATH misses it; the config found it and said so.
            assert "LD_LIBRARY_PATH=" in out
            cache = (tmp_path / "example" / "CMakeCache.txt").read_text()
            host = re.search(r"^NVSHMEM_HOST_LIBRARY:FILEPATH=(.+)$", cache, re.M)
            assert host, "the config found no NVSHMEM"
            lib = str(Path(host.group(1)).parent)
            env = dict(os.environ)
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (lib, env.get("LD_LIBRARY_PATH", "")) if p
            )
        gpu = _run([str(tmp_path / "example" / "uniep_gpu_example")], timeout=300, env=env)
        assert gpu.rstrip().endswith(("OK", "the GPU example is skipped")), gpu
        # Its CPU half runs without a GPU and ends in OK either way.
        decode = _run([str(tmp_path / "example" / "uniep_decode_example")], timeout=300, env=env)
        assert decode.rstrip().endswith("OK"), decode
        # Two forked ranks: the decode loop across them on a GPU; without one each says so.
        ep_example = str(tmp_path / "example" / "uniep_decode_ep_example")
        ep = _run([ep_example, "2"], timeout=300, env=env)
        assert ep.rstrip().endswith("OK (2 ranks)"), ep
        if cuda_device_count() == 0:
            assert ep.count("no CUDA device") == 2, ep
