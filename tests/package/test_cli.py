"""The `uniep` command line, run as a user would: a subprocess with a timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import uniep
from uniep.cli import _parser


def _uniep_command() -> list[str]:
    script = Path(sys.executable).with_name("uniep")
    if script.exists():
        return [str(script)]
    found = shutil.which("uniep")
    assert found, "the `uniep` console script is not installed"
    return [found]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # The CPU path, even where a GPU is visible (the GPU path has its own tests).
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [*_uniep_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_info_prints_versions() -> None:
    proc = _run("info", timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert torch.__version__ in out, out
    version = getattr(uniep, "__version__", "0.1.0")
    assert version in out, out


def test_info_prints_cmake_prefix_path() -> None:
    proc = _run("info", "--cmake-prefix-path", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == uniep.cmake_prefix_path()
    assert (Path(proc.stdout.strip()) / "lib" / "cmake" / "uniep" / "uniepConfig.cmake").is_file()


def test_demo_runs_on_cpu() -> None:
    proc = _run("demo", timeout=150)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "PASS" in proc.stdout and "cpu" in proc.stdout, proc.stdout


def test_demo_reports_bad_arguments() -> None:
    proc = _run("demo", "--experts", "3", "--world-size", "2", timeout=60)
    assert proc.returncode != 0
    assert "--experts" in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--timeout", "0", "must be a finite number of seconds > 0, got '0'"),
        ("--timeout", "-5", "must be a finite number of seconds > 0, got '-5'"),
        ("--timeout", "nan", "must be a finite number of seconds > 0, got 'nan'"),
        ("--timeout", "inf", "must be a finite number of seconds > 0, got 'inf'"),
        ("--timeout", "soon", "must be a number of seconds > 0, got 'soon'"),
        ("--world-size", "0", "must be an integer >= 1, got '0'"),
        ("--tokens", "-1", "must be an integer >= 1, got '-1'"),
        ("--hidden", "0", "must be an integer >= 1, got '0'"),
        ("--ffn", "0", "must be an integer >= 1, got '0'"),
        ("--experts", "-8", "must be an integer >= 1, got '-8'"),
        ("--top-k", "0", "must be an integer >= 1, got '0'"),
        ("--iters", "0", "must be an integer >= 1, got '0'"),
        ("--iters", "2.5", "must be an integer >= 1, got '2.5'"),
        ("--seed", "-1", "must be an integer in [0, 2**32), got '-1'"),
        ("--seed", str(2**64), f"must be an integer in [0, 2**32), got '{2**64}'"),
    ],
)
def test_demo_rejects_out_of_range_numbers(
    option: str, value: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The parser alone: a bad value must stop `uniep demo` before it spawns anything.
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["demo", option, value])
    assert exc.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert f"argument {option}: {words}" in err, err


def test_demo_accepts_the_boundaries() -> None:
    args = _parser().parse_args(
        ["demo", "--timeout", "0.5", "--world-size", "1", "--tokens", "1", "--seed", "0"]
    )
    assert (args.timeout, args.world_size, args.tokens, args.seed) == (0.5, 1, 1, 0)


# ---- uniep demo's choice of configuration (pure; the machine comes as arguments) ----

_GPU_BUILD = {"cuda_ops": True, "cuda_kernel": True}
_NO_GPU = {"gpus": 0, "cuda_ops": False, "cuda_kernel": False}


@pytest.mark.parametrize(
    ("gpus", "build", "want"),
    [
        (1, _GPU_BUILD, ("cuda", 1, "bfloat16", 8)),  # a one-GPU box: one rank, no refusal
        (2, _GPU_BUILD, ("cuda", 2, "bfloat16", 8)),
        (3, _GPU_BUILD, ("cuda", 3, "bfloat16", 9)),  # experts rounded up to the world
        (8, _GPU_BUILD, ("cuda", 8, "bfloat16", 8)),
        (16, _GPU_BUILD, ("cuda", 16, "bfloat16", 16)),
        (0, _GPU_BUILD, ("cpu", 2, "float32", 8)),  # no GPU: two gloo ranks
        (1, {"cuda_ops": False, "cuda_kernel": False}, ("cpu", 2, "float32", 8)),
        (1, {"cuda_ops": True, "cuda_kernel": False}, ("cpu", 2, "float32", 8)),
    ],
)
def test_demo_defaults_fit_the_machine(gpus: int, build: dict[str, bool], want: tuple) -> None:
    from uniep.cli.demo import plan_demo

    plan = plan_demo("auto", None, None, None, gpus=gpus, cpus=2, **build)
    assert (plan.device, plan.world, plan.dtype, plan.experts) == want
    assert (plan.why == "") == (want[0] == "cuda")


def test_demo_explicit_choices() -> None:
    from uniep.cli.demo import plan_demo

    # An explicit world larger than the GPUs, or a dtype the CUDA executor lacks: CPU, saying why.
    plan = plan_demo("auto", 2, None, None, gpus=1, cpus=2, **_GPU_BUILD)
    assert (plan.device, plan.world, plan.dtype) == ("cpu", 2, "float32")
    assert "1 CUDA device(s) visible" in plan.why
    plan = plan_demo("auto", None, "float32", None, gpus=1, cpus=2, **_GPU_BUILD)
    assert (plan.device, plan.world) == ("cpu", 2) and "bfloat16" in plan.why
    plan = plan_demo("cpu", None, None, 6, gpus=4, cpus=2, **_GPU_BUILD)
    assert (plan.device, plan.world, plan.dtype, plan.experts) == ("cpu", 2, "float32", 6)
    # --device cuda that cannot run is refused, naming what is missing.
    with pytest.raises(SystemExit, match="no CUDA device is visible"):
        plan_demo("cuda", None, None, None, gpus=0, cpus=2, **_GPU_BUILD)
    with pytest.raises(SystemExit, match="--world-size 4"):
        plan_demo("cuda", 4, None, None, gpus=2, cpus=2, **_GPU_BUILD)
    with pytest.raises(SystemExit, match="no torch CUDA ops"):
        plan_demo("cuda", None, None, None, gpus=1, cuda_ops=False, cuda_kernel=False, cpus=2)


# ---- world sizes the machine cannot hold: refused before anything is spawned ----


@pytest.mark.parametrize(
    ("device", "world", "machine", "words"),
    [
        (
            "cpu",
            9,
            {"cpus": 2, **_NO_GPU},
            "--world-size 9 is more than this machine holds: at most 8 gloo ranks on CPU "
            "(4 per core, 2 core(s))",
        ),
        (
            "auto",
            100_000,
            {"cpus": 2, **_NO_GPU},
            "--world-size 100000 is more than this machine holds: at most 8 gloo ranks",
        ),
        # More ranks than GPUs: auto would fall back to CPU, where 100000 ranks do not fit either.
        (
            "auto",
            100_000,
            {"cpus": 16, "gpus": 8, **_GPU_BUILD},
            "at most 64 gloo ranks on CPU (4 per core, 16 core(s)); not on GPU: 8 CUDA "
            "device(s) visible, --world-size 100000",
        ),
        (
            "cuda",
            9,
            {"cpus": 64, "gpus": 8, **_GPU_BUILD},
            "--device cuda is not possible: 8 CUDA device(s) visible, --world-size 9 asks for 9",
        ),
        ("auto", 0, {"cpus": 2, **_NO_GPU}, "--world-size must be >= 1, got 0"),
        ("cpu", -3, {"cpus": 2, **_NO_GPU}, "--world-size must be >= 1, got -3"),
    ],
)
def test_demo_refuses_a_world_the_machine_cannot_hold(
    device: str, world: int, machine: dict, words: str
) -> None:
    from uniep.cli.demo import plan_demo

    with pytest.raises(SystemExit) as exc:
        plan_demo(device, world, None, None, **machine)
    assert str(exc.value).startswith("uniep demo: error: "), exc.value
    assert words in str(exc.value), exc.value


@pytest.mark.parametrize(
    ("device", "world", "machine", "want"),
    [
        # CI runs 2 and 4 gloo ranks on 2-core machines; a 1-core one still takes 4.
        ("auto", 4, {"cpus": 2, **_NO_GPU}, ("cpu", 4)),
        ("cpu", 8, {"cpus": 2, **_NO_GPU}, ("cpu", 8)),
        ("auto", 4, {"cpus": 1, **_NO_GPU}, ("cpu", 4)),
        ("auto", 8, {"cpus": 1, "gpus": 8, **_GPU_BUILD}, ("cuda", 8)),  # one rank per GPU
        ("auto", 12, {"cpus": 4, "gpus": 8, **_GPU_BUILD}, ("cpu", 12)),
    ],
)
def test_demo_accepts_a_world_the_machine_holds(
    device: str, world: int, machine: dict, want: tuple[str, int]
) -> None:
    from uniep.cli.demo import plan_demo

    plan = plan_demo(device, world, None, None, **machine)
    assert (plan.device, plan.world) == want


def test_demo_refuses_a_huge_world_before_spawning() -> None:
    proc = _run("demo", "--world-size", "100000", timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("uniep demo: error: --world-size 100000 "), (
        proc.stderr
    )
    assert proc.stdout == ""  # not even the banner that precedes the spawn
