"""The step loop's arena writer on its own: runs of arena rows, and on a GPU (the GPU suite) the
copy engines and the kernel against each other on registered host memory."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from replicas.arena_writer import consecutive_runs
from replicas.outbox import Outbox, RequestBuffers
from tests.test_arena import D_MODEL, HOOKS, request_plan


def test_runs_break_where_arena_rows_jump_and_where_registrations_meet():
    targets = np.array([5, 6, 7, 20, 21, 3, 30, 31, 32, 33])
    starts, firsts, lengths = consecutive_runs(targets, row_bytes=8, pin_bytes=8 * 32)  # registrations of 32 rows
    assert starts.tolist() == [0, 3, 5, 6, 8] and firsts.tolist() == [5, 20, 3, 30, 32] and lengths.tolist() == [3, 2, 1, 2, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy engines write registered host memory: GPU suite")
@pytest.mark.parametrize("pin_piece_bytes", [8 << 20, 4 << 10])
def test_on_a_gpu_the_copy_engines_and_the_kernel_put_every_row_where_the_reader_looks(monkeypatch, pin_piece_bytes):
    """Whole chunks registered at once, or in pieces of 4 blocks (CUDA refuses a copy across two
    registrations; the kernel writes across them)."""
    monkeypatch.setattr("replicas.arena.PIN_PIECE_BYTES", pin_piece_bytes)
    device = torch.device("cuda")
    torch.cuda.init()
    shared = tempfile.TemporaryDirectory(dir="/dev/shm")  # where replicas keep their arena: CUDA pins its pages
    outbox = Outbox(shared.name, D_MODEL, arena_max_bytes=1 << 20, device=device)
    writer = outbox.writer
    assert writer.device.type == "cuda", "the arena was not registered with the GPU"
    plan = request_plan(prompt_len=200, max_tokens=1)
    buffers = [RequestBuffers.for_plan(plan, D_MODEL, 16, outbox.arena_layout) for _ in range(3)]
    counts, dests = np.array([130, 70, 200]), np.array([0, 0, 0])
    destinations = writer.destinations(buffers, counts, dests, len(HOOKS))
    arena_rows = destinations.arena_rows()
    rows = torch.randn(len(HOOKS), int(counts.sum()), D_MODEL, device=device)
    stream = torch.cuda.Stream(device)
    landed = outbox.arena.bytes[: (int(arena_rows.max()) + 1) * D_MODEL * 4].view(np.float32).reshape(-1, D_MODEL)
    writer.copy_runs(rows, arena_rows, stream)
    stream.synchronize()
    np.testing.assert_array_equal(landed[arena_rows], rows.cpu().numpy())
    landed[:] = 0
    writer.write(rows, torch.from_numpy(arena_rows).to(device).reshape(-1), stream)
    stream.synchronize()
    np.testing.assert_array_equal(landed[arena_rows], rows.cpu().numpy())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graphs write registered host memory: GPU suite")
def test_on_a_gpu_a_decode_steps_graph_writes_exactly_its_rows_step_after_step():
    """Two hooks, the second narrower (zero-padded); steps of 3, 8 and 5 rows share the 8-row
    graph, more steps than its ring of pinned index buffers; each step lands its rows and nothing else."""
    from types import SimpleNamespace

    from replicas.arena_graphs import RING, ArenaGraphs

    device = torch.device("cuda")
    shared = tempfile.TemporaryDirectory(dir="/dev/shm")
    outbox = Outbox(shared.name, D_MODEL, arena_max_bytes=1 << 20, device=device)
    graphs = ArenaGraphs(outbox.writer, device)
    sites = [SimpleNamespace(staging=torch.zeros(64, D_MODEL, device=device)),
             SimpleNamespace(staging=torch.zeros(64, D_MODEL // 2, device=device))]
    landed = outbox.arena.bytes[: 512 * D_MODEL * 4].view(np.float32).reshape(-1, D_MODEL)
    rng = np.random.default_rng(0)
    assert graphs.takes(sites, 8, D_MODEL, torch.float32) and not graphs.takes(sites, 200, D_MODEL, torch.float32)
    for n in [3, 8, 5] * (RING + 1):
        for site in sites:
            site.staging.copy_(torch.randn(site.staging.shape, device=device))
        step_rows = rng.choice(64, n, replace=False)
        arena_rows = rng.choice(512, (2, n), replace=False)
        landed[:] = 0
        graphs.write(sites, D_MODEL, torch.float32, step_rows, arena_rows).synchronize()
        expected = np.zeros_like(landed)
        expected[arena_rows[0]] = sites[0].staging[torch.from_numpy(step_rows).to(device)].cpu().numpy()
        expected[arena_rows[1], : D_MODEL // 2] = sites[1].staging[torch.from_numpy(step_rows).to(device)].cpu().numpy()
        np.testing.assert_array_equal(landed, expected)
    assert len(graphs._graphs) == 1  # one bucket, one hook set
