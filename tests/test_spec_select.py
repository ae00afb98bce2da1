"""The step loop's selection of SAE and read-out rows for every (request, spec) pair at once
(replicas.worker.spec_select) against the selection one pair at a time it replaced, and the
sites a step's read-outs read. No engine."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import gc

import numpy as np
import torch

from replicas.api import arrays
from replicas.api.hooks import HookPoint
from replicas.plans.readouts import ReadoutPlan
from replicas.plans.request import RequestPlan, SaePlan
from replicas.plans.positions import NO_END, selected_offsets
from replicas.readouts.device import DeviceProbe, DeviceReadouts, Unembed
from replicas.readouts.specs import ProbeFacts, ReadoutCatalog
from replicas._vllm import StepLayout
from replicas.worker.steady_decode import decode_key
from replicas.worker.collector import Collector
from replicas.worker.spec_handover import READOUT_SPECS, SAE_SPECS
from replicas.readouts.store import ProbeStore
from replicas.worker.outbox import RequestBuffers, StepRows
from replicas.worker.request_table import Batch, Entry, RequestTable
from replicas.worker.spec_select import SpecKind
from tests.test_engine_memory import CPU, D, Outbox, sites_of, step_of, wire_plan


def probe(name: str, positions: Any, width: int = 1) -> ReadoutPlan:
    return ReadoutPlan("probe", (1, "resid_post"), "blocks.1.hook_resid_post", positions, 16, width, probe=name)


def lens(layer: int, positions: Any, top_k: int) -> ReadoutPlan:
    return ReadoutPlan("logit_lens", (layer, "resid_pre"), f"blocks.{layer}.hook_resid_pre", positions, 16, top_k)


def sae(sae_id: str, positions: Any, top_k: int) -> SaePlan:
    return SaePlan(sae_id, "blocks.1.hook_resid_post", top_k, positions, "none", 16)


def readouts() -> list[list[ReadoutPlan]]:
    """Requests A, B and C (prompts of PROMPTS); explicit indices count back from the end of the
    prompt when negative."""
    return [
        [probe("p1", "all"), lens(0, "last_prompt", 5), probe("p2", [1, -1, 11], 3), probe("p1", "generated")],
        [lens(0, "prompt", 3), probe("p2", "all", 3), probe("p1", [-2, 0, 8])],
        [probe("p1", "last_prompt"), lens(2, "generated", 4)],
    ]


def saes() -> list[list[SaePlan]]:
    return [[sae("s1", "all", 8), sae("s2", [2, -3], 4)], [sae("s2", "generated", 6)], [sae("s1", "last_prompt", 2)]]


PROMPTS = [10, 7, 5]
# per step, each request's (start position, rows, first fresh row): A's prompt in two chunks; B
# preempted after step 2 and recomputed from position 0 (positions 0..7 were recorded before)
STEPS = [
    [(0, 4, 0), (0, 7, 0), (0, 5, 0)],
    [(4, 6, 0), (7, 1, 0), (5, 1, 0)],
    [(10, 1, 0), (0, 9, 8), (6, 1, 0)],
    [(11, 1, 0), (9, 1, 0), (7, 1, 0)],
]


def one_pair_at_a_time(
    entries: list[Entry], chunks: list[np.ndarray], specs_of: Callable[[Entry], list[Any]], key: Callable[[Any], Hashable],
    width: Callable[[Any], int], taken: dict[int, int],
) -> list[tuple[list[Any], list[Entry], list[int], list[int], list[int], list[int], int]]:
    """The selection as the collector made it before: per group (in order of its first member),
    (specs, entries, spec indices, rows, counts, dests, width); `taken` by id(spec)."""
    members: dict[Hashable, list[tuple[Entry, int, Any, np.ndarray]]] = {}
    for entry, first, start, count, prompt_len, fresh in zip(entries, *(c.tolist() for c in chunks[1:])):
        for j, spec in enumerate(specs_of(entry)):
            offsets = selected_offsets(spec.positions, start, count, prompt_len)
            offsets = offsets[offsets >= fresh]
            if len(offsets):
                members.setdefault(key(spec), []).append((entry, j, spec, first + offsets))
    groups = []
    for group in members.values():
        specs = [spec for _, _, spec, _ in group]
        counts = [len(rows) for *_, rows in group]
        dests = [taken.get(id(spec), 0) for spec in specs]
        for spec, n in zip(specs, counts):
            taken[id(spec)] = taken.get(id(spec), 0) + n
        groups.append((specs, [entry for entry, *_ in group], [j for _, j, _, _ in group],
                       np.concatenate([rows for *_, rows in group]).tolist(), counts, dests, max(width(s) for s in specs)))
    return groups


def admitted(specs: list[list[Any]], kind: SpecKind, outbox: Outbox, prompts: list[int] = PROMPTS) -> tuple[RequestTable, list[Entry]]:
    """A request table with these plans; a probe's rows get their region in the outbox's store."""
    table = RequestTable()
    for i, (asked, prompt_len) in enumerate(zip(specs, prompts, strict=True)):
        plan = RequestPlan(f"k{i}", prompt_len, None, None, **{kind.field: asked})
        table.admit(f"r{i}", plan, RequestBuffers.for_plan(plan, 8, 50, None, outbox.probes), -1)
    return table, [table.requests[f"r{i}"] for i in range(len(specs))]


def taken(spec: Any, outbox: Outbox) -> int:
    """Rows counted for a spec: a probe's by its store, the rest by the spec."""
    if getattr(spec, "kind", None) == "probe":
        return int(outbox.probes[spec.probe].taken[spec.region])
    return spec.taken


