"""Fast unit tests: hook names, request schemas, position selection, the array wire format."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from pydantic import ValidationError

from replicas.api import arrays
from replicas.api import CaptureSpec, GenerateRequest, GenerateResult, Intervention
from replicas.api.hooks import HookNameError, HookPoint, resolve_hook, served_hook_names
from replicas.plans.request import PlanError, build_wire_plan, reduced_on_replica
from replicas.plans.positions import EXPLICIT, MODE_CODES, captured_positions, concatenated_ranges, mode_code, selected_offsets, selected_spans, value_rows


@pytest.mark.parametrize(
    "name, point",
    [
        ("blocks.3.hook_resid_pre", HookPoint(3, "resid_pre")),
        ("blocks.3.hook_in", HookPoint(3, "resid_pre")),
        ("blocks.0.ln2.hook_in", HookPoint(0, "resid_mid")),
        ("blocks.12.hook_out", HookPoint(12, "resid_post")),
        ("blocks.1.attn.hook_out", HookPoint(1, "attn_unnormed")),
        ("blocks.1.mlp.hook_out", HookPoint(1, "mlp_unnormed")),
        ("blocks.1.ln1_post.hook_out", HookPoint(1, "attn_out")),
        ("blocks.1.ln2_post.hook_in", HookPoint(1, "mlp_unnormed")),
        ("7:mlp_out", HookPoint(7, "mlp_out")),
        ("ln_final.hook_normalized", HookPoint(None, "ln_final")),
    ],
)
def test_every_spelling_resolves(name, point):
    assert resolve_hook(name) == point
    assert resolve_hook(point.canonical_name) == point
    assert resolve_hook(point.wire_key) == point


@pytest.mark.parametrize("name", ["blocks.1.hook_q", "1:resid", "resid_post", "blocks.x.hook_out", ""])
def test_unknown_names_list_the_accepted_forms(name):
    with pytest.raises(HookNameError, match="blocks.<i>.hook_<kind>"):
        resolve_hook(name)


def test_layer_range_is_checked_when_known():
    with pytest.raises(HookNameError, match="layers 0..3"):
        resolve_hook("blocks.4.hook_out", n_layers=4)


def test_served_names_follow_the_armed_kinds():
    names = served_hook_names(2, ["resid_post"])
    assert names == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "ln_final.hook_normalized"]
    assert len(served_hook_names(3)) == 3 * 5 + 1


def test_requests_accept_dicts_arrays_and_encoded_arrays():
    vector = np.arange(4, dtype=np.float32)
    for value in (vector, vector.tolist(), arrays.to_base64(vector)):
        edit = Intervention.model_validate({"hook": "0:resid_pre", "op": "add", "vector": value})
        np.testing.assert_array_equal(edit.vector, vector)
    request = GenerateRequest.model_validate({"prompt": [1, 2], "capture": {"hooks": ["0:resid_pre"]}})
    assert request.capture.positions == "all" and request.capture.dtype == "float32"


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"hook": "0:resid_pre", "op": "add"}, "needs field 'vector'"),
        ({"hook": "0:resid_pre", "op": "scale", "factor": 1.0, "vector": [1.0]}, "does not apply"),
        ({"hook": "0:resid_pre", "op": "add", "vector": [1.0, float("inf")]}, "NaN or infinite"),
        ({"hook": "0:resid_pre", "op": "project_out", "vector": [0.0, 0.0]}, "vector: project_out needs a non-zero"),
        ({"hook": "0:resid_pre", "op": "add", "vector": [0.0, 0.0], "norm_match": True}, "vector: add with norm_match needs a non-zero"),
        ({"hook": "0:resid_pre", "op": "add", "vector": [1e-30, 0.0], "norm_match": True}, None),  # tiny, not zero: allowed
        ({"hook": "0:resid_pre", "op": "add", "vector": [1.0], "phase": "later"}, "phase"),
    ],
)
def test_bad_interventions_name_the_problem(edit, message):
    if message is None:
        edit = Intervention.model_validate(edit)
        assert np.isfinite(arrays.unit(edit.vector)).all() and abs(np.linalg.norm(arrays.unit(edit.vector)) - 1) < 1e-6
        return
    with pytest.raises(ValidationError, match=message):
        Intervention.model_validate(edit)


def test_a_seed_past_a_signed_64_bit_integer_is_refused_naming_the_field():
    """vLLM's engine cannot take such a seed (its server refuses it too): it failed the request as a 500."""
    from deploy.openai_translate import OpenAIRequestError, translate_chat
    from replicas.api.errors import InvalidRequestError
    from replicas.api.validation import validated

    for seed in (2**63 - 1, -(2**63), 0):
        assert validated({"prompt": "x", "seed": seed}).seed == seed
    for seed in (2**63, -(2**63) - 1, 2**70):
        with pytest.raises(InvalidRequestError, match=r"seed: Input should be (less|greater) than or equal to"):
            validated({"prompt": "x", "seed": seed})
    with pytest.raises(OpenAIRequestError, match="seed: Input should be less than or equal to 9223372036854775807") as refused:
        translate_chat({"messages": [{"role": "user", "content": "x"}], "seed": 2**70}, ["m"], 512)
    assert refused.value.param == "seed" and refused.value.status == 400


