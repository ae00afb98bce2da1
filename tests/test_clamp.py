"""The clamp op without an engine: its schema, its plan and its edit-table row, and the exact math of a
site applying it to residual rows and head by head (the engine checks against HF are in
tests/test_engine_interventions.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replicas.api import GenerateRequest, Intervention
from replicas.api.hooks import HookPoint
from replicas.engine.edit_slots import EditSlots
from replicas.plans.request import PlanError, RequestPlan, build_wire_plan
from replicas.worker.sites import Site, table_row

D = 4
HEADS = {"z": (2, 2), "q": (2, 2), "k": (2, 2), "v": (2, 2)}


def plan_edits(*edits: dict, head_shapes=HEADS) -> list:
    request = GenerateRequest.model_validate({"prompt": [1] * 6, "interventions": list(edits)})
    wire = build_wire_plan("k", request, prompt_len=6, n_layers=2, d_model=D, armed_kinds={"resid_post", "z"},
                           steer_kinds={"resid_post", "z"}, edit_stages=2, max_capture_bytes=1 << 20, head_shapes=head_shapes)
    return RequestPlan.from_wire(wire).edits


def site(per_column: bool = False, d_head: int | None = None, dtype: torch.dtype = torch.float32) -> Site:
    return Site(HookPoint(0, "z" if per_column else "resid_post"), d_model=D, max_tokens=4, edit_stages=1, edit_slots=4,
                capture=True, dtype=dtype, device=torch.device("cpu"), values=torch.zeros(16, D, dtype=dtype),
                per_column=per_column, d_head=d_head)


def clamped(rows: np.ndarray, direction: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """h + (clip(h . u, lo, hi) - h . u) u, u the unit direction, in float64."""
    unit = direction / np.linalg.norm(direction)
    dot = rows @ unit
    return rows + (np.clip(dot, lo, hi) - dot)[:, None] * unit


def test_a_residual_site_clamps_the_component_along_the_unit_vector_and_leaves_slot_0_rows_alone():
    vector = np.array([3.0, 4.0, 0.0, 0.0], np.float32)
    cap, floor, band = plan_edits(
        {"hook": "1:resid_post", "op": "clamp", "vector": vector, "max": 1.0},
        {"hook": "1:resid_post", "op": "clamp", "vector": vector * 7, "min": 2.0, "positions": [0]},
        {"hook": "1:resid_post", "op": "clamp", "vector": -vector, "min": -0.5, "max": 0.5, "positions": [1]},
    )
    assert (cap.lo, cap.hi) == (-np.inf, 1.0) and (floor.lo, floor.hi) == (2.0, np.inf)
    np.testing.assert_allclose(cap.direction, [0.6, 0.8, 0, 0], rtol=1e-6)  # unit on the worker
    edited = site()
    for slot, edit in enumerate((cap, floor, band), start=1):
        edited.table[0, slot] = torch.from_numpy(table_row(edit, D))
    rows = np.array([[1.0, 2.0, -4.0, 3.0], [-5.0, 1.0, 0.5, 2.0], [1.0, 2.0, -4.0, 3.0], [0.3, 0.1, 9.0, -7.0]], np.float32)
    # components along u = (0.6, 0.8): 2.2 (capped at 1), -2.2 (raised to 2), along -u -2.2 (raised to -0.5)
    edited.slot[0, :4] = torch.tensor([1, 2, 3, 0])
    out = edited(torch.from_numpy(rows)).numpy()
    expected = [clamped(rows[:1], vector, -np.inf, 1.0)[0], clamped(rows[1:2], vector, 2.0, np.inf)[0],
                clamped(rows[2:3], -vector, -0.5, 0.5)[0]]
    np.testing.assert_allclose(out[:3], expected, atol=1e-6)
    np.testing.assert_allclose(out[:3] @ np.array([0.6, 0.8, 0, 0]), [1.0, 2.0, 0.5], atol=1e-6)
    np.testing.assert_array_equal(out[3], rows[3])  # slot 0: bit for bit
    np.testing.assert_array_equal(edited.staging[:4].numpy(), out)
    # a row already within its bounds comes out as it went in
    edited.slot[0, :1] = torch.tensor([3])
    inside = np.array([[0.06, 0.08, 5.0, -1.0]], np.float32)
    np.testing.assert_allclose(edited(torch.from_numpy(inside)).numpy(), inside, atol=1e-7)


def test_min_and_max_zero_is_project_out_bit_for_bit():
    vector = np.random.default_rng(0).standard_normal(D).astype(np.float32)
    clamp, project = plan_edits({"hook": "1:resid_post", "op": "clamp", "vector": vector, "min": 0.0, "max": 0.0},
                                {"hook": "1:resid_post", "op": "project_out", "vector": vector})
    edited = site()
    edited.table[0, 1] = torch.from_numpy(table_row(clamp, D))
    edited.table[0, 2] = torch.from_numpy(table_row(project, D))
    rows = torch.from_numpy(np.random.default_rng(1).standard_normal((2, D)).astype(np.float32))
    edited.slot[0, :2] = torch.tensor([1, 1])
    by_clamp = edited(rows.clone())
    edited.slot[0, :2] = torch.tensor([2, 2])
    np.testing.assert_array_equal(by_clamp.numpy(), edited(rows.clone()).numpy())


def test_a_half_precision_site_clamps_in_float32_and_keeps_unedited_rows():
    edit = plan_edits({"hook": "1:resid_post", "op": "clamp", "vector": [1.0, 0.0, 0.0, 0.0], "max": 2.0})[0]
    edited = site(dtype=torch.float16)
    edited.table[0, 1] = torch.from_numpy(table_row(edit, D))
    rows = torch.tensor([[300.0, 200.0, 100.0, -50.0], [300.0, 200.0, 100.0, -50.0]], dtype=torch.float16)
    edited.slot[0, :2] = torch.tensor([1, 0])
    out = edited(rows)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert out[0].tolist() == [2.0, 200.0, 100.0, -50.0]
    assert torch.equal(out[1], rows[1])


def test_a_per_head_site_clamps_each_chosen_head_along_its_own_direction():
    """As a hook on [pos, head, d_head] would: per chosen head c = z[:, head] . u_head, clipped into
    [min, max]; heads not chosen, and rows at slot 0, are untouched."""
    own = np.array([[3.0, 4.0], [0.0, 2.0]], np.float32)
    both, one = plan_edits({"hook": "0:z", "op": "clamp", "vector": own, "max": 0.5},
                           {"hook": "0:z", "op": "clamp", "vector": [1.0, 1.0], "min": 1.0, "heads": [1]})
    np.testing.assert_allclose(both.direction, [0.6, 0.8, 0.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(one.direction, [0.0, 0.0, 2 ** -0.5, 2 ** -0.5], rtol=1e-6)
    edited = site(per_column=True, d_head=2)
    edited.table[0, 1] = torch.from_numpy(table_row(both, D, per_column=True))
    edited.table[0, 2] = torch.from_numpy(table_row(one, D, per_column=True))
    rows = np.array([[1.0, 2.0, -4.0, 3.0], [1.0, 2.0, -4.0, 3.0], [1.0, 2.0, -4.0, 3.0]], np.float32)
    edited.slot[0, :3] = torch.tensor([1, 2, 0])
    out = edited(torch.from_numpy(rows)).numpy()
    expected_both = np.concatenate([clamped(rows[:1, :2], own[0], -np.inf, 0.5), clamped(rows[:1, 2:], own[1], -np.inf, 0.5)], 1)
    expected_one = np.concatenate([rows[1:2, :2], clamped(rows[1:2, 2:], np.array([1.0, 1.0]), 1.0, np.inf)], 1)
    np.testing.assert_allclose(out[:2], np.concatenate([expected_both, expected_one]), atol=1e-6)
    np.testing.assert_array_equal(out[2], rows[2])


def test_clamps_with_other_bounds_take_their_own_table_row():
    vector = [1.0, 0.0, 0.0, 0.0]
    low, high = plan_edits({"hook": "1:resid_post", "op": "clamp", "vector": vector, "max": 1.0},
                           {"hook": "1:resid_post", "op": "clamp", "vector": vector, "max": 2.0, "positions": [0]})
    assert table_row(low, D).tobytes() != table_row(high, D).tobytes()
    request = GenerateRequest.model_validate({"prompt": [1] * 6, "interventions": [
        {"hook": "1:resid_post", "op": "clamp", "vector": vector, "max": m, "positions": [i]} for i, m in enumerate((1.0, 2.0, 3.0))]})
    wire = build_wire_plan("k", request, prompt_len=6, n_layers=2, d_model=D, armed_kinds={"resid_post"},
                           steer_kinds={"resid_post"}, edit_stages=1, max_capture_bytes=1 << 20)
    # at disjoint positions the three share a stage, but each needs its own row there
    with pytest.raises(PlanError, match="3 distinct edits at layer 1 resid_post"):
        EditSlots(2).check(wire["edits"])


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"op": "clamp", "vector": [1.0, 0.0]}, "needs 'min', 'max' or both"),
        ({"op": "clamp", "vector": [1.0, 0.0], "min": 2.0, "max": 1.0}, r"min \(2.0\) exceeds max \(1.0\)"),
        ({"op": "clamp", "vector": [0.0, 0.0], "max": 1.0}, "clamp needs a non-zero vector"),
        ({"op": "clamp", "max": 1.0}, "needs field 'vector'"),
        ({"op": "clamp", "vector": [1.0, 0.0], "max": float("inf")}, "max must be a finite number; leave it out"),
        ({"op": "clamp", "vector": [1.0, 0.0], "max": 1.0, "scale": 2.0}, "field 'scale' does not apply to op 'clamp'"),
        ({"op": "clamp", "vector": [1.0, 0.0], "max": 1.0, "norm_match": True}, "field 'norm_match' does not apply"),
        ({"op": "clamp", "vector": [1.0, 0.0], "max": 1.0, "factor": 2.0}, "field 'factor' does not apply to op 'clamp'"),
        ({"op": "clamp", "vector": [1.0, 0.0], "max": 1.0, "heads": [0]}, "heads applies to the attention hooks"),
        ({"op": "add", "vector": [1.0, 0.0], "max": 1.0}, "field 'max' does not apply to op 'add' \\(only clamp"),
        ({"op": "project_out", "vector": [1.0, 0.0], "min": 0.0}, "field 'min' does not apply to op 'project_out'"),
    ],
)
def test_bad_clamps_name_the_field(edit, message):
    with pytest.raises(ValueError, match=message):
        Intervention.model_validate({"hook": "1:resid_post"} | edit)


def test_a_per_head_clamp_with_no_direction_on_its_heads_is_refused():
    with pytest.raises(PlanError, match=r"interventions\[0\].vector: zero on the chosen heads, so there is no direction to clamp"):
        plan_edits({"hook": "0:z", "op": "clamp", "vector": [[1.0, 2.0], [0.0, 0.0]], "max": 1.0, "heads": [1]})
