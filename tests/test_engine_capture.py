"""Real engines: captures equal HuggingFace, per request, under batching and chunked prefill."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time

import numpy as np
import pytest

from replicas.api.errors import InvalidRequestError
from replicas.api.hooks import LAYER_KINDS, FINAL_NORM_HOOK
from replicas.arena.lifeline import OWNER_FILE
from tests.conftest import ACTIVATION_TOL, ARCHS, MAX_NUM_BATCHED_TOKENS, ON_GPU, assert_close
from tests.hf_reference import hf_activations

pytestmark = pytest.mark.engine
TOL = ACTIVATION_TOL


def prompt_ids(n: int, seed: int, vocab: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def all_hooks(n_layers: int) -> list[str]:
    return [f"blocks.{i}.hook_{kind}" for i in range(n_layers) for kind in LAYER_KINDS] + [FINAL_NORM_HOOK]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_hook_matches_hf_on_prompt_and_generated_rows(loop, engines, tiny_models, arch):
    engine = engines[arch]
    info = loop.run(engine.info())
    prompt = prompt_ids(11, seed=3)
    result = loop.run(
        engine.generate(
            {
                "prompt": prompt,
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
                "capture": {"hooks": all_hooks(info.n_layers), "positions": "all"},
            }
        )
    )
    fed = prompt + result.token_ids[:-1]  # the last sampled token is never fed through the model
    assert result.positions == list(range(len(fed)))
    assert result.capture_token_ids == fed
    reference = hf_activations(tiny_models[arch], fed)
    for i in range(info.n_layers):
        for kind in LAYER_KINDS:
            got = result.activations[f"blocks.{i}.hook_{kind}"]
            assert got.shape == (len(fed), info.d_model)
            assert_close(got, reference[(i, kind)], atol=TOL, rtol=0, err_msg=f"{arch} layer {i} {kind}")
    assert_close(result.activations[FINAL_NORM_HOOK], reference[(None, "ln_final")], atol=TOL, rtol=0)


def test_aliases_and_wire_keys_are_echoed_and_equal(loop, engines):
    engine = engines["llama"]
    hooks = ["blocks.2.hook_resid_post", "blocks.2.hook_out", "2:resid_post", "blocks.1.ln2.hook_in", "1:resid_mid"]
    result = loop.run(engine.generate({"prompt": prompt_ids(6, 1), "max_tokens": 2, "capture": {"hooks": hooks}}))
    assert set(result.activations) == set(hooks)
    np.testing.assert_array_equal(result.activations["blocks.2.hook_out"], result.activations["blocks.2.hook_resid_post"])
    np.testing.assert_array_equal(result.activations["2:resid_post"], result.activations["blocks.2.hook_resid_post"])
    np.testing.assert_array_equal(result.activations["blocks.1.ln2.hook_in"], result.activations["1:resid_mid"])


def random_spec(rng: random.Random, n_layers: int) -> dict:
    hooks = rng.sample(all_hooks(n_layers), k=rng.randint(1, 4))
    positions = rng.choice(["all", "prompt", "generated", "last_prompt", [0, -1], [1, 2, 3]])
    return {
        "hooks": hooks,
        "positions": positions,
        "reduce": rng.choice(["none", "none", "mean"]),
        "dtype": rng.choice(["float32", "float32", "bfloat16", "float16"]),
    }


def test_32_concurrent_requests_each_equal_the_request_alone(loop, engines):
    engine = engines["llama"]
    rng = random.Random(7)
    requests = [
        {
            "prompt": prompt_ids(rng.randint(4, 200), seed=100 + k),
            "max_tokens": rng.randint(2, 8),
            "temperature": 0,
            "ignore_eos": True,
            "capture": random_spec(rng, 4) if k % 5 else None,
        }
        for k in range(32)
    ]

    async def together():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    batched = loop.run(together())
    for request, got in zip(requests, batched):
        alone = loop.run(engine.generate(request))
        assert got.token_ids == alone.token_ids
        assert got.positions == alone.positions
        assert set(got.activations) == set(alone.activations) == set((request["capture"] or {}).get("hooks", []))
        for name, rows in alone.activations.items():
            assert got.activations[name].dtype == rows.dtype
            assert_close(got.activations[name].astype(np.float32), rows.astype(np.float32), atol=TOL, rtol=0)


def test_positions_modes_select_the_right_rows(loop, engines):
    engine = engines["qwen2"]
    prompt = prompt_ids(9, seed=5)
    base = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    full = loop.run(engine.generate(base | {"capture": {"hooks": ["1:resid_post"], "positions": "all"}}))
    rows = full.activations["1:resid_post"]
    expected = {"prompt": list(range(9)), "generated": [9, 10, 11], "last_prompt": [8], (0, -1, 10): [0, 8, 10]}
    for spec, positions in expected.items():
        spec_value = list(spec) if isinstance(spec, tuple) else spec
        got = loop.run(engine.generate(base | {"capture": {"hooks": ["1:resid_post"], "positions": spec_value}}))
        assert got.positions == positions, spec
        assert_close(got.activations["1:resid_post"], rows[positions], atol=TOL, rtol=0)
    mean = loop.run(engine.generate(base | {"capture": {"hooks": ["1:resid_post"], "positions": "prompt", "reduce": "mean"}}))
    assert mean.activations["1:resid_post"].shape == (rows.shape[1],)
    assert_close(mean.activations["1:resid_post"], rows[:9].mean(0), atol=TOL, rtol=0)
    half = loop.run(engine.generate(base | {"capture": {"hooks": ["1:resid_post"], "dtype": "bfloat16"}}))
    assert str(half.activations["1:resid_post"].dtype) == "bfloat16"
    assert_close(half.activations["1:resid_post"].astype(np.float32), rows, atol=0.05, rtol=0.01)


def test_prompt_longer_than_a_step_captures_correctly(loop, engines, tiny_models):
    engine = engines["gpt2"]
    prompt = prompt_ids(3 * MAX_NUM_BATCHED_TOKENS + 17, seed=9)
    result = loop.run(
        engine.generate(
            {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
             "capture": {"hooks": ["blocks.0.hook_resid_pre", "blocks.3.hook_resid_post", "2:attn_out"], "positions": "all"}}
        )
    )
    fed = prompt + result.token_ids[:-1]
    assert result.positions == list(range(len(fed)))
    reference = hf_activations(tiny_models["gpt2"], fed)
    assert_close(result.activations["blocks.0.hook_resid_pre"], reference[(0, "resid_pre")], atol=TOL, rtol=0)
    assert_close(result.activations["blocks.3.hook_resid_post"], reference[(3, "resid_post")], atol=TOL, rtol=0)
    assert_close(result.activations["2:attn_out"], reference[(2, "attn_out")], atol=TOL, rtol=0)


def test_text_and_chat_prompts_are_tokenized_by_the_replica(loop, engines):
    engine = engines["llama"]
    text = loop.run(engine.generate({"prompt": "the cat sat on the mat", "max_tokens": 2, "capture": {"hooks": ["0:resid_pre"], "positions": "prompt"}}))
    assert text.prompt_token_ids == engine.tokenizer.encode("the cat sat on the mat")
    assert text.capture_token_ids == text.prompt_token_ids
    chat = loop.run(engine.generate({"prompt": [{"role": "user", "content": "hello there"}], "max_tokens": 2}))
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True)
    assert chat.prompt_token_ids == engine.tokenizer.encode(rendered, add_special_tokens=False)


def test_sampling_options_pass_through(loop, engines):
    engine = engines["llama"]
    request = {"prompt": prompt_ids(8, 2), "max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3, "logprobs": 2, "prompt_logprobs": 1}
    first, second = loop.run(engine.generate(request)), loop.run(engine.generate(request))
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in second.choices]
    assert len(first.choices) == 3 and all(len(c.token_ids) == 6 for c in first.choices)
    assert len(first.logprobs) == 6 and all(len(row) >= 2 for row in first.logprobs)
    assert len(first.prompt_logprobs) == 8 and first.prompt_logprobs[0] is None
    capped = loop.run(engine.generate({"prompt": prompt_ids(8, 2), "max_tokens": 3, "temperature": 0}))
    assert len(capped.token_ids) <= 3


BAD_REQUESTS = {
    "unknown hook": ({"capture": {"hooks": ["blocks.0.hook_nope"]}}, "capture.hooks"),
    "layer out of range": ({"capture": {"hooks": ["blocks.9.hook_resid_post"]}}, "layer 9 is out of range"),
    "unknown position mode": ({"capture": {"hooks": ["0:resid_pre"], "positions": "middle"}}, "capture.positions"),
    "index past the sequence": ({"capture": {"hooks": ["0:resid_pre"], "positions": [40]}}, "capture.positions"),
    "capture over the byte cap": ({"max_tokens": 400, "capture": {"hooks": all_hooks(4)}}, "max_capture_bytes"),
    # each under the 2 MiB cap alone: 12 hooks x 309 rows x 512 bytes, and 309 rows of logits
    "capture and logits over the byte cap": ({"max_tokens": 300, "capture": {"hooks": all_hooks(4)[:12]},
                                              "logits": {"positions": "all"}}, "capture/logits:"),
    "n completions over the byte cap": ({"n": 2, "temperature": 1.0, "max_tokens": 100, "capture": {"hooks": all_hooks(4)}},
                                        "x n=2 completions (each captures in full)"),
    "prompt too long": ({"prompt": [5] * 497, "max_tokens": 30}, "max_model_len"),
    "token id outside vocab": ({"prompt": [5, 100000]}, "vocabulary"),
    "unknown field": ({"capture": {"hooks": ["0:resid_pre"], "layers": [1]}}, "capture.layers"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_input_fails_only_that_request(loop, engines, case):
    engine = engines["llama"]
    overrides, expected_text = BAD_REQUESTS[case]
    good = {"prompt": prompt_ids(10, 4), "max_tokens": 20, "ignore_eos": True, "capture": {"hooks": ["1:mlp_out"]}}
    bad = {"prompt": prompt_ids(10, 4), "max_tokens": 4} | overrides

    async def both():
        return await asyncio.gather(engine.generate(bad), engine.generate(good), return_exceptions=True)

    bad_result, good_result = loop.run(both())
    assert isinstance(bad_result, InvalidRequestError), bad_result
    assert expected_text in str(bad_result)
    assert not isinstance(good_result, BaseException), good_result
    assert good_result.activations["1:mlp_out"].shape == (10 + 19, 128)


def test_requests_without_capture_leave_nothing_behind(loop, engines):
    engine = engines["llama"]
    loop.run(engine.generate({"prompt": prompt_ids(5, 8), "max_tokens": 2, "capture": {"hooks": ["0:resid_pre"]}}))
    loop.run(engine.generate({"prompt": prompt_ids(5, 8), "max_tokens": 2}))
    stats = loop.run(settled_stats(engine))
    assert stats["requests_held"] == 0 and stats["bytes_held"] == 0 and stats["arena_bytes_in_use"] == 0
    assert stats["capture_groups"] == 0  # a capture group lives only while a request uses it
    # the arena is mapped by the worker and the replica only: a killed engine leaves no file behind
    # but the note of who owns the folder (for the sweep of folders whose replica is gone)
    assert os.listdir(engine.spill_dir) == [OWNER_FILE]


async def settled_stats(engine, timeout_s: float = 10.0) -> dict:
    """The worker's counters once the arena blocks read by the replica are back (they return with
    the next take RPC, asynchronously), or after timeout_s as they are."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (stats := await engine.stats())["arena_bytes_in_use"] and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return stats


