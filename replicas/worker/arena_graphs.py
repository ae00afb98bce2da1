"""A decode step's capture rows into the arena by one CUDA graph replay.

At a few dozen requests a decode step lasts a few milliseconds on the GPU, and the step loop's
own Python shows in throughput: gathering a step's rows from the staging buffers and writing them
into the arena took ~15 torch calls (index copy, gather, stream switches, the write kernel), each
10-40 µs of CPU on an H200 host. Here those ops are captured once per hook set, capture dtype and
size bucket, into a graph that reads its rows from a static index buffer, so a step costs one copy
of that index (from a pinned ring, with no allocation), one replay and one event.

A bucket holds up to K step rows; a step of n < K rows repeats its last (row, arena row) pair in
the unused entries, so the padding rewrites that row with the same bytes. The graph runs on the
step loop's stream, before the next forward: it reads staging buffers that forward overwrites.
That is why only small steps take it (`takes`): up to a decode step of 512 requests' rows of one
hook (4 MB of an 8B model's bf16 rows, ~80 µs over PCIe in a ~10 ms step); by the side stream such
steps ran ~0.8 ms longer each when capturing (H200, 512 x (512 + 128), `bench_side_by_side`).
Larger steps keep `ArenaWriter`'s side-stream writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from replicas.worker.arena_writer import ArenaWriter
from replicas.worker.sites import Site, stacked_rows

BUCKETS = (8, 16, 32, 64, 128, 256, 512)  # step rows per graph
MAX_ARENA_ROWS = BUCKETS[-1]  # hooks x rows of a step that goes by a graph
MAX_GRAPHS = 64  # a replica asked for more hook sets than this writes the others as before
RING = 4  # pinned index buffers per graph; the step loop runs at most two steps ahead of the GPU


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    index: torch.Tensor  # on the device [1 + hooks, K]: the step rows, then each hook's arena rows
    host: list[torch.Tensor]  # RING pinned [1 + hooks, K]: where each step's index comes from
    written: list[torch.cuda.Event | None] = field(default_factory=lambda: [None] * RING)
    turn: int = 0

    def __post_init__(self) -> None:
        self.host_arrays = [h.numpy() for h in self.host]  # the same memory, filled without torch calls


class ArenaGraphs:
    """The step loop's graphs of small arena writes, one per (hooks, width, dtype, bucket)."""

    def __init__(self, writer: ArenaWriter, device: torch.device):
        self.writer = writer
        self.device = device
        self._graphs: dict[tuple, _Graph] = {}

    def takes(self, sites: list[Site], rows: int, width: int, out: torch.dtype) -> bool:
        """Whether a step of `rows` rows of these hooks goes by a graph."""
        if len(sites) * rows > MAX_ARENA_ROWS:
            return False
        return len(self._graphs) < MAX_GRAPHS or _key(sites, width, out, _bucket(rows)) in self._graphs

    def write(self, sites: list[Site], width: int, out: torch.dtype, step_rows: np.ndarray, arena_rows: np.ndarray) -> torch.cuda.Event:
        """Step rows step_rows [n] of each site into arena rows arena_rows [hooks, n]; returns the
        event recorded after the write (the outbox waits for it before it publishes)."""
        n = len(step_rows)
        key = _key(sites, width, out, _bucket(n))
        graph = self._graphs.get(key) or self._capture(key, sites, width, out)
        turn = graph.turn % RING
        graph.turn += 1
        if graph.written[turn] is not None:  # the copy that last read this pinned buffer ended long ago
            graph.written[turn].synchronize()
        host = graph.host_arrays[turn]
        host[0, :n], host[1:, :n] = step_rows, arena_rows
        host[:, n:] = host[:, n - 1 : n]  # padding: the last pair again
        graph.index.copy_(graph.host[turn], non_blocking=True)
        graph.graph.replay()
        event = graph.written[turn] = torch.cuda.Event()
        event.record()
        return event

    def _capture(self, key: tuple, sites: list[Site], width: int, out: torch.dtype) -> _Graph:
        """Record the gather and the write once, on a side stream (vLLM's step goes on after it)."""
        k, hooks = key[-1], len(sites)
        index = torch.zeros((1 + hooks, k), dtype=torch.int64, device=self.device)
        host = list(torch.zeros((RING, 1 + hooks, k), dtype=torch.int64).pin_memory().unbind())
        target = self.writer.rows_of(width * out.itemsize)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(torch.cuda.Stream(self.device)):  # capturing runs nothing: no stream waits
            graph.capture_begin(capture_error_mode="thread_local")  # the outbox thread may wait on events meanwhile
            block = stacked_rows(sites, index[0], width).to(out)
            target.index_copy_(0, index[1:].reshape(-1), block.reshape(-1, width).view(target.dtype))
            graph.capture_end()
        self._graphs[key] = _Graph(graph, index, host)
        return self._graphs[key]


def _bucket(rows: int) -> int:
    return next(b for b in BUCKETS if b >= rows)


def _key(sites: list[Site], width: int, out: torch.dtype, bucket: int) -> tuple:
    return (tuple(map(id, sites)), width, out, bucket)

