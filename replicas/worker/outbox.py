"""The host side of capture: rows copied off the device reach per-request buffers on a thread of
their own, so the engine core's step loop only starts copies and never waits for them.

The step loop (`replicas.worker.worker`) hands over, per step and per group of requests that asked for
the same hooks, one `StepRows`: a host tensor (its copy possibly still in flight, with the CUDA
event that marks its end), which rows belong to which request and where they go in its buffer
(sized once from its plan). The outbox thread waits for the copy and files the rows into the
request's own arrays. Rows of large captures are already in their blocks of the shared-memory
arena: the device wrote them there (`replicas.worker.arena_writer`), and the step loop hands over
nothing for them (each request keeps the event of its latest write, which its result waits
for). When a request finishes the thread writes its
result: arena captures as their block numbers, small arrays inline, large logits to a
shared-memory file. Work runs in the order handed over, so a result holds every step handed over
before its request finished.

Nothing waits on the thread forever: the step loop waits for room in the backlog and `take` for a
result at most `timeout_s`, after which the requests concerned fail as the replica's fault. A
top-level guard catches the thread's death: the requests it holds fail, and so does every later
one at once (`Outbox.failure`), instead of hanging the engine core.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replicas.api import arrays
from replicas.arena.host import (
    ArenaLayout,
    BlockTable,
    HostArena,
    arena_blocks,
    delete_files,
    describe,
    stored_in,
)
from replicas.worker.arena_writer import ArenaWriter, CudaHostMemory
from replicas.api.errors import OUTBOX_DEAD, OUTBOX_STUCK
from replicas.plans.request import RequestPlan
from replicas.plans.positions import captured_positions
from replicas.readouts.specs import ReadoutRows
from replicas.readouts.store import ProbeStore, ProbeStores
from replicas.readouts.specs import unpacked as readout_columns
from replicas.sae.specs import SaeRows
from replicas.sae.specs import unpacked as sae_columns

logger = logging.getLogger(__name__)

SPILL_BYTES = 64 << 10  # arrays at least this large go through a shared-memory file
# While the outbox thread files rows, the step loop must get the GIL back soon after its forward
# returns, not after the default 5 ms switch interval. (Filing small steps on the step loop
# instead measured slower on the H200: 0.88x against 0.93x at 512 concurrent requests.)
SWITCH_INTERVAL_S = 0.0002
IDLE_S = 30.0  # after this long without work the arena gives back the memory no block uses
BACKLOG_BYTES = 4 << 30  # two of the largest steps (8192 tokens x 32 layers x 4096 x bf16 = 2 GiB)
TIMEOUT_S = 60.0  # EngineConfig.outbox_timeout_s
CPU = torch.device("cpu")
STUCK, DEAD = OUTBOX_STUCK, OUTBOX_DEAD  # RequestBuffers.replica_fault


@dataclass
class RequestBuffers:
    """One request's captured rows and logits, filled by the outbox thread."""

    plan: RequestPlan
    sites: np.ndarray | None = None  # [hooks, max_rows, d] (float32 sums [hooks, 1, d] for reduce=mean); None in the arena
    logits: np.ndarray | None = None  # [max_rows, vocab] float32
    sae: list[SaeRows] = field(default_factory=list)  # one per SAE spec of the plan
    readouts: list[ReadoutRows] = field(default_factory=list)  # one per read-out of the plan
    row_shape: tuple[int, str] = (0, "float32")  # (d, dtype) of a captured row
    rows_per_block: int = 0  # > 0: rows live in the arena, this many per block
    blocks_per_hook: int = 0  # in the arena: the blocks each hook's rows take
    table_slot: int = -1  # its row of the arena's block table, once it has one
    # torch.cuda.Events of its latest writes into the arena on the copy stream and by a decode
    # step's graph on the step loop's stream (`replicas.worker.arena_graphs`); None: none, or on the CPU,
    # where writes end as they are issued. Its result is published once both are done.
    written: Any = None
    graph_written: Any = None
    n_rows: int = 0  # rows handed over (set by the step loop once the request ran its last step)
    n_logits: int = 0
    error: str | None = None
    # "" when the error is the request's own; STUCK or DEAD when the outbox failed it (the replica's fault)
    replica_fault: str = ""
    result: dict[str, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    # set when `take` gave up waiting: the outbox then frees the result itself; the lock decides
    # which of the two frees it, never both
    abandoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def for_plan(
        cls, plan: RequestPlan, d_model: int, vocab: int, arena: ArenaLayout | None, probes: ProbeStores | None = None
    ) -> RequestBuffers:
        """`probes`: the outbox's probe stores (`Outbox.probes`), where a probe's rows go."""
        buffers = cls(plan)
        buffers.sae = [SaeRows.for_plan(spec, d_model) for spec in plan.sae]
        buffers.readouts = [ReadoutRows.for_plan(readout, probes) for readout in plan.readouts]
        capture = plan.capture
        if capture is not None:
            dtype = arrays.DTYPES[capture.dtype]
            d_model = capture.width or d_model  # rows as wide as the request's widest hook
            buffers.row_shape = (d_model, capture.dtype)
            row_bytes = d_model * dtype.itemsize
            in_arena = arena is not None and arena_blocks(
                len(capture.sites), capture.max_rows, row_bytes, capture.reduce, arena.block_bytes
            )
            if capture.reduce == "mean":
                buffers.sites = np.zeros((len(capture.sites), 1, d_model), np.float32)
            elif in_arena:  # at least a block's worth per hook
                buffers.rows_per_block = arena.rows_per_block(row_bytes)
                buffers.blocks_per_hook = -(-capture.max_rows // buffers.rows_per_block)
            else:
                buffers.sites = np.empty((len(capture.sites), capture.max_rows, d_model), dtype)
        if plan.logits_positions is not None:
            buffers.logits = np.empty((plan.logits_rows, vocab), np.float32)
        return buffers

    def nbytes(self, n_rows: int, n_logits: int) -> int:
        """Host memory its first n_rows rows and n_logits logits rows take."""
        capture = self.plan.capture
        if capture is not None and capture.reduce == "mean":
            rows = self.sites.nbytes
        elif capture is not None:
            d, dtype = self.row_shape
            rows = len(capture.sites) * n_rows * d * arrays.DTYPES[dtype].itemsize
        else:
            rows = 0
        return rows + (self.logits[:n_logits].nbytes if self.logits is not None else 0)

    def fail(self, error: str, replica_fault: str = "") -> None:
        """The request fails with this error (a first error stands)."""
        if self.error is None:
            self.error, self.replica_fault = error, replica_fault

    def error_result(self) -> dict[str, Any]:
        return {"error": self.error, "replica_fault": self.replica_fault}

    def wait(self, timeout_s: float) -> dict[str, Any]:
        """The result once the outbox wrote it; after timeout_s an error that blames the replica
        (the outbox frees the result when it comes)."""
        if self.done.wait(max(timeout_s, 0.0)):
            return self.result
        with self.lock:
            if self.done.is_set():  # it came in just now
                return self.result
            self.abandoned = True
        error = "the worker's outbox thread did not deliver the result in time (engine option outbox_timeout_s)"
        return {"error": error, "replica_fault": STUCK}

    def add_rows(self, data: np.ndarray, member: int, lo: int, n: int, dest: int) -> None:
        """Rows lo:lo+n of a step's gathered [hooks, rows, d] block (a sum row per request, at
        index `member`, for reduce=mean) into rows dest:dest+n. Rows carry their destination, so
        steps may be filed in any order."""
        if self.plan.capture.reduce == "mean":
            self.sites[:, 0] += data[:, member]
        else:
            self.sites[:, dest : dest + n] = data[:, lo : lo + n]

    def add_logits(self, data: np.ndarray, lo: int, n: int, dest: int) -> None:
        self.logits[dest : dest + n] = data[0, lo : lo + n]

    def finish(self, spill_path: Any, layout: ArenaLayout | None, table_row: np.ndarray) -> dict[str, Any]:
        """The wire form of the result: arena block numbers (its `table_row` of the block table),
        or dtype, shape and bytes (no pickle), or for large arrays a shared-memory file the replica
        reads and deletes. Rows are in position order: chunks run in order and re-run rows were
        skipped by the step loop."""
        if self.error is not None:
            return self.error_result()

        def encode(name: str, array: np.ndarray) -> dict[str, Any]:
            if spill_path is not None and array.nbytes >= SPILL_BYTES:
                return arrays.to_file(array, spill_path(name))
            return dict(arrays.to_raw(array))

        activations = {}
        capture = self.plan.capture
        d, dtype = self.row_shape
        for i, (_layer, _kind, name) in enumerate(capture.sites if capture is not None else ()):
            if self.rows_per_block and self.n_rows:
                first = i * self.blocks_per_hook
                used = -(-self.n_rows // self.rows_per_block)
                hook_blocks = table_row[first : first + used]
                activations[name] = describe(layout, hook_blocks, dtype, (self.n_rows, d))
            elif self.rows_per_block:
                activations[name] = encode(name, np.empty((0, d), arrays.DTYPES[dtype]))
            elif capture.reduce == "mean":
                activations[name] = encode(name, (self.sites[i, 0] / max(self.n_rows, 1)).astype(arrays.DTYPES[dtype]))
            else:
                activations[name] = encode(name, self.sites[i, : self.n_rows])
        plan = self.plan
        return {
            "positions": captured_positions(capture.positions, plan.prompt_len, self.n_rows) if capture is not None else [],
            "activations": activations,
            "logits": encode("logits", self.logits[: self.n_logits]) if self.n_logits else None,
            "logits_positions": captured_positions(plan.logits_positions, plan.prompt_len, self.n_logits) if self.n_logits else [],
            "sae": [rows.result(plan.prompt_len) for rows in self.sae],
            "readouts": [rows.result(plan.prompt_len) for rows in self.readouts],
            "error": None,
        }


@dataclass
class StepRows:
    """One step's rows for one group of requests: `tensor` is [hooks, rows, d] on the host (its
    copy done when `event` is); request i owns rows offsets[i]:offsets[i]+counts[i]."""

    kind: str  # "rows", "logits", "sae" or "readout"
    tensor: torch.Tensor
    event: Any  # torch.cuda.Event, or None when the tensor is ready
    requests: list[RequestBuffers]
    offsets: np.ndarray
    counts: np.ndarray
    dests: np.ndarray  # where request i's rows go in its buffer
    targets: tuple[list[int], int] | None = None  # kinds "sae", "readout": (request i's spec, the block's k_max or width)
    # a probe's rows: its store and request i's region there, filed with one copy
    probe: tuple[ProbeStore, np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        """Host memory it holds until filed."""
        return self.tensor.nbytes

    def file(self) -> None:
        """Copy each request's rows into its buffer (the copy to host must be done)."""
        data = _to_numpy(self.tensor)
        if self.probe is not None:  # one copy for every request (replicas.readouts.store)
            store, regions = self.probe
            for member in store.file(regions, self.dests, self.counts, data[0]).tolist():
                self.requests[member].fail(f"capture failed in the worker: more {self.kind} rows than planned")
            return
        specs, block = [], None
        if self.kind in ("sae", "readout"):  # the block's columns as views once, not once a member
            specs, k_max = self.targets
            block = (sae_columns if self.kind == "sae" else readout_columns)(data[0], k_max)
        members = zip(self.requests, self.offsets.tolist(), self.counts.tolist(), self.dests.tolist())
        for member, (buffers, lo, n, dest) in enumerate(members):
            if buffers.error is not None:
                continue
            try:
                if self.kind == "logits":
                    buffers.add_logits(data, lo, n, dest)
                elif self.kind == "sae":
                    buffers.sae[specs[member]].add(block, lo, n, dest)
                elif self.kind == "readout":
                    buffers.readouts[specs[member]].add(block, lo, n, dest)
                else:
                    buffers.add_rows(data, member, lo, n, dest)
            except Exception as exc:  # a bookkeeping bug must fail this request, not the worker
                buffers.fail(f"capture failed in the worker: {exc!r}")


class Outbox:
    """A thread that files steps once their copy is done and writes finished results; work runs
    in the order it is handed over. It owns the arena with its writer (`writer`, used by the step
    loop, which takes blocks under `arena_lock`; this thread gives them back)."""

    def __init__(
        self,
        spill_dir: str | None,
        d_model: int,
        backlog_bytes: int = BACKLOG_BYTES,
        *,
        arena_max_bytes: int | None = None,
        arena_reserve_bytes: int = 0,
        timeout_s: float = TIMEOUT_S,
        device: torch.device = CPU,
    ):
        self.spill_dir = spill_dir  # large results go through shared memory
        self.table = BlockTable()
        self.arena_lock = threading.Lock()  # the arena and its table: the step loop takes blocks, this thread gives them back
        self.arena = self.writer = None
        self.arena_layout = None
        self.probes = ProbeStores()  # every request's probe rows, filed here
        if spill_dir:
            self._open_arena(ArenaLayout.for_model(spill_dir, d_model), arena_max_bytes, arena_reserve_bytes, device)
        self._work: queue.SimpleQueue[StepRows | tuple[str, RequestBuffers] | list[int]] = queue.SimpleQueue()
        self.busy_seconds = 0.0
        self.backlog_bytes = backlog_bytes
        self.timeout_s = timeout_s
        self._queued_bytes = 0  # host rows handed over and not filed yet
        # guards _queued_bytes and `failure`; once `failure` is set nothing more is queued
        self._filed = threading.Condition()
        self.failure: str | None = None  # why the thread died
        self._current: StepRows | tuple[str, RequestBuffers] | list[int] | None = None  # the item in hand
        self.wait_seconds = 0.0  # the step loop's, for a full backlog
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._guarded_run, name="capserve-outbox", daemon=True)
        self._thread.start()
        if self.arena is not None:  # reserves memory ahead of the step loop (HostArena.grow_ahead)
            threading.Thread(target=self.arena.grow_when_asked, name="capserve-arena-grow", daemon=True).start()

    def _open_arena(self, layout: ArenaLayout, max_bytes: int | None, reserve_bytes: int, device: torch.device) -> None:
        """The arena, registered with the device when it is a GPU that can write host memory;
        otherwise the step loop copies a step's rows to the host before it writes them."""
        pin = CudaHostMemory.load() if device.type == "cuda" else None
        try:
            arena = HostArena(layout, max_bytes=max_bytes, reserve_bytes=max(reserve_bytes, pin is not None), pin=pin)
        except RuntimeError as exc:
            if pin is None:
                raise
            logger.warning("capture rows take a copy through the host: %s", exc)
            os.unlink(layout.path)
            arena, pin = HostArena(layout, max_bytes=max_bytes, reserve_bytes=reserve_bytes), None
        if pin is not None and not arena.chunks:  # /dev/shm is full: nothing to map the device view on
            arena.pin = pin = None
        self.arena, self.arena_layout = arena, layout
        self.writer = ArenaWriter(arena, self.table, self.arena_lock, device if pin is not None else CPU)

    def put(self, rows: StepRows) -> None:
        """Queue a step's rows; while the rows not filed yet exceed the backlog the step loop
        waits here (the GPU running ahead would only pile up pinned host memory), at most
        `timeout_s`: then these rows are dropped and their requests fail, and the step loop goes on."""
        size = rows.nbytes
        with self._filed:
            if self.failure is None and self._queued_bytes and self._queued_bytes + size > self.backlog_bytes:
                began = time.perf_counter()
                self._filed.wait_for(
                    lambda: self.failure is not None or not self._queued_bytes or self._queued_bytes + size <= self.backlog_bytes,
                    timeout=self.timeout_s,
                )
                self.wait_seconds += time.perf_counter() - began
                if self.failure is None and self._queued_bytes and self._queued_bytes + size > self.backlog_bytes:
                    fail_all(rows.requests, "the worker's outbox thread did not file earlier rows in time "
                              "(engine option outbox_timeout_s)", STUCK)
                    return
            if self.failure is not None:
                fail_all(rows.requests, self.failure, DEAD)
                return
            self._queued_bytes += size
            self._work.put(rows)

    def finish(self, name: str, buffers: RequestBuffers) -> None:
        """Queue the result of a request whose steps were all handed over (its files are named
        after `name`); `buffers.done` is set when it is ready."""
        with self._filed:
            if self.failure is None:
                self._work.put((name, buffers))
                return
        buffers.fail(self.failure, DEAD)
        self._deliver(buffers, buffers.error_result())

    def release(self, blocks: list[int]) -> None:
        """Arena blocks whose rows the replica has read (or will never read)."""
        if blocks:
            self._work.put(list(blocks))

    def discard(self, result: dict[str, Any]) -> None:
        """Free what a result nobody will read holds (a sibling completion)."""
        blocks, paths = stored_in(result)
        self.release(blocks)
        delete_files(paths)

    def stats(self) -> dict[str, Any]:
        arena = self.arena
        return {
            "arena_bytes": arena.reserved_bytes if arena else 0,
            "arena_bytes_in_use": arena.blocks_in_use * arena.layout.block_bytes if arena else 0,
        }

    def _guarded_run(self) -> None:
        """The thread: should it ever die, the requests it holds fail, and so do later ones."""
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - whatever kills the thread must not hang the engine core
            self._die(f"the worker's outbox thread died ({exc!r}); captures on this replica fail until it restarts")

    def _die(self, failure: str) -> None:
        with self._filed:
            self.failure = failure
            self._filed.notify_all()  # a step loop waiting for backlog room goes on
        # nothing is queued after `failure` is set: the item in hand and the queue are all that wait
        item, self._current = self._current, None
        while item is not None or not self._work.empty():
            item = item if item is not None else self._work.get_nowait()
            if isinstance(item, StepRows):
                fail_all(item.requests, failure, DEAD)
            elif isinstance(item, tuple) and not item[1].done.is_set():
                item[1].fail(failure, DEAD)
                self._deliver(item[1], item[1].error_result())
            item = None

    def _run(self) -> None:
        while True:
            try:
                item = self._work.get(timeout=IDLE_S)
            except queue.Empty:
                if self.arena is not None:
                    with self.arena_lock:
                        self.arena.shrink()
                continue
            self._current = item
            if isinstance(item, StepRows) and item.event is not None:
                item.event.synchronize()  # releases the GIL while the copy runs
            elif isinstance(item, tuple):
                for event in (item[1].written, item[1].graph_written):
                    if event is not None:
                        event.synchronize()  # the request's last rows are in the arena
            began = time.perf_counter()
            if isinstance(item, StepRows):
                self._file(item)
            elif isinstance(item, list):
                with self.arena_lock:
                    self.arena.release(item)
            else:
                self._finish(*item)
            self._current = None
            self.busy_seconds += time.perf_counter() - began

    def _file(self, rows: StepRows) -> None:
        try:
            rows.file()
        finally:
            with self._filed:
                self._queued_bytes -= rows.nbytes
                self._filed.notify()

    def _finish(self, name: str, buffers: RequestBuffers) -> None:
        with self.arena_lock:
            table_row = self.table.remove(buffers.table_slot) if buffers.table_slot >= 0 else np.empty(0, np.int64)
        try:
            result = buffers.finish(self._spill_path(name), self.arena_layout, table_row)
        except Exception as exc:  # e.g. shared memory full
            result = {"error": f"capture could not be delivered: {exc!r}"}
        taken = table_row[table_row >= 0]
        if len(taken):  # the blocks past the rows it wrote (it stopped early), or all when it failed
            unread = np.setdiff1d(taken, stored_in(result)[0] if result.get("error") is None else [])
            with self.arena_lock:
                self.arena.release(unread)
        self._deliver(buffers, result)

    def _deliver(self, buffers: RequestBuffers, result: dict[str, Any]) -> None:
        """Hand the result to `take`, or free it if `take` gave up waiting for it."""
        with buffers.lock:
            buffers.result = result
            buffers.done.set()
            abandoned = buffers.abandoned
        if abandoned:
            self.discard(result)

    def _spill_path(self, name: str) -> Any:
        if not self.spill_dir:
            return None
        numbers = itertools.count()
        return lambda _array_name: os.path.join(self.spill_dir, f"{name}-{next(numbers)}.bin")


def fail_all(requests: list[RequestBuffers], failure: str, fault: str = "") -> None:
    for buffers in requests:
        buffers.fail(failure, fault)


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(arrays.DTYPES["bfloat16"])
    return tensor.numpy()
