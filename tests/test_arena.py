"""The arena's host path without an engine: steps filed into the shared-memory arena (and into
request-owned arrays for small captures) come back, through the replica's reader, as exactly the
rows handed over, in order; blocks are reused, a result views them in place, and a full /dev/shm
fails only the requests that needed more of it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from replicas.arena.host import CHUNK_BLOCKS, ArenaLayout, ArenaReader, HostArena, stored_in
from replicas.api.arrays import from_raw
from replicas.worker.collector import Collector
from replicas.worker.spec_select import Selection
from replicas.worker.outbox import Outbox, RequestBuffers
from tests.arena_host import D_MODEL, HOOKS, Host, request_plan, shm_bytes


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
    reserved = shm_bytes(host.layout.path)
    host.arena.shrink()  # a block still waits for the replica: nothing is given back
    assert host.arena.chunks == 2 and shm_bytes(host.layout.path) == reserved
    np.testing.assert_array_equal(host.result(pending)[HOOKS[0]], host.expected(pending)[0])
    host.arena.shrink()  # idle: back to one chunk, and its memory to the system
    assert host.arena.chunks == 1 and host.arena.blocks_in_use == 0
    assert shm_bytes(host.layout.path) == reserved // 2
    after = host.buffers(request_plan(prompt_len=256, max_tokens=1))
    host.step([(after, 256)], rng)  # works as before
    np.testing.assert_array_equal(host.result(after)[HOOKS[0]], host.expected(after)[0])


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


def test_rows_are_written_with_the_widest_integer_that_divides_them():
    from replicas.worker.arena_writer import element_type

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
    from replicas.worker.request_table import UNPLANNED, RequestTable

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
