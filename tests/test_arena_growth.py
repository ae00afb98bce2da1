"""The arena's size: its limit and the default one, the reserve faulted in at start, chunks
registered with CUDA in pieces, and growth ahead of the step loop on a thread of its own."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from replicas.arena.host import ArenaLayout, HostArena
from tests.arena_host import D_MODEL, HOOKS, Host, request_plan, shm_bytes


def test_a_small_dev_shm_sends_results_through_the_temporary_folder(monkeypatch):
    import shutil
    from collections import namedtuple

    from replicas.engine import capture_engine as engine

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(os.path, "isdir", lambda path: True)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, 64 << 20))  # a container's default
    assert engine._spill_parent() is None
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 30, 0, 64 << 30))
    assert engine._spill_parent() == "/dev/shm"


def test_the_arena_never_grows_past_its_limit(tmp_path):
    """A limit below a chunk shrinks the chunk; past the limit a request fails naming the option,
    and the file never reserves more than the limit."""
    layout = ArenaLayout.for_model(str(tmp_path), D_MODEL)  # 1 KiB blocks
    arena = HostArena(layout, max_bytes=100 << 10)
    assert (arena.chunk_blocks, arena.max_chunks) == (100, 1)
    assert len(arena.allocate(100)) == 100
    with pytest.raises(OSError, match=r"arena is full: 102400 bytes in use, its limit is 102400 bytes \(engine option arena_max_bytes\)"):
        arena.allocate(1)
    assert os.stat(layout.path).st_size == 100 << 10 and shm_bytes(layout.path) == 100 << 10


def test_the_default_arena_limit_is_a_fair_share_of_the_file_system(monkeypatch):
    import shutil
    from collections import namedtuple

    from replicas.arena import host as arena

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 30, 0, 64 << 30))
    monkeypatch.setattr(arena, "node_gpu_count", lambda: 8)
    assert arena.arena_limit_bytes("/dev/shm", None) == 4 << 30  # half of it over 8 GPUs
    monkeypatch.setattr(arena, "node_gpu_count", lambda: 0)
    assert arena.arena_limit_bytes("/dev/shm", None) == 16 << 30  # CPU: half of it over two shares
    assert arena.arena_limit_bytes("/dev/shm", 1 << 20) == 1 << 20
    assert arena.arena_limit_bytes("/dev/shm", 1 << 40) == 64 << 30  # never more than there is
    assert arena.arena_geometry(4 << 30, 512 << 10) == (256, 32)


class RecordedPinning:
    """Stands in for CUDA's host registration: which ranges are registered now."""

    def __init__(self):
        self.registered: set[tuple[int, int]] = set()

    def register(self, address: int, size: int) -> None:
        self.registered.add((address, size))

    def unregister(self, address: int, size: int) -> None:
        self.registered.remove((address, size))


def test_the_reserve_is_faulted_in_and_registered_at_start_and_kept_when_idle(tmp_path):
    """The first request finds its memory ready; growth past the reserve registers each chunk,
    and an idle arena unregisters and gives back only what it grew."""
    layout = ArenaLayout.for_model(str(tmp_path), D_MODEL)  # 1 KiB blocks, 256 KiB chunks
    pin = RecordedPinning()
    arena = HostArena(layout, reserve_bytes=600 << 10, pin=pin)  # rounds up to 3 chunks
    base, reserve = arena.bytes.ctypes.data, (base_blocks := 3 * arena.chunk_blocks) * layout.block_bytes
    assert arena.chunks == arena.kept_chunks == 3 and shm_bytes(layout.path) == 3 * arena.chunk_bytes
    assert pin.registered == {(base, reserve)}  # in one piece: nothing runs yet that it could hold up
    blocks = arena.allocate(4 * arena.chunk_blocks)  # one chunk more
    assert arena.chunks == 4 and len(pin.registered) == 2
    chunk_3 = np.arange(base_blocks, base_blocks + arena.chunk_blocks)
    assert (arena.registration(np.arange(base_blocks)) == -1).all() and (arena.registration(chunk_3) >= 0).all()
    arena.release(blocks)
    arena.shrink()
    assert arena.chunks == 3 and pin.registered == {(base, reserve)} and shm_bytes(layout.path) == 3 * arena.chunk_bytes
    assert arena.blocks_in_use == 0 and arena.is_free[: 3 * arena.chunk_blocks].all() and not arena.is_free[3 * arena.chunk_blocks :].any()


class FailingPinning(RecordedPinning):
    """Refuses the registration after `registered_before` ranges, as CUDA may."""

    def __init__(self, registered_before: int):
        super().__init__()
        self.registered_before = registered_before

    def register(self, address: int, size: int) -> None:
        if len(self.registered) == self.registered_before:
            raise RuntimeError("cudaHostRegister failed")
        super().register(address, size)


