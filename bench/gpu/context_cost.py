"""What the engine option `switch_context_every_s` costs a GPU: the device memory its second CUDA
context takes, the time to create it, and a launch's host time; and the memory of such a context
with its stack, printf FIFO and malloc heap limits set to zero (its empty kernel uses none; not
yet run). Torch alone (no vLLM), so it runs before the bundle is installed:

    python3 bench/gpu/context_cost.py --out DIR      # writes DIR/context_cost_<gpu>.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import torch

from replicas.context_switch import SecondContext


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


# cuCtxSetLimit's limits: CU_LIMIT_STACK_SIZE, CU_LIMIT_PRINTF_FIFO_SIZE, CU_LIMIT_MALLOC_HEAP_SIZE
LEAST_LIMITS = {"stack": 0, "printf_fifo": 1, "malloc_heap": 2}


def least_limits_mib() -> dict[str, object]:
    """Another second context, its limits set to zero (each call's CUDA result), and the device
    memory it then holds."""
    driver = ctypes.CDLL("libcuda.so.1")
    before = free_bytes()
    second = SecondContext.open(torch.cuda.current_device())
    codes = {}
    driver.cuCtxPushCurrent_v2(second._context)
    try:
        for name, limit in LEAST_LIMITS.items():
            codes[name] = driver.cuCtxSetLimit(limit, ctypes.c_size_t(0))
    finally:
        driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    second.launch(wait=True)
    return {"least_limits_codes": codes, "least_limits_context_mib": (before - free_bytes()) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--launches", type=int, default=2000)
    args = parser.parse_args()

    torch.ones(1, device="cuda")  # torch's own context first, as in the engine
    before = free_bytes()
    began = time.perf_counter()
    second = SecondContext.open(torch.cuda.current_device())
    created_s = time.perf_counter() - began
    after_open = free_bytes()
    second.launch(wait=True)  # the first launch loads the kernel's module on the device
    after_launch = free_bytes()
    host_us = []
    for _ in range(args.launches):
        began = time.perf_counter()
        second.launch()
        host_us.append((time.perf_counter() - began) * 1e6)
    second.launch(wait=True)
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "context_mib": (before - after_open) / 2**20, "context_and_first_launch_mib": (before - after_launch) / 2**20,
        "create_s": created_s, "launch_host_us_p50": statistics.median(host_us),
        "launch_host_us_p99": sorted(host_us)[int(0.99 * len(host_us))], "launches": len(host_us),
        **least_limits_mib(),
    }
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    name = result["gpu"].split()[-1].lower()
    (args.out / f"context_cost_{name}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
