"""The step loop's arena writer on its own: runs of arena rows, and on a GPU (the GPU suite) the
copy engines and the kernel against each other on registered host memory."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from replicas.worker.arena_writer import Destinations, max_pitch_rows
from replicas.worker.outbox import Outbox, RequestBuffers
from tests.arena_host import D_MODEL, HOOKS, request_plan


def test_runs_join_a_requests_consecutive_blocks_and_break_at_jumps_and_registrations():
    """Two hooks, blocks of 4 rows, registrations of 4 blocks. Request A's 7 rows start at its
    row 2 (blocks 10, 11, 12 for hook 0: 10 and 11 are one registration, 12 the next; blocks 20,
    21, 22 for hook 1, one run); request B's 3 rows go to block 5 (hook 0) and 40 (hook 1). The
    hooks' runs differ, so each goes by a copy of its own."""
    destinations = Destinations(
        blocks=np.array([[10, 11, 12, 5], [20, 21, 22, 40]]),
        block=np.array([0, 0, 1, 1, 1, 1, 2, 3, 3, 3]),
        slot=np.array([2, 3, 0, 1, 2, 3, 0, 0, 1, 2]),
        per_block=4,
    )
    runs = destinations.runs(lambda blocks: blocks // 4, max_pitch_rows=1000)
    assert runs.hook.tolist() == [0, 0, 0, 1, 1] and runs.height.tolist() == [1] * 5
    assert runs.source.tolist() == [0, 6, 7, 0, 7]
    assert runs.target.tolist() == [42, 48, 20, 82, 160]
    assert runs.rows.tolist() == [6, 1, 3, 7, 3]
    assert_runs_cover(destinations, runs)


def test_a_requests_run_on_every_hook_goes_by_one_copy_where_its_blocks_allow():
    """Three hooks, blocks of 4 rows. Request A's blocks are one run, hook after hook (3 blocks a
    hook from block 100): its 8 rows go by one copy of three hooks 12 rows apart. Request B's blocks
    lie unevenly: a copy per hook. No copy of several hooks across two registrations, or with
    its hooks further apart than CUDA takes."""
    a = np.array([[100, 101, 102], [103, 104, 105], [106, 107, 108]])
    destinations = Destinations(
        blocks=np.concatenate([a, np.array([[7], [9], [30]])], axis=1),
        block=np.array([0, 0, 1, 1, 1, 1, 2, 2, 3]),
        slot=np.array([2, 3, 0, 1, 2, 3, 0, 1, 0]),
        per_block=4,
    )
    runs = destinations.runs(lambda blocks: np.full_like(blocks, -1), max_pitch_rows=1000)
    assert list(zip(runs.hook, runs.height, runs.source, runs.target, runs.pitch, runs.rows)) == [
        (0, 3, 0, 402, 12, 8), (0, 1, 8, 28, 0, 1), (1, 1, 8, 36, 0, 1), (2, 1, 8, 120, 0, 1)]
    assert_runs_cover(destinations, runs)
    for registration, pitch_limit in [(lambda blocks: blocks // 106, 1000), (lambda blocks: blocks * 0, 11)]:
        apart = destinations.runs(registration, pitch_limit)
        assert apart.height.tolist() == [1] * 6
        assert_runs_cover(destinations, apart)
    assert max_pitch_rows(steps=1000, row_bytes=8192) == ((1 << 31) - 1) // 8192
    assert max_pitch_rows(steps=300_000, row_bytes=8192) == 0  # a hook's own rows span more than a pitch


def assert_runs_cover(destinations: Destinations, runs) -> None:
    """The runs put every step row of every hook where `arena_rows` says, once."""
    arena_rows = destinations.arena_rows()
    covered = np.zeros(arena_rows.shape, int)
    for hook, height, source, target, pitch, n in zip(runs.hook, runs.height, runs.source, runs.target, runs.pitch, runs.rows):
        for h in range(height):
            assert arena_rows[hook + h, source : source + n].tolist() == list(range(target + h * pitch, target + h * pitch + n))
            covered[hook + h, source : source + n] += 1
    assert (covered == 1).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy engines write registered host memory: GPU suite")
@pytest.mark.parametrize("pin_piece_bytes", [8 << 20, 4 << 10])
def test_on_a_gpu_the_copy_engines_and_the_kernel_put_every_row_where_the_reader_looks(monkeypatch, pin_piece_bytes):
    """Rows past the start-up reserve (registered whole), in chunks registered whole or in pieces
    of 4 blocks (CUDA refuses a copy across two registrations; the kernel writes across them)."""
    monkeypatch.setattr("replicas.arena.host.PIN_PIECE_BYTES", pin_piece_bytes)
    device = torch.device("cuda")
    torch.cuda.init()
    shared = tempfile.TemporaryDirectory(dir="/dev/shm")  # where replicas keep their arena: CUDA pins its pages
    outbox = Outbox(shared.name, D_MODEL, arena_max_bytes=1 << 20, device=device)
    writer = outbox.writer
    assert writer.device.type == "cuda", "the arena was not registered with the GPU"
    assert outbox.arena.chunks == 1 and outbox.arena.whole_blocks == outbox.arena.chunk_blocks
    outbox.arena.allocate(outbox.arena.chunk_blocks)  # the reserve, held: the captures land in grown chunks
    plan = request_plan(prompt_len=200, max_tokens=1)
    buffers = [RequestBuffers.for_plan(plan, D_MODEL, 16, outbox.arena_layout) for _ in range(3)]
    counts, dests = np.array([130, 70, 200]), np.array([0, 0, 0])
    destinations = writer.destinations(buffers, counts, dests, len(HOOKS))
    arena_rows = destinations.arena_rows()
    rows = torch.randn(len(HOOKS), int(counts.sum()), D_MODEL, device=device)
    stream = torch.cuda.Stream(device)
    landed = outbox.arena.bytes[: (int(arena_rows.max()) + 1) * D_MODEL * 4].view(np.float32).reshape(-1, D_MODEL)
    runs = destinations.runs(outbox.arena.registration, max_pitch_rows(rows.shape[1], D_MODEL * 4))
    assert (runs.height > 1).any() == (pin_piece_bytes > 4 << 10)  # in small pieces a copy of several hooks never fits
    writer.copy_runs(rows, destinations, stream)
    stream.synchronize()
    np.testing.assert_array_equal(landed[arena_rows], rows.cpu().numpy())
    landed[:] = 0
    writer.write(rows, torch.from_numpy(arena_rows).to(device).reshape(-1), stream)
    stream.synchronize()
    np.testing.assert_array_equal(landed[arena_rows], rows.cpu().numpy())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graphs write registered host memory: GPU suite")
def test_on_a_gpu_a_decode_steps_graph_writes_exactly_its_rows_step_after_step():
    """Two hooks, the second narrower (zero-padded); steps of 3, 8 and 5 rows share the 8-row
    graph, more steps than its ring of pinned index buffers; each step lands its rows and nothing else.
    Then a decode step of 512 requests at one hook, the largest bucket."""
    from types import SimpleNamespace

    from replicas.worker.arena_graphs import RING, ArenaGraphs

    device = torch.device("cuda")
    shared = tempfile.TemporaryDirectory(dir="/dev/shm")
    outbox = Outbox(shared.name, D_MODEL, arena_max_bytes=1 << 20, device=device)
    graphs = ArenaGraphs(outbox.writer, device)
    sites = [SimpleNamespace(staging=torch.zeros(64, D_MODEL, device=device)),
             SimpleNamespace(staging=torch.zeros(64, D_MODEL // 2, device=device))]
    landed = outbox.arena.bytes[: 512 * D_MODEL * 4].view(np.float32).reshape(-1, D_MODEL)
    rng = np.random.default_rng(0)
    assert graphs.takes(sites, 8, D_MODEL, torch.float32) and not graphs.takes(sites, 257, D_MODEL, torch.float32)
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
    site = SimpleNamespace(staging=torch.randn(512, D_MODEL, device=device))
    step_rows, arena_rows = rng.permutation(512), rng.permutation(512)[None]
    assert graphs.takes([site], 512, D_MODEL, torch.float32) and not graphs.takes([site], 513, D_MODEL, torch.float32)
    landed[:] = 0
    graphs.write([site], D_MODEL, torch.float32, step_rows, arena_rows).synchronize()
    np.testing.assert_array_equal(landed[arena_rows[0]], site.staging[torch.from_numpy(step_rows).to(device)].cpu().numpy())