def test_selected_offsets():
    # a chunk of 6 rows at positions 3..8: the end of a 5-token prompt, then generated tokens
    assert selected_offsets("all", 3, 6, 5).tolist() == [0, 1, 2, 3, 4, 5]
    assert selected_offsets("prompt", 3, 6, 5).tolist() == [0, 1]
    assert selected_offsets("generated", 3, 6, 5).tolist() == [2, 3, 4, 5]
    assert selected_offsets("last_prompt", 3, 6, 5).tolist() == [1]
    assert selected_offsets("last_prompt", 6, 1, 5).tolist() == []
    assert selected_offsets("prompt", 7, 1, 5).tolist() == []
    assert selected_offsets([7, -1], 3, 6, 5).tolist() == [1, 4]
    assert value_rows([-1, 7], np.array([4, 7]), 5, 2).tolist() == [0, 1]
    assert value_rows("generated", np.array([6, 7]), 5, 4).tolist() == [1, 2]



def test_vectorized_selection_equals_the_per_chunk_one():
    """The step loop selects rows for a whole batch at once; each chunk must get what it would alone."""
    rng = np.random.default_rng(0)
    modes = ["all", "prompt", "generated", "last_prompt"]
    codes = rng.integers(0, 4, 500)
    start, count, prompt_len = rng.integers(0, 40, 500), rng.integers(1, 20, 500), rng.integers(1, 40, 500)
    a, b = selected_spans(codes, start, count, prompt_len)
    assert ((0 <= a) & (a <= b) & (b <= count)).all(), "spans index rows of the step: they stay inside the chunk"
    for i in range(500):
        expected = selected_offsets(modes[codes[i]], int(start[i]), int(count[i]), int(prompt_len[i]))
        assert np.arange(a[i], b[i]).tolist() == expected.tolist()
    assert mode_code([0, 3]) == EXPLICIT and mode_code("generated") == MODE_CODES["generated"]


def test_batch_row_helpers():
    from replicas.worker.edit_table import fill_ranges
    from replicas.worker.request_table import Columns

    assert concatenated_ranges(np.array([5, 0, 9]), np.array([2, 0, 3])).tolist() == [5, 6, 9, 10, 11]
    row = np.zeros(8, np.int64)
    fill_ranges(row, np.array([1, 4, 6]), np.array([3, 4, 8]), np.array([7, 9, 2]))
    assert row.tolist() == [0, 7, 7, 0, 0, 0, 2, 2]
    columns = Columns(capacity=2)
    columns.add("group", -1)
    handles = [columns.allocate() for _ in range(5)]  # grows twice, keeping what was set
    columns["group"][handles] = [10, 11, 12, 13, 14]
    columns.release(handles[1])
    assert columns["group"][columns.rows(np.array([handles[0], -2, handles[4], handles[1]]))].tolist() == [10, -1, 14, -1]

def plan(request: dict, **overrides):
    options = dict(prompt_len=10, n_layers=4, d_model=4, armed_kinds={"resid_post", "mlp_out"}, steer_kinds={"resid_post"},
                   edit_stages=1, max_capture_bytes=1000)
    return build_wire_plan("k", GenerateRequest.model_validate({"prompt": [1] * 10} | request), **(options | overrides))


