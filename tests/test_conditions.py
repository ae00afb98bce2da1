"""Conditional steering without an engine: the schema, the plan's test, the site's arithmetic, and an
SAE feature's activation as a read-out. The engine against HF: tests/test_readouts.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from replicas.api import GenerateRequest, Intervention
from replicas.api.errors import PlanError
from replicas.engine.edit_slots import _op_key
from replicas.engine.gates import resolve_conditions
from replicas.sae.specs import SaeCatalog
from tests.test_clamp import D, plan_edits, site
from replicas.worker.sites import table_row


def test_a_condition_takes_one_source_one_test_and_an_add():
    Intervention.model_validate({"hook": "0:resid_post", "op": "add", "vector": [1.0] * 4, "when": {"probe": "p", "below": 1.0}})
    for when, message in [({"above": 1.0}, "exactly one of probe, sae_id"), ({"probe": "p"}, "exactly one of above or below"),
                          ({"probe": "p", "vector": [1.0], "above": 0.0}, "got \\['probe', 'vector'\\]"),
                          ({"sae_id": "s", "above": 0.0}, "sae_id and feature go together"),
                          ({"sae_id": "s", "feature": 1, "below": 0.0}, "never negative"),
                          ({"probe": "p", "above": 0.0, "threshold": 1}, "Extra inputs")]:
        with pytest.raises(ValueError, match=message):
            Intervention.model_validate({"hook": "0:resid_post", "op": "add", "vector": [1.0] * 4, "when": when})
    with pytest.raises(ValueError, match="when: conditional steering takes op 'add', not 'scale'"):
        Intervention.model_validate({"hook": "0:resid_post", "op": "scale", "factor": 0.0, "when": {"probe": "p", "above": 0}})


def test_the_site_adds_only_on_rows_whose_read_out_crosses_and_leaves_the_rest_bit_for_bit():
    gate = np.array([1.0, -1.0, 0.5, 0.0], np.float32)
    vector = np.array([10.0, 20.0, 30.0, 40.0], np.float32)
    above, below = plan_edits(
        {"hook": "1:resid_post", "op": "add", "vector": vector, "when": {"vector": gate, "bias": 0.5, "above": 1.0}},
        {"hook": "1:resid_post", "op": "add", "vector": vector, "scale": -1.0, "when": {"vector": gate, "bias": 0.5, "below": 1.0}},
    )
    assert above.gate[2] == 1.0 and below.gate[1:] == (-0.5, -1.0)  # below: the test flipped, x.(-g) - 0.5 > -1
    edited = site()
    edited.table[0, 1] = torch.from_numpy(table_row(above, D))
    edited.table[0, 2] = torch.from_numpy(table_row(below, D))
    rows = np.array([[2.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 3.0], [0.0, 1.0, 0.0, 3.0], [2.0, 0.0, 0.0, 1.0]], np.float32)
    read = rows @ gate + 0.5  # 2.5, -0.5, -0.5, 2.5
    edited.slot[0, :4] = torch.tensor([1, 1, 2, 0])
    out = edited(torch.from_numpy(rows)).numpy()
    np.testing.assert_array_equal(out[0], rows[0] + vector)  # fires above
    np.testing.assert_array_equal(out[1], rows[1])  # does not fire: untouched, bit for bit
    np.testing.assert_array_equal(out[2], rows[2] - vector)  # fires below
    np.testing.assert_array_equal(out[3], rows[3])  # slot 0
    assert read[0] > 1.0 > read[1]
    # the gate is part of an edit's key: same vector, other condition, other table row
    plain = {"layer": 1, "kind": "resid_post", "stage": 0, "op": "add", "vector": {"data": b"v"}, "scale": 1.0,
             "norm_match": False, "factor": None, "columns": None}
    gated = plain | {"gate": {"vector": {"data": b"g"}, "bias": 0.5, "threshold": 1.0}}
    assert _op_key(plain) != _op_key(gated) != _op_key(gated | {"gate": {**gated["gate"], "threshold": 2.0}})


def test_the_plan_refuses_what_the_site_cannot_test():
    with pytest.raises(PlanError, match=r"interventions\[0\].when.vector: width 3 does not match the hook's 4"):
        plan_edits({"hook": "1:resid_post", "op": "add", "vector": [1.0] * 4, "when": {"vector": [1.0] * 3, "above": 0}})
    with pytest.raises(PlanError, match="per-head hooks"):
        plan_edits({"hook": "blocks.1.attn.hook_z", "op": "add", "vector": [1.0] * 4, "when": {"vector": [1.0] * 4, "above": 0}})
    with pytest.raises(PlanError, match=r"when.probe: this replica resolves no probes"):
        plan_edits({"hook": "1:resid_post", "op": "add", "vector": [1.0] * 4, "when": {"probe": "p", "above": 0}})


def sae_folder(root: Path, architecture: str, apply_b_dec: bool = True) -> tuple[str, dict[str, np.ndarray]]:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    weights = {"W_enc": rng.standard_normal((D, 6)).astype(np.float32), "b_enc": rng.standard_normal(6).astype(np.float32),
               "W_dec": rng.standard_normal((6, D)).astype(np.float32), "b_dec": rng.standard_normal(D).astype(np.float32)}
    if architecture == "jumprelu":
        weights["threshold"] = np.abs(rng.standard_normal(6)).astype(np.float32) + 1.0
    folder = root / architecture
    folder.mkdir()
    save_file(weights, str(folder / "sae_weights.safetensors"))
    cfg = {"architecture": architecture, "d_in": D, "d_sae": 6, "dtype": "float32", "hook_name": "blocks.1.hook_resid_post",
           "apply_b_dec_to_input": apply_b_dec, "normalize_activations": "none"}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return str(folder), weights


@pytest.mark.parametrize("architecture", ["standard", "jumprelu"])
def test_an_sae_feature_condition_is_its_pre_activation_and_fires_where_the_activation_does(tmp_path, architecture):
    path, w = sae_folder(tmp_path, architecture)
    saes = SaeCatalog.read({"s": {"path": path}})
    edit = {"hook": "blocks.1.hook_resid_post", "op": "add", "vector": [1.0] * D, "when": {"sae_id": "s", "feature": 4, "above": 0.5}}
    request = resolve_conditions(GenerateRequest.model_validate({"prompt": [1], "interventions": [edit]}), None, saes)
    when = request.interventions[0].when
    rows = np.random.default_rng(5).standard_normal((200, D)).astype(np.float32) * 3
    pre = (rows - w["b_dec"]) @ w["W_enc"][:, 4] + w["b_enc"][4]
    activation = np.maximum(pre, 0) if architecture == "standard" else pre * (pre > w["threshold"][4])
    np.testing.assert_allclose(rows @ when.vector + when.bias, pre, atol=1e-5)
    fires = rows @ when.vector + when.bias > when.above
    np.testing.assert_array_equal(fires, activation > 0.5)
    assert 0 < fires.sum() < len(rows)
    with pytest.raises(PlanError, match="not the edited hook"):
        resolve_conditions(GenerateRequest.model_validate(
            {"prompt": [1], "interventions": [edit | {"hook": "blocks.0.hook_resid_post"}]}), None, saes)
