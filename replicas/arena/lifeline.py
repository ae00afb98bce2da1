"""Engine processes die with the replica that started them, however it dies.

vLLM's engine core is a child process of the replica actor. When the replica exits normally it
shuts the engine down, but a replica killed by `ray.kill`, SIGKILL, Serve's force-stop or a dying
raylet leaves the engine core running with no parent: on a GPU it keeps its CUDA context, weights
and KV cache, and the replacement replica cannot start there. A parent-death signal cannot be set
from outside the engine core, so the worker (which runs capserve's code, in the engine core's
process or in its child) watches the replica instead: when the replica is gone it removes the
replica's shared-memory folder and kills the engine processes between itself and the replica.

Each engine's shared-memory folder names its owner (`owner.json`), so a replica starting on the
node also sweeps the folders of owners that are gone (an engine killed before its watchdog ran).
A pid means something only in its PID namespace: where /dev/shm is shared between containers, a
sweeper judges only the folders of owners in its own namespace (and removes those of an earlier
boot, whose processes are all gone); another container's folders are its own sweeper's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger("capserve.lifeline")

OWNER_FILE = "owner.json"
SPILL_PREFIX = "capserve-"
WATCH_PERIOD_S = 1.0
SWEEP_PERIOD_S = 10.0


@cache  # a process never changes PID namespace (unshare and setns move its children)
def current_pid_namespace() -> int:
    """This process's PID namespace, by the inode of its /proc/self/ns/pid link."""
    return os.stat("/proc/self/ns/pid").st_ino


