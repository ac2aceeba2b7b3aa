"""``uniep info``: what this build contains (kernels, libraries, devices)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch


def has_cuda_moe_kernel() -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key("uniep::moe_forward", "CUDA"))


def _info() -> dict[str, Any]:
    import uniep

    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "build": dict(uniep.build_info()),
        "cmake_prefix_path": uniep.cmake_prefix_path(),
        "runtime": {
            "torch_version": torch.__version__,
            "torch_cuda_version": torch.version.cuda or "",
            "cuda_devices": devices,
            "moe_forward_cuda_kernel": has_cuda_moe_kernel(),
            "routing_layout_cuda_kernel": bool(
                torch._C._dispatch_has_kernel_for_dispatch_key("uniep::routing_layout", "CUDA")
            ),
        },
    }


def yes(value: object) -> str:
    return "yes" if value else "no"


def cmd_info(args: argparse.Namespace) -> int:
    import uniep

    if args.cmake_prefix_path:
        print(uniep.cmake_prefix_path())
        return 0
    info = _info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    b, r = info["build"], info["runtime"]
    devices = r["cuda_devices"]
    rows = [
        ("uniep", b.get("version", "")),
        ("CUDA kernels compiled", yes(b.get("cuda_kernels"))),
        ("torch CUDA ops", yes(b.get("cuda_ops"))),
        ("  moe_forward on CUDA", yes(r["moe_forward_cuda_kernel"])),
        ("  routing_layout on CUDA", yes(r["routing_layout_cuda_kernel"])),
        ("NVSHMEM", b.get("nvshmem_version") or "-"),
        ("CUTLASS", b.get("cutlass_version") or "-"),
        ("CUDA archs (sm)", b.get("cuda_archs") or "-"),
        ("CUDA compiler", b.get("cuda_compiler_version") or "-"),
        ("torch (built against)", b.get("torch_version") or "-"),
        ("torch (running)", f"{r['torch_version']} (CUDA {r['torch_cuda_version'] or 'none'})"),
        ("C++ package (CMake prefix)", info["cmake_prefix_path"]),
        (
            "CUDA devices visible",
            f"{len(devices)}" + (f": {', '.join(devices)}" if devices else ""),
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


# ---- demo ----
