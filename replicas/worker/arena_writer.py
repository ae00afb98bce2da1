"""The step loop's side of the arena: a step's captured rows go from the device straight into
their arena blocks, with no copy on the host.

On a GPU the arena's chunks are registered with CUDA as they are reserved (the start-up reserve
in one piece). A small step (decode) is written by one `index_copy_` kernel on the copy stream,
every row into its block over PCIe; a large one (prefill) by the copy engines, so that hundreds of
MB streaming to the host take no SMs from the next step's forward: a `cudaMemcpy2DAsync` per
request and step, all hooks at once (a request's blocks are one run, hook after hook), or per
hook and run of consecutive arena rows where its blocks do not allow that. The outbox
thread only waits for the copy stream before it publishes a result. On the CPU engine the same
`index_copy_` writes through a CPU view of the mapping. Before, rows went device -> pinned
staging -> a numpy scatter on the outbox thread: a host copy at a few GB/s that capped bulk
capture.

Block numbers are handed out here, on the step loop, under the outbox's lock: the outbox thread
still takes blocks back and forgets finished requests.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from replicas.arena.host import BlockTable, HostArena
from replicas.plans.positions import concatenated_ranges

REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the addresses (UVA)
MAX_PITCH_BYTES = (1 << 31) - 1  # the largest pitch cudaMemcpy2DAsync takes (cudaDevAttrMaxPitch)


class CudaHostMemory:
    """cudaHostRegister through the runtime torch already loaded: pins and maps a range of the
    arena for the device, and checks the device sees it at the host's address (UVA), which the
    one device view of the whole arena relies on."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self._copy = lib.cudaMemcpy2DAsync
        self._copy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                               ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int

    @classmethod
    def load(cls) -> CudaHostMemory | None:
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                return cls(ctypes.CDLL(name))
            except OSError:
                continue
        return None

    def register(self, address: int, size: int) -> None:
        code = self.lib.cudaHostRegister(ctypes.c_void_p(address), ctypes.c_size_t(size), ctypes.c_uint(REGISTER_PORTABLE_MAPPED))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of {size} bytes of the capture arena failed with CUDA error {code}")
        device = ctypes.c_void_p()
        code = self.lib.cudaHostGetDevicePointer(ctypes.byref(device), ctypes.c_void_p(address), ctypes.c_uint(0))
        if code != 0 or device.value != address:
            self.unregister(address, size)
            raise RuntimeError(f"the device does not see the capture arena at its host address (CUDA error {code})")

    def unregister(self, address: int, _size: int) -> None:
        self.lib.cudaHostUnregister(ctypes.c_void_p(address))

    def copy(self, target: int, target_pitch: int, source: int, source_pitch: int, width: int, height: int,
             stream: int) -> None:
        """An asynchronous copy of `height` rows of `width` bytes on `stream` (a cudaStream_t), by
        the copy engines."""
        code = self._copy(target, target_pitch, source, source_pitch, width, height, MEMCPY_DEFAULT, stream)
        if code != 0:
            raise RuntimeError(
                f"cudaMemcpy2DAsync of {height} x {width} bytes into the capture arena failed with CUDA error {code}"
            )


class _DeviceWindow:
    """`__cuda_array_interface__` of registered host memory, so torch wraps it as a CUDA tensor."""

    def __init__(self, address: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3}


def max_pitch_rows(steps: int, row_bytes: int) -> int:
    """Most arena rows between the hooks of one copy: 0 (none) when the step's own rows lie
    further apart than CUDA takes."""
    return MAX_PITCH_BYTES // row_bytes if steps * row_bytes <= MAX_PITCH_BYTES else 0


def element_type(row_bytes: int) -> torch.dtype:
    """The widest integer type a row is made of: the kernel moves a row in as few stores as it can."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def table_slots(buffers: list) -> tuple[np.ndarray, np.ndarray]:
    """Each request's row of the block table and its blocks per hook."""
    return np.array([(b.table_slot, b.blocks_per_hook) for b in buffers], np.int64).reshape(-1, 2).T


COPY_ENGINE_MIN_ROWS = 1 << 14  # arena rows (hooks x rows) from which a step's rows go by the copy engines


