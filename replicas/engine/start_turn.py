"""Engines that share a GPU start one at a time (`replicas_per_gpu` > 1).

vLLM sizes its KV cache by profiling: it measures the GPU's used memory before and after a dummy
forward pass and counts every byte it did not allocate through torch as its own. Two engines that
start together on one GPU each count the other's weights and CUDA graphs: on an H100 two 8B-shaped
engines at gpu_memory_utilization 0.45 got 9,264 and 2,608 KV tokens instead of 148,176, and served
0.13x one engine's tokens (bench/results/scaling_llama8b_2_per_gpu_together.json). Started in turn,
each finds the other's memory already taken and sizes its own share from what is left. An engine
given `kv_cache_memory_bytes` is not profiled for its cache and takes no turn.

The turn is an exclusive `flock` on a file named after the replica's CUDA_VISIBLE_DEVICES (what
Ray gives each GPU actor), in the node's temp folder: the kernel releases it when its holder
exits, killed or not, so a replica that dies while starting never blocks the next. Replicas of
one GPU in separate containers that do not share that folder are not ordered by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

# Longer than an 8B-shaped cold start on an H100 (about 2.5 min); past it a replica starts anyway
# (possibly with a small KV cache, logged) rather than wait on an engine that hangs while starting.
TURN_TIMEOUT_S = 900.0
POLL_S = 0.5
logger = logging.getLogger("capserve.engine")


def turn_file(devices: str | None = None, folder: str | None = None) -> Path:
    """The lock file of the GPUs in `devices` (default: this process's CUDA_VISIBLE_DEVICES)."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "all") if devices is None else devices
    key = "_".join(sorted(d.strip() for d in devices.split(","))) or "none"
    return Path(folder or tempfile.gettempdir()) / f"capserve-gpu-start-{key}.lock"


@contextlib.asynccontextmanager
async def gpu_start_turn(
    name: str | None, path: Path | None = None, timeout_s: float = TURN_TIMEOUT_S
) -> AsyncIterator[bool]:
    """Hold this GPU's start turn while the body builds an engine; yields whether it holds it."""
    path = path or turn_file()
    with open(path, "a") as handle:
        held = await _wait_for_turn(handle, name, path, timeout_s)
        try:
            yield held
        finally:
            if held:
                fcntl.flock(handle, fcntl.LOCK_UN)


async def _wait_for_turn(handle: IO[str], name: str | None, path: Path, timeout_s: float) -> bool:
    if _take(handle):
        return True
    logger.info("engine %s: waiting for another engine on this GPU to finish starting (%s)", name, path)
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        await asyncio.sleep(POLL_S)
        if _take(handle):
            logger.info("engine %s: its turn to start came after %.0f s", name, time.monotonic() - started)
            return True
    logger.warning(
        "engine %s: another engine on this GPU has been starting for %.0f s; starting beside it (whose memory "
        "may shrink this engine's KV cache)", name, timeout_s,
    )
    return False


def _take(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
