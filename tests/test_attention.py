"""The attention hooks' pieces without an engine: names, plans of per-head edits, the per-head site,
and patterns computed from q and k. The engine checks against HF are in tests/test_architectures.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from replicas import _vllm
from replicas.api import AttentionInfo, CaptureSpec, GenerateRequest, Intervention
from replicas.engine.attention import attention_scores, finish_capture, softmax
from replicas.api.hooks import HookNameError, HookPoint, captured_kinds, resolve_hook, served_hook_names
from replicas.plans.request import PlanError, RequestPlan, build_wire_plan
from replicas.worker.sites import Site, table_row

HEADS = {"q": (4, 2), "k": (2, 2), "v": (2, 2), "z": (4, 2)}  # 4 query heads of 2, 2 KV heads


def test_attention_hook_names_resolve_in_every_spelling():
    for name in ("blocks.3.attn.hook_z", "blocks.3.attn.o.hook_in", "3:z"):
        assert resolve_hook(name) == HookPoint(3, "z")
    for name in ("blocks.1.attn.hook_q", "blocks.1.attn.hook_rot_q", "blocks.1.attn.q.hook_out", "1:q"):
        assert resolve_hook(name) == HookPoint(1, "q")
    assert resolve_hook("blocks.0.attn.hook_pattern").canonical_name == "blocks.0.attn.hook_pattern"
    assert resolve_hook("2:attn_scores").wire_key == "2:attn_scores"
    with pytest.raises(HookNameError, match="attn.hook_<kind>"):
        resolve_hook("blocks.0.attn.hook_nothing")
    assert captured_kinds(["resid_post", "pattern"]) == ["resid_post", "q", "k"]
    assert "blocks.1.attn.hook_pattern" in served_hook_names(2, ["z", "pattern"])


def plan(request: dict, **overrides):
    options = dict(prompt_len=10, n_layers=4, d_model=6, armed_kinds={"resid_post", "q", "k", "v", "z", "pattern"},
                   steer_kinds={"q", "z", "resid_post"}, edit_stages=1, max_capture_bytes=1 << 20, head_shapes=HEADS)
    return build_wire_plan("k", GenerateRequest.model_validate({"prompt": [1] * 10} | request), **(options | overrides))


def test_a_pattern_captures_its_layers_q_and_k_at_every_key_position():
    wire = plan({"capture": {"hooks": ["blocks.2.attn.hook_pattern", "2:resid_post"], "positions": "last_prompt"}})["capture"]
    assert wire["sites"] == [[2, "resid_post", "2:resid_post"], [2, "q", "blocks.2.attn.hook_q"], [2, "k", "blocks.2.attn.hook_k"]]
    assert wire["positions"] == "prompt" and wire["max_rows"] == 10 and wire["width"] == 8
    assert plan({"capture": {"hooks": ["0:pattern"], "positions": [3, 12]}, "max_tokens": 5})["capture"]["positions"] == "all"
    # q asked for by name is captured once, under that name
    assert plan({"capture": {"hooks": ["0:q", "0:pattern"]}})["capture"]["sites"][0] == [0, "q", "0:q"]
    with pytest.raises(PlanError, match="reduce: 'mean' does not apply"):
        plan({"capture": {"hooks": ["0:pattern"], "reduce": "mean"}})


def test_head_selectors_become_column_factors_and_masked_rows():
    scale = plan({"interventions": [{"hook": "1:z", "op": "scale", "factor": 0.0, "heads": [1, 3]}]})["edits"][0]
    edit = RequestPlan.from_wire({"key": "k", "prompt_len": 10, "edits": [scale]}).edits[0]
    assert edit.columns.tolist() == [1, 1, 0, 0, 1, 1, 0, 0] and edit.factor == 1.0
    patch = plan({"interventions": [{"hook": "1:z", "op": "set", "values": [[5.0, 6.0]], "heads": [2], "positions": "prompt"}]})
    edit = RequestPlan.from_wire({"key": "k", "prompt_len": 10, "edits": patch["edits"]}).edits[0]
    assert edit.columns.tolist() == [1, 1, 1, 1, 0, 0, 1, 1]
    assert edit.values.tolist() == [[0, 0, 0, 0, 5, 6, 0, 0]]
    add = plan({"interventions": [{"hook": "0:q", "op": "add", "vector": [[1, 2], [3, 4], [5, 6], [7, 8]], "heads": [0]}]})
    assert RequestPlan.from_wire({"key": "k", "prompt_len": 10, "edits": add["edits"]}).edits[0].direction.tolist() == [1, 2, 0, 0, 0, 0, 0, 0]
    with pytest.raises(PlanError, match=r"heads: head 4 is out of range; hook_z has heads 0..3"):
        plan({"interventions": [{"hook": "1:z", "op": "scale", "factor": 0.0, "heads": [4]}]})
    with pytest.raises(PlanError, match="width 3 fits neither"):
        plan({"interventions": [{"hook": "1:z", "op": "add", "vector": [1.0, 2.0, 3.0]}]})


def test_bad_attention_edits_name_the_field():
    with pytest.raises(ValueError, match="heads applies to the attention hooks"):
        Intervention.model_validate({"hook": "1:resid_post", "op": "scale", "factor": 0.0, "heads": [0]})
    with pytest.raises(ValueError, match="computed from q and k"):
        Intervention.model_validate({"hook": "1:pattern", "op": "scale", "factor": 0.0})
    with pytest.raises(ValueError, match="norm_match does not apply with heads"):
        Intervention.model_validate({"hook": "1:z", "op": "add", "vector": [1.0, 2.0], "norm_match": True, "heads": [0]})
    with pytest.raises(ValueError, match="distinct head indices"):
        Intervention.model_validate({"hook": "1:z", "op": "scale", "factor": 0.0, "heads": [1, 1]})


def test_a_per_head_site_scales_and_patches_only_the_chosen_heads():
    site = Site(HookPoint(0, "z"), d_model=4, max_tokens=3, edit_stages=1, edit_slots=3, capture=True,
                dtype=torch.float32, device=torch.device("cpu"), values=torch.zeros(6, 6), per_column=True)
    scale = plan({"interventions": [{"hook": "0:z", "op": "scale", "factor": 0.5, "heads": [1]}]}, head_shapes={"z": (2, 2)})
    patch = plan({"interventions": [{"hook": "0:z", "op": "set", "values": [9.0, 8.0], "heads": [0]}]}, head_shapes={"z": (2, 2)})
    for slot, wire in ((1, scale), (2, patch)):
        edit = RequestPlan.from_wire({"key": "k", "prompt_len": 10, "edits": wire["edits"]}).edits[0]
        site.table[0, slot] = torch.from_numpy(table_row(edit, 4, per_column=True))
    site.slot[0, :3] = torch.tensor([0, 1, 2])
    site.set_stage[:3] = torch.tensor([-1, -1, 0])
    site.set_row[:3] = torch.tensor([0, 0, 2])
    site.values[2] = torch.tensor([9.0, 8.0, 0.0, 0.0])
    out = site(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert out.tolist() == [[0, 1, 2, 3], [4, 5, 3, 3.5], [9, 8, 10, 11]]
    np.testing.assert_array_equal(site.staging[:3].numpy(), out.numpy())


def test_project_out_on_heads_removes_each_heads_component_along_its_own_direction():
    """As a hook on [pos, head, d_head] would: h[:, head] -= (h[:, head] . u) u per chosen head,
    u the unit direction of that head; the joint heads x d_head row is not projected as one."""
    site = Site(HookPoint(0, "z"), d_model=4, max_tokens=2, edit_stages=1, edit_slots=2, capture=True,
                dtype=torch.float32, device=torch.device("cpu"), values=torch.zeros(4, 4), per_column=True, d_head=2)
    shared = plan({"interventions": [{"hook": "0:z", "op": "project_out", "vector": [3.0, 4.0], "heads": [0, 1]}]},
                  head_shapes={"z": (2, 2)})
    edit = RequestPlan.from_wire({"key": "k", "prompt_len": 10, "edits": shared["edits"]}).edits[0]
    np.testing.assert_allclose(edit.direction, [0.6, 0.8, 0.6, 0.8], rtol=1e-6)
    site.table[0, 1] = torch.from_numpy(table_row(edit, 4, per_column=True))
    site.slot[0, :2] = torch.tensor([1, 0])
    rows = torch.tensor([[1.0, 2.0, -4.0, 3.0], [1.0, 2.0, -4.0, 3.0]])
    # head 0: (1, 2) . (0.6, 0.8) = 2.2 -> (1, 2) - 2.2 (0.6, 0.8); head 1 is orthogonal to it; row 1 unedited
    np.testing.assert_allclose(site(rows).numpy(), [[-0.32, 0.24, -4.0, 3.0], [1.0, 2.0, -4.0, 3.0]], atol=1e-6)
    own = plan({"interventions": [{"hook": "1:z", "op": "project_out", "vector": [[1, 2], [0, 5], [3, 0], [1, 1]], "heads": [1, 2]}]})
    edit = RequestPlan.from_wire({"key": "k", "prompt_len": 10, "edits": own["edits"]}).edits[0]
    assert edit.direction.tolist() == [0, 0, 0, 1, 1, 0, 0, 0]  # each chosen head's own direction, unit
    with pytest.raises(PlanError, match="zero on the chosen heads"):
        plan({"interventions": [{"hook": "1:z", "op": "project_out", "vector": [[1, 2], [0, 0], [3, 0], [1, 1]], "heads": [1]}]})


def test_a_z_site_written_in_place_hands_on_the_op_rows_and_stages_only_edits():
    """The attention op wrote z's rows into the site's staging buffer: an unedited site hands those
    rows on as they are (its input, the op's unwritten tensor, is never read) and copies nothing; a
    site that edits hands on the edited rows and stages them in place of the op's."""
    def site(stages: int) -> Site:
        return Site(HookPoint(0, "z"), d_model=4, max_tokens=3, edit_stages=stages, edit_slots=2, capture=True,
                    dtype=torch.float32, device=torch.device("cpu"), values=torch.zeros(6, 4), per_column=True,
                    written_in_place=True)

    written = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    plain = site(0)
    plain.staging[:2] = written
    out = plain(torch.full((2, 4), float("nan")))
    assert out.data_ptr() == plain.staging.data_ptr() and out.tolist() == written.tolist()
    edited = site(1)
    edited.staging[:2] = written
    edit = plan({"interventions": [{"hook": "0:z", "op": "scale", "factor": 0.0, "heads": [1]}]}, head_shapes={"z": (2, 2)})
    edited.table[0, 1] = torch.from_numpy(table_row(RequestPlan.from_wire({"key": "k", "prompt_len": 9, "edits": edit["edits"]}).edits[0],
                                                    4, per_column=True))
    edited.slot[0, :2] = torch.tensor([1, 0])
    out = edited(torch.full((2, 4), float("nan")))
    assert out.tolist() == [[0, 1, 0, 0], [4, 5, 6, 7]]
    assert edited.staging[:2].tolist() == out.tolist()


def test_attend_into_points_the_kernel_at_the_buffer_and_refuses_a_misfit():
    """`_vllm.attend_into` on an op whose impl writes `output` as vLLM's do: the rows land in the buffer."""
    class Impl:
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None):
            output.copy_(query * 2)
            return output

    class Op(torch.nn.Module):
        impl = Impl()

    op, buffer = Op(), torch.zeros(5, 6)
    _vllm.attend_into(op, buffer)
    query, output = torch.ones(3, 2, 3), torch.zeros(3, 2, 3)
    op.impl.forward(op, query, None, None, None, None, output=output)
    assert buffer[:3].tolist() == [[2.0] * 6] * 3 and not buffer[3:].any() and not output.any()
    with pytest.raises(_vllm.VllmInternalsError, match="does not fit the buffer"):
        op.impl.forward(op, query, None, None, None, None, output=torch.zeros(3, 2, 4))