def test_cancelled_request_frees_its_state(loop, engines):
    engine = engines["llama"]

    async def cancel_midway():
        task = asyncio.ensure_future(
            engine.generate({"prompt": prompt_ids(20, 3), "max_tokens": 480, "ignore_eos": True, "capture": {"hooks": ["0:resid_pre"]}})
        )
        # cancel once the worker holds the request's rows (a GPU runs all 480 steps in about a second)
        while (await engine.stats())["requests_held"] == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await settled_stats(engine)

    stats = loop.run(cancel_midway())
    # its rows filled arena blocks (500 rows > one block); the replica handed them back unread
    assert stats["arena_bytes"] > 0
    assert stats["requests_held"] == 0 and stats["bytes_held"] == 0 and stats["arena_bytes_in_use"] == 0


def test_the_sites_device_memory_is_measured_for_vllms_budget(loop, engines, tiny_models):
    """On a GPU the worker measures what its sites, edit tables and read-outs allocate after the
    weights (and counts it with them: replicas._vllm.count_with_weights): at least a staging
    buffer of every layer's residual stream. The CPU engine's KV cache has a set size."""
    from transformers import AutoConfig

    device_bytes = loop.run(engines["llama"].stats())["device_bytes"]
    if not ON_GPU:
        assert device_bytes == 0
        return
    config = AutoConfig.from_pretrained(tiny_models["llama"])
    assert device_bytes >= config.num_hidden_layers * MAX_NUM_BATCHED_TOKENS * config.hidden_size * 4  # float32


