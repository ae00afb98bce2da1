"""The model call's time per decode step, on the host and on the device (engine option `forward_timing`).

A step slower than another may owe it to the GPU (its kernels, or the device waiting inside the
forward) or to the engine's work around the forward (scheduling, sampling, the step loop). The
decode period (`replicas.worker.worker`) sees the sum; this splits it without a profiler, whose own cost
hides a few percent: per decode step, the host's wall time of the model call (a CUDA graph's
launch included) and, on a GPU, CUDA events recorded on the forward's stream right before and
right after it: from the device reaching the first to its finishing the forward's work. Off by
default; on, it costs two event records a decode step.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

RECENT = 4096  # decode steps kept, oldest dropped first


class ForwardTimes:
    """Begin/end around each decode step's model call; `drain` hands back the times since the last drain."""

    def __init__(self, on_gpu: bool, recent: int = RECENT):
        # a ring of reused event pairs: creating events each step would cost more than recording them
        self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(recent)] if on_gpu else []
        self._host: deque[float] = deque(maxlen=recent)
        self._recorded: deque[int] = deque(maxlen=recent)  # ring slots recorded since the last drain
        self._next = 0
        self._began: float | None = None

    def begin(self) -> None:
        self._began = time.perf_counter()
        if self._events:
            self._events[self._next][0].record()

    def end(self) -> None:
        """After the model call; nothing when `begin` was not called for this step (not a decode step)."""
        if self._began is None:
            return
        self._host.append(time.perf_counter() - self._began)
        self._began = None
        if self._events:
            self._events[self._next][1].record()
            self._recorded.append(self._next)
            self._next = (self._next + 1) % len(self._events)

    def drain(self) -> dict[str, Any]:
        """Microseconds per decode step since the last drain, oldest first: `host` (the model call's
        wall time) and `device` (between the events; empty without a GPU)."""
        device = []
        for slot in self._recorded:
            start, end = self._events[slot]
            end.synchronize()
            device.append(round(start.elapsed_time(end) * 1e3, 1))
        host = [round(seconds * 1e6, 1) for seconds in self._host]
        self._recorded.clear()
        self._host.clear()
        return {"host": host, "device": device}
