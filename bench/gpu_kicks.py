"""GPU work that ends the slow state a capture leaves on an H200 (bench_side_by_side's z-kick):
run inside the engine's own process through `collective_rpc` (a second CUDA context of that
process, or a side stream of its own context), or by this process on a timer during a batch; and
this process's bursts of GPU work before a batch (z-reset's, `gpu_burst`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

_second: Any = None  # replicas.worker.context_switch.SecondContext, made on the first kick


def kick(_worker: Any, where: str) -> float:
    """One empty kernel in a second CUDA context of this process (`second context`, the engine
    option `switch_context_every_s`'s), or one tiny torch kernel on a new stream of torch's own
    context (`own side stream`), waited for; returns the seconds it took on the host."""
    import torch

    global _second
    began = time.perf_counter()
    if where == "second context":
        if _second is None:
            from replicas.worker.context_switch import SecondContext

            _second = SecondContext.open(torch.cuda.current_device())
        _second.launch(wait=True)
    elif where == "own side stream":
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.zeros(1, device="cuda").add_(1)
        stream.synchronize()
    else:
        raise ValueError(f"where must be 'second context' or 'own side stream', not {where!r}")
    return time.perf_counter() - began


class PeriodicKicks:
    """Two tiny kernels by this process (a CUDA context of its own) every `every_s` seconds, on a
    thread, from `start()` until `stop()`; counts them."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-kicks", daemon=True)

    def start(self) -> PeriodicKicks:
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.count

    def _run(self) -> None:
        import torch

        tiny = torch.zeros(1, device="cuda")
        while not self._stop.wait(self.every_s):
            tiny.add_(1)
            tiny.add_(1)
            torch.cuda.synchronize()
            self.count += 1


def gpu_burst(kind: str, seconds: float) -> None:
    """GPU work for `seconds` on this process's GPU (its own CUDA context), or its CPU: "matmul" (tensor
    cores), "copy" (device memory copies, no arithmetic) or "kernel" (two tiny kernels, seconds unused)."""
    if seconds <= 0 and kind != "kernel":
        return
    import torch

    on_gpu = torch.cuda.is_available()
    side = 64 if kind == "kernel" else 8192 if on_gpu else 512
    a = torch.randn(side, side, device="cuda" if on_gpu else "cpu", dtype=torch.bfloat16 if on_gpu else torch.float32)
    b = torch.empty_like(a)
    end = time.perf_counter() + seconds
    while True:
        if kind == "kernel":
            a[:1, :1].add_(0)
        elif kind == "matmul":
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
        else:
            for _ in range(8):
                b.copy_(a)
                a.copy_(b)
        if on_gpu:
            torch.cuda.synchronize()
        if time.perf_counter() >= end:
            return
