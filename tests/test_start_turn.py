"""Engines sharing a GPU start in turn (replicas.engine.start_turn): real flocks, real processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from replicas.engine.start_turn import gpu_start_turn, turn_file


def test_turn_files_name_the_gpus(tmp_path: Path) -> None:
    assert turn_file("0", str(tmp_path)) == turn_file("0", str(tmp_path))
    assert turn_file("1,0", str(tmp_path)) == turn_file("0, 1", str(tmp_path))
    assert turn_file("0", str(tmp_path)) != turn_file("1", str(tmp_path))
    assert turn_file("GPU-4bd6fd5e", str(tmp_path)).name == "capserve-gpu-start-GPU-4bd6fd5e.lock"


def test_second_engine_on_a_gpu_starts_when_the_first_is_up(tmp_path: Path) -> None:
    order: list[str] = []

    async def start(name: str, entered: asyncio.Event | None, release: asyncio.Event | None) -> bool:
        async with gpu_start_turn(name, turn_file("0", str(tmp_path))) as held:
            order.append(f"{name} starts")
            if entered is not None:
                entered.set()
            if release is not None:
                await release.wait()
            order.append(f"{name} up")
            return held

    async def main() -> tuple[bool, bool]:
        entered, release = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(start("a", entered, release))
        await entered.wait()
        second = asyncio.create_task(start("b", None, None))
        await asyncio.sleep(1.2)  # two of the waiter's polls: it must still be waiting
        assert order == ["a starts"]
        release.set()
        return await first, await second

    assert asyncio.run(main()) == (True, True)
    assert order == ["a starts", "a up", "b starts", "b up"]


def test_engines_on_other_gpus_do_not_wait(tmp_path: Path) -> None:
    async def main() -> list[str]:
        order: list[str] = []
        async with gpu_start_turn("a", turn_file("0", str(tmp_path))):
            async with gpu_start_turn("b", turn_file("1", str(tmp_path)), timeout_s=0.0) as held:
                order.append(f"b starts, held={held}")
        return order

    assert asyncio.run(main()) == ["b starts, held=True"]


def test_a_starting_engine_killed_never_blocks_the_next(tmp_path: Path) -> None:
    path = turn_file("0", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(600)"
        ), str(path)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"

        async def main() -> bool:
            waiter = asyncio.create_task(_held(path, timeout_s=60.0))
            await asyncio.sleep(1.0)
            assert not waiter.done()  # the holder is alive: the turn is its
            holder.kill()
            return await waiter

        assert asyncio.run(main()) is True
    finally:
        holder.kill()
        holder.wait()


def test_an_engine_stuck_starting_is_passed_after_the_timeout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = turn_file("0", str(tmp_path))

    async def main() -> bool:
        async with gpu_start_turn("stuck", path):
            return await _held(path, timeout_s=1.0)

    with caplog.at_level("INFO", logger="capserve.engine"):
        assert asyncio.run(main()) is False
    assert "waiting for another engine on this GPU" in caplog.text
    assert "starting beside it" in caplog.text


async def _held(path: Path, timeout_s: float) -> bool:
    async with gpu_start_turn("next", path, timeout_s=timeout_s) as held:
        return held