def reference_scores(q, q_positions, k, scale, cap, window):
    """Loops over every (query, head, key): the definition, without vectorisation."""
    group = q.shape[1] // k.shape[1]
    n_keys = max(q_positions) + 1
    out = np.full((len(q_positions), q.shape[1], n_keys), -np.inf, np.float32)
    for i, position in enumerate(q_positions):
        for h in range(q.shape[1]):
            for j in range(n_keys):
                if j <= position and (window is None or position - j < window):
                    score = float(q[i, h] @ k[j, h // group]) * scale
                    out[i, h, j] = math.tanh(score / cap) * cap if cap else score
    return out


@pytest.mark.parametrize("cap, window", [(0.0, None), (50.0, 4), (0.0, 3)])
def test_patterns_follow_gqa_scale_soft_cap_and_window(cap, window):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((6, 4, 8)).astype(np.float32), rng.standard_normal((9, 2, 8)).astype(np.float32)
    info = AttentionInfo(n_heads=4, n_kv_heads=2, d_head=8, d_head_v=8, scale=[0.3], soft_cap=[cap], sliding_window=[window])
    positions = np.array([0, 2, 3, 5, 7, 8])
    scores = attention_scores(q, positions, k, info, 0)
    np.testing.assert_allclose(scores, reference_scores(q, positions, k, 0.3, cap, window), rtol=1e-5, atol=1e-5)
    pattern = softmax(scores)
    np.testing.assert_allclose(pattern.sum(-1), 1.0, rtol=1e-6)
    assert (pattern[0, :, 1:] == 0).all()


def test_finish_capture_keeps_the_asked_positions_and_shapes_heads():
    info = AttentionInfo(n_heads=2, n_kv_heads=1, d_head=2, d_head_v=2, scale=[1.0], soft_cap=[0.0], sliding_window=[None])
    rows = np.arange(5 * 6, dtype=np.float32).reshape(5, 6)  # 5 positions, rows padded to the widest hook (resid: 6)
    activations = {"0:resid_post": rows, "blocks.0.attn.hook_q": rows, "blocks.0.attn.hook_k": rows, "0:z": rows}
    capture = CaptureSpec(hooks=["0:resid_post", "0:pattern", "0:z"], positions=[1, -1])
    out, positions = finish_capture(activations, list(range(5)), capture, 5, 6, info, widened=True)
    assert positions == [1, 4] and set(out) == {"0:resid_post", "0:pattern", "0:z"}
    np.testing.assert_array_equal(out["0:resid_post"], rows[[1, 4]])
    np.testing.assert_array_equal(out["0:z"], rows[[1, 4], :4].reshape(2, 2, 2))
    assert out["0:pattern"].shape == (2, 2, 5)
    expected = attention_scores(rows[[1, 4], :4].reshape(2, 2, 2), np.array([1, 4]), rows[:, :2].reshape(5, 1, 2), info, 0)
    np.testing.assert_allclose(out["0:pattern"], softmax(expected))
