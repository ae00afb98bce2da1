"""The architecture matrix: every supported architecture's hooks and edits equal HuggingFace fp32.

One engine per architecture, started when its tests begin and shut down after them (the three
of conftest's `engines` are reused). On the GPU host too they start one at a time: eight
starting together there did not come up within a 10-minute call (2026-11-30). Per architecture: every kind its blocks have at every layer
on prompt and generated rows; every intervention op at every kind, all in one batch beside a
request that edits nothing; edits of the residual stream reaching the next layer bit for bit.
Which architectures run where is README.md's support table. The engines arm the attention hooks
too: q, k, v, z and patterns equal HF's eager attention, and per-head edits reproduce HF with the
same edit of z (tests/hf_attention.py).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from replicas.engine.architectures import layer_kinds
from replicas.api.hooks import FINAL_NORM_HOOK, HEAD_KINDS, PATTERN_KINDS, ROUTER_KINDS, UNNORMED_KINDS
from replicas.tiny import ARCHS as ALL_ARCHS
from replicas.tiny import make_tiny_model
from tests.conftest import ACTIVATION_TOL, ARCHS, LOGIT_TOL, armed_with_attention, assert_close, start_engine
from tests.hf_attention import hf_attention
from tests.hf_reference import hf_activations, hf_greedy, hf_lens, hf_logits
from tests.test_engine_capture import prompt_ids
from tests.test_engine_interventions import direction, hf_edits

pytestmark = pytest.mark.engine
PROMPT_LEN = 40  # past the tiny Gemmas' sliding window of 16
MAX_TOKENS = 5


@pytest.fixture(scope="module", params=ALL_ARCHS)
def arch(request: pytest.FixtureRequest, loop, tiny_models, model_root) -> tuple[str, object, str, tuple[str, ...]]:
    """(arch, engine, model path, the kinds its blocks have)."""
    name = request.param
    if name in ARCHS:
        engine = request.getfixturevalue("engines")[name]
        yield name, engine, tiny_models[name], layer_kinds(engine.shape)
        return
    path = make_tiny_model(name, model_root / name, seed=1)
    engine = loop.run(start_engine(path, name=f"engine-{name}", quick_compile=True, armed_kinds=armed_with_attention(path)))
    try:
        yield name, engine, path, layer_kinds(engine.shape)
    finally:
        loop.run(engine.shutdown())


def test_every_hook_and_the_logits_match_hf_on_prompt_and_generated_rows(loop, arch):
    name, engine, path, kinds = arch
    info = loop.run(engine.info())
    extra = (set(ROUTER_KINDS) if info.moe is not None else set()) | (set(UNNORMED_KINDS) if engine.shape == "sandwich" else set())
    assert set(info.armed_kinds) == set(kinds) | set(HEAD_KINDS) | set(PATTERN_KINDS) | extra
    hooks = [f"blocks.{i}.hook_{kind}" for i in range(info.n_layers) for kind in kinds] + [FINAL_NORM_HOOK]
    prompt = prompt_ids(PROMPT_LEN, seed=3)
    lens_hook = f"blocks.{info.n_layers // 2}.hook_resid_post"  # the model's own head on a middle layer (docs/readouts.md)
    result = loop.run(engine.generate({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                                       "capture": {"hooks": hooks}, "logits": {"positions": "all"},
                                       "readouts": {"kind": "logit_lens", "hook": lens_hook, "top_k": 5}}))
    fed = prompt + result.token_ids[:-1]
    assert result.positions == list(range(len(fed)))
    assert result.token_ids == hf_greedy(path, prompt, MAX_TOKENS), name
    reference = hf_activations(path, fed)
    for i in range(info.n_layers):
        for kind in kinds:
            got = result.activations[f"blocks.{i}.hook_{kind}"]
            assert_close(got, reference[(i, kind)], atol=ACTIVATION_TOL, rtol=ACTIVATION_TOL, err_msg=f"{name} layer {i} {kind}")
    assert_close(result.activations[FINAL_NORM_HOOK], reference[(None, "ln_final")], atol=ACTIVATION_TOL, rtol=ACTIVATION_TOL)
    assert_close(result.logits, hf_logits(path, fed), atol=LOGIT_TOL, rtol=0, err_msg=name)
    lens = result.readouts[0]
    reference = hf_lens(path, fed, (info.n_layers // 2, "resid_post"))
    assert_close(lens.logprobs, np.take_along_axis(reference, lens.ids.astype(np.int64), 1), atol=LOGIT_TOL, err_msg=name)
    assert_close(lens.logprobs, -np.sort(-reference, axis=1)[:, :5], atol=LOGIT_TOL, err_msg=name)


def edit_of(op: str, hook: str) -> dict:
    if op == "add":
        return {"hook": hook, "op": "add", "vector": direction(1), "scale": 2.0}
    if op == "add_norm_matched":
        return {"hook": hook, "op": "add", "vector": direction(2), "scale": 0.5, "norm_match": True}
    if op == "scale":
        return {"hook": hook, "op": "scale", "factor": 0.0 if hook.endswith(("attn_out", "mlp_out")) else 0.5}
    if op == "set":
        values = np.random.default_rng(2).standard_normal((3, 128)).astype(np.float32)
        return {"hook": hook, "op": "set", "values": values, "positions": [1, 3, -1]}
    if op == "clamp":
        return {"hook": hook, "op": "clamp", "vector": direction(4), "min": -0.5, "max": 0.5}
    return {"hook": hook, "op": "project_out", "vector": direction(3), "positions": "generated"}


OPS = ("add", "add_norm_matched", "scale", "set", "project_out", "clamp")


def test_every_op_at_every_kind_matches_hf_in_one_batch_with_an_unedited_request(loop, arch):
    name, engine, path, kinds = arch
    prompt = prompt_ids(12, seed=21)
    base = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logits": {"positions": "all"}}
    edits = [edit_of(op, f"blocks.{k % 4}.hook_{kind}") for k, (op, kind) in enumerate((op, kind) for op in OPS for kind in kinds)]
    plain = base | {"capture": {"hooks": [f"blocks.2.hook_{kind}" for kind in kinds]}}

    async def together():
        return await asyncio.gather(engine.generate(plain), *(engine.generate(base | {"interventions": [e]}) for e in edits))

    unedited, *results = loop.run(together())
    reference = hf_activations(path, prompt + unedited.token_ids[:-1])
    for kind in kinds:
        assert_close(unedited.activations[f"blocks.2.hook_{kind}"], reference[(2, kind)], atol=ACTIVATION_TOL, rtol=ACTIVATION_TOL)
    for edit, result in zip(edits, results):
        reference_edits = hf_edits([edit], len(prompt))
        where = f"{name} {edit['op']} {edit['hook']}"
        assert result.token_ids == hf_greedy(path, prompt, 4, edits=reference_edits), where
        expected = hf_logits(path, prompt + result.token_ids[:-1], edits=reference_edits)
        assert_close(result.logits, expected, atol=LOGIT_TOL, rtol=0, err_msg=where)


def test_residual_edits_reach_the_next_layer_bit_for_bit(loop, arch):
    """An edit at resid_post[i] is exactly what layer i+1 reads: zero-ablating the stream leaves
    0, not the rounding residue of `mlp_out + (edited - value) + residual`."""
    name, engine, path, _ = arch
    edits = [{"hook": "blocks.1.hook_resid_post", "op": "scale", "factor": 0.0},
             {"hook": "blocks.2.hook_resid_post", "op": "add", "vector": direction(4), "scale": 3.0}]
    hooks = ["blocks.1.hook_resid_post", "blocks.2.hook_resid_pre", "blocks.2.hook_resid_post", "blocks.3.hook_resid_pre"]
    prompt = prompt_ids(9, seed=23)
    result = loop.run(engine.generate({"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                       "capture": {"hooks": hooks}, "interventions": edits, "logits": {"positions": "all"}}))
    assert not result.activations["blocks.2.hook_resid_pre"].any(), name
    np.testing.assert_array_equal(result.activations["blocks.1.hook_resid_post"], result.activations["blocks.2.hook_resid_pre"])
    np.testing.assert_array_equal(result.activations["blocks.2.hook_resid_post"], result.activations["blocks.3.hook_resid_pre"])
    reference_edits = hf_edits(edits, len(prompt))
    assert result.token_ids == hf_greedy(path, prompt, 3, edits=reference_edits), name
    assert_close(result.logits, hf_logits(path, prompt + result.token_ids[:-1], edits=reference_edits), atol=LOGIT_TOL, rtol=0)


def test_attention_hooks_match_hf_on_prompt_and_generated_rows(loop, arch):
    name, engine, path, _ = arch
    info = loop.run(engine.info())
    kinds = (*HEAD_KINDS, *PATTERN_KINDS)
    hooks = [f"blocks.{i}.attn.hook_{kind}" for i in range(info.n_layers) for kind in kinds] + ["blocks.1.hook_resid_post"]
    prompt = prompt_ids(PROMPT_LEN, seed=5)
    result = loop.run(engine.generate({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                                       "capture": {"hooks": hooks}}))
    fed = prompt + result.token_ids[:-1]
    reference = hf_attention(path, fed)
    for i in range(info.n_layers):
        for kind in HEAD_KINDS:
            got = result.activations[f"blocks.{i}.attn.hook_{kind}"]
            assert_close(got, reference[(i, kind)], atol=ACTIVATION_TOL, rtol=ACTIVATION_TOL, err_msg=f"{name} layer {i} {kind}")
        pattern = result.activations[f"blocks.{i}.attn.hook_pattern"]
        assert_close(pattern, reference[(i, "pattern")], atol=ACTIVATION_TOL, rtol=0, err_msg=f"{name} layer {i} pattern")
        # scores: masked exactly where HF's weights are 0, and their softmax is HF's pattern
        scores = result.activations[f"blocks.{i}.attn.hook_attn_scores"]
        np.testing.assert_array_equal(np.isneginf(scores), reference[(i, "pattern")] == 0)
        assert_close(softmax(scores, sinks_of(info, i)), reference[(i, "pattern")], atol=ACTIVATION_TOL, rtol=0)
    assert result.activations["blocks.0.attn.hook_q"].shape == (len(fed), info.attention.n_heads, info.attention.d_head)
    assert result.activations["blocks.0.attn.hook_k"].shape[1] == info.attention.n_kv_heads


def test_a_pattern_for_chosen_queries_covers_every_earlier_key(loop, arch):
    """last_prompt and explicit positions: [queries, heads, keys up to the last query]; the
    other hooks of the request keep to the positions asked for."""
    name, engine, path, _ = arch
    prompt = prompt_ids(PROMPT_LEN, seed=6)
    capture = {"hooks": ["blocks.3.attn.hook_pattern", "blocks.3.hook_resid_post", "blocks.3.attn.hook_z"]}
    last, chosen = loop.run(together(
        engine.generate({"prompt": prompt, "max_tokens": 3, "temperature": 0, "capture": capture | {"positions": "last_prompt"}}),
        engine.generate({"prompt": prompt, "max_tokens": 3, "temperature": 0, "capture": capture | {"positions": [3, -2, 20]}}),
    ))
    reference = hf_attention(path, prompt)
    pattern = reference[(3, "pattern")]
    assert last.positions == [PROMPT_LEN - 1]
    assert_close(last.activations["blocks.3.attn.hook_pattern"], pattern[-1:], atol=ACTIVATION_TOL, rtol=0, err_msg=name)
    assert_close(last.activations["blocks.3.attn.hook_z"], reference[(3, "z")][-1:], atol=ACTIVATION_TOL, rtol=ACTIVATION_TOL)
    assert chosen.positions == [3, 20, PROMPT_LEN - 2]
    assert_close(chosen.activations["blocks.3.attn.hook_pattern"], pattern[[3, 20, PROMPT_LEN - 2], :, : PROMPT_LEN - 1],
                 atol=ACTIVATION_TOL, rtol=0, err_msg=name)
    assert chosen.activations["blocks.3.hook_resid_post"].shape == (3, 128)


def test_per_head_edits_match_hf_and_leave_the_batch_alone(loop, arch):
    """Ablating one head of z (scale 0) and patching another (set) reproduce HF with the same
    edit of z: greedy tokens equal, logits within 1e-3; a request beside them is unchanged, and
    zeroing a head's q makes its pattern uniform over the keys it sees."""
    name, engine, path, _ = arch
    info = loop.run(engine.info())
    heads, d_head = info.attention.n_heads, info.attention.d_head_v
    prompt = prompt_ids(14, seed=24)
    patch = np.random.default_rng(3).standard_normal((1, d_head)).astype(np.float32)
    edits = [{"hook": "blocks.1.attn.hook_z", "op": "scale", "factor": 0.0, "heads": [heads - 1]},
             {"hook": "blocks.2.attn.hook_z", "op": "set", "values": patch, "heads": [0], "positions": "prompt"}]
    base = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logits": {"positions": "all"}}
    zero_q = {"hook": "blocks.0.attn.hook_q", "op": "scale", "factor": 0.0, "heads": [0]}
    plain, edited, flat = loop.run(together(
        engine.generate(base),
        engine.generate(base | {"interventions": edits}),
        engine.generate(base | {"interventions": [zero_q], "capture": {"hooks": ["blocks.0.attn.hook_pattern"], "positions": "prompt"}}),
    ))

    def ablate(z):
        z = z.clone()
        z[:, heads - 1] = 0
        return z

    def patched(z):
        z = z.clone()
        z[: len(prompt), 0] = torch.from_numpy(patch[0])
        return z

    tokens = list(prompt)
    for _ in range(4):  # HF greedy with the same edits of z
        reference = hf_attention(path, tokens, {1: ablate, 2: patched})
        tokens.append(int(reference[(-1, "logits")][-1].argmax()))
    assert edited.token_ids == tokens[len(prompt):], name
    expected = hf_attention(path, prompt + edited.token_ids[:-1], {1: ablate, 2: patched})[(-1, "logits")]
    assert_close(edited.logits, expected, atol=LOGIT_TOL, rtol=0, err_msg=name)
    assert_close(plain.logits, hf_logits(path, prompt + plain.token_ids[:-1]), atol=LOGIT_TOL, rtol=0, err_msg=name)
    uniform = flat.activations["blocks.0.attn.hook_pattern"][:, 0]
    visible = uniform > 0
    # every visible key scores 0; a sink (gpt-oss) takes exp(sink) of the weight besides
    sink = 0.0 if info.attention.sinks is None else np.exp(info.attention.sinks[0][0])
    expected_uniform = np.where(visible, 1.0 / (visible.sum(-1, keepdims=True) + sink), 0.0)
    assert_close(uniform, expected_uniform, atol=1e-6, rtol=0, err_msg=name)


