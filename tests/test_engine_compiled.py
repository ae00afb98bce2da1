"""The graph-safe path: hooks traced into a compiled model give what the eager engine gives.

On CPU vLLM traces the model once with Dynamo (no CUDA graphs), which freezes any Python the
hooks run: a hook that branched on the step's requests would keep its first decision forever.
The GPU suite runs every engine test with CUDA graphs as well.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from replicas.api.errors import InvalidRequestError
from replicas.api.hooks import LAYER_KINDS
from tests.conftest import ACTIVATION_TOL, LOGIT_TOL, assert_close
from tests.test_engine_capture import prompt_ids

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def compiled(loop, tiny_models):
    from replicas.engine import CaptureEngine, EngineConfig

    config = EngineConfig(
        model=tiny_models["llama"], dtype="float32", max_model_len=512, max_num_seqs=64, edit_stages=2,
        steer_layers=[1, 2],  # the test's edits sit there; the other layers carry no edit pass
        armed_kinds=[*LAYER_KINDS, "z"],  # z: the attention op writes it into its site's buffer, which the graph reads
        kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.25, enforce_eager=False,
        engine_kwargs={"compilation_config": {"backend": "eager"}},  # trace with Dynamo, skip Inductor's slow CPU build
    )
    engine = loop.run(CaptureEngine.start(config, name="compiled"))
    yield engine
    loop.run(engine.shutdown())


def test_compiled_engine_matches_eager_for_captures_edits_and_logits(loop, engines, compiled):
    hooks = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_mid", "2:attn_out", "3:mlp_out", "ln_final.hook_normalized",
             "blocks.0.attn.hook_z", "blocks.1.attn.hook_z", "blocks.3.attn.hook_z"]
    steer = {"hook": "blocks.1.hook_resid_pre", "op": "add", "vector": np.linspace(-1, 1, 128), "positions": "generated"}
    patch = {"hook": "blocks.2.hook_resid_mid", "op": "set", "positions": [2, -1], "values": np.ones((2, 128))}
    ablate = {"hook": "blocks.1.attn.hook_z", "op": "scale", "factor": 0.0, "heads": [1], "phase": "decode"}
    clamps = [{"hook": "blocks.2.hook_resid_post", "op": "clamp", "vector": np.cos(np.arange(128)), "min": -0.5, "max": 0.5},
              {"hook": "blocks.2.attn.hook_z", "op": "clamp", "vector": np.sin(np.arange(64)), "max": 0.0, "heads": [0]}]
    plain = {"prompt": prompt_ids(30, 80), "max_tokens": 6, "temperature": 0, "ignore_eos": True,
             "capture": {"hooks": hooks}, "logits": {"positions": "all"}}
    requests = [plain, plain | {"interventions": [steer, patch]}, plain | {"prompt": prompt_ids(9, 81)},
                plain | {"interventions": [ablate]}, plain | {"interventions": clamps}]

    async def both(engine):
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    results = loop.run(both(compiled))
    for got, want in zip(results, loop.run(both(engines["llama"]))):
        assert got.token_ids == want.token_ids
        for name in hooks:
            assert_close(got.activations[name], want.activations[name], atol=ACTIVATION_TOL, rtol=0)
        assert_close(got.logits, want.logits, atol=LOGIT_TOL, rtol=0)
    steered, unsteered, ablated = results[1], results[0], results[3]
    for edited in (steered, results[4]):
        assert np.abs(edited.logits - unsteered.logits).max() > 1e-2
    # the ablated head's z is zero on decode rows alone, where the edited rows were staged; the prompt's rows,
    # and the first decode row's other head (its input token came from unedited logits), are the plain request's
    z, z_plain = ablated.activations["blocks.1.attn.hook_z"], unsteered.activations["blocks.1.attn.hook_z"]
    prompt_len = len(plain["prompt"])
    assert not z[prompt_len:, 1].any() and np.abs(z_plain[prompt_len:, 1]).max(axis=-1).min() > 0
    np.testing.assert_array_equal(z[:prompt_len], z_plain[:prompt_len])
    np.testing.assert_array_equal(z[prompt_len, 0], z_plain[prompt_len, 0])
    elsewhere = plain | {"interventions": [steer | {"hook": "blocks.3.hook_resid_pre"}]}
    with pytest.raises(InvalidRequestError, match=r"interventions\[0\]\.hook: layer 3 .* steerable layers: \[1, 2\]"):
        loop.run(compiled.generate(elsewhere))
