"""The arena's host path without an engine, for the arena and outbox tests: a request's plan, a
real collector and outbox filing steps in the calling thread, and a memmove standing in for CUDA's
copy engines."""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import numpy as np
import torch

from replicas.api import GenerateRequest
from replicas.arena.host import ArenaReader, stored_in
from replicas.worker.collector import Collector
from replicas.worker.spec_select import Selection
from replicas.worker.outbox import Outbox, RequestBuffers, StepRows
from replicas.plans.request import RequestPlan, build_wire_plan

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


def shm_bytes(path: str) -> int:
    """Memory a file holds (the arena's size is the file system's: it is sparse)."""
    return os.stat(path).st_blocks * 512