def test_per_head_project_out_matches_hf_and_leaves_the_batch_alone(loop, arch):
    """project_out with heads removes from each chosen head's d_head slice of z its component along
    that head's unit direction (one d_head direction shared, or one per head), as HF with the same
    edit of z; a scale by a number without heads multiplies every head, as TransformerLens's hook on
    [pos, head, d_head] would; a request beside them in the batch is unchanged."""
    name, engine, path, _ = arch
    info = loop.run(engine.info())
    heads, d_head = info.attention.n_heads, info.attention.d_head_v
    rng = np.random.default_rng(5)
    shared, own = rng.standard_normal(d_head).astype(np.float32), rng.standard_normal((heads, d_head)).astype(np.float32)
    edits = [{"hook": "blocks.1.attn.hook_z", "op": "project_out", "vector": shared, "heads": list(range(heads))},
             {"hook": "blocks.2.attn.hook_z", "op": "project_out", "vector": own, "heads": [heads - 1]},
             {"hook": "blocks.3.attn.hook_z", "op": "scale", "factor": 0.5}]
    prompt = prompt_ids(14, seed=25)
    base = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logits": {"positions": "all"}}
    plain, edited = loop.run(together(engine.generate(base), engine.generate(base | {"interventions": edits})))

    def project(directions: np.ndarray, chosen: list[int]):
        def fn(z):
            z = z.clone()
            for head in chosen:
                unit = torch.from_numpy(directions[head] / np.linalg.norm(directions[head]))
                z[:, head] -= (z[:, head] @ unit)[:, None] * unit
            return z
        return fn

    head_edits = {1: project(np.tile(shared, (heads, 1)), list(range(heads))), 2: project(own, [heads - 1]), 3: lambda z: z * 0.5}
    tokens = list(prompt)
    for _ in range(4):
        tokens.append(int(hf_attention(path, tokens, head_edits)[(-1, "logits")][-1].argmax()))
    assert edited.token_ids == tokens[len(prompt):], name
    expected = hf_attention(path, prompt + edited.token_ids[:-1], head_edits)[(-1, "logits")]
    assert_close(edited.logits, expected, atol=LOGIT_TOL, rtol=0, err_msg=name)
    assert_close(plain.logits, hf_logits(path, prompt + plain.token_ids[:-1]), atol=LOGIT_TOL, rtol=0, err_msg=name)