def test_plans_reject_what_the_model_or_deployment_cannot_serve():
    assert plan({}) is None
    with pytest.raises(PlanError, match="has not armed"):
        plan({"capture": {"hooks": ["0:attn_out"]}})
    with pytest.raises(PlanError, match=r"layer 2 .* steerable layers: \[0, 1\]"):
        plan({"interventions": [{"hook": "2:resid_post", "op": "scale", "factor": 2.0}]}, steer_layers={0, 1})
    with pytest.raises(PlanError, match="steer_kinds"):
        plan({"interventions": [{"hook": "0:mlp_out", "op": "scale", "factor": 2.0}]})
    with pytest.raises(PlanError, match="outside the sequence"):
        plan({"max_tokens": 2, "capture": {"hooks": ["0:resid_post"], "positions": [11]}})
    with pytest.raises(PlanError, match="max_capture_bytes=1000"):
        plan({"max_tokens": 60, "capture": {"hooks": ["0:resid_post"]}})
    with pytest.raises(PlanError, match="at most 1 per hook"):
        edit = {"hook": "1:resid_post", "op": "scale", "factor": 2.0}
        plan({"interventions": [edit, edit]})
    with pytest.raises(PlanError, match="width 3"):
        plan({"interventions": [{"hook": "1:resid_post", "op": "add", "vector": [1.0, 2.0, 3.0]}]})
    wire = plan({"capture": {"hooks": ["0:resid_post"], "positions": "last_prompt"}})
    assert wire["capture"]["sites"] == [[0, "resid_post", "0:resid_post"]]


def test_edits_at_disjoint_explicit_positions_share_a_stage_and_keep_their_order():
    """A row takes one edit per stage: edits at disjoint explicit positions (a per-position add)
    share one, and an edit goes after every earlier one at its hook that may touch its rows."""
    def add(positions) -> dict:
        return {"hook": "1:resid_post", "op": "add", "vector": [1.0, 2.0, 3.0, 4.0], "positions": positions}

    scale = {"hook": "1:resid_post", "op": "scale", "factor": 2.0, "positions": "prompt"}
    wire = plan({"interventions": [add([1]), add([3, 3]), add([-1]), add([2, 0])]})["edits"]
    assert [e["stage"] for e in wire] == [0, 0, 0, 0]
    wire = plan({"interventions": [add([1]), scale, add([4]), add([1, 5])]}, edit_stages=3)["edits"]
    assert [e["stage"] for e in wire] == [0, 1, 2, 2]  # [1, 5] goes after [1] and after the mode
    with pytest.raises(PlanError, match=r"interventions\[1\]: 2 edits at hook '1:resid_post' may touch one position; .* at most 1 per hook at a position"):
        plan({"interventions": [add([1, 2]), add([-8])]})  # -8 is position 2 of 10
    with pytest.raises(PlanError, match=r"interventions\[2\]: 3 edits .* at most 2 per hook"):
        plan({"interventions": [add([1]), scale, add([4])]}, edit_stages=2)


def test_a_position_listed_twice_is_edited_once_and_refused_for_rows_that_come_back():
    """TransformerLens: act[:, [3, 3]] += v adds v once; act[:, [3, 3]] = rows takes the last row.
    Captured rows come back once per position, so a repeat there is refused with what to do."""
    edit = {"hook": "1:resid_post", "op": "set", "values": [[1.0] * 4, [2.0] * 4, [3.0] * 4], "positions": [3, -7, 5]}
    assert plan({"interventions": [edit]})["edits"][0]["positions"] == [3, -7, 5]
    assert selected_offsets([3, -7, 5], 0, 10, 10).tolist() == [3, 5]
    assert value_rows([3, -7, 5], np.array([3, 5]), 10, 3).tolist() == [1, 2]  # position 3: the last row given for it
    for field, request in (("capture", {"capture": {"hooks": ["0:resid_post"], "positions": [3, -7]}}),
                           ("logits", {"logits": {"positions": [3, 3]}})):
        with pytest.raises(PlanError, match=rf"{field}.positions: position 3 is listed more than once .* list each position once"):
            plan(request, d_vocab=5)


