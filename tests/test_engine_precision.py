"""Half-precision engines: rows nobody edited stay finite and equal HF in the same dtype.

Real residual streams are large (norms of hundreds in Llama-class models), and in float16 the sum
of squares of a row with |h| > 256 overflows. The tiny Llama here has its embeddings scaled so its
residual norms are about 340: a norm taken in the model dtype turns every row of an edited site
into inf or NaN, including the rows of requests that edit nothing.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from replicas.api.hooks import FINAL_NORM_HOOK
from replicas.tiny import make_tiny_model
from tests.conftest import start_engine
from tests.hf_reference import hf_activations
from tests.test_engine_capture import prompt_ids
from tests.test_engine_interventions import direction, hf_edits

pytestmark = pytest.mark.engine
EMBEDDING_SCALE = 300.0  # row norms of about 1.1 -> 340
# Relative error ||vLLM - HF|| / ||HF|| per hook, both in the engine's dtype: kernels differ in
# accumulation order, so agreement is at the dtype's precision, not bit for bit.
RELATIVE_TOL = {"float16": 5e-3, "bfloat16": 3e-2}


def loud_model(root: Path) -> str:
    """The tiny Llama with residual norms a real model has."""
    from safetensors.torch import load_file, save_file

    folder = root / "loud-llama"
    if not folder.exists():
        shutil.copytree(make_tiny_model("llama", root / "llama-for-loud", seed=1), folder)
        weights = load_file(folder / "model.safetensors")
        weights["model.embed_tokens.weight"] *= EMBEDDING_SCALE
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def half_engine(request: pytest.FixtureRequest, loop, model_root):
    path = loud_model(model_root)
    engine = loop.run(start_engine(path, name=f"engine-{request.param}", quick_compile=True, dtype=request.param))
    yield request.param, engine, path
    loop.run(engine.shutdown())


def relative_error(actual: np.ndarray, desired: np.ndarray) -> float:
    actual, desired = actual.astype(np.float32), desired.astype(np.float32)
    return float(np.linalg.norm(actual - desired) / np.linalg.norm(desired))


def test_a_steered_and_an_unsteered_request_in_one_batch_stay_finite_and_match_hf(loop, half_engine):
    dtype, engine, path = half_engine
    hooks = [f"blocks.{i}.hook_{kind}" for i in range(4) for kind in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")]
    hooks.append(FINAL_NORM_HOOK)
    capture = {"hooks": hooks, "dtype": dtype}
    edits = [
        {"hook": "blocks.1.hook_resid_post", "op": "add", "vector": direction(1), "scale": 0.25, "norm_match": True},
        {"hook": "blocks.2.hook_resid_mid", "op": "project_out", "vector": direction(2)},
        {"hook": "blocks.2.hook_mlp_out", "op": "scale", "factor": 0.5},
    ]
    base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "capture": capture}
    steered_prompt, plain_prompt = prompt_ids(10, seed=1), prompt_ids(13, seed=2)

    async def together():
        return await asyncio.gather(
            engine.generate(base | {"prompt": steered_prompt, "interventions": edits}),
            engine.generate(base | {"prompt": plain_prompt}),
        )

    steered, plain = loop.run(together())
    torch_dtype = getattr(torch, dtype)
    for result, prompt, result_edits in ((plain, plain_prompt, []), (steered, steered_prompt, edits)):
        reference = hf_activations(path, prompt + result.token_ids[:-1], hf_edits(result_edits, len(prompt)), dtype=torch_dtype)
        for name in hooks:
            rows = result.activations[name]
            assert str(rows.dtype) == dtype
            assert np.isfinite(rows.astype(np.float32)).all(), f"{dtype} {name}: inf or NaN"
            key = (None, "ln_final") if name == FINAL_NORM_HOOK else (int(name.split(".")[1]), name.split("hook_")[1])
            error = relative_error(rows, reference[key])
            assert error <= RELATIVE_TOL[dtype], f"{dtype} {name}{' (steered)' if result_edits else ''}: relative error {error:.1e}"
    residual_norm = np.linalg.norm(plain.activations["blocks.1.hook_resid_post"].astype(np.float32), axis=-1)
    assert residual_norm.min() > 256, "the model must have residual norms whose squares overflow float16"