async def together(*requests):
    return await asyncio.gather(*requests)


def softmax(scores: np.ndarray, sinks: list[float] | None = None) -> np.ndarray:
    """Over the keys of [q, heads, keys] scores; a head's attention sink (gpt-oss) is one more
    column in the denominator."""
    extra = np.zeros((scores.shape[1], 1)) if sinks is None else np.asarray(sinks)[:, None]
    peak = np.maximum(scores.max(-1, keepdims=True), extra)
    weights = np.exp(scores - peak)
    return weights / (weights.sum(-1, keepdims=True) + (0 if sinks is None else np.exp(extra - peak)))


def sinks_of(info, layer: int) -> list[float] | None:
    return None if info.attention.sinks is None else info.attention.sinks[layer]


SANDWICH_ARCHS = ("gemma2", "gemma3", "olmo2")


@pytest.mark.parametrize("arch", ["llama", *SANDWICH_ARCHS], indirect=True)
def test_bridge_sublayer_outputs_are_the_modules_own_and_hook_attn_out_what_the_block_adds(loop, arch):
    """TransformerLens 4.3 (bridge included) puts hook_attn_out / hook_mlp_out after a sandwich
    block's post-norm (its BlockBridge re-points them at ln1_post / ln2_post), while the bridge's
    attn.hook_out / mlp.hook_out are the modules' own outputs, before it. Both equal HF's; an edit
    of the unnormed output passes through the post-norm as in HF. In a pre-norm block the two
    names are one value."""
    name, engine, path, _ = arch
    layers = range(4)
    hooks = [f"blocks.{i}.{where}" for i in layers for where in ("attn.hook_out", "mlp.hook_out", "hook_attn_out",
                                                                  "ln1_post.hook_out", "ln2_post.hook_in")]
    prompt = prompt_ids(PROMPT_LEN, seed=8)
    vector = direction(5)
    edit = {"hook": "blocks.1.attn.hook_out", "op": "add", "vector": vector, "scale": 3.0}
    base = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logits": {"positions": "all"}}
    plain, edited = loop.run(together(engine.generate(base | {"capture": {"hooks": hooks}}),
                                      engine.generate(base | {"interventions": [edit]})))
    fed = prompt + plain.token_ids[:-1]
    reference = hf_activations(path, fed)
    sandwich = name in SANDWICH_ARCHS
    for i in layers:
        got = plain.activations
        np.testing.assert_array_equal(got[f"blocks.{i}.ln1_post.hook_out"], got[f"blocks.{i}.hook_attn_out"])
        for kind, hook in (("attn_unnormed", "attn.hook_out"), ("mlp_unnormed", "mlp.hook_out")):
            expected = reference[(i, kind if sandwich else UNNORMED_KINDS[kind])]
            assert_close(got[f"blocks.{i}.{hook}"], expected, atol=ACTIVATION_TOL, rtol=ACTIVATION_TOL, err_msg=f"{name} {i} {hook}")
        assert_close(got[f"blocks.{i}.ln2_post.hook_in"], got[f"blocks.{i}.mlp.hook_out"], atol=0, rtol=0)
        differs = np.abs(got[f"blocks.{i}.attn.hook_out"] - got[f"blocks.{i}.hook_attn_out"]).max() > 1e-3
        assert differs == sandwich, (name, i)
    shift = torch.from_numpy(vector) * 3.0
    reference_edits = [(1, "attn_unnormed" if sandwich else "attn_out", lambda x: x + shift)]
    assert edited.token_ids == hf_greedy(path, prompt, 3, edits=reference_edits), name
    assert_close(edited.logits, hf_logits(path, prompt + edited.token_ids[:-1], edits=reference_edits), atol=LOGIT_TOL,
                 rtol=0, err_msg=name)


