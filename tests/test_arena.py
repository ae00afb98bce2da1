"""The host path of capture without an engine: steps filed into the shared-memory arena (and into
request-owned arrays for small captures) come back, through the replica's reader, as exactly the
rows handed over, in order; blocks are reused and a full /dev/shm fails only the requests that
needed more of it."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from replicas.api import GenerateRequest
from replicas.arena import CHUNK_BLOCKS, ArenaLayout, ArenaReader, HostArena, stored_in
from replicas.arrays import from_raw
from replicas.collector import Collector, Selection
from replicas.outbox import Outbox, RequestBuffers, StepRows
from replicas.plans import RequestPlan, build_wire_plan

D_MODEL = 8  # float32 rows of 32 bytes; a block holds 32 float32 or 64 bfloat16 rows
HOOKS = ["blocks.0.hook_resid_post", "blocks.2.hook_resid_post", "blocks.3.hook_resid_post"]


def request_plan(prompt_len: int, max_tokens: int, positions="all", dtype="float32", hooks=HOOKS) -> RequestPlan:
    request = GenerateRequest.model_validate(
        {"prompt": [1] * prompt_len, "max_tokens": max_tokens, "capture": {"hooks": hooks, "positions": positions, "dtype": dtype}}
    )
    wire = build_wire_plan(
        "k", request, prompt_len=prompt_len, n_layers=4, d_model=D_MODEL, armed_kinds={"resid_post"},
        steer_kinds=set(), edit_stages=1, max_capture_bytes=1 << 30,
    )
    return RequestPlan.from_wire(wire)


class Host:
    """The worker's host path without an engine or the outbox thread: a real collector writes each
    step's rows (arena requests straight into their blocks, the others into request arrays), and
    steps and results are filed in the calling thread."""

    def __init__(self, directory: str, by_copy_engine: bool = False, max_bytes: int | None = None):
        self.outbox = Outbox(directory, D_MODEL, arena_max_bytes=max_bytes)
        self.layout, self.arena, self.table = self.outbox.arena_layout, self.outbox.arena, self.outbox.table
        self.arena.ahead_chunks = 0  # these tests count chunks: growth on demand only (growing ahead has its own)
        self.writer = self.outbox.writer
        self.collector = Collector(None, {(None, "ln_final"): None}, 16, torch.device("cpu"), self)
        if by_copy_engine:  # every step's rows go as a GPU's prefill steps do: one copy per run
            self.arena.pin = MemmovePinning()
            self.writer.by_copy_engine = lambda destinations: True
        self.reader = ArenaReader()
        self.sent: dict[int, list[np.ndarray]] = {}  # id(buffers) -> rows handed over, per step

    def put(self, rows: StepRows) -> None:  # the collector's outbox
        rows.file()

    def buffers(self, plan: RequestPlan) -> RequestBuffers:
        return RequestBuffers.for_plan(plan, D_MODEL, vocab=16, arena=self.layout)

    def step(self, members: list[tuple[RequestBuffers, int]], rng: np.random.Generator, dtype=torch.float32) -> None:
        """One step in which each member gets n rows (n may be 0 for none)."""
        members = [(b, n) for b, n in members if n]
        counts = np.array([n for _, n in members])
        data = torch.from_numpy(rng.standard_normal((len(HOOKS), int(counts.sum()), D_MODEL), dtype=np.float32)).to(dtype)
        dests = np.array([b.n_rows for b, _ in members])
        for (buffers, n), lo in zip(members, np.cumsum(counts) - counts):
            buffers.n_rows += n
            self.sent.setdefault(id(buffers), []).append(data[:, lo : lo + n].float().numpy())
        sites = [SimpleNamespace(staging=data[i]) for i in range(len(HOOKS))]
        self.collector.group_sites = [(sites, {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype], "none")]
        entries = [SimpleNamespace(buffers=b) for b, _ in members]
        selection = Selection(entries, np.arange(int(counts.sum())), np.cumsum(counts) - counts, counts, dests)
        self.collector._hand_over_rows(0, selection)

    def finish(self, buffers: RequestBuffers) -> dict:
        """What the outbox thread does when a request ends (here in the calling thread)."""
        self.outbox._finish("r", buffers)
        return buffers.result

    def result(self, buffers: RequestBuffers) -> dict[str, np.ndarray]:
        """What the replica reads, then hands back."""
        result = self.finish(buffers)
        assert result["error"] is None, result["error"]
        arrays = {name: self.reader.read(raw) if "blocks" in raw else raw for name, raw in result["activations"].items()}
        blocks, paths = stored_in(result)
        assert not paths
        self.arena.release(blocks)
        assert result["positions"] == list(range(buffers.n_rows))
        return arrays

    def expected(self, buffers: RequestBuffers) -> np.ndarray:
        return np.concatenate(self.sent[id(buffers)], axis=1)  # [hooks, rows, d]


class MemmovePinning:
    """The arena's pinning on the CPU: a run's copy is a memmove."""

    copies = 0

    def register(self, address: int, size: int) -> None:
        pass

    def unregister(self, address: int, size: int) -> None:
        pass

    def copy(self, target: int, target_pitch: int, source: int, source_pitch: int, width: int, height: int,
             stream: int) -> None:
        for row in range(height):
            ctypes.memmove(target + row * target_pitch, source + row * source_pitch, width)
        self.copies += 1


@pytest.fixture(params=["kernel", "copy engine"])
def host(tmp_path, request) -> Host:
    return Host(str(tmp_path), by_copy_engine=request.param == "copy engine")


def test_rows_come_back_in_order_across_blocks_and_interleaved_requests(host):
    rng = np.random.default_rng(0)
    long = host.buffers(request_plan(prompt_len=150, max_tokens=40))  # 189 rows: 6 blocks per hook
    short = host.buffers(request_plan(prompt_len=40, max_tokens=1))  # 40 rows: 2 blocks per hook
    host.step([(long, 70)], rng)  # a prefill chunk crossing two block boundaries
    host.step([(long, 80), (short, 40)], rng)
    for _ in range(39):  # decode: one row each step
        host.step([(long, 1)], rng)
    assert long.rows_per_block == short.rows_per_block == 32 and long.sites is None
    for buffers in (long, short):
        rows = host.result(buffers)
        expected = host.expected(buffers)
        assert [a.shape for a in rows.values()] == [(buffers.n_rows, D_MODEL)] * len(HOOKS)
        for i, name in enumerate(HOOKS):
            np.testing.assert_array_equal(rows[name], expected[i])


def test_a_narrower_hook_of_a_group_lands_zero_padded(host):
    """A capture group as wide as its widest hook (attention heads: k narrower than q): the
    narrower hook's rows land with zeros on the right, by kernel or by copy engine."""
    rng = np.random.default_rng(5)
    buffers = host.buffers(request_plan(prompt_len=100, max_tokens=1))
    staged = [rng.standard_normal((100, D_MODEL if i != 1 else D_MODEL // 2), dtype=np.float32) for i in range(len(HOOKS))]
    sites = [SimpleNamespace(staging=torch.from_numpy(a)) for a in staged]
    host.collector.group_sites = [(sites, "float32", "none")]
    for lo, n in [(0, 70), (70, 30)]:
        selection = Selection([SimpleNamespace(buffers=buffers)], np.arange(lo, lo + n), np.array([0]), np.array([n]), np.array([lo]))
        buffers.n_rows += n
        host.collector._hand_over_rows(0, selection)
    rows = host.result(buffers)
    for i, name in enumerate(HOOKS):
        expected = np.zeros((100, D_MODEL), np.float32)
        expected[:, : staged[i].shape[1]] = staged[i]
        np.testing.assert_array_equal(rows[name], expected)


def test_blocks_are_reused_and_a_new_chunk_comes_only_when_all_are_in_use(host):
    rng = np.random.default_rng(1)
    first = host.buffers(request_plan(prompt_len=256, max_tokens=1))  # 3 hooks x 8 blocks
    host.step([(first, 256)], rng)
    host.result(first)
    assert host.arena.chunks == 1 and host.arena.blocks_in_use == 0
    again = host.buffers(request_plan(prompt_len=256, max_tokens=1))
    host.step([(again, 256)], rng)  # same blocks: a stale row would show below
    np.testing.assert_array_equal(host.result(again)[HOOKS[1]], host.expected(again)[1])
    # more requests than one chunk holds: the arena grows, and every request still reads back
    many = [host.buffers(request_plan(prompt_len=256, max_tokens=1)) for _ in range(CHUNK_BLOCKS // 24 + 1)]
    host.step([(b, 256) for b in many], rng)
    assert host.arena.chunks == 2
    pending = many.pop()
    for buffers in many:
        np.testing.assert_array_equal(host.result(buffers)[HOOKS[2]], host.expected(buffers)[2])
    reserved = shm_bytes(host)
    host.arena.shrink()  # a block still waits for the replica: nothing is given back
    assert host.arena.chunks == 2 and shm_bytes(host) == reserved
    np.testing.assert_array_equal(host.result(pending)[HOOKS[0]], host.expected(pending)[0])
    host.arena.shrink()  # idle: back to one chunk, and its memory to the system
    assert host.arena.chunks == 1 and host.arena.blocks_in_use == 0
    assert shm_bytes(host) == reserved // 2
    after = host.buffers(request_plan(prompt_len=256, max_tokens=1))
    host.step([(after, 256)], rng)  # works as before
    np.testing.assert_array_equal(host.result(after)[HOOKS[0]], host.expected(after)[0])


def shm_bytes(host: Host) -> int:
    """Memory the arena file holds (its size is the file system's: it is sparse)."""
    return os.stat(host.layout.path).st_blocks * 512


def test_small_captures_keep_their_own_arrays_beside_arena_ones_in_one_step(host):
    rng = np.random.default_rng(2)
    small = host.buffers(request_plan(prompt_len=20, max_tokens=1))  # 20 rows < a block: inline
    large = host.buffers(request_plan(prompt_len=100, max_tokens=1))
    host.step([(small, 20), (large, 100)], rng)
    assert small.sites is not None and small.rows_per_block == 0
    result = host.finish(small)
    np.testing.assert_array_equal(np.frombuffer(result["activations"][HOOKS[0]]["data"], np.float32).reshape(20, D_MODEL),
                                  host.expected(small)[0])
    np.testing.assert_array_equal(host.result(large)[HOOKS[0]], host.expected(large)[0])


def test_bfloat16_rows_pack_twice_as_many_per_block(host):
    rng = np.random.default_rng(3)
    buffers = host.buffers(request_plan(prompt_len=130, max_tokens=1, dtype="bfloat16"))
    host.step([(buffers, 65)], rng, torch.bfloat16)
    host.step([(buffers, 65)], rng, torch.bfloat16)
    assert buffers.rows_per_block == 64
    rows = host.result(buffers)
    assert rows[HOOKS[0]].dtype.name == "bfloat16"
    np.testing.assert_array_equal(rows[HOOKS[0]].astype(np.float32), host.expected(buffers)[0])


def test_a_full_shared_memory_fails_only_the_requests_that_needed_more(host, monkeypatch):
    rng = np.random.default_rng(4)
    small = host.buffers(request_plan(prompt_len=10, max_tokens=1))
    holding = host.buffers(request_plan(prompt_len=256, max_tokens=1))
    host.step([(holding, 256)], rng)
    held = host.arena.blocks_in_use

    monkeypatch.setattr(host.arena, "max_chunks", host.arena.chunks)  # the arena is at its limit
    needy = [host.buffers(request_plan(prompt_len=256, max_tokens=1)) for _ in range(CHUNK_BLOCKS // 24)]
    host.step([(small, 10), *((b, 256) for b in needy)], rng)
    assert all("arena is full" in b.error and "arena_max_bytes" in b.error for b in needy)
    assert small.error is None and holding.error is None
    for buffers in needy:  # their blocks go back
        assert host.finish(buffers)["error"].startswith("capture could not be stored")
    assert host.arena.blocks_in_use == held
    np.testing.assert_array_equal(host.result(holding)[HOOKS[0]], host.expected(holding)[0])


def test_a_small_dev_shm_sends_results_through_the_temporary_folder(monkeypatch):
    import shutil
    from collections import namedtuple

    from replicas import engine

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(os.path, "isdir", lambda path: True)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, 64 << 20))  # a container's default
    assert engine._spill_parent() is None
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 30, 0, 64 << 30))
    assert engine._spill_parent() == "/dev/shm"


def test_the_step_loop_waits_while_the_backlog_of_unfiled_rows_is_full():
    """Rows whose copy has not finished (or not been filed) count against the backlog: a step
    that would overflow it waits for the outbox, one that fits, or the first, goes straight in."""
    import threading

    class SlowCopy:  # a CUDA event whose copy ends when the test says so
        def __init__(self):
            self.done = threading.Event()

        def synchronize(self):
            self.done.wait()

    outbox = Outbox(None, D_MODEL, backlog_bytes=2000)
    plan = request_plan(prompt_len=10, max_tokens=1)
    buffers = [RequestBuffers.for_plan(plan, D_MODEL, 16, None) for _ in range(3)]

    def step(buffers, copy, rows=10):  # 3 hooks x rows x 8 float32 = 96 bytes a row
        data = torch.zeros(len(HOOKS), rows, D_MODEL)
        return StepRows("rows", data, copy, [buffers], np.array([0]), np.array([rows]), np.array([0]))

    first = SlowCopy()
    outbox.put(step(buffers[0], first, rows=20))  # 1,920 bytes: over nothing, so it goes in
    blocked = threading.Thread(target=outbox.put, args=(step(buffers[1], None),))
    blocked.start()
    blocked.join(timeout=0.5)
    assert blocked.is_alive()  # 1,920 + 960 > 2,000: waits for the first step's copy
    first.done.set()
    blocked.join(timeout=10)
    assert not blocked.is_alive()
    outbox.finish("b1", buffers[1])
    assert buffers[1].done.wait(10) and outbox.wait_seconds > 0


def test_the_arena_never_grows_past_its_limit(tmp_path):
    """A limit below a chunk shrinks the chunk; past the limit a request fails naming the option,
    and the file never reserves more than the limit."""
    layout = ArenaLayout.for_model(str(tmp_path), D_MODEL)  # 1 KiB blocks
    arena = HostArena(layout, max_bytes=100 << 10)
    assert (arena.chunk_blocks, arena.max_chunks) == (100, 1)
    assert len(arena.allocate(100)) == 100
    with pytest.raises(OSError, match=r"arena is full: 102400 bytes in use, its limit is 102400 bytes \(engine option arena_max_bytes\)"):
        arena.allocate(1)
    assert os.stat(layout.path).st_size == 100 << 10 and shm_bytes_of(layout.path) == 100 << 10


def shm_bytes_of(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_the_default_arena_limit_is_a_fair_share_of_the_file_system(monkeypatch):
    import shutil
    from collections import namedtuple

    from replicas import arena

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 30, 0, 64 << 30))
    monkeypatch.setattr(arena, "node_gpu_count", lambda: 8)
    assert arena.arena_limit_bytes("/dev/shm", None) == 4 << 30  # half of it over 8 GPUs
    monkeypatch.setattr(arena, "node_gpu_count", lambda: 0)
    assert arena.arena_limit_bytes("/dev/shm", None) == 16 << 30  # CPU: half of it over two shares
    assert arena.arena_limit_bytes("/dev/shm", 1 << 20) == 1 << 20
    assert arena.arena_limit_bytes("/dev/shm", 1 << 40) == 64 << 30  # never more than there is
    assert arena.arena_geometry(4 << 30, 512 << 10) == (256, 32)


class SlowCopy:
    """A CUDA event whose copy ends when the test says so."""

    def __init__(self):
        self.done = threading.Event()

    def synchronize(self):
        self.done.wait()


class FailedCopy:
    """A CUDA event whose wait raises: what kills an unguarded outbox thread."""

    def synchronize(self):
        raise RuntimeError("copy failed")


def step_rows(buffers, copy, rows=10, first=0):
    data = torch.ones(len(HOOKS), rows, D_MODEL)
    buffers.n_rows = first + rows
    return StepRows("rows", data, copy, [buffers], np.array([0]), np.array([rows]), np.array([first]))


def test_a_dead_outbox_thread_fails_the_requests_it_holds_and_every_later_one_at_once():
    from replicas.errors import OUTBOX_DEAD
    outbox = Outbox(None, D_MODEL)
    plan = request_plan(prompt_len=10, max_tokens=1)
    held, later = (RequestBuffers.for_plan(plan, D_MODEL, 16, None) for _ in range(2))
    outbox.put(step_rows(held, FailedCopy()))
    outbox.finish("held", held)
    assert held.done.wait(10), "the request the dead thread held was never answered"
    assert held.result["replica_fault"] == OUTBOX_DEAD
    assert "outbox thread died (RuntimeError('copy failed'))" in held.result["error"]
    outbox.put(step_rows(later, None))  # nothing waits for a dead thread
    outbox.finish("later", later)
    assert later.done.is_set() and later.result == held.result


def test_a_stuck_outbox_fails_the_wait_and_frees_the_result_once_it_comes(tmp_path):
    """`take` gives up after the timeout; the outbox then frees the arena blocks of the result
    nobody will read."""
    from replicas.errors import OUTBOX_STUCK
    outbox = Outbox(str(tmp_path), D_MODEL, timeout_s=0.1)
    buffers = RequestBuffers.for_plan(request_plan(prompt_len=64, max_tokens=1), D_MODEL, 16, outbox.arena_layout)
    assert buffers.rows_per_block  # it files into the arena
    copy = SlowCopy()  # the device's write into the arena has not ended
    rows, counts, dests = torch.ones(len(HOOKS), 64, D_MODEL), np.array([64]), np.array([0])
    destinations = outbox.writer.destinations([buffers], counts, dests, len(HOOKS))
    outbox.writer.write(rows, torch.from_numpy(destinations.arena_rows()).reshape(-1), None)
    buffers.n_rows = 64
    buffers.written = copy
    outbox.finish("stuck", buffers)
    result = buffers.wait(0.1)
    assert result["replica_fault"] == OUTBOX_STUCK and "outbox_timeout_s" in result["error"]
    copy.done.set()
    assert buffers.done.wait(10)
    stats = outbox.stats()
    for _ in range(100):  # the blocks go back through the outbox's queue
        if not (stats := outbox.stats())["arena_bytes_in_use"]:
            break
        threading.Event().wait(0.05)
    assert stats["arena_bytes"] > 0 and stats["arena_bytes_in_use"] == 0


def test_a_step_loop_waiting_for_backlog_room_gives_up_and_fails_those_rows():
    from replicas.errors import OUTBOX_STUCK
    outbox = Outbox(None, D_MODEL, backlog_bytes=2000, timeout_s=0.1)
    plan = request_plan(prompt_len=20, max_tokens=1)
    first, second = (RequestBuffers.for_plan(plan, D_MODEL, 16, None) for _ in range(2))
    outbox.put(step_rows(first, SlowCopy(), rows=20))  # 1,920 bytes whose copy never ends
    waiting = threading.Thread(target=outbox.put, args=(step_rows(second, None),))
    waiting.start()
    waiting.join(timeout=10)
    assert not waiting.is_alive(), "the step loop waited for the outbox forever"
    assert second.replica_fault == OUTBOX_STUCK and "did not file earlier rows in time" in second.error
    assert first.error is None


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
    assert arena.chunks == arena.kept_chunks == 3 and shm_bytes_of(layout.path) == 3 * arena.chunk_bytes
    assert pin.registered == {(base, reserve)}  # in one piece: nothing runs yet that it could hold up
    blocks = arena.allocate(4 * arena.chunk_blocks)  # one chunk more
    assert arena.chunks == 4 and len(pin.registered) == 2
    chunk_3 = np.arange(base_blocks, base_blocks + arena.chunk_blocks)
    assert (arena.registration(np.arange(base_blocks)) == -1).all() and (arena.registration(chunk_3) >= 0).all()
    arena.release(blocks)
    arena.shrink()
    assert arena.chunks == 3 and pin.registered == {(base, reserve)} and shm_bytes_of(layout.path) == 3 * arena.chunk_bytes
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
    monkeypatch.setattr("replicas.arena.PIN_PIECE_BYTES", 64 << 10)
    pauses: list[float] = []
    monkeypatch.setattr("replicas.arena.time", SimpleNamespace(perf_counter=time.perf_counter, sleep=pauses.append))
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
    monkeypatch.setattr("replicas.arena.PIN_PIECE_BYTES", 2 << 10)  # two blocks
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


def test_rows_are_written_with_the_widest_integer_that_divides_them():
    from replicas.arena_writer import element_type

    assert [element_type(n) for n in (8192, 4100, 4098, 4097)] == [torch.int64, torch.int32, torch.int16, torch.uint8]


def test_a_capture_takes_its_blocks_in_one_run_and_gives_back_those_it_never_wrote(host):
    """All of a request's blocks are taken at its first write, in one run, so each hook's rows lie
    in one piece; a request that stops early frees the blocks past its rows as it finishes."""
    rng = np.random.default_rng(6)
    buffers = host.buffers(request_plan(prompt_len=40, max_tokens=200))  # up to 239 rows: 8 blocks per hook
    host.step([(buffers, 40)], rng)
    assert host.arena.blocks_in_use == len(HOOKS) * 8
    table_row = host.table.table[buffers.table_slot, : len(HOOKS) * 8]
    assert (np.diff(table_row) == 1).all()
    result = host.finish(buffers)  # stopped after its prompt: 2 blocks per hook hold rows
    assert host.arena.blocks_in_use == len(HOOKS) * 2 == len(stored_in(result)[0])
    host.arena.release(stored_in(result)[0])
    assert host.arena.blocks_in_use == 0


def test_a_result_views_the_arena_in_place_until_its_last_array_is_dropped(host):
    import gc
    import weakref

    rng = np.random.default_rng(7)
    buffers = host.buffers(request_plan(prompt_len=100, max_tokens=1))
    host.step([(buffers, 100)], rng)
    described = host.finish(buffers)["activations"][HOOKS[1]]
    host.reader.attach(host.layout.path)
    held = host.reader.hold(host.layout.path)
    freed = threading.Event()
    weakref.finalize(held, freed.set)
    rows = host.reader.read(described, held)
    np.testing.assert_array_equal(rows, host.expected(buffers)[1])
    assert np.shares_memory(rows, held) and not rows.flags.writeable  # read in place
    part = rows[10:20, 2:]  # a caller's slice keeps the mapping held too
    del held, rows
    gc.collect()
    assert not freed.is_set()
    np.testing.assert_array_equal(part, host.expected(buffers)[1][10:20, 2:])
    del part
    gc.collect()
    assert freed.is_set()
    copied = host.reader.read(described)  # without a holder: a copy
    assert not np.shares_memory(copied, np.frombuffer(host.reader.hold(host.layout.path), np.uint8))
    np.testing.assert_array_equal(copied, host.expected(buffers)[1])
    totals = host.reader.totals  # one read in place, one copied out
    assert totals["viewed_bytes"] == totals["copied_bytes"] == copied.nbytes and totals["copy_s"] > 0


def test_an_arena_at_its_limit_hands_out_scattered_blocks_rather_than_fail(tmp_path):
    """The replica admits a capture once its blocks fit in the whole arena; a run of them may not
    exist then, and the capture gets free blocks wherever they are."""
    arena = HostArena(ArenaLayout.for_model(str(tmp_path), D_MODEL), max_bytes=100 << 10)  # 100 blocks
    first, second = arena.allocate(40), arena.allocate(20)
    assert first.tolist() == list(range(40)) and second.tolist() == list(range(40, 60))
    arena.release(first)
    scattered = arena.allocate(44)  # 80 free, but no run of 44
    assert sorted(scattered.tolist()) == list(range(40)) + list(range(60, 64))
    assert arena.blocks_in_use == 64
    with pytest.raises(OSError, match="arena is full"):
        arena.allocate(37)


@pytest.mark.parametrize("by_copy_engine", [False, True])
def test_a_capture_on_scattered_blocks_reads_back_whole(tmp_path, by_copy_engine):
    """An arena at its limit hands a capture scattered blocks: its rows still land in order, by
    kernel or by one copy per run."""
    host = Host(str(tmp_path), by_copy_engine, max_bytes=100 << 10)  # 100 blocks of 32 float32 rows
    rng = np.random.default_rng(8)
    hold = host.arena.allocate(90)
    host.arena.release(hold[::3])  # 30 free blocks, no two adjacent
    buffers = host.buffers(request_plan(prompt_len=200, max_tokens=1))  # 3 hooks x 7 blocks
    host.step([(buffers, 130)], rng)
    host.step([(buffers, 70)], rng)
    assert not (np.diff(host.table.table[buffers.table_slot, :21]) == 1).any()
    if by_copy_engine:  # a copy per block a step writes: 5 blocks, then 3 (one shared)
        assert host.arena.pin.copies == 5 + 3  # the hooks' blocks lie evenly apart: each copy takes all three
    rows = host.result(buffers)
    for i, name in enumerate(HOOKS):
        np.testing.assert_array_equal(rows[name], host.expected(buffers)[i])



def test_steady_decode_steps_skip_the_selection_and_write_what_it_would(tmp_path, monkeypatch):
    """Requests capturing every position, the generated ones or the last prompt position, beside
    an unplanned one, through prefill, repeated decode steps, a new order, a newcomer's prefill and
    departures: every row reads back as staged, and decode steps like the one before go by
    `SteadyDecode` (rows looked up once, `Batch.repeats`); a decode step of requests that select
    none of its rows does nothing."""
    from replicas._vllm import StepLayout
    from replicas.request_table import UNPLANNED, RequestTable

    outbox = Outbox(str(tmp_path), D_MODEL)
    sites = {(i, "resid_post"): SimpleNamespace(staging=torch.zeros(64, D_MODEL)) for i in (0, 2, 3)}
    collector = Collector(None, {(None, "ln_final"): None, **sites}, 16, torch.device("cpu"), outbox)
    table = RequestTable()
    full = []
    monkeypatch.setattr(collector, "_collect", lambda *a, f=collector._collect: (full.append(1), f(*a)))
    names = {"a": "all", "b": "generated", "c": "all", "d": "all", "e": "last_prompt"}
    entries, expected, prompt = {}, {n: [] for n in names}, {"a": 5, "b": 3, "c": 28, "d": 4, "e": 6}
    selects = {"all": lambda p, n: True, "generated": lambda p, n: p >= n, "last_prompt": lambda p, n: p == n - 1}
    batches = []
    rng = np.random.default_rng(3)

    def admit(name: str) -> None:
        plan = request_plan(prompt_len=prompt[name], max_tokens=40, positions=names[name])
        buffers = RequestBuffers.for_plan(plan, D_MODEL, 16, outbox.arena_layout)
        assert (buffers.rows_per_block > 0) == (name != "e")  # one row is filed by the outbox, not in the arena
        entries[name] = table.admit(name, plan, buffers, collector.group(plan.capture))

    def step(batch: list[tuple[str, int, int]]) -> None:
        """(request, first position, rows) per request; "u" is unplanned."""
        counts = [n for _, _, n in batch]
        layout = StepLayout([r for r, _, _ in batch], np.concatenate([[0], np.cumsum(counts)]),
                            np.array([s for _, s, _ in batch], np.int64))
        staged = rng.standard_normal((len(sites), sum(counts), D_MODEL), dtype=np.float32)
        for i, site in enumerate(sites.values()):
            site.staging[: sum(counts)] = torch.from_numpy(staged[i])
        for (name, start, n), lo in zip(batch, layout.offsets[:-1]):
            if name in names:
                keep = [j for j in range(n) if selects[names[name]](start + j, prompt[name])]
                expected[name].append(staged[:, lo + np.array(keep, int)] if keep else staged[:, :0])
        batches.append(table.batch(layout, batches[-1] if batches else None, lambda name: table.plan(name, None) or UNPLANNED))
        collector.collect(batches[-1], table)

    for name in "abce":
        admit(name)
    step([("a", 0, 5), ("u", 0, 2), ("b", 0, 3), ("c", 0, 28), ("e", 0, 6)])
    position = {"a": 5, "u": 2, "b": 3, "c": 28, "e": 6}  # c's rows cross into its second block while decoding

    def decode(order: str, times: int) -> None:
        for _ in range(times):
            step([(r, position[r], 1) for r in order])
            for r in order:
                position[r] += 1

    decode("aubce", 6)
    assert len(full) == 2  # the prefill and the first decode step; five went by SteadyDecode
    assert [b.repeats for b in batches] == [False] + [True] * 6  # the same requests in the same order, prefill then decode
    decode("cueab", 3)
    assert len(full) == 3
    admit("d")
    step([(r, position[r], 1) for r in "cueab"] + [("d", 0, 4)])
    position["d"] = 4
    for r in "cueab":
        position[r] += 1
    assert not batches[-1].repeats  # d was admitted
    decode("cueabd", 4)
    assert len(full) == 5
    decode("cued", 3)  # a and b left
    assert len(full) == 6 and collector.steady_steps == 5 + 2 + 3 + 2
    decode("ue", 3)  # e asks nothing of a decode step
    assert len(full) == 7 and collector.steady_steps == 5 + 2 + 3 + 2 + 2
    reader = ArenaReader()
    for name, entry in entries.items():
        buffers = entry.buffers
        buffers.n_rows = int(table.columns["rows_taken"][entry.handle])
        outbox._finish(name, buffers)
        assert buffers.result["error"] is None
        want = np.concatenate(expected[name], axis=1)
        for i, hook in enumerate(HOOKS):
            described = buffers.result["activations"][hook]
            got = reader.read(described) if "arena" in described else from_raw(described)
            np.testing.assert_array_equal(got, want[i], err_msg=f"{name} {hook}")