def test_chunks_are_registered_in_pieces_with_pauses_on_the_grower(tmp_path, monkeypatch):
    """cudaHostRegister stalls the step loop for as long as it pins, so a chunk is registered a
    piece at a time, and the grower pauses after each piece, unless an allocation is waiting for
    its chunk. Shrinking unregisters every piece; a piece CUDA refuses leaves none of its chunk
    registered."""
    monkeypatch.setattr("replicas.arena.host.PIN_PIECE_BYTES", 64 << 10)
    pauses: list[float] = []
    monkeypatch.setattr("replicas.arena.host.time", SimpleNamespace(perf_counter=time.perf_counter, sleep=pauses.append))
    layout = ArenaLayout.for_model(str(tmp_path), D_MODEL)  # 1 KiB blocks, 256 KiB chunks: 4 pieces
    pin = RecordedPinning()
    arena = HostArena(layout, reserve_bytes=256 << 10, pin=pin)
    base = arena.bytes.ctypes.data
    assert arena.pin_bytes == 64 << 10
    assert pin.registered == {(base, 256 << 10)}  # the reserve, in one piece
    assert pauses == []  # the reserve, at start-up: no step loop to make way for
    for allocation_waits in (False, True):
        pauses.clear()
        arena.allocate(100)  # 156 free: two chunks ahead
        arena._allocation_waits = allocation_waits  # as while `allocate` waits for the grower's chunk
        arena.grow_ahead()
        assert arena.chunks == 3 and len(pin.registered) == 9
        assert len(pauses) == (0 if allocation_waits else 8) and all(p > 0 for p in pauses)
        arena.release(np.arange(100))
        arena.shrink()
        assert pin.registered == {(base, 256 << 10)}

    (tmp_path / "failing").mkdir()
    failing = HostArena(ArenaLayout.for_model(str(tmp_path / "failing"), D_MODEL), pin=FailingPinning(registered_before=2))
    with pytest.raises(RuntimeError):
        failing.allocate(10)
    assert failing.chunks == 0 and not failing.pin.registered


def test_copies_break_where_two_registrations_meet(tmp_path, monkeypatch):
    """A capture's run of rows across a piece boundary goes by two copies, and no copy spans two
    pieces (a copy of several hooks neither); its rows read back whole."""
    monkeypatch.setattr("replicas.arena.host.PIN_PIECE_BYTES", 2 << 10)  # two blocks
    host = Host(str(tmp_path), by_copy_engine=True)
    copies: list[tuple[int, int]] = []
    memmove = host.arena.pin.copy

    def copy(target, target_pitch, source, source_pitch, width, height, stream):
        copies.append((target, (height - 1) * target_pitch + width))
        memmove(target, target_pitch, source, source_pitch, width, height, stream)

    host.arena.pin.copy = copy
    rng = np.random.default_rng(9)
    buffers = host.buffers(request_plan(prompt_len=200, max_tokens=1))  # 7 blocks a hook, in one run
    host.step([(buffers, 130)], rng)
    host.step([(buffers, 70)], rng)
    base, piece = host.arena.bytes.ctypes.data, host.arena.pin_bytes
    assert piece == 2 << 10 and len(copies) > 2 * len(HOOKS)
    assert all((target - base) // piece == (target + size - 1 - base) // piece for target, size in copies)
    rows = host.result(buffers)
    for i, name in enumerate(HOOKS):
        np.testing.assert_array_equal(rows[name], host.expected(buffers)[i])


class SlowPinning(RecordedPinning):
    """Registration that takes a while, as cudaHostRegister of a chunk does; a range registered
    twice is an error, as it is for CUDA."""

    def __init__(self):
        super().__init__()
        self.threads: list[str] = []

    def register(self, address: int, size: int) -> None:
        assert (address, size) not in self.registered, "a chunk was registered twice"
        self.threads.append(threading.current_thread().name)
        time.sleep(0.002)
        super().register(address, size)


def test_the_arena_grows_ahead_of_the_step_loop_on_a_thread_of_its_own(tmp_path):
    """Allocations that leave fewer free blocks than the margin ask the grower; while it keeps up,
    the allocating thread never reserves memory itself. Under a steady stream of allocations and
    releases on two threads every chunk is registered once and no block is handed out twice."""
    layout = ArenaLayout.for_model(str(tmp_path), D_MODEL)  # 1 KiB blocks, 256-block chunks
    pin = SlowPinning()
    arena = HostArena(layout, max_bytes=64 * (256 << 10), reserve_bytes=256 << 10, pin=pin)  # 1 chunk of 64
    assert arena.chunks == 1
    arena.allocate(100)
    assert arena.growth_wanted.is_set()  # 156 free < 512, two chunks
    arena.grow_ahead()
    assert arena.chunks == 3 and arena.is_free[: 3 * 256].sum() == 668
    pin.threads.clear()
    arena.allocate(300)  # fits in what was reserved ahead
    assert arena.chunks == 3 and pin.threads == []

    grower = threading.Thread(target=arena.grow_when_asked, name="grower", daemon=True)
    grower.start()
    rng = np.random.default_rng(0)
    held: list[np.ndarray] = []
    for _ in range(400):
        held.append(arena.allocate(int(rng.integers(1, 60))))
        if len(held) > 20:
            arena.release(held.pop(int(rng.integers(len(held)))))
        time.sleep(0.0005)
    taken = np.concatenate(held)
    assert len(np.unique(taken)) == len(taken) and not arena.is_free[taken].any()
    assert len(pin.registered) == arena.chunks <= arena.max_chunks
    assert pin.threads.count("grower") > pin.threads.count("MainThread")  # most chunks came ahead of need


def test_a_reserve_larger_than_the_limit_takes_the_limit(tmp_path):
    layout = ArenaLayout.for_model(str(tmp_path), D_MODEL)
    arena = HostArena(layout, max_bytes=512 << 10, reserve_bytes=1 << 30)
    assert arena.chunks == arena.max_chunks == 2