def test_step_preparation_runs_on_every_step(loop, engines):
    """The fire counter: one prefill step plus one per fed generated token, CUDA graphs or not."""
    engine = engines["llama"]
    before = loop.run(engine.stats())["steps"]
    loop.run(engine.generate({"prompt": prompt_ids(12, 13), "max_tokens": 10, "ignore_eos": True}))
    assert loop.run(engine.stats())["steps"] - before == 10


def test_n_completions_capture_follows_the_first(loop, engines):
    engine = engines["llama"]
    # 44 rows: the arena holds them (a block is 32 float32 rows); the siblings' blocks go back
    request = {"prompt": prompt_ids(40, 17), "max_tokens": 5, "temperature": 1.0, "seed": 3, "n": 3, "ignore_eos": True,
               "capture": {"hooks": [f"{i}:resid_post" for i in range(4)], "positions": "all"}}
    result = loop.run(engine.generate(request))
    assert result.capture_token_ids == result.prompt_token_ids + result.choices[0].token_ids[:-1]
    alone = loop.run(engine.generate(request | {"n": 1, "prompt": result.prompt_token_ids + result.choices[0].token_ids[:-1],
                                                "max_tokens": 1, "capture": request["capture"] | {"positions": "prompt"}}))
    for name, rows in result.activations.items():
        assert_close(rows, alone.activations[name], atol=TOL)
    del result, alone, rows  # their views hold the arena blocks they read (`view_share`)
    gc.collect()
    assert loop.run(settled_stats(engine))["arena_bytes_in_use"] == 0


