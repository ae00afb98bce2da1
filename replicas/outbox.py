"""The host side of capture: rows copied off the device reach per-request buffers on a thread of
their own, so the engine core's step loop only starts copies and never waits for them.

The step loop (`replicas.worker`) hands over, per step and per group of requests that asked for
the same hooks, one `StepRows`: a host tensor (its copy possibly still in flight, with the CUDA
event that marks its end), which rows belong to which request and where they go in its buffer
(sized once from its plan). The outbox thread waits for the copy, files each request's rows, and
when the request finishes writes its result: small arrays inline, large ones to shared-memory
files the replica reads. Work runs in the order handed over, so a result holds every step handed
over before its request finished.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replicas import arrays
from replicas.plans import RequestPlan

SPILL_BYTES = 64 << 10  # arrays at least this large go through a shared-memory file
# While the outbox thread files rows, the step loop must get the GIL back soon after its forward
# returns, not after the default 5 ms switch interval. (Filing small steps on the step loop
# instead measured slower on the H200: 0.88x against 0.93x at 512 concurrent requests.)
SWITCH_INTERVAL_S = 0.0002


@dataclass
class RequestBuffers:
    """One request's captured rows, logits and their positions, filled by the outbox thread."""

    plan: RequestPlan
    sites: np.ndarray | None = None  # [hooks, max_rows, d] (or float32 sums [hooks, 1, d] for reduce=mean)
    positions: np.ndarray | None = None
    logits: np.ndarray | None = None  # [max_rows, vocab] float32
    logits_positions: np.ndarray | None = None
    n_rows: int = 0  # rows handed over so far (set by the step loop)
    n_logits: int = 0
    error: str | None = None
    result: dict[str, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def for_plan(cls, plan: RequestPlan, d_model: int, vocab: int) -> RequestBuffers:
        buffers = cls(plan)
        capture = plan.capture
        if capture is not None:
            if capture.reduce == "mean":
                buffers.sites = np.zeros((len(capture.sites), 1, d_model), np.float32)
            else:
                buffers.sites = np.empty((len(capture.sites), capture.max_rows, d_model), arrays.DTYPES[capture.dtype])
            buffers.positions = np.empty(capture.max_rows, np.int64)
        if plan.logits_positions is not None:
            buffers.logits = np.empty((plan.logits_rows, vocab), np.float32)
            buffers.logits_positions = np.empty(plan.logits_rows, np.int64)
        return buffers

    def nbytes(self) -> int:
        rows = self.sites[:, : self.n_rows].nbytes if self.sites is not None else 0
        return rows + (self.logits[: self.n_logits].nbytes if self.logits is not None else 0)

    def add_rows(self, data: np.ndarray, member: int, lo: int, n: int, dest: int, positions: np.ndarray) -> None:
        """Rows lo:lo+n of a step's gathered [hooks, rows, d] block (a sum row per request, at
        index `member`, for reduce=mean) into rows dest:dest+n. Rows carry their destination, so
        steps may be filed in any order."""
        if self.plan.capture.reduce == "mean":
            self.sites[:, 0] += data[:, member]
        else:
            self.sites[:, dest : dest + n] = data[:, lo : lo + n]
        self.positions[dest : dest + n] = positions[lo : lo + n]

    def add_logits(self, data: np.ndarray, lo: int, n: int, dest: int, positions: np.ndarray) -> None:
        self.logits[dest : dest + n] = data[0, lo : lo + n]
        self.logits_positions[dest : dest + n] = positions[lo : lo + n]

    def finish(self, spill_path: Any) -> dict[str, Any]:
        """The wire form of the result: dtype, shape and bytes (no pickle), or for large arrays a
        shared-memory file the replica reads and deletes. Rows are in position order: chunks run
        in order and re-run rows were skipped by the step loop."""

        def encode(name: str, array: np.ndarray) -> dict[str, Any]:
            if spill_path is not None and array.nbytes >= SPILL_BYTES:
                return arrays.to_file(array, spill_path(name))
            return dict(arrays.to_raw(array))

        activations = {}
        capture = self.plan.capture
        for i, (_layer, _kind, name) in enumerate(capture.sites if capture is not None else ()):
            if capture.reduce == "mean":
                array = (self.sites[i, 0] / max(self.n_rows, 1)).astype(arrays.DTYPES[capture.dtype])
            else:
                array = self.sites[i, : self.n_rows]
            activations[name] = encode(name, array)
        return {
            "positions": self.positions[: self.n_rows].tolist() if self.positions is not None else [],
            "activations": activations,
            "logits": encode("logits", self.logits[: self.n_logits]) if self.n_logits else None,
            "logits_positions": self.logits_positions[: self.n_logits].tolist() if self.n_logits else [],
            "error": self.error,
        }


@dataclass
class StepRows:
    """One step's rows for one group of requests: `tensor` is [hooks, rows, d] on the host (its
    copy done when `event` is); request i owns rows offsets[i]:offsets[i]+counts[i]."""

    kind: str  # "rows" or "logits"
    tensor: torch.Tensor
    event: Any  # torch.cuda.Event, or None when the tensor is ready
    requests: list[RequestBuffers]
    offsets: np.ndarray
    counts: np.ndarray
    dests: np.ndarray  # where request i's rows go in its buffer
    positions: np.ndarray  # absolute position of every row

    def file(self) -> None:
        """Copy each request's rows into its buffer (the copy to host must be done)."""
        data = _to_numpy(self.tensor)
        members = zip(self.requests, self.offsets.tolist(), self.counts.tolist(), self.dests.tolist())
        for member, (buffers, lo, n, dest) in enumerate(members):
            if buffers.error is not None:
                continue
            try:
                if self.kind == "logits":
                    buffers.add_logits(data, lo, n, dest, self.positions)
                else:
                    buffers.add_rows(data, member, lo, n, dest, self.positions)
            except Exception as exc:  # a bookkeeping bug must fail this request, not the worker
                buffers.error = f"capture failed in the worker: {exc!r}"


class Outbox:
    """A thread that files steps once their copy is done and writes finished results; work runs
    in the order it is handed over."""

    def __init__(self, spill_dir: str | None):
        self.spill_dir = spill_dir  # large results go through shared memory
        self._work: queue.SimpleQueue[StepRows | tuple[str, RequestBuffers]] = queue.SimpleQueue()
        self.busy_seconds = 0.0
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="capserve-outbox", daemon=True)
        self._thread.start()

    def put(self, rows: StepRows) -> None:
        self._work.put(rows)

    def finish(self, name: str, buffers: RequestBuffers) -> None:
        """Queue the result of a request whose steps were all handed over (its files are named
        after `name`); `buffers.done` is set when it is ready."""
        self._work.put((name, buffers))

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if isinstance(item, StepRows) and item.event is not None:
                item.event.synchronize()  # releases the GIL while the copy runs
            began = time.perf_counter()
            if isinstance(item, StepRows):
                item.file()
            else:
                self._finish(*item)
            self.busy_seconds += time.perf_counter() - began

    def _finish(self, name: str, buffers: RequestBuffers) -> None:
        try:
            buffers.result = buffers.finish(self._spill_path(name))
        except Exception as exc:  # e.g. shared memory full
            buffers.result = {"error": f"capture could not be delivered: {exc!r}"}
        finally:
            buffers.done.set()

    def _spill_path(self, name: str) -> Any:
        if not self.spill_dir:
            return None
        numbers = itertools.count()
        return lambda _array_name: os.path.join(self.spill_dir, f"{name}-{next(numbers)}.bin")


def discard(result: dict[str, Any]) -> None:
    """Delete the shared-memory files of a result nobody will read (a sibling completion)."""
    described = [*result.get("activations", {}).values(), result.get("logits") or {}]
    for array in described:
        if "path" in array:
            os.unlink(array["path"])


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(arrays.DTYPES["bfloat16"])
    return tensor.numpy()
