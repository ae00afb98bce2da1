"""A torch.profiler window over the worker's step loop, for finding where a step's time goes.

`EngineConfig.step_profile` names the steps (counted by the worker from its start, warm-up runs
excluded) and a folder. Over those steps the profiler records CPU ops (and CUDA kernels on a
GPU); capserve's own phases show as `capserve.prepare` and `capserve.collect`. When the window
closes the worker writes `step_profile-<pid>.txt` there: Python's garbage collections in the
window (a pause inside a phase shows as that phase's own CPU time), then the ops by their own CPU
time, by their total CPU time (what each phase spent, waits included) and, on a GPU, by their own
CUDA time (which kernels fill the step), led on a GPU by the window's timeline: the median step
period and the share of it when no kernel or copy ran on the device (a step loop that falls
behind the GPU shows as idle time). With `python` set, cProfile's table of the step loop's
Python functions goes to `python_profile-<pid>.txt` beside it. Tables, not a trace: a trace of a
few hundred steps runs to hundreds of MB.
"""

from __future__ import annotations

import cProfile
import gc
import io
import os
import pstats
import statistics
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Iterable

import torch

from replicas.engine.config import StepProfile

ROWS = 45


class StepProfiler:
    """Opens the profiler at `first_step`, closes it `steps` later and writes the table."""

    def __init__(self, profile: StepProfile, on_gpu: bool):
        self.profile = profile
        os.makedirs(profile.folder, exist_ok=True)  # at start: a missing folder failed the step that wrote the table
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if on_gpu:
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler: Any = None
        self._python: cProfile.Profile | None = None
        self.written: str | None = None
        self.collections: dict[int, list[float]] = {}  # generation -> seconds of each collection
        self._collecting_since = 0.0

    @classmethod
    def maybe(cls, options: dict[str, Any], on_gpu: bool) -> StepProfiler | None:
        raw = options.get("step_profile")
        return cls(StepProfile.model_validate(raw), on_gpu) if raw else None

    def at_step(self, step: int) -> None:
        """Called as step `step` begins."""
        if step == self.profile.first_step and self._profiler is None and self.written is None:
            self._profiler = torch.profiler.profile(activities=self.activities)
            self._profiler.__enter__()
            gc.callbacks.append(self._on_gc)
            if self.profile.python:
                self._python = cProfile.Profile()
                self._python.enable()
        elif step == self.profile.first_step + self.profile.steps and self._profiler is not None:
            gc.callbacks.remove(self._on_gc)
            if self._python is not None:
                self._python.disable()
                self._write_python(self._python)
                self._python = None
            self._profiler.__exit__(None, None, None)
            self.written = self._write(self._profiler.key_averages(), self._timeline(self._profiler))
            self._profiler = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._collecting_since = time.perf_counter()
        else:
            self.collections.setdefault(info["generation"], []).append(time.perf_counter() - self._collecting_since)

    def phase(self, name: str) -> AbstractContextManager[Any]:
        """A labelled range while the window is open; nothing otherwise."""
        if self._profiler is None:
            return nullcontext()
        return torch.profiler.record_function(f"capserve.{name}")

    def _write_python(self, profile: cProfile.Profile) -> None:
        """The step loop's Python functions by own time, then by cumulative time, then capserve's
        alone by cumulative time (before the ops' table, whose appearance ends a profiling run)."""
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(ROWS)
        stats.sort_stats("cumulative").print_stats(ROWS)
        stats.sort_stats("cumulative").print_stats("/replicas/", ROWS)  # capserve's own functions alone
        path = os.path.join(self.profile.folder, f"python_profile-{os.getpid()}.txt")
        with open(path, "w") as out:
            out.write(text.getvalue())

    def _timeline(self, profiler: Any) -> str | None:
        if torch.profiler.ProfilerActivity.CUDA not in self.activities:
            return None
        try:  # Kineto's raw events are not a stable API; the tables must still come out
            events = profiler.profiler.kineto_results.events()
        except (AttributeError, RuntimeError) as exc:
            return f"unavailable ({exc})"
        steps = [e.start_ns() for e in events if e.name() == "capserve.prepare"]
        device = [(e.start_ns(), e.end_ns(), e.device_resource_id()) for e in events
                  if e.device_type() == torch.autograd.DeviceType.CUDA]
        return describe_timeline(steps, device)

    def _write(self, averages: Any, timeline: str | None = None) -> str:
        path = os.path.join(self.profile.folder, f"step_profile-{os.getpid()}.txt")
        header = f"steps {self.profile.first_step}..{self.profile.first_step + self.profile.steps - 1}"
        collected = ", ".join(
            f"generation {g}: {len(t)} taking {sum(t) * 1e3:.2f} ms (longest {max(t) * 1e3:.2f})"
            for g, t in sorted(self.collections.items())
        )
        with open(path, "w") as out:
            out.write(f"{header}, garbage collections: {collected or 'none'}\n\n")
            if timeline is not None:
                out.write(f"{header}, timeline: {timeline}\n\n")
            out.write(f"{header}, by self CPU time\n{averages.table(sort_by='self_cpu_time_total', row_limit=ROWS)}\n")
            out.write(f"{header}, by total CPU time\n{averages.table(sort_by='cpu_time_total', row_limit=ROWS)}\n")
            if torch.profiler.ProfilerActivity.CUDA in self.activities:
                out.write(f"{header}, by self CUDA time\n{averages.table(sort_by='self_cuda_time_total', row_limit=ROWS)}\n")
        return path


def describe_timeline(step_starts: list[int], device: Iterable[tuple[int, int, int]]) -> str:
    """The steps' median period and how much of the window (first step's start to the last's) the
    device spent idle, from the steps' start times and the device's (start, end, stream) intervals,
    all in ns; each stream's busy share beside it."""
    if len(step_starts) < 2:
        return "fewer than two steps"
    step_starts = sorted(step_starts)
    lo, hi = step_starts[0], step_starts[-1]
    inside = [(max(a, lo), min(b, hi), stream) for a, b, stream in device if b > lo and a < hi]
    streams: dict[int, list[tuple[int, int]]] = {}
    for a, b, stream in inside:
        streams.setdefault(stream, []).append((a, b))
    window, steps = hi - lo, len(step_starts) - 1
    idle = window - covered([(a, b) for a, b, _ in inside])
    period = statistics.median(b - a for a, b in zip(step_starts, step_starts[1:]))
    per_stream = ", ".join(f"{stream}: {covered(spans) / window:.1%}" for stream, spans in sorted(streams.items()))
    return (f"{steps} steps, median {period / 1e6:.3f} ms; device idle {idle / window:.1%} of the window "
            f"({idle / steps / 1e3:.0f} us a step); busy by stream {per_stream or 'none'}")


def covered(spans: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) spans."""
    total, reach = 0, None
    for a, b in sorted(spans):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total