def test_repeated_decode_steps_skip_the_selection_and_capture_the_same_rows(loop, engines):
    """Decode steps of the same capturing requests in the same order go by `SteadyDecode`; their
    rows equal a prefill of the same tokens, for both requests of the batch."""
    engine = engines["llama"]
    capture = {"hooks": ["0:resid_post", "2:attn_out"], "positions": "all"}
    requests = [{"prompt": prompt_ids(36, seed), "max_tokens": 16, "temperature": 0, "ignore_eos": True, "capture": capture}
                for seed in (31, 32)]
    before = loop.run(engine.stats())
    loop.run(engine.forward_times())  # drained: the next call holds this batch's decode steps

    async def both():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    started = time.perf_counter()
    results = loop.run(both())
    elapsed = time.perf_counter() - started
    after = loop.run(engine.stats())
    assert after["steady_decode_steps"] - before["steady_decode_steps"] >= 10
    # the engine's decode period: 14-15 periods a request pair, each inside the batch's time
    periods = after["decode_periods"] - before["decode_periods"]
    period_s = after["seconds"]["decode_period"] - before["seconds"]["decode_period"]
    assert 14 <= periods <= 15 and 0 < period_s < elapsed
    # every token the batch ran was scheduled in some step (2 x 36 prompt, 2 x 15 generated), the last step inside the batch
    assert after["tokens"] - before["tokens"] == 2 * (36 + 15)
    assert before["time"] < after["last_step_at"] < after["time"]
    recent = loop.run(engine.decode_periods())  # the same periods one by one, the latest last
    assert sum(recent[-periods:]) == pytest.approx(period_s * 1e6, rel=1e-3, abs=periods * 0.1)
    # each decode step's model call (forward_timing): a period's step and the first of each run of decode
    # steps, every call a part of its step's period
    forward = loop.run(engine.forward_times())
    assert periods < len(forward["host"]) <= periods + 2 and len(forward["device"]) == (len(forward["host"]) if ON_GPU else 0)
    assert min(forward["host"]) > 0 and sum(sorted(forward["host"])[:periods]) < period_s * 1e6
    assert loop.run(engine.forward_times()) == {"host": [], "device": []}  # drained
    # switch_context_every_s: on a GPU the batch's rows came with context switches (the rows below
    # equal a prefill's all the same); the CPU engine has no second context
    switched = after["context_switches"] - before["context_switches"]
    assert switched >= 1 if ON_GPU else switched == 0
    for result in results:
        assert len(result.positions) == 36 + 15
        prefilled = loop.run(engine.generate({"prompt": result.capture_token_ids, "max_tokens": 1, "temperature": 0,
                                              "capture": capture | {"positions": "prompt"}}))
        for name, rows in result.activations.items():
            assert_close(rows, prefilled.activations[name], atol=TOL)


