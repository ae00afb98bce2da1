"""What the engine option `switch_context_every_s` costs a GPU: the device memory its second CUDA
context takes (its stack, printf FIFO and malloc heap limits at zero, `context_switch.LIMITS`), the
time to create it, and a launch's host time. Torch alone (no vLLM), so it runs before the bundle is
installed:

    python3 bench/gpu/context_cost.py --out DIR      # writes DIR/context_cost_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from replicas.worker.context_switch import LIMITS, SecondContext


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


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
        "limits_at_zero": list(LIMITS),
    }
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    name = result["gpu"].split()[-1].lower()
    (args.out / f"context_cost_{name}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
