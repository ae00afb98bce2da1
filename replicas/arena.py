"""Host memory for large captures: blocks of one shared-memory file, reused across requests.

Fresh memory is what moving activations costs: the first write to a new shared-memory page ran
at ~1.2 GB/s on the CI machine where a copy into pages written before ran at ~10 GB/s
(`python -m bench.bench_host_path` compares the two designs). So the worker keeps its arena: the
outbox thread scatters each step's rows of every large capture into blocks (one numpy scatter
per step, whatever the number of requests), a finished capture is described by its block
numbers, the replica copies its rows out (`ArenaReader`) and hands the numbers back with its next
`capserve_take`, and the blocks go to the next request. The arena reserves memory a chunk at a
time when every block is in use (a full /dev/shm fails only the requests that needed the new
chunk), gives all but one chunk back once it has stood empty for a while, and is deleted with
the engine.

A block holds `rows_per_block` rows of one hook of one request: the block size is a multiple of
a float32 row, so a row of any capture dtype never straddles two blocks.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from replicas import arrays

FLOAT32_ROWS_PER_BLOCK = 32
CHUNK_BLOCKS = 256  # the arena grows by this many blocks: 128 MiB for a 4096-wide model
COPY_THREADS = min(4, os.cpu_count() or 1)
PARALLEL_COPY_BYTES = 16 << 20  # a step's rows are split into parts of at least this size


def arena_path(directory: str) -> str:
    return os.path.join(directory, "arena.bin")


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


class HostArena:
    """The worker's side: hands out blocks and writes rows into them. Used by the outbox thread only.

    The file is as large as its file system from the start but sparse: the mapping never moves
    (one numpy view serves every write), and pages are reserved a chunk at a time."""

    def __init__(self, layout: ArenaLayout, chunk_blocks: int = CHUNK_BLOCKS):
        self.layout = layout
        self.chunk_blocks = chunk_blocks
        self.chunk_bytes = chunk_blocks * layout.block_bytes
        directory = os.path.dirname(layout.path)
        self.max_chunks = shutil.disk_usage(directory).total // self.chunk_bytes
        self.fd = os.open(layout.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, self.max_chunks * self.chunk_bytes)
        self.bytes = np.frombuffer(mmap.mmap(self.fd, self.max_chunks * self.chunk_bytes), np.uint8)
        self.chunks = 0
        self.free: list[int] = []
        self._copiers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="capserve-arena")

    @property
    def reserved_bytes(self) -> int:
        return self.chunks * self.chunk_bytes

    @property
    def blocks_in_use(self) -> int:
        return self.chunks * self.chunk_blocks - len(self.free)

    def allocate(self, n: int) -> np.ndarray:
        """n block numbers; raises OSError when shared memory cannot hold another chunk."""
        while len(self.free) < n:
            self._grow()
        taken = self.free[len(self.free) - n :]
        del self.free[len(self.free) - n :]
        return np.array(taken, np.int64)

    def release(self, blocks: list[int] | np.ndarray) -> None:
        self.free.extend(int(b) for b in blocks)

    def write(self, blocks: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
        """rows[i] (a [n, row_bytes] uint8 array) into slot slots[i] of block blocks[i]; a large
        step in parts on several threads (numpy lets go of the GIL while it copies)."""
        row_bytes = rows.shape[1]
        target = self.bytes.reshape(-1, row_bytes)
        index = blocks * self.layout.rows_per_block(row_bytes) + slots
        parts = min(COPY_THREADS, rows.nbytes // PARALLEL_COPY_BYTES)
        if parts <= 1:
            target[index] = rows
            return
        bounds = np.linspace(0, len(rows), parts + 1).astype(int).tolist()

        def copy(lo: int, hi: int) -> None:
            target[index[lo:hi]] = rows[lo:hi]

        list(self._copiers.map(copy, bounds[:-1], bounds[1:]))

    def shrink(self) -> None:
        """Give the memory of every chunk but the first back to the system; only while no block
        is in use (none is written or waiting for the replica)."""
        if self.blocks_in_use or self.chunks <= 1:
            return
        total = self.max_chunks * self.chunk_bytes
        os.ftruncate(self.fd, self.chunk_bytes)  # drops the pages beyond; the mapping stays valid
        os.ftruncate(self.fd, total)
        self.free = list(range(self.chunk_blocks - 1, -1, -1))
        self.chunks = 1

    def _grow(self) -> None:
        if self.chunks == self.max_chunks:
            raise OSError(errno.ENOSPC, f"the capture arena fills {self.layout.path}'s file system")
        # reserve the pages now: a full /dev/shm is an OSError here, where a write through the
        # mapping would kill the engine core with SIGBUS
        os.posix_fallocate(self.fd, self.chunks * self.chunk_bytes, self.chunk_bytes)
        first = self.chunks * self.chunk_blocks
        self.free.extend(range(first + self.chunk_blocks - 1, first - 1, -1))
        self.chunks += 1


class BlockTable:
    """Which block holds each (hook, run of rows) of every request filing into the arena:
    table[slot, hook * blocks_per_hook + row // rows_per_block], -1 until first written. One
    array, so a step's lookups for all its requests are one numpy gather."""

    def __init__(self) -> None:
        self.table = np.full((16, 64), -1, np.int64)
        self.free_slots = list(range(15, -1, -1))

    def add(self, entries: int) -> int:
        """A slot for a request with this many entries."""
        capacity, width = self.table.shape
        if entries > width or not self.free_slots:
            grown = np.full((2 * capacity if not self.free_slots else capacity, max(width, entries)), -1, np.int64)
            grown[:capacity, :width] = self.table
            self.table = grown
            self.free_slots.extend(range(grown.shape[0] - 1, capacity - 1, -1))
        return self.free_slots.pop()

    def remove(self, slot: int) -> np.ndarray:
        """Forget a request; returns its row (-1 where it wrote nothing)."""
        row = self.table[slot].copy()
        self.table[slot] = -1
        self.free_slots.append(slot)
        return row

    def fill(self, arena: HostArena, slots: np.ndarray, entries: np.ndarray) -> np.ndarray:
        """The blocks at (slots, entries) (arrays of one shape), allocating those not written yet."""
        blocks = self.table[slots, entries]
        missing = blocks < 0
        if missing.any():
            width = self.table.shape[1]
            wanted, inverse = np.unique(slots[missing] * width + entries[missing], return_inverse=True)
            fresh = arena.allocate(len(wanted))
            self.table[wanted // width, wanted % width] = fresh
            blocks[missing] = fresh[inverse.reshape(-1)]
        return blocks


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


class ArenaReader:
    """The replica's side: copies a finished capture's rows out of the worker's arena file."""

    def __init__(self) -> None:
        self._files: dict[str, np.ndarray] = {}

    def read(self, described: dict[str, Any]) -> np.ndarray:
        layout = ArenaLayout.from_wire(described["arena"])
        dtype = arrays.DTYPES[described["dtype"]]
        n_rows, width = (int(n) for n in described["shape"])
        row_bytes = width * dtype.itemsize
        per_block = layout.rows_per_block(row_bytes)
        rows = self._file(layout.path).reshape(-1, row_bytes)
        out = np.empty((n_rows, row_bytes), np.uint8)
        for i, block in enumerate(described["blocks"]):  # a block's rows are contiguous: one copy each
            n = min(per_block, n_rows - i * per_block)
            out[i * per_block : i * per_block + n] = rows[block * per_block : block * per_block + n]
        return out.view(dtype).reshape(n_rows, width)

    def attach(self, path: str) -> None:
        """Map the arena file and delete its name (no other process opens it by name later)."""
        self._file(path)
        os.unlink(path)

    def _file(self, path: str) -> np.ndarray:
        if path not in self._files:
            with open(path, "rb") as file:
                self._files[path] = np.frombuffer(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
        return self._files[path]