def test_a_stop_string_trims_rows_to_the_tokens_returned(loop, engines):
    """vLLM matches stop strings in its front end, after the engine core has run more steps: rows
    (and a mean over them, and logits) must stop where the returned tokens do."""
    engine = engines["llama"]
    prompt = prompt_ids(12, seed=21)
    hooks = ["1:resid_post", "3:mlp_out"]
    base = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = loop.run(engine.generate(base | {"capture": {"hooks": hooks}, "logits": {"positions": "all"}}))
    texts = [engine.tokenizer.decode(full.token_ids[: k + 1]) for k in range(len(full.token_ids))]
    # the first token from the 6th on whose text ends in characters not seen before it
    stop_at = next(k for k in range(5, 20) if texts[k][-2:].strip() and texts[k][-2:] not in texts[k - 1] and texts[k] != texts[k - 1])
    stop = texts[stop_at][-2:]
    stopped = loop.run(engine.generate(base | {"stop": [stop], "capture": {"hooks": hooks}, "logits": {"positions": "all"}}))
    mean = loop.run(engine.generate(base | {"stop": [stop], "capture": {"hooks": hooks, "positions": "generated", "reduce": "mean"}}))
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    fed = len(prompt) + len(stopped.token_ids) - 1
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert stopped.positions == list(range(fed)) and stopped.logits_positions == list(range(fed))
    assert stopped.capture_token_ids == (prompt + stopped.token_ids)[:fed]
    for name in hooks:
        assert_close(stopped.activations[name], full.activations[name][:fed], atol=TOL)
        assert_close(mean.activations[name], full.activations[name][len(prompt) : fed].mean(0), atol=TOL)
    assert_close(stopped.logits, full.logits[:fed], atol=1e-3)
    assert mean.positions == list(range(len(prompt), fed))


def kv_tokens_in(nbytes: int, model: str, dtype_bytes: int) -> int:
    """Whole tokens of keys and values at every layer that `nbytes` holds (vLLM rounds down to blocks)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model)
    d_head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return nbytes // (2 * hf.num_hidden_layers * hf.num_key_value_heads * d_head * dtype_bytes)


def test_an_engine_reports_the_tokens_its_kv_cache_holds(engines, tiny_models):
    fits = kv_tokens_in(256 << 20, tiny_models["llama"], dtype_bytes=4)  # conftest: 256 MiB, float32
    tokens = engines["llama"].kv_cache_tokens
    assert fits - 256 < tokens <= fits and tokens % 16 == 0, (tokens, fits)


def test_dtype_auto_keeps_a_float32_checkpoint_in_float32(loop, engines):
    """The GPT-2 engine runs dtype auto (conftest): its captures above equal HF fp32 only if so."""
    assert engines["gpt2"].config.dtype == "float32"
    assert loop.run(engines["gpt2"].info()).dtype == "float32"