def step_chunks(entries: list[Entry], step: list[tuple[int, int, int]]) -> list[np.ndarray]:
    start, counts, fresh = (np.array(column, np.int64) for column in zip(*step))
    handles = np.array([entry.handle for entry in entries], np.int64)
    first = np.cumsum(counts) - counts
    return [handles, first, start, counts, np.array(PROMPTS, np.int64), fresh]


def test_every_pair_at_once_selects_the_rows_counts_and_dests_of_one_pair_at_a_time() -> None:
    outbox = Outbox()
    collector = Collector(None, sites_of(), 50, CPU, outbox)
    for kind, specs, key, width in ((READOUT_SPECS, readouts(), lambda s: s.group, lambda s: s.width),
                                    (SAE_SPECS, saes(), lambda s: s.sae_id, lambda s: s.top_k)):
        table, entries = admitted(specs, kind, outbox)
        counted: dict[int, int] = {}
        for number, step in enumerate(STEPS):
            chunks = step_chunks(entries, step)
            want = one_pair_at_a_time(entries, chunks, lambda e: getattr(e.plan, kind.field), key, width, counted)
            got = collector._spec_groups(table, chunks, kind)
            assert len(got) == len(want), (kind.field, number)
            for (specs_got, selection), (specs_want, members, targets, rows, counts, dests, widest) in zip(got, want):
                if getattr(specs_want[0], "kind", None) == "probe":  # its first spec stands for all
                    assert [id(s) for s in specs_got] == [id(specs_want[0])]
                    store, regions = selection.probe
                    assert regions.tolist() == [s.region for s in specs_want]
                else:
                    assert [id(s) for s in specs_got] == [id(s) for s in specs_want], (kind.field, number)
                    assert selection.probe is None
                assert [e.name for e in selection.requests] == [e.name for e in members]
                assert selection.targets == (targets, widest)
                assert selection.rows.tolist() == rows, (kind.field, number)
                assert selection.counts.tolist() == counts and selection.dests.tolist() == dests
                assert selection.offsets.tolist() == (np.cumsum(counts) - counts).tolist()
        assert [taken(s, outbox) for e in entries for s in getattr(e.plan, kind.field)] == \
            [counted.get(id(s), 0) for e in entries for s in getattr(e.plan, kind.field)]


def test_the_groups_of_a_step_by_hand() -> None:
    """Step 3 of STEPS: A decodes position 10, B re-runs 0..8 of which only 8 is fresh, C decodes 6."""
    outbox = Outbox()
    collector = Collector(None, sites_of(), 50, CPU, outbox)
    table, entries = admitted(readouts(), READOUT_SPECS, outbox)
    for step in STEPS[:2]:
        collector._spec_groups(table, step_chunks(entries, step), READOUT_SPECS)
    groups = collector._spec_groups(table, step_chunks(entries, STEPS[2]), READOUT_SPECS)
    # rows: A's is row 0, B's are 1..9 (position 8 at row 9), C's is row 10
    by_key = {specs[0].group: (specs, s) for specs, s in groups}
    assert list(by_key) == [("probe", "p1"), ("probe", "p2"), ("lens", (2, "resid_pre"), -1)]
    specs, p1 = by_key[("probe", "p1")]
    assert [e.name for e in p1.requests] == [entries[0].name, entries[0].name, entries[1].name]
    assert p1.targets == ([0, 3, 2], 1) and p1.rows.tolist() == [0, 0, 9] and p1.counts.tolist() == [1, 1, 1]
    assert p1.dests.tolist() == [10, 0, 2]  # A's "all": 10 rows before; its "generated": none; B's [5, 0, 8]: 5 and 0
    assert [taken(s, outbox) for s in (entries[0].plan.readouts[0], entries[0].plan.readouts[3], entries[1].plan.readouts[2])] == [11, 1, 3]
    _, p2 = by_key[("probe", "p2")]
    assert p2.rows.tolist() == [9] and p2.dests.tolist() == [8] and p2.targets == ([1], 3)  # A's [1, 9, 11] selects none
    _, lens_2 = by_key[("lens", (2, "resid_pre"), -1)]
    assert lens_2.rows.tolist() == [10] and lens_2.dests.tolist() == [1]
    quiet = collector._spec_groups(table, step_chunks(entries, [(12, 1, 0), (10, 1, 0), (8, 1, 0)]), SAE_SPECS)
    assert quiet == []  # SAE plans: none asked, and a step that selects nothing hands over nothing


