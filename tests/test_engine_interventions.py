"""Real engines: interventions and logits equal HuggingFace with the same edit, per request."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from replicas.api.errors import InvalidRequestError
from replicas.api.hooks import LAYER_KINDS
from tests.conftest import ACTIVATION_TOL, ARCHS, LOGIT_TOL, MAX_NUM_BATCHED_TOKENS, assert_close, assert_same
from tests.hf_attention import hf_attention
from tests.hf_reference import hf_activations, hf_greedy, hf_logits
from tests.test_engine_capture import prompt_ids

pytestmark = pytest.mark.engine
D_MODEL = 128


def direction(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(D_MODEL).astype(np.float32)


def make_edit(op: str, hook: str, positions, n_rows: int) -> dict:
    if op == "add":
        return {"hook": hook, "op": "add", "vector": direction(1), "scale": 4.0, "positions": positions}
    if op == "scale":
        # zero-ablate sublayer outputs; halve residual streams (zeroing a whole residual stream
        # leaves only rounding noise for the next RMSNorm to blow up, in HF and vLLM alike)
        factor = 0.0 if hook.endswith(("attn_out", "mlp_out")) else 0.5
        return {"hook": hook, "op": "scale", "factor": factor, "positions": positions}
    if op == "set":
        values = np.random.default_rng(2).standard_normal((n_rows, D_MODEL)).astype(np.float32)
        return {"hook": hook, "op": "set", "values": values, "positions": positions}
    if op == "clamp":  # caps the direction: rows with a positive component along it lose that part
        return {"hook": hook, "op": "clamp", "vector": direction(4), "max": 0.0, "positions": positions}
    return {"hook": hook, "op": "project_out", "vector": direction(3), "positions": positions}


def hf_edit_fn(edit: dict, prompt_len: int):
    """The same edit as a function of the full [seq, d] activation, for the HF forward hooks."""

    def selected(seq_len: int) -> np.ndarray:
        positions = edit.get("positions", "all")
        index = np.arange(seq_len)
        if positions == "all":
            return index
        if positions == "prompt":
            return index[index < prompt_len]
        if positions == "generated":
            return index[index >= prompt_len]
        return np.array([p + prompt_len if p < 0 else p for p in positions])

    def fn(h: torch.Tensor) -> torch.Tensor:
        rows = torch.as_tensor(selected(h.shape[0]))
        rows = rows[rows < h.shape[0]]
        out = h.clone()
        part = h[rows].float()  # as the engine does: in float32, rounded once to the model dtype
        if edit["op"] == "add":
            vector = torch.as_tensor(edit["vector"])
            if edit.get("norm_match"):
                part = part + edit["scale"] * part.norm(dim=-1, keepdim=True) * vector / vector.norm()
            else:
                part = part + edit["scale"] * vector
        elif edit["op"] == "scale":
            part = part * edit["factor"]
        elif edit["op"] == "set":
            values = torch.as_tensor(np.atleast_2d(edit["values"]))
            part = values[: len(rows)] if len(values) > 1 else values.expand_as(part)
        elif edit["op"] == "clamp":
            part = clamped(part, edit["vector"], edit.get("min"), edit.get("max"))
        else:
            unit = torch.as_tensor(edit["vector"]) / torch.as_tensor(edit["vector"]).norm()
            part = part - (part @ unit)[:, None] * unit
        out[rows] = part.to(h.dtype)
        return out

    return fn


def clamped(rows: torch.Tensor, vector: np.ndarray, lo: float | None, hi: float | None) -> torch.Tensor:
    """rows + (clip(rows . u, lo, hi) - rows . u) u for the unit vector u along `vector` (None: no bound)."""
    unit = torch.as_tensor(vector, dtype=torch.float32) / torch.as_tensor(vector, dtype=torch.float32).norm()
    dot = rows @ unit
    return rows + (dot.clamp(lo, hi) - dot)[:, None] * unit


def hf_edits(edits: list[dict], prompt_len: int) -> list:
    from replicas.api.hooks import resolve_hook

    return [(*resolve_hook(e["hook"]), hf_edit_fn(e, prompt_len)) for e in edits]


OP_POSITIONS = {"add": "all", "scale": "prompt", "set": [1, 3, -1], "project_out": "all", "clamp": "generated"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", list(OP_POSITIONS))
def test_every_op_at_every_kind_matches_hf(loop, engines, tiny_models, arch, op):
    engine, path = engines[arch], tiny_models[arch]
    prompt = prompt_ids(8, seed=21)
    for layer, kind in zip([0, 1, 2, 3, 1], LAYER_KINDS):
        hook = f"blocks.{layer}.hook_{kind}"
        edit = make_edit(op, hook, OP_POSITIONS[op], n_rows=3)
        result = loop.run(
            engine.generate(
                {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                 "interventions": [edit], "logits": {"positions": "all"}}
            )
        )
        edits = hf_edits([edit], len(prompt))
        assert result.token_ids == hf_greedy(path, prompt, 4, edits=edits), f"{arch} {op} {hook}"
        fed = prompt + result.token_ids[:-1]
        reference = hf_logits(path, fed, edits=edits)
        assert result.logits_positions == list(range(len(fed)))
        assert_close(result.logits, reference, atol=LOGIT_TOL, rtol=0, err_msg=f"{arch} {op} {hook}")


def test_norm_matched_add_and_stacked_edits_match_hf(loop, engines, tiny_models):
    engine, path = engines["llama"], tiny_models["llama"]
    prompt = prompt_ids(7, seed=22)
    edits = [
        {"hook": "blocks.1.hook_resid_pre", "op": "add", "vector": direction(5), "scale": 0.5, "norm_match": True},
        {"hook": "blocks.1.hook_resid_pre", "op": "project_out", "vector": direction(6)},
        {"hook": "blocks.2.hook_mlp_out", "op": "scale", "factor": 2.5, "positions": "generated"},
    ]
    result = loop.run(engine.generate({"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                       "interventions": edits, "logits": {"positions": "all"}}))
    reference = hf_edits(edits, len(prompt))
    assert result.token_ids == hf_greedy(path, prompt, 5, edits=reference)
    assert_close(result.logits, hf_logits(path, prompt + result.token_ids[:-1], edits=reference), atol=LOGIT_TOL, rtol=0)


def test_clamp_matches_hf_on_the_residual_stream_and_per_head_on_z_beside_an_unedited_request(loop, engines, tiny_models):
    """A clamp holds the component along its unit vector within [min, max]: on resid_post, and on
    z head by head along each chosen head's own direction (HF with the same edit of z). The bounds
    sit at the median of the unedited components, so some rows are clipped and others not; a
    request beside them in the batch is unchanged."""
    engine, path = engines["llama"], tiny_models["llama"]
    info = loop.run(engine.info())
    heads, d_head = info.attention.n_heads, info.attention.d_head_v
    prompt = prompt_ids(12, seed=27)
    vector = direction(20)
    own = np.random.default_rng(21).standard_normal((heads, d_head)).astype(np.float32)
    chosen = [0, heads - 1]
    along = hf_activations(path, prompt)[(1, "resid_post")] @ (vector / np.linalg.norm(vector))
    z = hf_attention(path, prompt)[(2, "z")]
    per_head = np.stack([z[:, h] @ (own[h] / np.linalg.norm(own[h])) for h in chosen])
    cap = {"hook": "blocks.1.hook_resid_post", "op": "clamp", "vector": vector, "max": float(np.median(along))}
    floor = {"hook": "blocks.2.attn.hook_z", "op": "clamp", "vector": own, "min": float(np.median(per_head)), "heads": chosen}
    base = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logits": {"positions": "all"}}

    async def together():
        return await asyncio.gather(engine.generate(base), *(engine.generate(base | {"interventions": [e]}) for e in (cap, floor)))

    plain, capped, floored = loop.run(together())

    reference = hf_edits([cap], len(prompt))
    assert capped.token_ids == hf_greedy(path, prompt, 5, edits=reference)
    assert_close(capped.logits, hf_logits(path, prompt + capped.token_ids[:-1], edits=reference), atol=LOGIT_TOL, rtol=0)

    def floor_heads(z: torch.Tensor) -> torch.Tensor:
        z = z.clone()
        for head in chosen:
            z[:, head] = clamped(z[:, head], own[head], floor["min"], None)
        return z

    tokens = list(prompt)
    for _ in range(5):
        tokens.append(int(hf_attention(path, tokens, {2: floor_heads})[(-1, "logits")][-1].argmax()))
    assert floored.token_ids == tokens[len(prompt):]
    expected = hf_attention(path, prompt + floored.token_ids[:-1], {2: floor_heads})[(-1, "logits")]
    assert_close(floored.logits, expected, atol=LOGIT_TOL, rtol=0)
    assert_close(plain.logits, hf_logits(path, prompt + plain.token_ids[:-1]), atol=LOGIT_TOL, rtol=0)
    for edited in (capped, floored):  # the clamps bit
        assert np.abs(edited.logits[: len(prompt)] - plain.logits[: len(prompt)]).max() > 1e-2


def test_edits_stay_in_their_own_rows(loop, engines, tiny_models):
    engine, path = engines["qwen2"], tiny_models["qwen2"]
    prompts = {name: prompt_ids(6 + k, seed=30 + k) for k, name in enumerate("ABC")}
    steer = {"hook": "blocks.1.hook_resid_post", "op": "add", "vector": direction(8), "scale": 6.0}
    ablate = {"hook": "blocks.2.hook_attn_out", "op": "scale", "factor": 0.0}
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logits": {"positions": "all"},
            "capture": {"hooks": ["blocks.3.hook_resid_post"]}}
    requests = {
        "A": base | {"prompt": prompts["A"], "interventions": [steer]},
        "B": base | {"prompt": prompts["B"], "interventions": [ablate]},
        "C": base | {"prompt": prompts["C"]},
    }

    async def together():
        return await asyncio.gather(*(engine.generate(requests[name]) for name in "ABC"))

    a, b, c = loop.run(together())
    for result, name, edit in ((a, "A", steer), (b, "B", ablate)):
        edits = hf_edits([edit], len(prompts[name]))
        assert result.token_ids == hf_greedy(path, prompts[name], 6, edits=edits)
        assert_close(result.logits, hf_logits(path, prompts[name] + result.token_ids[:-1], edits=edits), atol=LOGIT_TOL, rtol=0)
    alone = loop.run(engine.generate(requests["C"]))
    assert c.token_ids == alone.token_ids
    assert_same(c.activations["blocks.3.hook_resid_post"], alone.activations["blocks.3.hook_resid_post"])
    assert_same(c.logits, alone.logits)


def test_per_position_edits_past_edit_stages_and_repeated_positions_match_hf(loop, engines, tiny_models):
    """Three adds of different vectors and a set at disjoint positions of one hook share one of the
    engine's edit_stages=2, a scale of every prompt row after them the other. A position listed
    twice is edited once (add), or takes its last row (set), as TransformerLens's act[:, pos] op= v:
    equal to HF with each edit spelt once; a request beside them is unchanged."""
    engine, path = engines["llama"], tiny_models["llama"]
    prompt, hook = prompt_ids(9, seed=26), "blocks.1.hook_resid_post"
    rows = np.random.default_rng(13).standard_normal((2, D_MODEL)).astype(np.float32)
    adds = [{"hook": hook, "op": "add", "vector": direction(14 + i), "scale": 3.0} for i in range(3)]
    scale = {"hook": hook, "op": "scale", "factor": 0.5, "positions": "prompt"}
    asked = [adds[0] | {"positions": [1]}, adds[1] | {"positions": [3, 3]}, adds[2] | {"positions": [-1]},
             {"hook": hook, "op": "set", "values": rows, "positions": [5, -4]}, scale]
    meant = [adds[0] | {"positions": [1]}, adds[1] | {"positions": [3]}, adds[2] | {"positions": [8]},
             {"hook": hook, "op": "set", "values": rows[1:], "positions": [5]}, scale]
    base = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logits": {"positions": "all"}}

    async def together():
        return await asyncio.gather(engine.generate(base | {"interventions": asked}), engine.generate(base))

    edited, plain = loop.run(together())
    reference = hf_edits(meant, len(prompt))
    assert edited.token_ids == hf_greedy(path, prompt, 4, edits=reference)
    assert_close(edited.logits, hf_logits(path, prompt + edited.token_ids[:-1], edits=reference), atol=LOGIT_TOL, rtol=0)
    assert_close(plain.logits, hf_logits(path, prompt + plain.token_ids[:-1]), atol=LOGIT_TOL, rtol=0)


def test_requests_with_the_same_edit_share_its_row_until_the_last_one_ends(loop, engines, tiny_models):
    """A and B steer with one vector (one table row); A ends first, then C takes a free row for
    another vector while B still runs: B must keep its own vector to the end."""
    engine, path = engines["llama"], tiny_models["llama"]
    shared = {"hook": "blocks.1.hook_resid_post", "op": "add", "vector": direction(10), "scale": 4.0}
    other = shared | {"vector": direction(11)}
    base = {"temperature": 0, "ignore_eos": True, "logits": {"positions": "all"}}
    requests = {
        "A": base | {"prompt": prompt_ids(7, seed=50), "max_tokens": 2, "interventions": [shared]},
        "B": base | {"prompt": prompt_ids(8, seed=51), "max_tokens": 40, "interventions": [shared]},
        "C": base | {"prompt": prompt_ids(9, seed=52), "max_tokens": 6, "interventions": [other]},
    }

    async def staggered():
        a, b = (asyncio.ensure_future(engine.generate(requests[name])) for name in "AB")
        first = await a
        c = await engine.generate(requests["C"])
        return first, await b, c

    results = dict(zip("ABC", loop.run(staggered())))
    for name, result in results.items():
        prompt, request = requests[name]["prompt"], requests[name]
        edits = hf_edits(request["interventions"], len(prompt))
        assert result.token_ids == hf_greedy(path, prompt, request["max_tokens"], edits=edits), name
        assert_close(result.logits, hf_logits(path, prompt + result.token_ids[:-1], edits=edits), atol=LOGIT_TOL, rtol=0)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_phase_limits_where_an_edit_applies(loop, engines, phase):
    engine = engines["llama"]
    prompt = prompt_ids(9, seed=40)
    request = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
               "capture": {"hooks": ["blocks.3.hook_resid_post"], "positions": "all"}}
    plain = loop.run(engine.generate(request))
    edit = {"hook": "blocks.0.hook_resid_post", "op": "add", "vector": direction(9), "scale": 3.0, "phase": phase}
    edited = loop.run(engine.generate(request | {"interventions": [edit], "max_tokens": 6}))
    before = plain.activations["blocks.3.hook_resid_post"]
    after = edited.activations["blocks.3.hook_resid_post"]
    prompt_changed = np.abs(after[:9] - before[:9]).max(axis=1) > 1e-3
    if phase == "decode":
        assert not prompt_changed.any()
        assert (np.abs(after[9:] - before[9:]).max(axis=1) > 1e-3).all()
    else:
        assert prompt_changed.all()


def test_capture_at_the_edited_hook_shows_the_edited_value(loop, engines):
    engine = engines["gpt2"]
    request = {"prompt": prompt_ids(5, seed=41), "max_tokens": 2, "temperature": 0,
               "capture": {"hooks": ["blocks.1.hook_mlp_out", "blocks.1.hook_resid_pre"], "positions": "prompt"}}
    edited = loop.run(engine.generate(request | {"interventions": [{"hook": "blocks.1.hook_mlp_out", "op": "scale", "factor": 0.0}]}))
    plain = loop.run(engine.generate(request))
    assert np.all(edited.activations["blocks.1.hook_mlp_out"] == 0)
    np.testing.assert_array_equal(edited.activations["blocks.1.hook_resid_pre"], plain.activations["blocks.1.hook_resid_pre"])


def test_patching_the_last_layer_reproduces_the_source_logits(loop, engines):
    engine = engines["llama"]
    source, target = prompt_ids(8, seed=50), prompt_ids(8, seed=51)
    hook = "blocks.3.hook_resid_post"
    captured = loop.run(engine.generate({"prompt": source, "max_tokens": 1, "capture": {"hooks": [hook], "positions": "prompt"},
                                         "logits": {"positions": "prompt"}}))
    patched = loop.run(engine.generate({
        "prompt": target, "max_tokens": 1, "logits": {"positions": "prompt"},
        "interventions": [{"hook": hook, "op": "set", "positions": captured.positions, "values": captured.activations[hook]}],
    }))
    assert_close(patched.logits, captured.logits, atol=ACTIVATION_TOL, rtol=0)
    unpatched = loop.run(engine.generate({"prompt": target, "max_tokens": 1, "logits": {"positions": "prompt"}}))
    assert np.abs(unpatched.logits - captured.logits).max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_hf(loop, engines, tiny_models, arch):
    prompt = prompt_ids(10, seed=60)
    result = loop.run(engines[arch].generate({"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                              "logits": {"positions": [0, 4, -1, 11]}}))
    assert result.logits_positions == [0, 4, 9, 11]
    reference = hf_logits(tiny_models[arch], prompt + result.token_ids[:-1])
    assert result.logits.dtype == np.float32 and result.logits.shape == (4, reference.shape[1])
    assert_close(result.logits, reference[[0, 4, 9, 11]], atol=LOGIT_TOL, rtol=0)


BAD_EDITS = {
    "wrong vector width": ({"hook": "1:resid_post", "op": "add", "vector": [1.0] * 7}, "width 7"),
    "nan values": ({"hook": "1:resid_post", "op": "add", "vector": [float("nan")] * D_MODEL}, "NaN"),
    "set rows do not match positions": ({"hook": "1:resid_post", "op": "set", "positions": [0, 1], "values": np.ones((3, D_MODEL))}, "3 rows"),
    "unknown op": ({"hook": "1:resid_post", "op": "negate", "vector": [1.0] * D_MODEL}, "interventions.0.op"),
    "missing field": ({"hook": "1:resid_post", "op": "scale"}, "needs field 'factor'"),
    "final norm": ({"hook": "ln_final.hook_normalized", "op": "scale", "factor": 2.0}, "cannot be edited"),
}


@pytest.mark.parametrize("case", BAD_EDITS, ids=list(BAD_EDITS))
def test_bad_intervention_fails_only_that_request(loop, engines, case):
    engine = engines["llama"]
    edit, expected = BAD_EDITS[case]
    good = {"prompt": prompt_ids(6, 70), "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "interventions": [{"hook": "0:mlp_out", "op": "scale", "factor": 0.5}]}

    async def both():
        bad = engine.generate({"prompt": prompt_ids(6, 71), "max_tokens": 3, "interventions": [edit]})
        return await asyncio.gather(bad, engine.generate(good), return_exceptions=True)

    bad_result, good_result = loop.run(both())
    assert isinstance(bad_result, InvalidRequestError) and expected in str(bad_result), bad_result
    assert not isinstance(good_result, BaseException) and len(good_result.token_ids) == 8


def test_an_edit_the_worker_could_not_install_fails_its_request(loop, engines):
    """The engine admits edits by the table rows it expects to be free, but only the worker knows
    whether an edit was installed. An edit-only request whose edit was not must fail, naming the
    field, instead of running unsteered and returning normally. The plan is altered after the
    engine validated it (a site the worker lacks), which is how a disagreement would look."""
    import uuid

    from replicas.api import GenerateRequest
    from replicas.api.errors import CaptureFailedError
    from replicas.engine.results import Finish

    engine = engines["llama"]
    prompt = prompt_ids(6, seed=80)
    request = GenerateRequest.model_validate({"prompt": prompt, "max_tokens": 3, "interventions": [
        {"hook": "blocks.1.hook_resid_post", "op": "scale", "factor": 0.5}]})
    key = uuid.uuid4().hex
    plan = engine._plan(key, request, prompt)
    plan["edits"][0]["layer"] = 99
    with pytest.raises(CaptureFailedError, match="interventions could not be installed"):
        loop.run(engine._run(key, prompt, engine._sampling_params(request, plan), Finish(True, None, len(prompt))))
    good = loop.run(engine.generate({"prompt": prompt, "max_tokens": 3, "interventions": request.model_dump()["interventions"]}))
    assert len(good.token_ids) == 3


@pytest.mark.parametrize("edit", [{"positions": "generated"}, {"phase": "decode"}], ids=["generated", "decode"])
def test_an_edit_of_generated_rows_on_a_prompt_prefilled_in_chunks(loop, engines, tiny_models, edit):
    """The prompt's first chunks end before any generated row: the edit's span there is empty and
    must stay inside the chunk (it once indexed past the step's rows and killed the engine)."""
    engine, path = engines["llama"], tiny_models["llama"]
    prompt = prompt_ids(2 * MAX_NUM_BATCHED_TOKENS + 9, seed=81)
    edits = [{"hook": "blocks.1.hook_resid_post", "op": "add", "vector": direction(12), "scale": 3.0} | edit]
    result = loop.run(engine.generate({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                       "interventions": edits, "logits": {"positions": "all"}}))
    reference = hf_edits([edits[0] | {"positions": "generated"}], len(prompt))
    assert result.token_ids == hf_greedy(path, prompt, 4, edits=reference)
    assert_close(result.logits, hf_logits(path, prompt + result.token_ids[:-1], edits=reference), atol=LOGIT_TOL, rtol=0)


def test_set_at_two_layers_of_two_requests_in_one_batch_matches_hf(loop, engines, tiny_models):
    """Every steered site reads `set` values from one buffer they share: A patches the same rows
    at two layers, B patches two other hooks in the same batch; each must equal HF alone."""
    engine, path = engines["llama"], tiny_models["llama"]
    rng = np.random.default_rng(12)

    def patch(hook: str, positions, n_rows: int) -> dict:
        return {"hook": hook, "op": "set", "positions": positions, "values": rng.standard_normal((n_rows, D_MODEL)).astype(np.float32)}

    prompts = {"A": prompt_ids(8, seed=90), "B": prompt_ids(9, seed=91)}
    edits = {
        "A": [patch("blocks.1.hook_resid_post", [1, 3, -1], 3), patch("blocks.2.hook_mlp_out", [1, 3, -1], 3)],
        "B": [patch("blocks.1.hook_resid_post", [0, 2], 2), patch("blocks.0.hook_attn_out", "prompt", 9)],
    }
    base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logits": {"positions": "all"}}

    async def together():
        return await asyncio.gather(*(engine.generate(base | {"prompt": prompts[n], "interventions": edits[n]}) for n in "AB"))

    for name, result in zip("AB", loop.run(together())):
        reference = hf_edits(edits[name], len(prompts[name]))
        assert result.token_ids == hf_greedy(path, prompts[name], 4, edits=reference), name
        fed = prompts[name] + result.token_ids[:-1]
        assert_close(result.logits, hf_logits(path, fed, edits=reference), atol=LOGIT_TOL, rtol=0, err_msg=name)
