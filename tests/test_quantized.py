"""Quantized models on the CPU build: captures and edits are the quantized model's own activations.

A pre-quantized checkpoint (AWQ, GPTQ; tests/quantized.py builds tiny ones) is compared with HF
running the same weights dequantized, in the engine's dtype: the hooks must read what the 4-bit
model computes, not what the float model would have. vLLM's online fp8 (block-wise on CPU) has no
float twin, so its checks are the stream's own sums and a bound on how far fp8 moves it.
Unserved combinations are refused at start with what is served (replicas/engine/quantization.py).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from replicas.api.hooks import FINAL_NORM_HOOK
from replicas.engine.quantization import UnsupportedQuantizationError, check_quantization
from replicas.tiny import make_tiny_model
from tests.conftest import start_engine
from tests.hf_reference import hf_activations, hf_logits
from tests.test_engine_capture import prompt_ids
from tests.test_engine_interventions import direction
from tests.test_engine_precision import relative_error
from tests.quantized import quantized_model

KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
# ||vLLM - HF|| / ||HF|| per hook, HF on the dequantized weights in the same dtype: the kernels'
# accumulation order. (In bfloat16 on a CPU with AMX, vLLM's 4-bit kernel also quantizes the
# activations to int8 as it multiplies (W4A8), which HF does not: the 4-bit checks run in float16.)
RELATIVE_TOL = {"float16": 1e-2}
# vLLM's 4-bit MoE kernel on CPU sums the experts' outputs in float16: 1.6 % from HF at mlp_out
MOE_RELATIVE_TOL = 3e-2


@pytest.fixture(scope="module")
def awq_llama(loop, model_root):
    source = make_tiny_model("llama", model_root / "llama", seed=1)
    path, reference = quantized_model(source, "awq", model_root / "llama-awq")
    engine = loop.run(start_engine(path, name="engine-awq", dtype="float16"))
    yield engine, reference, source
    loop.run(engine.shutdown())


@pytest.mark.engine
def test_an_awq_checkpoint_captures_and_steers_as_its_dequantized_weights_compute(loop, awq_llama):
    engine, reference, source = awq_llama
    hooks = [f"blocks.{i}.hook_{kind}" for i in range(4) for kind in KINDS] + [FINAL_NORM_HOOK]
    edit = {"hook": "blocks.1.hook_resid_post", "op": "add", "vector": direction(1), "scale": 2.0}
    base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "capture": {"hooks": hooks, "dtype": "float32"},
            "logits": {"positions": "all"}}
    prompts = prompt_ids(12, seed=1), prompt_ids(15, seed=2)

    async def together():
        return await asyncio.gather(engine.generate(base | {"prompt": prompts[0], "interventions": [edit]}),
                                    engine.generate(base | {"prompt": prompts[1]}))

    steered, plain = loop.run(together())
    shift = torch.from_numpy(direction(1)) * 2.0
    for result, prompt, edits in ((plain, prompts[1], []), (steered, prompts[0], [(1, "resid_post", lambda x: x + shift)])):
        fed = prompt + result.token_ids[:-1]
        expected = hf_activations(reference, fed, edits=edits, dtype="float16")
        for name, array in result.activations.items():
            point = (None, "ln_final") if name == FINAL_NORM_HOOK else (int(name.split(".")[1]), name.split("hook_")[1])
            assert relative_error(array, expected[point]) < RELATIVE_TOL["float16"], name
        logits = hf_logits(reference, fed, edits=edits, dtype="float16")
        assert relative_error(result.logits, logits) < RELATIVE_TOL["float16"]
    # the rows are the 4-bit model's: the float weights it came from give other numbers
    float_model = hf_activations(source, prompts[1] + plain.token_ids[:-1], dtype="float16")
    assert relative_error(plain.activations["blocks.3.hook_resid_post"], float_model[(3, "resid_post")]) > 0.05


@pytest.fixture(scope="module")
def gptq_moe(loop, model_root):
    source = make_tiny_model("olmoe", model_root / "olmoe", seed=1)
    path, reference = quantized_model(source, "gptq", model_root / "olmoe-gptq")
    engine = loop.run(start_engine(path, name="engine-gptq-moe", dtype="float16"))
    yield engine, reference, source
    loop.run(engine.shutdown())


@pytest.mark.engine
def test_a_gptq_mixture_of_experts_routes_as_its_captured_logits_say(loop, gptq_moe):
    """Quantized experts, a float router: each token's expert ids are a top 2 of the router logits
    captured beside them and HF's choice but for near ties, and every hook equals HF's on the tokens
    routed alike (a token sent to another expert takes another path from there on)."""
    engine, reference, source = gptq_moe
    info = loop.run(engine.info())
    hooks = [f"blocks.{i}.hook_{kind}" for i in range(4) for kind in KINDS]
    hooks += [f"blocks.{i}.mlp.hook_{kind}" for i in info.moe.layers for kind in ("router_logits", "expert_ids")]
    prompt = prompt_ids(20, seed=3)
    result = loop.run(engine.generate({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                       "capture": {"hooks": hooks}}))
    expected = hf_activations(reference, prompt + result.token_ids[:-1], dtype="float16")
    agreed = np.ones(len(result.positions), dtype=bool)  # tokens routed as HF routed them, at every layer
    for i in info.moe.layers:
        logits = result.activations[f"blocks.{i}.mlp.hook_router_logits"]
        ids = result.activations[f"blocks.{i}.mlp.hook_expert_ids"]
        # a top 2: no expert left out scores above one chosen (either of two equal logits is vLLM's to pick)
        picked = np.take_along_axis(logits, ids, axis=-1)
        left_out = np.where(np.eye(8, dtype=bool)[ids].any(1), -np.inf, logits)
        assert (picked.min(-1) >= left_out.max(-1)).all() and (ids[:, 0] != ids[:, 1]).all(), i
        same = (np.sort(ids, -1) == np.sort(expected[(i, "expert_ids")], -1)).all(-1)
        # where a token routed alike so far is routed otherwise, HF's 2nd and 3rd logits were a near tie
        gaps = -np.diff(np.sort(expected[(i, "router_logits")], -1)[:, ::-1][:, 1:3], axis=-1)[:, 0]
        assert (gaps[~same & agreed] < 2e-2).all() and same.mean() > 0.9, (i, gaps[~same & agreed])
        agreed &= same
        assert relative_error(logits[agreed], expected[(i, "router_logits")][agreed]) < RELATIVE_TOL["float16"]
    for i in range(4):
        for kind in KINDS:
            got = result.activations[f"blocks.{i}.hook_{kind}"]
            assert relative_error(got[agreed], expected[(i, kind)][agreed]) < MOE_RELATIVE_TOL, (i, kind)
    # the rows are the 4-bit model's: its float original is further away than that
    original = hf_activations(source, prompt + result.token_ids[:-1], dtype="float16")
    assert relative_error(result.activations["blocks.3.hook_resid_post"], original[(3, "resid_post")]) > 2 * MOE_RELATIVE_TOL


@pytest.mark.engine
def test_online_fp8_keeps_the_stream_s_sums_and_stays_near_the_float_model(loop, model_root):
    path = make_tiny_model("llama", model_root / "llama", seed=1)
    engine = loop.run(start_engine(path, name="engine-fp8", dtype="bfloat16", quantization="fp8_per_block"))
    try:
        hooks = [f"blocks.{i}.hook_{kind}" for i in range(4) for kind in KINDS]
        prompt = prompt_ids(16, seed=4)
        result = loop.run(engine.generate({"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                           "capture": {"hooks": hooks}}))
    finally:
        loop.run(engine.shutdown())
    got = result.activations
    expected = hf_activations(path, prompt + result.token_ids[:-1], dtype="bfloat16")
    for i in range(4):
        if i + 1 < 4:
            np.testing.assert_array_equal(got[f"blocks.{i}.hook_resid_post"], got[f"blocks.{i + 1}.hook_resid_pre"])
        total = got[f"blocks.{i}.hook_resid_pre"] + got[f"blocks.{i}.hook_attn_out"]
        assert relative_error(got[f"blocks.{i}.hook_resid_mid"], total) < 1e-2
        # fp8 weights move the stream by a few percent, not more
        assert 1e-3 < relative_error(got[f"blocks.{i}.hook_resid_post"], expected[(i, "resid_post")]) < 0.15


def test_unserved_quantization_is_refused_naming_what_is_served():
    float_config = type("Config", (), {})()
    awq = type("Config", (), {"quantization_config": {"quant_method": "awq"}})()
    marlin = type("Config", (), {"quantization_config": {"quant_method": "marlin"}})()
    assert check_quantization(None, float_config, "cpu", "float32", moe=False) is None
    assert check_quantization(None, awq, "cpu", "float16", moe=False) == "awq"
    assert check_quantization("fp8", float_config, "cuda", "bfloat16", moe=True) == "fp8"
    with pytest.raises(UnsupportedQuantizationError, match=r"quantization: 'fp8' is not served on cpu. Served: cuda: fp8 \(online\); cpu: fp8_per_block"):
        check_quantization("fp8", float_config, "cpu", "bfloat16", moe=False)
    with pytest.raises(UnsupportedQuantizationError, match="quant_method: 'marlin' is not served on cuda"):
        check_quantization(None, marlin, "cuda", "float16", moe=False)
    with pytest.raises(UnsupportedQuantizationError, match="router's gate"):
        check_quantization("fp8_per_block", float_config, "cpu", "bfloat16", moe=True)
    with pytest.raises(UnsupportedQuantizationError, match="dtype: 'float32' with 'awq'.*float16 or bfloat16"):
        check_quantization(None, awq, "cpu", "float32", moe=False)
    with pytest.raises(UnsupportedQuantizationError, match="already quantized with 'awq'"):
        check_quantization("fp8", awq, "cuda", "float16", moe=False)
    from replicas.engine import EngineConfig

    with pytest.raises(ValueError, match="engine_kwargs.quantization: set the engine config's own `quantization`"):
        EngineConfig(model="m", engine_kwargs={"quantization": "fp8"}).engine_args()