def test_a_steps_read_out_sites_are_the_union_of_its_requests_sets_held_while_they_run() -> None:
    sites = sites_of()
    outbox = Outbox()
    collector = Collector(None, sites, 50, CPU, outbox)
    # A and B read (1, resid_post) and (0, resid_pre); C and D (1, resid_post) and (2, resid_pre)
    table, entries = admitted(readouts() + readouts()[2:], READOUT_SPECS, outbox, PROMPTS + [5])
    sets = table.site_sets
    a_sites, c_sites = frozenset({(1, "resid_post"), (0, "resid_pre")}), frozenset({(1, "resid_post"), (2, "resid_pre")})
    assert set(sets.ids) == {a_sites, c_sites}
    rows = table.columns.rows(np.array([entry.handle for entry in entries]))
    batch, only_c = Batch(None, rows), Batch(None, rows[2:3])  # type: ignore[arg-type]
    assert collector.captured_sites(batch, table) == {sites[(1, "resid_post")], sites[(0, "resid_pre")], sites[(2, "resid_pre")]}
    assert collector.captured_sites(only_c, table) == {sites[(1, "resid_post")], sites[(2, "resid_pre")]}
    table.retire("r2", entries[2])
    assert set(sets.ids) == {a_sites, c_sites}  # D still reads them
    table.retire("r3", entries[3])
    assert set(sets.ids) == {a_sites}
    table.fail(entries[0], "an error")
    assert set(sets.ids) == {a_sites}  # B's
    assert collector.captured_sites(batch, table) == {sites[(1, "resid_post")], sites[(0, "resid_pre")]}
    table.retire("r1", entries[1])
    assert not sets.ids and collector.captured_sites(batch, table) == set()


def random_staging(sites: dict, seed: int) -> tuple[dict, torch.Generator]:
    """The sites with random rows staged, and the generator to draw more from."""
    generator = torch.Generator().manual_seed(seed)
    for site in sites.values():
        site.staging.copy_(torch.randn(site.staging.shape, generator=generator))
    return sites, generator


def test_read_outs_that_can_select_no_later_row_stop_counting_and_their_decode_steps_go_steady() -> None:
    """A request whose read-outs all end with its prompt (a lens at last_prompt, a probe at explicit
    prompt positions) leaves the step loop's read-out selection once its last prompt row is
    handed over, and its decode steps may then take the steady path; one whose probe reads every
    position stays, and one with an explicit generated position stays until that row."""
    sites, generator = random_staging(sites_of(kinds=("resid_pre", "resid_post"), edit_stages=0, max_tokens=32), seed=7)
    head = torch.randn(50, D, generator=generator)
    probes = {name: DeviceProbe(torch.randn(n, D, generator=generator), torch.zeros(n)) for name, n in (("p1", 1), ("p2", 3))}
    outbox = Outbox()
    collector = Collector(None, sites, 50, CPU, outbox, readouts=DeviceReadouts(Unembed(lambda x: x, lambda x: x @ head.T), probes=probes))
    table, entries = admitted([[lens(0, "last_prompt", 5), probe("p1", [1, -1])], [probe("p2", "all", 3)],
                               [lens(2, "prompt", 4), probe("p1", [6])]], READOUT_SPECS, outbox)
    rows = table.columns.rows(np.array([entry.handle for entry in entries]))
    prefill = Batch(StepLayout(["r0"], np.array([0, 10]), np.array([0])), rows[:1])
    assert collector.captured_sites(prefill, table) == {sites[(0, "resid_pre")], sites[(1, "resid_post")]}
    counting = []
    for starts, counts in (([0, 0, 0], [10, 7, 5]), ([10, 7, 5], [1, 1, 1]), ([11, 8, 6], [1, 1, 1]), ([12, 9, 7], [1, 1, 1])):
        step = StepLayout([f"r{i}" for i in range(3)], np.concatenate([[0], np.cumsum(counts)]), np.array(starts))
        collector.collect(Batch(step, rows), table)
        counting.append(table.columns["readouts"][rows].tolist())
    assert counting == [[0, 1, 2], [0, 1, 2], [0, 1, 0], [0, 1, 0]]  # C's explicit row 6 came in the third step
    for step in outbox.steps:
        step.file()
    c_p1 = entries[2].buffers.readouts[1]  # its one row: the third step's third (no forward ran: the staging stays)
    np.testing.assert_allclose(c_p1.store.read(c_p1.plan.region)[:, 0],
                               (sites[(1, "resid_post")].staging[[2]] @ probes["p1"].weight.T)[:, 0].numpy(), atol=1e-6)
    a_decodes = Batch(StepLayout(["r0"], np.array([0, 1]), np.array([13])), rows[:1])
    assert decode_key(a_decodes, table.columns, arena=False) is not None
    assert collector.captured_sites(a_decodes, table) == set()  # A's read-outs read nothing more
    assert decode_key(Batch(a_decodes.step, rows[1:2]), table.columns, arena=False) is None  # B's probe reads on
    sae_table, sae_entries = admitted(saes(), SAE_SPECS, Outbox())  # SAE specs end the same way
    assert sae_table.columns["sae_end"][[e.handle for e in sae_entries]].tolist() == [NO_END, NO_END, PROMPTS[2]]