MOE_ARCHS = [name for name in ALL_ARCHS if name in ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")]
routed = pytest.mark.parametrize("arch", MOE_ARCHS, indirect=True)


@routed
def test_router_logits_and_expert_ids_match_hf_on_prompt_and_generated_rows(loop, arch):
    """Every sparse layer's router logits equal HF's (`output_router_logits`), its expert ids HF's
    choice exactly (ints); a dense layer's router is refused, naming the layers that have one."""
    name, engine, path, _ = arch
    info = loop.run(engine.info())
    assert info.moe is not None and info.moe.n_experts == 8 and info.moe.top_k == 2, name
    hooks = [f"blocks.{i}.mlp.hook_{kind}" for i in info.moe.layers for kind in ("router_logits", "expert_ids")]
    assert set(hooks) <= set(info.hook_names)
    prompt = prompt_ids(PROMPT_LEN, seed=7)
    result = loop.run(engine.generate({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                                       "capture": {"hooks": hooks + ["blocks.1.mlp.hook_expert_indices"]}}))
    fed = prompt + result.token_ids[:-1]
    reference = hf_activations(path, fed)
    for i in info.moe.layers:
        logits = result.activations[f"blocks.{i}.mlp.hook_router_logits"]
        ids = result.activations[f"blocks.{i}.mlp.hook_expert_ids"]
        assert logits.shape == (len(fed), 8) and ids.shape == (len(fed), 2) and ids.dtype == np.int32
        assert_close(logits, reference[(i, "router_logits")], atol=ACTIVATION_TOL, rtol=ACTIVATION_TOL, err_msg=f"{name} {i}")
        np.testing.assert_array_equal(ids, reference[(i, "expert_ids")], err_msg=f"{name} layer {i}")
    np.testing.assert_array_equal(result.activations["blocks.1.mlp.hook_expert_indices"],
                                  result.activations["blocks.1.mlp.hook_expert_ids"])
    dense = sorted(set(range(info.n_layers)) - set(info.moe.layers))
    if dense:
        with pytest.raises(ValueError, match=rf"layer {dense[0]} of this model is dense.*{info.moe.layers}"):
            loop.run(engine.generate({"prompt": prompt, "max_tokens": 1, "capture": {"hooks": [f"{dense[0]}:router_logits"]}}))


@routed
def test_router_edits_reroute_as_hf_and_leave_the_batch_alone(loop, arch):
    """Forbidding an expert (-1e4 on its logit) and forcing another (+1e4) route as HF routes the
    same edited logits: the forbidden expert is never chosen, the forced one always, greedy tokens
    and logits equal HF's; a request beside them in the batch is unchanged, and expert ids
    cannot be edited."""
    name, engine, path, _ = arch
    info = loop.run(engine.info())
    first, last = info.moe.layers[0], info.moe.layers[-1]
    prompt = prompt_ids(16, seed=25)
    base = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logits": {"positions": "all"}}
    hooks = [f"blocks.{first}.mlp.hook_expert_ids", f"blocks.{last}.mlp.hook_expert_ids"]
    plain = loop.run(engine.generate(base | {"capture": {"hooks": hooks}}))
    busiest = int(np.bincount(plain.activations[hooks[0]].ravel(), minlength=8).argmax())
    rarest = int(np.bincount(plain.activations[hooks[1]].ravel(), minlength=8).argmin())
    forbid, force = np.zeros(8, np.float32), np.zeros(8, np.float32)
    forbid[busiest], force[rarest] = -1e4, 1e4
    edits = [{"hook": f"blocks.{first}.mlp.hook_router_logits", "op": "add", "vector": forbid},
             {"hook": f"blocks.{last}.mlp.hook_router_logits", "op": "add", "vector": force}]
    edited, beside = loop.run(together(engine.generate(base | {"interventions": edits, "capture": {"hooks": hooks}}),
                                       engine.generate(base | {"capture": {"hooks": hooks}})))
    assert busiest not in edited.activations[hooks[0]] and (edited.activations[hooks[1]] == rarest).any(1).all(), name
    shift = {first: torch.from_numpy(forbid), last: torch.from_numpy(force)}
    reference_edits = [(layer, "router_logits", lambda x, v=v: x + v) for layer, v in shift.items()]
    assert edited.token_ids == hf_greedy(path, prompt, 4, edits=reference_edits), name
    assert_close(edited.logits, hf_logits(path, prompt + edited.token_ids[:-1], edits=reference_edits), atol=LOGIT_TOL,
                 rtol=0, err_msg=name)
    assert beside.token_ids == plain.token_ids and np.array_equal(beside.activations[hooks[0]], plain.activations[hooks[0]])
    assert_close(beside.logits, hf_logits(path, prompt + beside.token_ids[:-1]), atol=LOGIT_TOL, rtol=0, err_msg=name)
    with pytest.raises(ValueError, match="router's choice and cannot be edited.*hook_router_logits"):
        loop.run(engine.generate(base | {"interventions": [{"hook": hooks[0], "op": "scale", "factor": 0.0}]}))
