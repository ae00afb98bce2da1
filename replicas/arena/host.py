"""Host memory for large captures: blocks of one shared-memory file, reused across requests.

Fresh memory is what moving activations costs: the first write to a new shared-memory page ran
at ~1.2 GB/s on the CI machine where a copy into pages written before ran at ~10 GB/s
(`python -m bench.bench_host_path` compares the two designs). So the worker keeps its arena: the
step loop writes each step's rows of every large capture straight from the device into their
blocks (`replicas.worker.arena_writer`: a kernel or the copy engines, whatever the number of requests;
on a GPU the arena's chunks are registered with CUDA), a finished capture is described by its block
numbers, the replica reads its rows (`ArenaReader`: in place, or a copy) and hands the numbers
back with a later `capserve_take`, and the blocks go to the next request. A request takes all its
blocks when it first writes, as one run, so each hook's rows lie in one piece and can be read in
place; blocks past the rows it wrote go back as it finishes. The arena reserves `reserve_bytes` at
start-up, pages faulted in, and more a chunk at a time: ahead of need on a thread of its own
(`grow_ahead`), or on the step loop when no run of free blocks fits (a full /dev/shm fails only
the requests that needed the new chunk); it gives what it grew back once it has stood empty for
a while, and is deleted with the engine. It never grows past its limit (`EngineConfig.arena_max_bytes`, by default a fair
share of the file system: `arena_limit_bytes`); the replica admits a request only once the
blocks its capture may need fit beside those of the requests in flight, and hands read blocks
back with the batched take RPC, which loses none when it fails (both in `replicas.arena.client`).

A block holds `rows_per_block` rows of one hook of one request: the block size is a multiple of
a float32 row, so a row of any capture dtype never straddles two blocks.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import mmap
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from replicas.api import arrays

FLOAT32_ROWS_PER_BLOCK = 32
CHUNK_BLOCKS = 256  # the arena grows by this many blocks: 128 MiB for a 4096-wide model
# cudaHostRegister holds up every other CUDA call of the process while it pins (62 ms for 128 MiB
# on an H200 host: a step loop stand-in ran at half speed meanwhile, bench/gpu/register_stall.py),
# so a chunk grown while the engine serves is registered this much at a time, and the grower
# pauses between pieces (the start-up reserve goes in one piece: nothing runs yet to hold up)
PIN_PIECE_BYTES = 8 << 20
# By default the arenas of all replicas on a node may take half of the file system, split evenly
# between them (one replica per GPU, at least two shares): the other half stays for Ray's object
# store and everything else that lives in /dev/shm.
ARENA_SHARE_OF_FILE_SYSTEM = 0.5
MIN_ARENA_SHARES = 2


def arena_path(directory: str) -> str:
    return os.path.join(directory, "arena.bin")


def node_gpu_count() -> int:
    """GPUs on this node, from their device files: asking CUDA would initialize it in the
    replica's process, which breaks vLLM's forked engine process."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def arena_limit_bytes(directory: str, configured: int | None) -> int:
    """The most memory one replica's arena may take: `configured`, or by default this replica's
    share (ARENA_SHARE_OF_FILE_SYSTEM split over max(GPUs on the node, MIN_ARENA_SHARES)); never
    more than the file system holds."""
    total = shutil.disk_usage(directory).total
    if configured is None:
        configured = int(total * ARENA_SHARE_OF_FILE_SYSTEM) // max(node_gpu_count(), MIN_ARENA_SHARES)
    return min(configured, total)