@cache
def current_boot_id() -> str:
    """The kernel's id of this boot: the same in every container of the host."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@dataclass(frozen=True)
class Owner:
    """A process, by pid and start time: a pid the OS reuses for another process does not match.

    The start time is the kernel's own, in clock ticks since boot (/proc/<pid>/stat, field 22). A
    wall-clock time (psutil's `create_time()` adds the boot time, which the kernel derives from
    the wall clock) moves when NTP or an admin steps the clock, and then every live owner looks
    like a reused pid: its engine's shared memory would be swept under it."""

    pid: int
    start_ticks: int  # clock ticks since boot
    pid_ns: int = field(default_factory=current_pid_namespace)  # where `pid` is this process's number
    boot_id: str = field(default_factory=current_boot_id)

    @classmethod
    def of(cls, pid: int) -> "Owner":
        start_ticks = _start_ticks(pid)
        if start_ticks is None:
            raise ProcessLookupError(f"no process {pid}")
        return cls(pid, start_ticks)

    @classmethod
    def current(cls) -> "Owner":
        return cls.of(os.getpid())

    def foreign(self) -> bool:
        """Whether this owner is another PID namespace's process (a container sharing /dev/shm):
        its pid names some other process here, or none, so nothing here can tell if it lives."""
        return self.boot_id == current_boot_id() and self.pid_ns != current_pid_namespace()

    def alive(self) -> bool:
        """Whether the process runs; False for one of an earlier boot. Meaningless when `foreign()`."""
        return self.boot_id == current_boot_id() and self.pid_ns == current_pid_namespace() and _start_ticks(self.pid) == self.start_ticks

    def write(self, folder: str) -> None:
        # "started", wall-clock seconds, is what capserve before 2026-12-05 judges an owner by: a
        # replica of that version on the same node must still find this one alive (it would sweep
        # the folder of an owner it cannot read as alive); this version reads the other fields
        try:
            started = psutil.Process(self.pid).create_time()
        except psutil.NoSuchProcess:
            started = 0.0  # gone: gone for the older readers too
        Path(folder, OWNER_FILE).write_text(json.dumps({**asdict(self), "started": started}))

    @classmethod
    def read(cls, folder: str | Path) -> "Owner | None":
        """The folder's owner; None for none, or one written by capserve before 2026-12-05 (which
        names no namespace: such folders are left to that version's own sweepers)."""
        try:
            fields = json.loads(Path(folder, OWNER_FILE).read_text())
            return cls(int(fields["pid"]), int(fields["start_ticks"]), int(fields["pid_ns"]), str(fields["boot_id"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _start_ticks(pid: int) -> int | None:
    """When a live process started, in clock ticks since boot; None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after its last ")"
    fields = stat[stat.rindex(")") + 2:].split()
    state, started = fields[0], fields[19]  # fields 3 and 22
    return None if state in ("Z", "X") else int(started)


class Progress:
    """Whether a busy engine core still moves: the seconds since any request last got output,
    counted only while some request waits for one. A wedged engine core keeps its process (so a
    liveness probe of the process passes) but stops producing output."""

    def __init__(self) -> None:
        self.active = 0
        self._last = time.monotonic()

    def started(self) -> None:
        if self.active == 0:
            self._last = time.monotonic()
        self.active += 1

    def output(self) -> None:
        self._last = time.monotonic()

    def finished(self) -> None:
        self.active -= 1

    def stalled_s(self) -> float:
        return time.monotonic() - self._last if self.active else 0.0


def engine_lineage(owner: Owner) -> list[Owner]:
    """This process and its ancestors below `owner` (the engine core, when the worker is its own
    process), nearest first. Read while the owner is alive: afterwards the parents are gone."""
    lineage, process = [], psutil.Process()
    while process is not None and process.pid != owner.pid:
        lineage.append(Owner.of(process.pid))
        process = process.parent()
    if process is None:
        raise RuntimeError(f"process {os.getpid()} does not descend from its replica (pid {owner.pid})")
    return lineage


def watch_owner(owner: Owner, spill_dir: str | None, period_s: float = WATCH_PERIOD_S) -> threading.Thread:
    """Start the watchdog thread of this engine process. It ends the engine when the replica is
    gone, and also when the engine core above this worker is (a worker without it serves nobody)."""
    lineage = engine_lineage(owner)
    watched = [owner, *lineage[1:]]

    def run() -> None:
        while all(process.alive() for process in watched):
            time.sleep(period_s)
        end_engine(owner, lineage, spill_dir)

    thread = threading.Thread(target=run, name="capserve-lifeline", daemon=True)
    thread.start()
    return thread


def end_engine(owner: Owner, lineage: list[Owner], spill_dir: str | None) -> None:
    logger.warning("replica %d or its engine core is gone: ending the engine (pids %s)", owner.pid, [p.pid for p in lineage])
    if spill_dir:
        shutil.rmtree(spill_dir, ignore_errors=True)
    # farthest first: the engine core, then this process (which may be the engine core itself)
    for process in reversed(lineage):
        if process.alive():
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Sweeper:
    """Sweeps a node's shared-memory folders at a replica's start and then at most every
    `period_s` (from its health check): an engine killed together with its worker (Ray kills a
    worker's children when the worker exits in order, and vLLM's worker follows its engine core at
    once) never runs its watchdog, and a replacement may have started before its folder was left."""

    def __init__(self, parent: str, period_s: float = SWEEP_PERIOD_S) -> None:
        self.parent = parent
        self.period_s = period_s
        self._at = -period_s

    def maybe(self) -> list[str]:
        if time.monotonic() - self._at < self.period_s:
            return []
        self._at = time.monotonic()
        return sweep_stale_spill_dirs(self.parent)


def sweep_stale_spill_dirs(parent: str) -> list[str]:
    """Remove the shared-memory folders of engines whose replica is gone; returns what it removed.
    Folders of another PID namespace's replicas are left to that namespace's sweeper."""
    removed = []
    for folder in Path(parent).glob(SPILL_PREFIX + "*"):
        owner = Owner.read(folder)
        if folder.is_dir() and owner is not None and not owner.foreign() and not owner.alive():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    if removed:
        logger.warning("removed %d shared-memory folders of engines whose replica is gone: %s", len(removed), removed)
    return removed


def engine_processes(core_pids: list[int]) -> list[dict[str, Any]]:
    """The engine cores (by the pids vLLM started them with: process names are cut to 15
    characters) and every process under them, each with its `Owner` fields (pid, start ticks)."""
    processes = []
    for pid in core_pids:
        try:
            core = psutil.Process(pid)
            processes.append(_described(core, "engine_core"))
            processes += [_described(child, "engine_child") for child in core.children(recursive=True)]
        except (psutil.NoSuchProcess, ProcessLookupError):  # gone while we looked
            continue
    return processes


def _described(process: psutil.Process, role: str) -> dict[str, Any]:
    return {**asdict(Owner.of(process.pid)), "role": role, "name": process.name()}