PROBE_WIDTHS = {"a": 2, "b": 3, "c": 1}
PROBES_ASKED = [["a", "b"], ["b", "a"], ["c"]]  # over 30, 20 and 10 prompt rows at blocks.1.hook_resid_post


def collected_probe_sets(failing: tuple[str, ...] | None = None) -> tuple[list, dict, torch.Tensor, list]:
    """One prefill step of three requests asking PROBES_ASKED through a real collector: each probe
    set's (names, rows) product, the probes' weights, the staged rows, the requests' buffers. The
    `failing` set raises as if out of device memory."""
    sites, generator = random_staging(sites_of(kinds=("resid_post",), edit_stages=0, max_tokens=80), seed=5)
    weights = {name: DeviceProbe(torch.randn(n, D, generator=generator), torch.randn(n, generator=generator))
               for name, n in PROBE_WIDTHS.items()}
    readouts = DeviceReadouts(Unembed(norm=lambda x: x, logits=lambda x: x), probes=weights)
    products = []
    probe_set = readouts.probe_set

    def recorded(names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
        products.append((names, x.shape[0]))
        if names == failing:
            raise RuntimeError("out of device memory (a stand-in)")
        return probe_set(names, x)

    readouts.probe_set = recorded
    collector = Collector(None, sites, 50, CPU, Outbox(), readouts=readouts)
    catalog = ReadoutCatalog(None, {name: ProbeFacts(name, "", "blocks.1.hook_resid_post", HookPoint(1, "resid_post"), n, D, True)
                                    for name, n in PROBE_WIDTHS.items()})
    plans = [wire_plan({"readouts": [{"kind": "probe", "probe": name} for name in names]}, n, readouts=catalog)
             for names, n in zip(PROBES_ASKED, (30, 20, 10))]
    buffers = [RequestBuffers.for_plan(plan, D, 50, None, collector.outbox.probes) for plan in plans]
    table = RequestTable()
    for i, (plan, buffer) in enumerate(zip(plans, buffers)):
        table.admit(f"r{i}", plan, buffer, -1)
    collector.collect(step_of(table, [30, 20, 10]), table)
    for step in collector.outbox.steps:
        step.file()
    return products, weights, sites[(1, "resid_post")].staging, buffers


def test_probes_at_one_site_over_the_same_rows_take_one_product_and_each_gets_its_own_columns() -> None:
    """The collector alone: probes a and b, asked by the same two requests at one hook, take one
    product with their weights side by side and one block to host, whose columns each probe's
    rows get; probe c at that hook over another request's rows takes its own. Every value equals
    rows @ W.T + b."""
    products, weights, staging, buffers = collected_probe_sets()
    assert products == [(("a", "b"), 50), (("c",), 10)]
    for buffer, names, (lo, hi) in zip(buffers, PROBES_ASKED, ((0, 30), (30, 50), (50, 60))):
        assert buffer.error is None
        for rows, name in zip(buffer.readouts, names):
            want = staging[lo:hi] @ weights[name].weight.T + weights[name].bias
            np.testing.assert_allclose(rows.store.read(rows.plan.region), want.numpy(), atol=1e-5, err_msg=name)


def test_a_probe_set_that_fails_on_the_device_fails_its_requests_and_no_other() -> None:
    products, weights, staging, buffers = collected_probe_sets(failing=("a", "b"))
    assert products == [(("a", "b"), 50), (("c",), 10)]
    assert [buffer.error for buffer in buffers] == ["read-out failed on the device: out of device memory (a stand-in)"] * 2 + [None]
    c_rows = buffers[2].readouts[0]
    want = staging[50:60] @ weights["c"].weight.T + weights["c"].bias
    np.testing.assert_allclose(c_rows.store.read(c_rows.plan.region), want.numpy(), atol=1e-5)


# ---------------------------------------------------------------- a probe's rows in one store


def test_a_probes_rows_of_every_request_go_in_with_one_copy_and_read_back_exactly() -> None:
    store = ProbeStore(width=2, rows=8)
    a, b, c = store.allocate(3), store.allocate(5), store.allocate(2)
    first = np.arange(12, dtype=np.float32).reshape(6, 2)  # a 1 row, b 3, c 2
    regions, counts = np.array([a, b, c]), np.array([1, 3, 2])
    assert store.file(regions, store.count(regions, counts), counts, first).tolist() == []
    second = -np.arange(8, dtype=np.float32).reshape(4, 2)  # a 2 rows, b 1, c 1: c past its 2
    counts = np.array([2, 1, 1])
    assert store.file(regions, store.count(regions, counts), counts, second).tolist() == [2]
    np.testing.assert_array_equal(store.read(a), np.concatenate([first[:1], second[:2]]))
    np.testing.assert_array_equal(store.read(b), np.concatenate([first[1:4], second[2:3]]))
    np.testing.assert_array_equal(store.read(c), first[4:6])  # its third row was left out, nothing else moved


def test_a_probe_store_grows_keeping_its_rows_and_reuses_what_requests_free() -> None:
    store = ProbeStore(width=1, rows=4)
    regions = [store.allocate(3) for _ in range(5)]  # 15 rows: grown twice
    counts = np.full(5, 3)
    rows = np.arange(15, dtype=np.float32)[:, None]
    store.file(np.array(regions), store.count(np.array(regions), counts), counts, rows)
    assert [store.read(r)[:, 0].tolist() for r in regions] == [list(range(3 * i, 3 * i + 3)) for i in range(5)]
    size = len(store.data)
    for r in regions[1:4]:
        store.free(r)
    nine = store.allocate(9)  # the three freed neighbours, merged: no growth
    assert len(store.data) == size and store.start[nine] == store.start[regions[1]] and store.taken[nine] == 0
    assert store.read(regions[4])[:, 0].tolist() == [12, 13, 14]


def test_probe_rows_filed_from_a_step_reach_the_result_and_their_regions_go_with_the_request() -> None:
    outbox = Outbox()
    collector = Collector(None, sites_of(), 50, CPU, outbox)
    plans = [[probe("p2", "all", 3)], [probe("p2", "all", 3), probe("p1", "all")]]
    table, entries = admitted(plans, READOUT_SPECS, outbox, [4, 3])
    for step in ([(0, 4, 0), (0, 3, 0)], [(4, 1, 0), (3, 1, 0)]):
        for _, selection in collector._spec_groups(table, step_chunks(entries, step), READOUT_SPECS):
            width = selection.targets[1]
            block = np.arange(len(selection.rows) * width, dtype=np.float32).reshape(1, -1, width) + 100 * selection.rows[None, :, None]
            buffers = [entry.buffers for entry in selection.requests]
            StepRows("readout", torch.from_numpy(block), None, buffers, selection.offsets, selection.counts, selection.dests,
                     selection.targets, selection.probe).file()
    # step rows: A's prompt 0..3 and B's 4..6, then A's position 4 and B's 3 at rows 0 and 1; a block's
    # i-th row starts with 100 x its step row + 3 i
    a, b = (entry.buffers.readouts[0].result(prompt_len) for entry, prompt_len in zip(entries, (4, 3)))
    assert list(a["positions"]) == [0, 1, 2, 3, 4] and list(b["positions"]) == [0, 1, 2, 3]
    values = arrays.from_raw(a["values"])
    assert values.shape == (5, 3) and values[:, 0].tolist() == [0, 103, 206, 309, 0]
    assert values[1].tolist() == [103, 104, 105]
    assert arrays.from_raw(b["values"])[:, 0].tolist() == [412, 515, 618, 103]
    store = outbox.probes["p2"]
    del a, b, entries, table, selection, buffers  # the last step's hand-over held B too
    gc.collect()
    assert store.holes == [(0, len(store.data))]  # every region back