def test_a_kind_the_block_shape_lacks_is_refused_with_the_reason():
    from replicas.engine.architectures import absent_kinds

    parallel = dict(armed_kinds={"resid_post", "resid_mid"}, steer_kinds={"resid_mid"}, absent_kinds=absent_kinds("parallel"))
    with pytest.raises(PlanError, match=r"capture.hooks\[0\]: hook 'blocks.1.ln2.hook_in' does not exist in this model: .*parallel"):
        plan({"capture": {"hooks": ["blocks.1.ln2.hook_in"]}}, **parallel)
    with pytest.raises(PlanError, match=r"interventions\[0\].hook: .* does not exist"):
        plan({"interventions": [{"hook": "0:resid_mid", "op": "scale", "factor": 2.0}]}, **parallel)


def test_router_hooks_are_planned_at_their_own_widths_on_sparse_layers_only():
    from replicas.api import MoeInfo
    from replicas.engine.architectures import absent_kinds

    moe = dict(armed_kinds={"resid_post", "router_logits", "expert_ids"}, steer_kinds={"router_logits"},
               moe=MoeInfo(n_experts=8, top_k=2, layers=[1, 2, 3]), max_capture_bytes=10_000)
    wire = plan({"capture": {"hooks": ["blocks.1.mlp.hook_expert_ids", "2:router_logits"]}}, **moe)
    assert wire["capture"]["width"] == 8  # the widest of the two: n_experts
    wire = plan({"capture": {"hooks": ["blocks.1.mlp.hook_expert_indices"]}}, **moe)
    assert (wire["capture"]["width"], wire["capture"]["sites"]) == (2, [[1, "expert_ids", "blocks.1.mlp.hook_expert_indices"]])
    with pytest.raises(PlanError, match=r"layer 0 of this model is dense \(no router\); the layers with a router are \[1, 2, 3\]"):
        plan({"capture": {"hooks": ["0:router_logits"]}}, **moe)
    with pytest.raises(PlanError, match="width 4 does not match the router's n_experts=8"):
        plan({"interventions": [{"hook": "1:router_logits", "op": "add", "vector": [1.0] * 4}]}, **moe)
    assert plan({"interventions": [{"hook": "1:router_logits", "op": "add", "vector": [0.0] * 7 + [-1e4]}]}, **moe)
    with pytest.raises(PlanError, match="'mean' does not apply to expert ids"):
        plan({"capture": {"hooks": ["1:expert_ids"], "reduce": "mean"}}, **moe)
    with pytest.raises(ValueError, match="router's choice and cannot be edited.*hook_router_logits"):
        Intervention.model_validate({"hook": "1:expert_ids", "op": "scale", "factor": 0.0})
    dense = dict(armed_kinds={"resid_post"}, absent_kinds=absent_kinds("pre_norm"))
    with pytest.raises(PlanError, match="does not exist in this model: this model has no mixture-of-experts layers"):
        plan({"capture": {"hooks": ["blocks.0.mlp.hook_router_logits"]}}, **dense)


@pytest.mark.parametrize(
    "positions, max_tokens, on_replica",
    [("prompt", 4, False), ("last_prompt", 4, False), ([0, -1], 4, False), ("all", 4, True), ("generated", 4, True), ([2, 11], 4, True)],
)
def test_a_mean_over_generated_rows_is_taken_by_the_replica(positions, max_tokens, on_replica):
    """The engine core may run past a stop string; only the replica knows which rows to average."""
    spec = {"hooks": ["0:resid_post"], "positions": positions, "reduce": "mean", "dtype": "bfloat16"}
    assert reduced_on_replica(CaptureSpec.model_validate(spec), prompt_len=10) == on_replica
    capture = plan({"max_tokens": max_tokens, "capture": spec}, max_capture_bytes=10_000)["capture"]
    # the worker keeps whole float32 rows when the replica averages them, a float32 sum otherwise
    assert (capture["reduce"], capture["dtype"]) == (("none", "float32") if on_replica else ("mean", "bfloat16"))