def arena_geometry(max_bytes: int, block_bytes: int, chunk_blocks: int = CHUNK_BLOCKS) -> tuple[int, int]:
    """(blocks per chunk, most chunks) of an arena limited to max_bytes: chunks shrink to fit a
    small limit. The worker's arena and the replica's admission both size it with this."""
    chunk_blocks = max(1, min(chunk_blocks, max_bytes // block_bytes))
    return chunk_blocks, max_bytes // (chunk_blocks * block_bytes)


def arena_blocks(hooks: int, max_rows: int, row_bytes: int, reduce: str, block_bytes: int) -> int:
    """Blocks a capture may take in the arena at most; 0 when its rows stay in the worker's own
    arrays (a mean, or less than a block's worth of rows per hook)."""
    per_block = block_bytes // row_bytes
    if reduce == "mean" or max_rows < per_block:
        return 0
    return hooks * -(-max_rows // per_block)


def capture_arena_bytes(hooks: int, max_rows: int, row_bytes: int, d_model: int) -> int:
    """Arena memory a capture of up to max_rows rows of `hooks` hooks takes, its rows rounded up to
    whole blocks: arena_reserve_bytes for N such captures at once is N times this."""
    block_bytes = ArenaLayout.for_model("", d_model).block_bytes
    return arena_blocks(hooks, max_rows, row_bytes, "none", block_bytes) * block_bytes


@dataclass(frozen=True)
class ArenaLayout:
    path: str  # one sparse file, mapped whole by the worker and the replica
    block_bytes: int

    @classmethod
    def for_model(cls, directory: str, d_model: int) -> ArenaLayout:
        return cls(arena_path(directory), FLOAT32_ROWS_PER_BLOCK * d_model * 4)

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ArenaLayout:
        return cls(wire["path"], int(wire["block_bytes"]))

    def wire(self) -> dict[str, Any]:
        return {"path": self.path, "block_bytes": self.block_bytes}

    def rows_per_block(self, row_bytes: int) -> int:
        return self.block_bytes // row_bytes


class HostPinning(Protocol):
    """Registers arena memory with the device and copies into it (`replicas.worker.arena_writer.CudaHostMemory`)."""

    def register(self, address: int, size: int) -> None: ...

    def unregister(self, address: int, size: int) -> None: ...

    def copy(self, target: int, target_pitch: int, source: int, source_pitch: int, width: int, height: int,
             stream: int) -> None: ...


class HostArena:
    """The worker's side: hands out blocks (the step loop, under the outbox's lock), takes them
    back and shrinks (the outbox thread, under that lock), and grows ahead (its grower thread).

    The file is as large as its file system from the start but sparse: the mapping never moves
    (one numpy view serves every write), and pages are reserved a chunk at a time."""

    def __init__(self, layout: ArenaLayout, chunk_blocks: int = CHUNK_BLOCKS, max_bytes: int | None = None,
                 reserve_bytes: int = 0, pin: HostPinning | None = None):
        self.layout = layout
        self.pin = pin
        directory = os.path.dirname(layout.path)
        self.max_bytes = arena_limit_bytes(directory, max_bytes)
        self.chunk_blocks, self.max_chunks = arena_geometry(self.max_bytes, layout.block_bytes, chunk_blocks)
        self.chunk_bytes = self.chunk_blocks * layout.block_bytes
        self.pin_blocks = pin_piece_blocks(self.chunk_blocks, layout.block_bytes)  # per registration
        self.pin_bytes = self.pin_blocks * layout.block_bytes
        self.fd = os.open(layout.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        size = max(self.max_chunks * self.chunk_bytes, mmap.PAGESIZE)  # a limit below one block maps a page
        os.ftruncate(self.fd, size)
        self.bytes = np.frombuffer(mmap.mmap(self.fd, size), np.uint8)
        self.chunks = 0
        self.is_free = np.zeros(self.max_chunks * self.chunk_blocks, bool)  # True: reserved and unused
        # growers (the step loop in `allocate`, the grower thread in `grow_ahead`) and `shrink`
        # take turns here; a new chunk is published by marking its blocks free, then counting it
        self._growing = threading.Lock()
        self.largest_allocation = 0  # blocks, for `grow_ahead`'s margin
        self.growth_wanted = threading.Event()  # set by `allocate` when free blocks run below the margin
        self._allocation_waits = False  # the step loop waits for a chunk: the grower stops pausing
        self.ahead_chunks = 2  # free chunks `grow_ahead` keeps at least (0: the arena grows only on demand)
        self.whole_blocks = 0  # blocks registered at start-up, in one piece
        self._reserve(min(-(-reserve_bytes // self.chunk_bytes), self.max_chunks))
        self.kept_chunks = self.chunks

    def _reserve(self, chunks: int) -> None:
        """Reserve the first chunks now, so a first batch finds its pages faulted in like a warm
        one. On a GPU they are registered in one piece: no step loop runs yet to be held up, and
        a step's copies into them never break at a registration's edge."""
        reserved = 0
        try:
            while reserved < chunks:
                os.posix_fallocate(self.fd, reserved * self.chunk_bytes, self.chunk_bytes)
                reserved += 1
        except OSError:  # /dev/shm is fuller than the reserve: the rest comes as it is needed
            pass
        if not reserved:
            return
        self._fault_in(0, reserved, one_piece=True)
        self.whole_blocks = reserved * self.chunk_blocks
        self.is_free[: self.whole_blocks] = True
        self.chunks = reserved

    def registration(self, blocks: np.ndarray) -> np.ndarray:
        """Which registration with the device each block lies in (a copy must stay inside one):
        -1 for the start-up reserve, then one per piece of `pin_blocks`."""
        return np.where(blocks < self.whole_blocks, -1, blocks // self.pin_blocks)

    @property
    def reserved_bytes(self) -> int:
        return self.chunks * self.chunk_bytes

    @property
    def blocks_in_use(self) -> int:
        return self.chunks * self.chunk_blocks - self._free_blocks()

    def allocate(self, n: int) -> np.ndarray:
        """n consecutive block numbers, the first run that fits, growing the arena until one does:
        a capture's blocks in one piece let the replica read each hook's rows in place. An arena
        at its limit hands out scattered free blocks rather than fail (the replica admits only
        what fits in all); OSError when not even those are free."""
        if n == 0:
            return np.empty(0, np.int64)
        self.largest_allocation = max(self.largest_allocation, n)
        start = first_free_run(self.is_free[: self.chunks * self.chunk_blocks], n)
        while start < 0:
            self._allocation_waits = True
            try:
                with self._growing:  # after `grow_ahead`'s chunk, if it is reserving one
                    if first_free_run(self.is_free[: self.chunks * self.chunk_blocks], n) < 0:
                        self._grow()
            except OSError:  # at its limit: free blocks anywhere will do (the replica then copies)
                free = np.flatnonzero(self.is_free[: self.chunks * self.chunk_blocks])
                if len(free) < n:
                    raise
                self.is_free[free[:n]] = False
                return free[:n].astype(np.int64)
            finally:
                self._allocation_waits = False
            start = first_free_run(self.is_free[: self.chunks * self.chunk_blocks], n)
        self.is_free[start : start + n] = False
        if self._free_blocks() < self._margin():
            self.growth_wanted.set()
        return np.arange(start, start + n, dtype=np.int64)

    def release(self, blocks: list[int] | np.ndarray) -> None:
        self.is_free[np.asarray(blocks, np.int64)] = True

    def grow_when_asked(self) -> None:
        """A thread of its own (the Outbox starts it): `grow_ahead` each time `allocate` asks."""
        while True:
            self.growth_wanted.wait()
            self.growth_wanted.clear()
            self.grow_ahead()

    def grow_ahead(self) -> None:
        """Reserve chunks while fewer blocks are free than the margin (`ahead_chunks`, or four of
        the largest allocations seen), so the step loop seldom reserves memory itself: fallocate and
        cudaHostRegister of a 128 MiB chunk take tens of milliseconds, and registering holds up every
        CUDA call of the process, so it goes in pieces with pauses between them (`_grow`).
        Runs without the arena lock (see `_grow`), so allocations go on meanwhile."""
        while True:
            with self._growing:
                if self.chunks == self.max_chunks or self._free_blocks() >= self._margin():
                    return
                try:
                    self._grow(pause=True)
                except (OSError, RuntimeError):  # /dev/shm is full, CUDA refused: allocate says so when it must
                    return

    def _free_blocks(self) -> int:
        return int(self.is_free[: self.chunks * self.chunk_blocks].sum())

    def _margin(self) -> int:
        if not self.ahead_chunks:
            return 0
        return max(self.ahead_chunks * self.chunk_blocks, 4 * self.largest_allocation)

    def shrink(self) -> None:
        """Give the memory of the chunks beyond the reserved ones (at least one) back to the
        system; only while no block is in use (none is written or waiting for the replica)."""
        kept = max(self.kept_chunks, 1)
        with self._growing:  # not while `grow_ahead` adds a chunk
            if self.blocks_in_use or self.chunks <= kept:
                return
            self._drop_chunks(kept)

    def _drop_chunks(self, kept: int) -> None:
        if self.pin is not None:
            for address in range(self._address(kept), self._address(self.chunks), self.pin_bytes):
                self.pin.unregister(address, self.pin_bytes)
        total = self.max_chunks * self.chunk_bytes
        os.ftruncate(self.fd, kept * self.chunk_bytes)  # drops the pages beyond; the mapping stays valid
        os.ftruncate(self.fd, total)
        self.is_free[:] = False
        self.is_free[: kept * self.chunk_blocks] = True
        self.chunks = kept

    def _address(self, chunk: int) -> int:
        return self.bytes.ctypes.data + chunk * self.chunk_bytes

    def _grow(self, pause: bool = False) -> None:
        """Reserve, fault in and register one chunk more; with `pause`, wait after each piece's
        registration as long as it took, so the step loop's CUDA calls get their turn (unless the
        step loop is waiting for this very chunk)."""
        if self.chunks == self.max_chunks:
            raise OSError(
                errno.ENOSPC,
                f"the capture arena is full: {self.chunks * self.chunk_bytes} bytes in use, its limit is "
                f"{self.max_bytes} bytes (engine option arena_max_bytes)",
            )
        # reserve the pages now: a full /dev/shm is an OSError here, where a write through the
        # mapping would kill the engine core with SIGBUS
        start = self.chunks * self.chunk_bytes
        os.posix_fallocate(self.fd, start, self.chunk_bytes)
        self._fault_in(self.chunks, 1, pause=pause)
        # in this order, so a reader under the arena lock (allocate, on another thread) sees the
        # chunk whole or not at all
        first = self.chunks * self.chunk_blocks
        self.is_free[first : first + self.chunk_blocks] = True
        self.chunks += 1

    def _fault_in(self, chunk: int, chunks: int, one_piece: bool = False, pause: bool = False) -> None:
        """Fault the chunks' pages in now rather than on the first write of each: on a GPU by
        registering them (all in one piece, or each chunk piece by piece), else by zeroing them."""
        if self.pin is None:
            self.bytes[chunk * self.chunk_bytes : (chunk + chunks) * self.chunk_bytes] = 0
        elif one_piece:
            self.pin.register(self._address(chunk), chunks * self.chunk_bytes)
        else:
            for each in range(chunk, chunk + chunks):
                self._register(self._address(each), pause)

    def _register(self, address: int, pause: bool) -> None:
        """Register a chunk piece by piece; a failure unregisters the pieces done."""
        pieces = range(address, address + self.chunk_bytes, self.pin_bytes)
        for done, piece in enumerate(pieces):
            began = time.perf_counter()
            try:
                self.pin.register(piece, self.pin_bytes)
            except Exception:
                for registered in pieces[:done]:
                    self.pin.unregister(registered, self.pin_bytes)
                raise
            if pause and not self._allocation_waits:
                time.sleep(time.perf_counter() - began)


def pin_piece_blocks(chunk_blocks: int, block_bytes: int) -> int:
    """Blocks registered with CUDA at a time: at most PIN_PIECE_BYTES (or one block), a divisor of the chunk."""
    blocks = max(1, min(chunk_blocks, PIN_PIECE_BYTES // block_bytes))
    while chunk_blocks % blocks:
        blocks -= 1
    return blocks


def first_free_run(is_free: np.ndarray, n: int) -> int:
    """Where the first run of n free blocks starts; -1 when there is none."""
    if n > len(is_free):
        return -1
    counts = np.concatenate(([0], np.cumsum(is_free, dtype=np.int64)))
    starts = np.flatnonzero(counts[n:] - counts[:-n] == n)
    return int(starts[0]) if len(starts) else -1


class BlockTable:
    """Which block holds each (hook, run of rows) of every request filing into the arena:
    table[slot, hook * blocks_per_hook + row // rows_per_block]; a request's blocks are taken at
    once, as one run, when it first writes. One array, so a step's lookups for all its requests
    are one numpy gather."""

    def __init__(self) -> None:
        self.table = np.full((16, 64), -1, np.int64)
        self.free_slots = list(range(15, -1, -1))

    def add(self, blocks: np.ndarray) -> int:
        """A slot for a request whose entries are these blocks."""
        entries = len(blocks)
        capacity, width = self.table.shape
        if entries > width or not self.free_slots:
            grown = np.full((2 * capacity if not self.free_slots else capacity, max(width, entries)), -1, np.int64)
            grown[:capacity, :width] = self.table
            self.table = grown
            self.free_slots.extend(range(grown.shape[0] - 1, capacity - 1, -1))
        slot = self.free_slots.pop()
        self.table[slot, :entries] = blocks
        return slot

    def remove(self, slot: int) -> np.ndarray:
        """Forget a request; returns its row (-1 past its entries)."""
        row = self.table[slot].copy()
        self.table[slot] = -1
        self.free_slots.append(slot)
        return row


def describe(layout: ArenaLayout, blocks: np.ndarray, dtype: str, shape: tuple[int, int]) -> dict[str, Any]:
    """The wire form of one hook's rows: which blocks hold them, in order."""
    return {"dtype": dtype, "shape": list(shape), "arena": layout.wire(), "blocks": blocks.tolist()}


def stored_in(result: dict[str, Any]) -> tuple[list[int], list[str]]:
    """The arena blocks and shared-memory files that hold a worker result's arrays."""
    described = [*result.get("activations", {}).values(), result.get("logits") or {}]
    blocks = [int(block) for array in described for block in array.get("blocks", ())]
    return blocks, [array["path"] for array in described if "path" in array]


def delete_files(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:  # read (and deleted) already
            pass


HeldArena = ctypes.Array  # the arena's mapping as held by one result's arrays (`ArenaReader.hold`)


class ArenaReader:
    """The replica's side: reads a finished capture's rows out of the worker's arena file."""

    def __init__(self) -> None:
        self._files: dict[str, np.ndarray] = {}
        self._mappings: dict[str, mmap.mmap] = {}
        # what the replica's results took from the arena: viewed in place, or copied out (and how long that took)
        self.totals = {"viewed_bytes": 0, "copied_bytes": 0, "copy_s": 0.0}
        self._counting = threading.Lock()  # results are read on several threads

    def read(self, described: dict[str, Any], held: HeldArena | None = None) -> np.ndarray:
        """A hook's rows: a read-only view of `held` when its blocks are one run and `held` is
        given (nothing copied), a copy otherwise."""
        layout = ArenaLayout.from_wire(described["arena"])
        dtype = arrays.DTYPES[described["dtype"]]
        n_rows, width = (int(n) for n in described["shape"])
        row_bytes = width * dtype.itemsize
        per_block = layout.rows_per_block(row_bytes)
        blocks = np.asarray(described["blocks"], np.int64)
        in_one_run = len(blocks) > 0 and bool((np.diff(blocks) == 1).all())
        if held is not None and in_one_run:
            first = int(blocks[0]) * per_block * row_bytes
            rows = np.frombuffer(held, np.uint8, n_rows * row_bytes, first).view(dtype).reshape(n_rows, width)
            rows.flags.writeable = False  # the caller's arrays, not the worker's blocks
            self._count("viewed_bytes", rows.nbytes)
            return rows
        began = time.perf_counter()
        source = self._rows(layout.path, row_bytes)
        if in_one_run:
            out = source[blocks[0] * per_block : blocks[0] * per_block + n_rows].copy()
        else:
            out = np.empty((n_rows, row_bytes), np.uint8)
            for i, block in enumerate(blocks.tolist()):  # a block's rows are contiguous: one copy each
                n = min(per_block, n_rows - i * per_block)
                out[i * per_block : i * per_block + n] = source[block * per_block : block * per_block + n]
        self._count("copied_bytes", out.nbytes, time.perf_counter() - began)
        return out.view(dtype).reshape(n_rows, width)

    def _count(self, key: str, nbytes: int, seconds: float = 0.0) -> None:
        with self._counting:
            self.totals[key] += nbytes
            self.totals["copy_s"] += seconds

    def hold(self, path: str) -> HeldArena:
        """A handle on the whole mapping for one result's views (`read(..., held)`). Every array
        taken from it, and every view of those, keeps it alive: a finalizer on it runs once the
        last is dropped. (An ndarray cannot serve: numpy collapses chains of views to the first
        array that owns its data or the first object that is no array.)"""
        mapped = self._mappings[path]
        return (ctypes.c_char * len(mapped)).from_buffer(mapped)

    def _rows(self, path: str, row_bytes: int) -> np.ndarray:
        mapped = self._file(path)
        return mapped[: len(mapped) // row_bytes * row_bytes].reshape(-1, row_bytes)

    def attach(self, path: str) -> None:
        """Map the arena file and delete its name (no other process opens it by name later)."""
        self._file(path)
        os.unlink(path)

    def _file(self, path: str) -> np.ndarray:
        if path not in self._files:
            with open(path, "r+b") as file:  # writable only so that `hold` can export it
                self._mappings[path] = mmap.mmap(file.fileno(), 0)
            self._files[path] = np.frombuffer(self._mappings[path], np.uint8)
        return self._files[path]

