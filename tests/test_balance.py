"""Unit tests of the cost model and the ledger behind least-outstanding-cost routing (no Ray)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from deploy.balance import CostLedger, RouteHint, route_hint
from replicas.api import GenerateRequest
from replicas.plans.cost import estimate_prompt_tokens, request_cost, returned_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def req(**fields) -> GenerateRequest:
    return GenerateRequest.model_validate({"prompt": [5] * 10, "max_tokens": 4, **fields})


# ---------------------------------------------------------------- cost


def test_prompt_estimates_count_ids_exactly_and_text_by_bytes():
    assert estimate_prompt_tokens(req(prompt=[1, 2, 3])) == 3
    assert estimate_prompt_tokens(req(prompt="x" * 40)) == 11  # BOS + 40 bytes / 4
    chat = req(prompt=[{"role": "user", "content": "y" * 8}, {"role": "assistant", "content": "z" * 4}])
    assert estimate_prompt_tokens(chat) == 1 + (4 + 2) + (4 + 1)


def test_returned_bytes_follow_hooks_positions_dtype_and_logits():
    capture = {"hooks": ["blocks.0.hook_resid_post", "blocks.1.hook_mlp_out"], "positions": "prompt"}
    assert returned_bytes(req(capture=capture), 10, d_model=128, d_vocab=500) == 2 * 10 * 128 * 4
    half = {**capture, "dtype": "bfloat16", "positions": "all"}  # all = prompt + max_tokens - 1 fed rows
    assert returned_bytes(req(capture=half), 10, 128, 500) == 2 * 13 * 128 * 2
    mean = {**capture, "reduce": "mean"}
    assert returned_bytes(req(capture=mean), 10, 128, 500) == 2 * 1 * 128 * 4
    assert returned_bytes(req(logits={"positions": "last_prompt"}), 10, 128, 500) == 500 * 4


def test_returned_bytes_count_lenses_probes_and_sae_features():
    lens = {"kind": "logit_lens", "hook": "blocks.1.hook_resid_post", "top_k": 20, "positions": "last_prompt"}
    assert returned_bytes(req(readouts=lens), 10, 128, 500) == 20 * 8  # int32 id + float32 logprob per token
    probes = [{"kind": "probe", "probe": "wide", "positions": "prompt"}, {"kind": "probe", "probe": "unknown", "positions": "prompt"}]
    assert returned_bytes(req(readouts=probes), 10, 128, 500, probe_widths={"wide": 3}) == 10 * 3 * 4 + 10 * 1 * 4
    sae = {"sae_id": "s", "top_k": 32, "positions": "all"}
    assert returned_bytes(req(sae=sae), 10, 128, 500) == 13 * 32 * 8
    assert returned_bytes(req(sae={**sae, "error": "norm"}), 10, 128, 500) == 13 * (32 * 8 + 4)
    assert returned_bytes(req(sae={**sae, "error": "vector"}), 10, 128, 500) == 13 * (32 * 8 + 128 * 4)
    everything = req(capture={"hooks": ["blocks.0.hook_resid_post"], "positions": "prompt"}, logits={"positions": "last_prompt"},
                     readouts=lens, sae=sae)
    assert returned_bytes(everything, 10, 128, 500) == 10 * 128 * 4 + 500 * 4 + 20 * 8 + 13 * 32 * 8


def test_cost_adds_prompt_generation_and_payload():
    plain = request_cost(req(), 128, 500)
    assert plain == 10 + 4
    assert request_cost(req(n=3), 128, 500) == 10 + 12
    capture = req(capture={"hooks": ["blocks.0.hook_resid_post"], "positions": "prompt"})
    assert request_cost(capture, 128, 500, capture_bytes_per_token=1024) == 14 + 10 * 128 * 4 / 1024
    assert request_cost(req(), 128, 500, prompt_token_weight=0.5) == 5 + 4


# ---------------------------------------------------------------- ledger


def test_rank_prefers_least_outstanding_cost_and_charges_nothing():
    ledger = CostLedger(rng=random.Random(0))
    ledger.confirm("big", "a", 100.0)
    for i in range(10):
        ranked = ledger.rank(["a", "b"])
        assert ranked == ["b", "a"]
        ledger.confirm(f"s{i}", ranked[0], 5.0)
    assert ledger.snapshot() == {"a": {"cost": 100.0, "requests": 1}, "b": {"cost": 50.0, "requests": 10}}
    assert ledger.rank(["a", "b"]) == ["b", "a"]  # ranking alone changes nothing


def test_confirm_moves_a_tickets_charge_and_release_drops_it():
    ledger = CostLedger()
    ledger.confirm("t", "a", 7.0)
    ledger.confirm("t", "b", 7.0)  # the request was retried on b
    assert ledger.snapshot() == {"b": {"cost": 7.0, "requests": 1}}
    ledger.release("t")
    ledger.release("t")  # idempotent
    assert ledger.snapshot() == {}


def test_release_returns_to_exactly_zero_without_float_drift():
    ledger = CostLedger()
    for i in range(100):
        ledger.confirm(f"t{i}", "a", 0.1)
    for i in range(100):
        ledger.release(f"t{i}")
    assert ledger.snapshot() == {}
    ledger.confirm("x", "a", 1.0)
    assert ledger.snapshot()["a"]["cost"] == 1.0


def test_avoided_and_suspect_replicas_are_left_out_while_others_remain():
    clock = Clock()
    ledger = CostLedger(clock=clock, rng=random.Random(2))
    ledger.confirm("busy", "b", 1000.0)
    assert ledger.rank(["a", "b"], avoid={"a"}) == ["b"]
    ledger.suspect("a", 30.0)
    assert ledger.rank(["a", "b"]) == ["b"]
    assert ledger.rank(["a", "b"], avoid={"b"}) == ["a", "b"]  # nobody left: try them all
    clock.now = 31.0
    assert ledger.rank(["a", "b"]) == ["a", "b"]


def test_equal_replicas_share_evenly():
    ledger = CostLedger(rng=random.Random(3))
    picks = Counter()
    for _ in range(1000):
        picks[ledger.rank(["a", "b", "c"])[0]] += 1  # nothing held: only the tie-break decides
    assert min(picks.values()) > 280, picks
    held = Counter()
    for i in range(100):
        replica = ledger.rank(["a", "b"])[0]
        ledger.confirm(f"h{i}", replica, 1.0)
        held[replica] += 1
    assert held == {"a": 50, "b": 50}  # while they are held, least-outstanding alternates


def test_route_hint_is_recognized_by_a_by_value_copy_of_this_module():
    """Serve cloudpickles the request-router class into the Router process by value, so its
    module globals (RouteHint included) are copies; the hint must still be recognized."""
    import cloudpickle

    import deploy.balance as balance

    cloudpickle.register_pickle_by_value(balance)
    try:
        copied = cloudpickle.loads(cloudpickle.dumps(balance.route_hint))
    finally:
        cloudpickle.unregister_pickle_by_value(balance)
    hint = RouteHint(CostLedger())
    assert copied is not balance.route_hint and copied.__globals__ is not balance.__dict__  # really a copy
    assert copied(type("Pending", (), {"args": [hint]})()) is hint


def test_route_hint_is_read_from_the_first_routing_argument():
    class Pending:
        def __init__(self, args):
            self.args = args

    hint = RouteHint(CostLedger())
    assert route_hint(Pending([hint])) is hint
    assert route_hint(Pending([{"prompt": "x"}])) is None
    assert route_hint(Pending([])) is None
    assert route_hint(None) is None


@pytest.mark.parametrize("bad", [{"prompt": ""}, {"prompt": [1], "n": 0}])
def test_cost_needs_a_valid_request(bad):
    with pytest.raises(ValueError):
        req(**bad)


def test_full_replicas_are_skipped_and_none_with_room_means_wait():
    ledger = CostLedger(rng=random.Random(4))
    assert ledger.free_slots() is None  # nothing seen yet
    ledger.confirm("t1", "a", 1.0)
    ledger.confirm("t2", "a", 1.0)
    ledger.confirm("t3", "b", 50.0)
    assert ledger.rank(["a", "b"], capacity={"a": 2, "b": 8}) == ["b"]  # a is full, b has room
    assert ledger.free_slots() == 7
    ledger.confirm("t4", "b", 1.0)
    assert ledger.rank(["a", "b"], capacity={"a": 2, "b": 2}) == []
    assert ledger.free_slots() == 0
    assert ledger.has_alternative(avoid={"a"})
    ledger.suspect("b", 10.0)
    assert not ledger.has_alternative(avoid={"a"})


def test_the_serve_request_router_returns_only_the_best_replica_with_room():
    import asyncio
    from types import SimpleNamespace

    from deploy.balance import CostAwareRequestRouter

    def replica(name: str, limit: int) -> SimpleNamespace:
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), max_ongoing_requests=limit)

    def pending(*args) -> SimpleNamespace:
        return SimpleNamespace(args=list(args), routing_context=SimpleNamespace(should_backoff=False))

    choose = CostAwareRequestRouter.choose_replicas  # pure apart from its arguments
    a, b = replica("a", 80), replica("b", 80)
    ledger = CostLedger(rng=random.Random(5))
    ledger.confirm("busy", "a", 10.0)
    request = pending(RouteHint(ledger, slots=64))
    assert asyncio.run(choose(None, [a, b], request)) == [[b]]
    assert request.routing_context.should_backoff  # all full -> Serve waits, then asks again
    for i in range(64):
        ledger.confirm(f"b{i}", "b", 0.1)
    assert asyncio.run(choose(None, [a, b], pending(RouteHint(ledger, slots=64)))) == [[a]]
    for i in range(63):
        ledger.confirm(f"a{i}", "a", 0.1)
    assert asyncio.run(choose(None, [a, b], pending(RouteHint(ledger, slots=64)))) == []
    plain = asyncio.run(choose(None, [a, b], pending({"prompt": "x"})))  # no hint: power of two
    assert len(plain) == 1 and sorted(r.replica_id.unique_id for r in plain[0]) == ["a", "b"]