def test_array_wire_format_round_trips_every_dtype():
    for name in ("float32", "float16", "bfloat16", "int64"):
        array = np.arange(6).reshape(2, 3).astype(arrays.DTYPES[name])
        for encoded in (arrays.to_raw(array), arrays.to_base64(array)):
            decoded = arrays.from_raw(encoded)
            assert decoded.dtype == array.dtype and decoded.shape == (2, 3)
            np.testing.assert_array_equal(decoded.astype(np.float32), array.astype(np.float32))
    with pytest.raises(ValueError, match="need 24"):
        arrays.from_raw({"dtype": "float32", "shape": [2, 3], "data": b"\0" * 8})


def test_edit_slots_admit_by_distinct_ops():
    """Requests with the same steering vector share one table row; a new vector waits for a free one."""
    import asyncio

    from replicas.engine.edit_slots import EditSlots

    def edit(vector: list[float]) -> dict:
        return {"layer": 1, "kind": "resid_post", "stage": 0, "op": "add", "vector": arrays.to_raw(np.array(vector, np.float32)),
                "values": None, "scale": 1.0, "norm_match": False, "factor": None}

    async def scenario() -> list[str]:
        slots, order = EditSlots(1), []

        async def run(name: str, vector: list[float], hold: asyncio.Event) -> None:
            async with slots.hold([edit(vector)]):
                order.append(f"{name} in")
                await hold.wait()
            order.append(f"{name} out")

        release = asyncio.Event()
        same = [asyncio.ensure_future(run(n, [1.0, 2.0], release)) for n in ("a", "b")]
        other = asyncio.ensure_future(run("c", [3.0, 4.0], asyncio.Event()))
        await asyncio.sleep(0.05)
        order.append("released")
        release.set()
        await asyncio.gather(*same)
        await asyncio.sleep(0.05)
        other.cancel()
        return order

    order = asyncio.run(scenario())
    assert order[:3] == ["a in", "b in", "released"]  # both share the one slot; c waited
    assert order.index("c in") > order.index("b out")
    # one request that needs more rows at a hook than there are would wait for ever: refused
    EditSlots(2).check([edit([1.0, 2.0]), edit([1.0, 2.0]), edit([3.0, 4.0])])
    with pytest.raises(PlanError, match=r"interventions: 3 distinct edits at layer 1 resid_post .* at most 2 there at once \(engine option edit_slots\)"):
        EditSlots(2).check([edit([1.0, 2.0]), edit([3.0, 4.0]), edit([5.0, 6.0])])


def test_captured_positions_follow_each_mode_and_stop_where_the_rows_did():
    """Rows are not stored with their positions: the result lists them from the spec and the
    number of rows captured (fewer when generation stopped early)."""
    assert captured_positions("all", 5, 7) == list(range(7))
    assert captured_positions("prompt", 5, 5) == list(range(5))
    assert captured_positions("generated", 5, 3) == [5, 6, 7]
    assert captured_positions("last_prompt", 5, 1) == [4]
    assert captured_positions([7, -1, 0], 5, 3) == [0, 4, 7]
    assert captured_positions([7, -1, 0], 5, 2) == [0, 4]  # stopped before position 7 was fed


def test_results_pickle_every_array_out_of_band():
    """Ray pickles results with protocol 5: bytes handed to the buffer callback travel out-of-band
    (zero-copy reads of the object store on one node); bytes inside the stream are copied on every
    hop. numpy keeps ml_dtypes' bfloat16 in the stream unless the result hands over its bits."""
    rng = np.random.default_rng(0)
    captured = {
        "blocks.0.hook_resid_post": rng.standard_normal((64, 32)).astype(arrays.DTYPES["bfloat16"]),
        "blocks.1.hook_resid_post": rng.standard_normal((64, 32)).astype(np.float16),
        "blocks.2.hook_resid_post": rng.standard_normal(32).astype(np.float32),
    }
    result = GenerateResult(request_id="r", text="", token_ids=[], prompt_token_ids=[], finish_reason=None, choices=[],
                            activations=captured)
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(result, protocol=5, buffer_callback=buffers.append)
    assert sorted(b.raw().nbytes for b in buffers) == sorted(a.nbytes for a in captured.values())
    assert len(stream) < 2048
    loaded = pickle.loads(stream, buffers=buffers)
    for hook, array in captured.items():
        assert loaded.activations[hook].dtype == array.dtype and loaded.activations[hook].shape == array.shape
        assert np.array_equal(loaded.activations[hook].view(np.uint8), array.view(np.uint8))
    assert result.activations == captured  # pickling left the result itself alone
    assert pickle.loads(pickle.dumps(result)).activations["blocks.0.hook_resid_post"].dtype == arrays.DTYPES["bfloat16"]


