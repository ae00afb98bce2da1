"""Where a benchmark's step loops run on the host's CPUs (Linux /proc), and pinning them there.

A step loop that partly waits on the CPU (CUDA graph launches, the scheduler) slows when its thread
shares a core, or lands on a busy core's hyperthread sibling. `placement` reads, for a process's
main thread (a vLLM engine core's step loop, the driver's event loop), the CPU it last ran on and
its context switches so far; `pin` gives each such thread a core of its own and every other thread
of those processes (and their children) the remaining cores."""

from __future__ import annotations

import os
from pathlib import Path


def placement(pid: int) -> dict[str, int]:
    """The main thread's last CPU and its voluntary and involuntary context switches so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 is fields[0]
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    return {"cpu": int(fields[36]), "voluntary": int(status["voluntary_ctxt_switches"]),
            "involuntary": int(status["nonvoluntary_ctxt_switches"])}


def pin(main_threads: list[int]) -> dict[int, int]:
    """Each main thread (a pid) on a core of its own, in order from core 0; every other thread of
    those processes and of their descendants on the cores left. Returns pid → core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < len(main_threads) + 2:
        raise SystemExit(f"--pin needs at least {len(main_threads) + 2} CPUs, this process may use {len(cores)}")
    own = dict(zip(main_threads, cores))
    rest = set(cores[len(main_threads) :])
    for pid in main_threads:
        for process in [pid, *descendants(pid)]:
            for task in Path(f"/proc/{process}/task").iterdir():
                tid = int(task.name)
                os.sched_setaffinity(tid, {own[tid]} if tid in own else rest)
    return own


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found
