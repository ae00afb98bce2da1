"""A torch.profiler window over the worker's step loop, for finding where a step's time goes.

`EngineConfig.step_profile` names the steps (counted by the worker from its start, warm-up runs
excluded) and a folder. Over those steps the profiler records CPU ops (and CUDA kernels on a
GPU); capserve's own phases show as `capserve.prepare` and `capserve.collect`. When the window
closes the worker writes `step_profile-<pid>.txt` there: the ops by their own CPU time, then by
their total CPU time (what each phase spent, waits included). A table, not a trace: a
trace of a few hundred steps runs to hundreds of MB.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from replicas.engine_config import StepProfile

ROWS = 45


class StepProfiler:
    """Opens the profiler at `first_step`, closes it `steps` later and writes the table."""

    def __init__(self, profile: StepProfile, on_gpu: bool):
        self.profile = profile
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if on_gpu:
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler: Any = None
        self.written: str | None = None

    @classmethod
    def maybe(cls, options: dict[str, Any], on_gpu: bool) -> StepProfiler | None:
        raw = options.get("step_profile")
        return cls(StepProfile.model_validate(raw), on_gpu) if raw else None

    def at_step(self, step: int) -> None:
        """Called as step `step` begins."""
        if step == self.profile.first_step and self._profiler is None and self.written is None:
            self._profiler = torch.profiler.profile(activities=self.activities)
            self._profiler.__enter__()
        elif step == self.profile.first_step + self.profile.steps and self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.written = self._write(self._profiler.key_averages())
            self._profiler = None

    def phase(self, name: str) -> AbstractContextManager[Any]:
        """A labelled range while the window is open; nothing otherwise."""
        if self._profiler is None:
            return nullcontext()
        return torch.profiler.record_function(f"capserve.{name}")

    def _write(self, averages: Any) -> str:
        path = os.path.join(self.profile.folder, f"step_profile-{os.getpid()}.txt")
        header = f"steps {self.profile.first_step}..{self.profile.first_step + self.profile.steps - 1}"
        with open(path, "w") as out:
            out.write(f"{header}, by self CPU time\n{averages.table(sort_by='self_cpu_time_total', row_limit=ROWS)}\n")
            out.write(f"{header}, by total CPU time\n{averages.table(sort_by='cpu_time_total', row_limit=ROWS)}\n")
        return path