def test_logits_and_every_completion_count_against_the_byte_cap():
    """The worker holds each of n completions' rows in full, and logits as float32 [rows, d_vocab]."""
    capture = {"hooks": ["0:resid_post"], "positions": "all"}  # 14 rows x 4 x 4 bytes = 224 bytes a completion
    assert plan({"max_tokens": 5, "n": 4, "capture": capture})["capture"]["max_rows"] == 14  # 896 bytes
    with pytest.raises(PlanError, match=r"capture/n: \(1 hooks x 14 positions x 4 x 4 bytes = 224 bytes\) "
                                        r"x n=5 completions \(each captures in full\) = 1120 bytes, over the replica's "
                                        r"max_capture_bytes=1000; .*lower n"):
        plan({"max_tokens": 5, "n": 5, "capture": capture})
    logits = {"positions": "all"}  # 14 rows x 100 x 4 bytes = 5,600 bytes
    with pytest.raises(PlanError, match=r"^logits: 14 positions x 100 x 4 bytes = 5600 bytes, over "
                                        r"the replica's max_capture_bytes=1000"):
        plan({"max_tokens": 5, "logits": logits}, d_vocab=100)
    # together: 224 + 2 x 100 x 4 = 1,024 bytes, each part under the cap alone
    with pytest.raises(PlanError, match=r"capture/logits: capture: .* = 224 bytes \+ logits: 2 positions .* = 1024 bytes, over"):
        plan({"max_tokens": 5, "capture": capture, "logits": {"positions": [0, 1]}}, d_vocab=100)
    assert plan({"max_tokens": 5, "capture": capture, "logits": {"positions": [0]}}, d_vocab=100)["logits"]["max_rows"] == 1


def test_a_request_carries_at_most_max_set_edits_set_interventions():
    def patch(layer: int) -> dict:
        return {"hook": f"{layer}:resid_post", "op": "set", "values": [1.0, 2.0, 3.0, 4.0], "positions": [0]}

    steer = {"steer_kinds": {"resid_post"}, "armed_kinds": {"resid_post"}}
    assert len(plan({"interventions": [patch(0), patch(1)]}, max_set_edits=2, **steer)["edits"]) == 2
    with pytest.raises(PlanError, match=r"interventions\[2\]: 3 `set` interventions .* at most 2 \(engine option max_set_edits\)"):
        plan({"interventions": [patch(0), patch(1), patch(2)]}, max_set_edits=2, **steer)


def test_transformerlens_puts_hook_attn_out_after_the_post_norm_and_attn_hook_out_before_it():
    """The definitions the hook names follow, read off TransformerLens 4.3 itself: a block with
    post-norms re-points hook_attn_out / hook_mlp_out at ln1_post / ln2_post's output, while
    attn.hook_out stays the attention module's own output (capserve's attn_unnormed)."""
    pytest.importorskip("transformer_lens", reason="the tl extra (transformer-lens 4.3) is not installed")
    from transformer_lens.model_bridge.generalized_components.block import BlockBridge
    from transformer_lens.model_bridge.generalized_components.normalization import NormalizationBridge

    post = {key: NormalizationBridge(name=key, config=None) for key in ("ln1", "ln1_post", "ln2", "ln2_post")}
    aliases = BlockBridge(name="layer", submodules=post).hook_aliases
    assert aliases["hook_attn_out"] == "ln1_post.hook_out" and aliases["hook_mlp_out"] == "ln2_post.hook_out"
    assert BlockBridge.hook_aliases["hook_attn_out"] == "attn.hook_out"
    assert resolve_hook("blocks.0.hook_attn_out") == resolve_hook("blocks.0.ln1_post.hook_out") == HookPoint(0, "attn_out")
    assert resolve_hook("blocks.0.attn.hook_out") == resolve_hook("blocks.0.ln1_post.hook_in") == HookPoint(0, "attn_unnormed")
