"""Memory a request may hold, and what must come back when things fail: the shared `set` values
buffer, bounded per-step temporaries, capture groups, the arena budget, and the take RPC's blocks
on a failed or twice-cancelled take, without an engine (one small real engine:
tests/test_engine_memory_bounds.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from replicas._vllm import StepLayout
from replicas.api import GenerateRequest, ModelInfo
from replicas.arena.client import ArenaBudget, BatchedTake
from replicas.readouts.store import ProbeStores
from replicas.worker.blocks import SiteOptions, _build_sites
from replicas.worker.collector import Collector
from replicas.worker.edit_table import EditTable
from replicas.api.errors import ReplicaUnavailableError
from replicas.worker.outbox import RequestBuffers
from replicas.plans.request import RequestPlan, build_wire_plan
from replicas.worker.request_table import Batch, RequestTable

D = 8
CPU = torch.device("cpu")


def wire_plan(request: dict, prompt_len: int, **options) -> RequestPlan:
    settings = dict(n_layers=4, d_model=D, armed_kinds={"resid_pre", "resid_post"}, steer_kinds={"resid_pre", "resid_post"},
                    edit_stages=2, max_capture_bytes=1 << 30, d_vocab=50)
    request = GenerateRequest.model_validate({"prompt": [1] * prompt_len, "max_tokens": 1} | request)
    return RequestPlan.from_wire(build_wire_plan("k", request, prompt_len=prompt_len, **(settings | options)))


def sites_of(kinds=("resid_pre", "resid_post"), edit_stages=2, max_set_edits=2, max_tokens=16):
    layout = SimpleNamespace(layers=[None] * 4, d_model=D)
    options = SiteOptions(armed_kinds=list(kinds), steer_kinds=set(kinds), steer_layers=None, edit_stages=edit_stages,
                          edit_slots=4, max_set_edits=max_set_edits)
    return _build_sites(layout, options, max_tokens=max_tokens, dtype=torch.float32, device=CPU)


def step_of(table: RequestTable, counts: list[int]) -> Batch:
    req_ids = [f"r{i}" for i in range(len(counts))]
    step = StepLayout(req_ids, np.concatenate([[0], np.cumsum(counts)]), np.zeros(len(counts), np.int64))
    return Batch(step, table.columns.rows(table.handles(req_ids)))


# ---------------------------------------------------------------- the shared `set` values buffer


def test_every_steered_site_shares_one_values_buffer():
    sites = sites_of()
    steered = [s for s in sites.values() if s.edit_stages]
    assert len(steered) == 8
    assert len({s.values.data_ptr() for s in steered}) == 1  # one buffer, not one per site
    assert steered[0].values.shape == (2 * 16, D)  # max_set_edits x max_tokens rows
    assert not hasattr(sites[(None, "ln_final")], "values")


def test_set_at_two_sites_on_the_same_rows_in_one_step_keeps_each_sites_values():
    """Request r0 patches rows 0-2 at two hooks (the same step rows, two sites); r1 patches one
    row of its own at one of them. Each site must write exactly its own values."""
    sites = sites_of()
    table, edits = RequestTable(), EditTable(sites, 4, CPU, max_set_edits=2)
    rng = np.random.default_rng(0)
    v1, v2, v3 = rng.standard_normal((3, D)), rng.standard_normal((3, D)), rng.standard_normal(D)
    plans = [
        wire_plan({"interventions": [{"hook": "1:resid_post", "op": "set", "positions": [0, 1, 2], "values": v1},
                                     {"hook": "3:resid_pre", "op": "set", "positions": "prompt", "values": v2}]}, 3),
        wire_plan({"interventions": [{"hook": "1:resid_post", "op": "set", "positions": [1], "values": v3}]}, 4),
    ]
    for i, plan in enumerate(plans):
        edits.assign(table.admit(f"r{i}", plan, None, -1), table.columns)
    edits.prepare(step_of(table, [3, 4]), table)
    h = torch.zeros(7, D)
    at_1, at_3 = sites[(1, "resid_post")](h.clone()), sites[(3, "resid_pre")](h.clone())
    expected_1, expected_3 = np.zeros((7, D), np.float32), np.zeros((7, D), np.float32)
    expected_1[:3], expected_1[4], expected_3[:3] = v1, v3, v2
    np.testing.assert_array_equal(at_1.numpy(), expected_1)
    np.testing.assert_array_equal(at_3.numpy(), expected_3)


# ---------------------------------------------------------------- a steady decode step


def test_decode_steps_of_the_same_requests_reuse_the_slot_maps_and_others_rewrite_them(monkeypatch):
    """r0 ablates at every position, r1 adds on generated ones, r2 edits at prefill only; u is
    unplanned. A decode step like the previous one writes nothing to the device and its maps stay
    right; a new order, a prefill chunk or a request going request by request rewrites them."""
    sites = sites_of()
    site = sites[(1, "resid_post")]
    table, edits = RequestTable(), EditTable(sites, 4, CPU, max_set_edits=2)
    vector = np.ones(D)
    specs = {
        "r0": {"interventions": [{"hook": "1:resid_post", "op": "scale", "factor": 0.0}]},
        "r1": {"interventions": [{"hook": "1:resid_post", "op": "add", "vector": vector, "positions": "generated"}]},
        "r2": {"interventions": [{"hook": "1:resid_post", "op": "add", "vector": 2 * vector, "phase": "prefill"}]},
        "p": {"interventions": [{"hook": "1:resid_post", "op": "set", "positions": [0], "values": vector}]},
    }
    slot_of = {}
    for name, request in specs.items():
        entry = table.admit(name, wire_plan(request, 4), None, -1)
        edits.assign(entry, table.columns)
        slot_of[name] = entry.plan.edits[0].slot
    writes = []
    write = edits._write_edit_rows
    monkeypatch.setattr(edits, "_write_edit_rows", lambda *a: (writes.append(a[2]), write(*a)))

    def step(names: list[str], counts: list[int], start: list[int]) -> list[int]:
        layout = StepLayout(names, np.concatenate([[0], np.cumsum(counts)]), np.array(start, np.int64))
        edits.prepare(Batch(layout, table.columns.rows(table.handles(names))), table)
        return site.slot[0, : sum(counts)].tolist()

    decode = (["r0", "u", "r1", "r2"], [1, 1, 1, 1], [4, 9, 6, 5])
    expected = [slot_of["r0"], 0, slot_of["r1"], 0]
    assert step(*decode) == expected and len(writes) == 1
    assert step(decode[0], decode[1], [5, 10, 7, 6]) == expected and len(writes) == 1  # the next token: nothing written
    assert step(["r1", "u", "r0", "r2"], [1, 1, 1, 1], [8, 11, 6, 7]) == [slot_of["r1"], 0, slot_of["r0"], 0]
    assert len(writes) == 2
    # a prefill chunk of r2 beside them: its rows edit at prefill
    assert step(["r0", "r2"], [1, 3], [7, 1]) == [slot_of["r0"]] + [slot_of["r2"]] * 3 and len(writes) == 3
    assert step(["r0", "u"], [1, 1], [8, 12]) == [slot_of["r0"], 0] and len(writes) == 4
    assert step(["r0", "u"], [1, 1], [9, 13]) == [slot_of["r0"], 0] and len(writes) == 4
    # a request whose edit goes request by request (explicit positions) is never cached
    assert step(["r0", "p"], [1, 1], [10, 6]) == [slot_of["r0"], 0] and len(writes) == 5
    assert step(["r0", "p"], [1, 1], [11, 7]) == [slot_of["r0"], 0] and len(writes) == 6
    # a step the table says repeats the one before skips even the comparison, unless it is a prefill
    r0_r1 = (["r0", "r1"], np.array([0, 1, 2]))
    edits.prepare(Batch(StepLayout(*r0_r1, np.array([12, 12])), table.columns.rows(table.handles(r0_r1[0]))), table)
    monkeypatch.setattr(edits, "_decode_key", lambda *a: pytest.fail("a repeated decode step was looked at"))
    repeated = Batch(StepLayout(*r0_r1, np.array([13, 13])), table.columns.rows(table.handles(r0_r1[0])), repeats=True)
    assert edits.prepare(repeated, table)[site].tolist() == [[slot_of["r0"], slot_of["r1"]], [0, 0]] and len(writes) == 7
    chunked = Batch(StepLayout(["r0", "r1"], np.array([0, 1, 3]), np.array([14, 14])), repeated.rows, repeats=True)
    with pytest.raises(pytest.fail.Exception, match="was looked at"):
        edits.prepare(chunked, table)  # two tokens of r1: not a decode step


def test_a_step_repeats_the_one_before_only_for_the_same_requests_in_order_and_an_unchanged_table():
    table, admitted = RequestTable(), []

    def admit(req_id: str) -> int:
        admitted.append(req_id)
        return table.admit(req_id, wire_plan({"capture": {"hooks": ["1:resid_post"]}}, 4), None, -1).handle

    def batch(req_ids: list[str], last: Batch | None) -> Batch:
        layout = StepLayout(req_ids, np.arange(len(req_ids) + 1), np.full(len(req_ids), 4, np.int64))
        return table.batch(layout, last, admit)

    first = batch(["a", "b"], None)
    assert not first.repeats and admitted == ["a", "b"]
    second = batch(["a", "b"], first)
    assert second.repeats and second.rows is first.rows and admitted == ["a", "b"]
    swapped = batch(["b", "a"], second)
    assert not swapped.repeats and swapped.rows.tolist() == second.rows[::-1].tolist()  # another order
    third = batch(["a", "b"], swapped)
    assert not third.repeats  # the step before ran b, a
    table.retire("b", table.requests["b"])  # cancelled between steps: its handle is given back
    table.forget("b")
    fourth = batch(["a", "b"], third)
    assert not fourth.repeats and admitted == ["a", "b", "b"]  # b looked up again (and admitted anew)
    assert batch(["a", "b"], fourth).repeats


# ---------------------------------------------------------------- bounded per-step temporaries


class LmHead:
    """`compute_logits` of a model whose lm_head pads the vocabulary; records rows per call."""

    def __init__(self, vocab: int):
        self.weight = torch.randn(vocab + 6, D, generator=torch.Generator().manual_seed(1))
        self.rows: list[int] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.rows.append(hidden.shape[0])
        return hidden @ self.weight.T


class Outbox:
    writer = None  # no arena: every request keeps its rows in its own arrays

    def __init__(self) -> None:
        self.steps: list = []
        self.probes = ProbeStores()

    def put(self, rows) -> None:
        self.steps.append(rows)


def collector_of(sites, vocab=50, max_step_bytes=1 << 30):
    head = LmHead(vocab)
    runner = SimpleNamespace(get_model=lambda: head)
    return Collector(runner, sites, vocab, CPU, Outbox(), max_step_bytes=max_step_bytes), head


def test_a_large_steps_logits_and_rows_are_computed_in_bounded_chunks_and_equal_the_whole():
    sites = sites_of(kinds=("resid_post",), edit_stages=0, max_tokens=64)
    generator = torch.Generator().manual_seed(2)
    for site in sites.values():
        site.staging.copy_(torch.randn(site.staging.shape, generator=generator))
    # a logits row takes 8 x 4 (normed) + 50 x (4 + 4) bytes = 432: ten rows per chunk
    collector, head = collector_of(sites, vocab=50, max_step_bytes=4320)
    table = RequestTable()
    hooks = ["0:resid_post", "2:resid_post"]
    plans = [wire_plan({"capture": {"hooks": hooks}, "logits": {"positions": "all"}}, 40),
             wire_plan({"capture": {"hooks": hooks, "positions": "prompt", "reduce": "mean"}}, 20)]
    buffers = [RequestBuffers.for_plan(plan, D, 50, None) for plan in plans]
    for i, (plan, buffer) in enumerate(zip(plans, buffers)):
        table.admit(f"r{i}", plan, buffer, collector.group(plan.capture))
    collector.collect(step_of(table, [40, 20]), table)
    for step in collector.outbox.steps:
        step.file()
    assert head.rows == [10, 10, 10, 10]  # never the whole step at once
    final = sites[(None, "ln_final")].staging[:40]
    np.testing.assert_allclose(buffers[0].logits[:40], (final @ head.weight[:50].T).numpy(), atol=1e-5)  # matmul rounding
    for i, hook in enumerate(hooks):
        staging = sites[(int(hook[0]), "resid_post")].staging
        np.testing.assert_array_equal(buffers[0].sites[i, :40], staging[:40].numpy())
        np.testing.assert_allclose(buffers[1].sites[i, 0], staging[40:60].sum(0).numpy(), rtol=1e-5)
    assert collector.rows_per_chunk(2 * D * (2 * 4 + 4)) == 22  # two hooks' rows: 192 bytes each


def test_capture_groups_are_forgotten_once_no_request_uses_them():
    collector, _ = collector_of(sites_of(kinds=("resid_post",), edit_stages=0))

    def capture(*layers: int):
        return wire_plan({"capture": {"hooks": [f"{layer}:resid_post" for layer in layers]}}, 4).capture

    first, again, other = collector.group(capture(0, 1)), collector.group(capture(0, 1)), collector.group(capture(2))
    assert first == again != other and collector.live_groups == 2
    collector.release_group(first)
    assert collector.live_groups == 2  # `again` still uses it
    collector.release_group(again)
    assert collector.live_groups == 1
    for layers in [(0,), (1,), (3,), (0, 2), (1, 3), (0, 1, 2, 3)] * 10:  # many distinct hook sets, one at a time
        collector.release_group(collector.group(capture(*layers)))
    collector.release_group(other)
    assert collector.live_groups == 0 and collector.groups == {}
    assert len(collector.group_sites) == 2  # freed groups are reused: bounded by the groups in use at once


# ---------------------------------------------------------------- the arena budget and the take RPC


def test_the_arena_budget_admits_in_order_once_blocks_fit():
    async def scenario() -> tuple[list[str], ArenaBudget]:
        budget, order = ArenaBudget(10, 1024, 10 << 10), []

        async def request(name: str, blocks: int) -> None:
            await budget.acquire(blocks)
            order.append(name)

        await budget.acquire(6)
        waiting = [asyncio.ensure_future(request(name, n)) for name, n in (("b", 6), ("c", 3), ("d", 1))]
        gone = asyncio.ensure_future(request("e", 2))
        await asyncio.sleep(0)
        gone.cancel()  # a waiter that gives up takes nothing
        await asyncio.sleep(0)
        assert order == [] and budget.used == 6  # c would fit, but b came first
        budget.release(6)
        await asyncio.gather(*waiting)
        return order, budget

    order, budget = asyncio.run(scenario())
    assert order == ["b", "c", "d"] and budget.used == 10 and budget.waits == 4


class FakeLLM:
    """collective_rpc answers in turn: an exception to raise, "hang", or a dict to return."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls: list[tuple] = []
        self.called = asyncio.Event()
        self.answer_now = asyncio.Event()

    async def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append(args)
        self.called.set()
        answer = self.answers.pop(0) if self.answers else {}
        if isinstance(answer, BaseException):
            raise answer
        if answer == "hang":
            await asyncio.sleep(3600)
        if answer == "later":
            await self.answer_now.wait()
            answer = {key: [arena_result([3, 4, 5])] for key in args[0]}
        if answer == "fail later":
            await self.answer_now.wait()
            raise RuntimeError("engine core failed")
        return [answer]

    def get_tokenizer(self):
        return None


