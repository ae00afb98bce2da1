"""The step loop's profiler window (replicas/worker/diagnostics/step_profile.py), without an engine."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from replicas.engine.config import StepProfile
from replicas.worker.diagnostics.step_profile import StepProfiler, covered, describe_timeline


def test_the_window_covers_exactly_its_steps_and_names_capserve_phases(tmp_path):
    folder = tmp_path / "profiles"  # not there yet: the profiler makes it
    profiler = StepProfiler(StepProfile(first_step=2, steps=3, folder=str(folder), python=True), on_gpu=False)
    x = torch.ones(32, 32)
    for step in range(8):
        profiler.at_step(step)
        with profiler.phase("collect"):
            x = _step_work(x)
        gc.collect(1)  # one generation-1 collection a step, three in the window
    assert profiler.written is not None and Path(profiler.written).parent == folder
    table = Path(profiler.written).read_text()
    first_line = table.splitlines()[0]
    assert first_line.startswith("steps 2..4, garbage collections:") and "generation 1: 3 taking" in first_line
    assert "steps 2..4, by self CPU time" in table
    collect = next(line for line in table.splitlines() if line.strip().startswith("capserve.collect"))
    assert collect.split()[-1] == "3"  # # of Calls: steps 2, 3 and 4 only
    mm = next(line for line in table.splitlines() if line.strip().startswith("aten::mm"))
    assert mm.split()[-1] == "3"
    python = (folder / Path(profiler.written).name.replace("step_profile", "python_profile")).read_text()
    calls = next(line for line in python.splitlines() if line.rstrip().endswith("(_step_work)"))
    assert calls.split()[0] == "3"  # cProfile saw the window's steps only


def _step_work(x: torch.Tensor) -> torch.Tensor:
    return x @ x / 32


def test_the_timeline_counts_device_idle_time_between_steps_and_overlaps_once():
    ms = 1_000_000
    steps = [0, 10 * ms, 20 * ms]  # two steps of 10 ms
    device = [(0, 6 * ms, 7), (4 * ms, 8 * ms, 9),  # overlapping on two streams: 8 ms busy
              (10 * ms, 19 * ms, 7),  # 9 ms busy
              (19 * ms, 30 * ms, 7)]  # 1 ms inside the window
    line = describe_timeline(steps, device)
    assert line.startswith("2 steps, median 10.000 ms; device idle 10.0% of the window (1000 us a step)")
    assert "7: 80.0%" in line and "9: 20.0%" in line
    assert covered([(0, 5), (1, 2), (4, 9), (12, 13)]) == 10