@dataclass
class Destinations:
    """Row r of a step goes, for hook h, to slot[r] of block blocks[h, block[r]]."""

    blocks: np.ndarray  # [hooks, blocks the step writes]
    block: np.ndarray  # [rows]
    slot: np.ndarray  # [rows]
    per_block: int

    @property
    def arena_rows_count(self) -> int:
        return self.blocks.shape[0] * len(self.block)

    def arena_rows(self) -> np.ndarray:
        """[hooks, rows]: each step row's row number in the arena (the arena read as rows of the
        capture's row size), for each hook."""
        return self.blocks[:, self.block] * self.per_block + self.slot

    def packed(self, rows: np.ndarray) -> np.ndarray:
        """The step rows to read and their arena rows, in one array: one copy to the device a
        step, because each copy costs the step loop more than its few bytes."""
        return np.concatenate([rows, self.arena_rows().ravel()])

    def index(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From `packed` (on the device where the rows are written): the step rows [rows] and
        their arena rows [hooks, rows]."""
        n = len(self.block)
        return packed[:n], packed[n:].view(self.blocks.shape[0], n)

    def runs(self, registration: Callable[[np.ndarray], np.ndarray], max_pitch_rows: int) -> Runs:
        """The copies that put the step's rows in place. Per hook, each run of step rows that lands
        on consecutive arena rows inside one registration (`registration` numbers them; CUDA
        refuses a copy across two), worked out per segment (a request's rows inside one block)
        rather than per row: a prefill step holds thousands of rows per hook but a few blocks per
        request. Then the same run of every hook becomes one 2D copy where their targets lie
        evenly apart (a request's blocks are one run: hook after hook) inside one registration,
        at most `max_pitch_rows` apart: a copy per request and step instead of per hook."""
        n = len(self.block)
        starts_segment = np.ones(n, bool)
        starts_segment[1:] = (np.diff(self.block) != 0) | (np.diff(self.slot) != 1)
        segment = np.flatnonzero(starts_segment)
        length = np.diff(np.append(segment, n))
        blocks = self.blocks[:, self.block[segment]]  # [hooks, segments]
        target = blocks * self.per_block + self.slot[segment]
        pieces = registration(blocks)
        joined = np.zeros(blocks.shape, bool)
        joined[:, 1:] = (target[:, :-1] + length[:-1] == target[:, 1:]) & (pieces[:, :-1] == pieces[:, 1:])
        hook, first = np.nonzero(~joined)  # hook by hook; each hook's first segment starts a run
        width = len(segment)
        last = np.append(hook[1:] * width + first[1:], blocks.size) - hook * width  # the next run's start, or the hook's end
        rows_before = np.concatenate([[0], np.cumsum(length)])
        runs = Runs(hook, np.ones_like(hook), segment[first], target[hook, first], np.zeros_like(hook),
                    rows_before[last] - rows_before[first])
        return runs.across_hooks(len(blocks), lambda rows: registration(rows // self.per_block), max_pitch_rows)


@dataclass
class Runs:
    """Copies of a step's rows into the arena, each `height` hooks from `hook` on: rows[i] rows
    from step row source[i] on, to arena row target[i] on for the first hook and `pitch[i]` arena
    rows further for each next one (the arena read as rows of the capture's size)."""

    hook: np.ndarray
    height: np.ndarray
    source: np.ndarray
    target: np.ndarray
    pitch: np.ndarray
    rows: np.ndarray

    def across_hooks(self, hooks: int, registration: Callable[[np.ndarray], np.ndarray], max_pitch_rows: int) -> Runs:
        """These one-hook runs with each run that every hook has alike (the same step rows,
        targets evenly apart and at least a run apart, one registration from the first row to
        the last) made one copy of `hooks` rows."""
        per_hook = len(self.hook) // hooks
        if hooks == 1 or (np.bincount(self.hook, minlength=hooks) != per_hook).any():
            return self
        source, rows, target = (a.reshape(hooks, per_hook) for a in (self.source, self.rows, self.target))
        pitch = target[1] - target[0]
        whole = ((source == source[0]).all(0) & (rows == rows[0]).all(0) & (np.diff(target, axis=0) == pitch).all(0)
                 & (pitch >= rows[0]) & (pitch <= max_pitch_rows)
                 & (registration(target[0]) == registration(target[-1] + rows[-1] - 1)))
        if not whole.any():
            return self
        apart = np.broadcast_to(~whole, (hooks, per_hook)).ravel()
        merged = whole.sum()
        return Runs(
            np.concatenate([np.zeros(merged, np.int64), self.hook[apart]]),
            np.concatenate([np.full(merged, hooks), self.height[apart]]),
            np.concatenate([source[0, whole], self.source[apart]]),
            np.concatenate([target[0, whole], self.target[apart]]),
            np.concatenate([pitch[whole], self.pitch[apart]]),
            np.concatenate([rows[0, whole], self.rows[apart]]),
        )


class ArenaWriter:
    """Writes a step's rows for the requests that file into the arena, on the device (`device`
    is the CPU when the arena is not registered with the GPU: rows then come to the host first)."""

    def __init__(self, arena: HostArena, table: BlockTable, lock: threading.Lock, device: torch.device):
        self.arena = arena
        self.table = table
        self.lock = lock
        self.device = device
        address, size = arena.bytes.ctypes.data, arena.bytes.nbytes
        self.address = address
        if device.type == "cuda":
            self.window = torch.as_tensor(_DeviceWindow(address, size), device=device)
        else:
            self.window = torch.from_numpy(arena.bytes)
        self._views: dict[int, torch.Tensor] = {}

    def destinations(self, buffers: list, counts: np.ndarray, dests: np.ndarray, hooks: int) -> Destinations:
        """Where each captured row goes: request i's counts[i] rows are its rows dests[i]...;
        a request takes all its blocks when it first writes. Raises OSError when the arena cannot
        grow (those requests fail). Computed per block, not per row: a prefill step has thousands of
        rows per hook but a handful of blocks per request."""
        per_block = buffers[0].rows_per_block  # one group: one dtype and width
        with self.lock:
            for b in buffers:
                if b.table_slot < 0:  # its first rows: all its blocks, in one run
                    b.table_slot = self.table.add(self.arena.allocate(hooks * b.blocks_per_hook))
            slots, per_hook = table_slots(buffers)
            if len(counts) == int(counts.sum()):  # one row each (counts are >= 1; decode): one block each
                return self._one_row_each(slots, per_hook, dests, hooks, per_block)
            first = dests // per_block
            n_blocks = (dests + counts - 1) // per_block - first + 1
            owner = np.repeat(np.arange(len(buffers)), n_blocks)
            entries = np.arange(hooks)[:, None] * per_hook[owner] + concatenated_ranges(first, n_blocks)
            blocks = self.table.table[slots[owner], entries]
        block_start = np.cumsum(n_blocks) - n_blocks  # where request i's blocks begin among the step's
        member = np.repeat(np.arange(len(buffers)), counts)
        row = concatenated_ranges(dests, counts)  # within each request
        return Destinations(blocks, block_start[member] + row // per_block - first[member], row % per_block, per_block)

    def decode_destinations(self, slots: np.ndarray, per_hook: np.ndarray, dests: np.ndarray, hooks: int,
                            per_block: int) -> Destinations:
        """`destinations` of a decode step (one row each) whose requests have their blocks, at
        their `table_slots`, without `destinations`' Python per request: at 512 requests ~8x less
        host time a step (`bench/bench_decode_destinations.py`)."""
        with self.lock:
            return self._one_row_each(slots, per_hook, dests, hooks, per_block)

    def _one_row_each(self, slots: np.ndarray, per_hook: np.ndarray, dests: np.ndarray, hooks: int,
                      per_block: int) -> Destinations:
        blocks = self.table.table[slots, np.arange(hooks)[:, None] * per_hook + dests // per_block]
        return Destinations(blocks, np.arange(len(dests)), dests % per_block, per_block)

    def rows_of(self, row_bytes: int) -> torch.Tensor:
        """The arena as rows of row_bytes, in the widest integer that divides them (one view per
        row size: building it costs the step loop more than the write's launch)."""
        view = self._views.get(row_bytes)
        if view is None:
            kind = element_type(row_bytes)
            usable = self.window.shape[0] // row_bytes * row_bytes
            view = self._views[row_bytes] = self.window[:usable].view(kind).view(-1, row_bytes // kind.itemsize)
        return view

    def by_copy_engine(self, destinations: Destinations) -> bool:
        """Whether a step's rows go by `copy_runs` rather than `write`: a large step (prefill) on a
        GPU. An SM kernel writing a bulk step's 537 MB over PCIe slowed matmuls beside it by ~9% on
        an H200, the copy engines by nothing, at the same ~53 GB/s (bench/gpu/copy_paths.py); a small
        step (decode) takes one kernel, cheaper than a copy per run of a row or two."""
        return self.device.type == "cuda" and destinations.arena_rows_count >= COPY_ENGINE_MIN_ROWS

    def copy_runs(self, rows: torch.Tensor, destinations: Destinations, stream: torch.cuda.Stream | None) -> None:
        """rows [hooks, n, width] (contiguous) into the arena at `destinations`, a (2D)
        `cudaMemcpyAsync` per run (`Destinations.runs`) through the arena's pinning
        (`HostPinning.copy`), on `stream`; the caller records the event the outbox waits for."""
        steps, row_bytes = rows.shape[1], rows.shape[2] * rows.element_size()
        runs = destinations.runs(self.arena.registration, max_pitch_rows(steps, row_bytes))
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        handle = stream.cuda_stream if stream is not None else 0
        source_pitch, copy, arena, base = steps * row_bytes, self.arena.pin.copy, self.address, rows.data_ptr()
        for hook, height, source, target, pitch, n in zip(*(a.tolist() for a in (runs.hook, runs.height, runs.source,
                                                                                   runs.target, runs.pitch, runs.rows))):
            width = n * row_bytes
            flat = height == 1  # pitches matter only between a copy's rows
            copy(arena + target * row_bytes, width if flat else pitch * row_bytes, base + (hook * steps + source) * row_bytes,
                 width if flat else source_pitch, width, height, handle)
        if stream is not None:
            rows.record_stream(stream)  # its memory is not reused before the copies end

    def write(self, rows: torch.Tensor, index: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """rows [hooks, n, width] (contiguous) into arena rows index ([hooks * n], on the device),
        on `stream` (a side stream on a GPU, so the next step does not wait for it); the caller
        records the event the outbox waits for."""
        if rows.device != self.window.device:
            rows, index, stream = rows.cpu(), index.cpu(), None
        target = self.rows_of(rows.shape[-1] * rows.element_size())
        source = rows.reshape(-1, rows.shape[-1]).view(target.dtype)
        if stream is None:
            target.index_copy_(0, index, source)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                target.index_copy_(0, index, source)
            rows.record_stream(stream)  # their memory is not reused before the kernel ends
            index.record_stream(stream)