def arena_result(blocks: list[int]) -> dict:
    return {"error": None, "positions": [0], "logits": None, "logits_positions": [],
            "activations": {"h": {"dtype": "float32", "shape": [1, D], "blocks": blocks}}}


async def calls_settled(llm: FakeLLM, n: int) -> None:
    for _ in range(200):
        if len(llm.calls) >= n:
            return
        await asyncio.sleep(0.01)


def test_blocks_released_by_a_failed_take_rpc_go_with_the_next_one():
    async def scenario() -> FakeLLM:
        llm = FakeLLM(RuntimeError("engine busy"), {"k": []})
        taker = BatchedTake(llm)
        taker.release([1, 2])
        await calls_settled(llm, 1)
        await taker.take("k")
        return llm

    llm = asyncio.run(scenario())
    assert [call[1] for call in llm.calls] == [[1, 2], [1, 2]]  # released, and released again
    assert llm.calls[1][2:] == (1, [0])  # call 1 tells the worker to free what call 0 may have delivered


def test_a_take_that_comes_while_a_take_rpc_fails_is_still_sent():
    async def scenario() -> tuple[FakeLLM, list]:
        llm = FakeLLM("fail later", {"b": [arena_result([7])]})
        taker = BatchedTake(llm)
        first = taker.take("a")
        await llm.called.wait()
        second = taker.take("b")  # joins the next call
        llm.answer_now.set()
        return llm, await asyncio.gather(first, asyncio.wait_for(second, 5), return_exceptions=True)

    llm, (first, second) = asyncio.run(scenario())
    assert isinstance(first, RuntimeError) and second == [arena_result([7])]
    assert [call[0] for call in llm.calls] == [["a"], ["b"]]


def test_a_take_rpc_past_its_timeout_fails_as_the_replicas_fault_and_is_abandoned():
    async def scenario() -> FakeLLM:
        llm = FakeLLM("hang", {"k2": []})
        taker = BatchedTake(llm, timeout_s=0.05)
        with pytest.raises(ReplicaUnavailableError, match=r"did not answer the take RPC within 0.05 s \(engine option take_timeout_s\)"):
            await taker.take("k1")
        assert await taker.take("k2") == []
        return llm

    llm = asyncio.run(scenario())
    assert [call[0] for call in llm.calls] == [["k1"], ["k2"]]
    assert llm.calls[1][2:] == (1, [0])


def test_a_request_cancelled_again_during_its_take_still_frees_its_blocks_and_budget():
    from replicas.engine import CaptureEngine, EngineConfig
    from replicas.engine.results import Finish

    class Outputs:
        def __init__(self):
            self.started = asyncio.Event()

        async def generate(self, prompt, params, request_id):
            self.started.set()
            await asyncio.sleep(3600)  # cancelled while it runs
            yield None

    async def scenario() -> tuple[FakeLLM, ArenaBudget]:
        llm, outputs = FakeLLM("later"), Outputs()
        llm.generate = outputs.generate
        info = ModelInfo(model="m", architecture="a", n_layers=1, d_model=D, d_vocab=50, max_model_len=64, dtype="float32",
                         hook_names=[], armed_kinds=[])
        engine = CaptureEngine(llm, EngineConfig(model="m", engine_kwargs={"skip_tokenizer_init": True}), info)
        engine._arena_budget = budget = ArenaBudget(10, 1024, 10 << 10)
        await budget.acquire(3)
        task = asyncio.ensure_future(engine._run("key", [1, 2], None, Finish(True, None, 2, arena_blocks=3)))
        await outputs.started.wait()
        task.cancel()  # the request is cancelled: it goes on to take its rows
        await llm.called.wait()
        task.cancel()  # and cancelled again while the take waits
        with pytest.raises(asyncio.CancelledError):
            await task
        llm.answer_now.set()
        await calls_settled(llm, 2)
        return llm, budget

    llm, budget = asyncio.run(scenario())
    assert llm.calls[1][1] == [3, 4, 5]  # the blocks went back with the next take RPC
    assert budget.used == 0


def test_what_capserve_puts_on_the_device_after_the_weights_is_counted_with_them():
    """vLLM leaves the KV cache its budget less the weights and a profile run's peak measured from
    that run's start: the sites installed in between must join the weights, or the KV cache takes
    their memory too (a 70B fp8 engine ran out at its first batch so)."""
    from replicas import _vllm

    runner = SimpleNamespace(model_memory_usage=70 << 30)
    _vllm.count_with_weights(runner, 13 << 30)
    assert runner.model_memory_usage == 83 << 30
    with pytest.raises(_vllm.VllmInternalsError, match="count_with_weights"):
        _vllm.count_with_weights(SimpleNamespace(), 1)
