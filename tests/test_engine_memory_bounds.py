"""One small real engine held to tight bounds: an arena of 64 blocks, 32 KiB of per-step
temporaries. Long prefills computed in chunks equal HF; requests wait for arena room and one that
never fits is refused; results viewing the arena hold their blocks until dropped; a shard job that
outgrows the arena completes; a dead outbox fails captures as the replica's fault and the engine
goes on."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from replicas.api.errors import InvalidRequestError, ReplicaUnavailableError


ARENA_BYTES = 1 << 20  # 64 blocks of 32 float32 rows of the tiny models' 128 floats
STEP_BYTES = 32 << 10  # a logits row takes ~4 KiB: 8 rows a chunk


@pytest.fixture(scope="module")
def small(loop, tiny_models):
    from tests.conftest import start_engine

    engine = loop.run(start_engine(tiny_models["llama"], "small-memory", arena_max_bytes=ARENA_BYTES,
                                   max_step_temp_bytes=STEP_BYTES, max_capture_bytes=16 << 20))
    yield engine
    loop.run(engine.shutdown())


def hooks_of(n: int) -> list[str]:
    """n distinct hooks of the tiny 4-layer models."""
    from replicas.api.hooks import LAYER_KINDS

    return [f"blocks.{layer}.hook_{kind}" for kind in LAYER_KINDS for layer in range(4)][:n]


def settled_budget(loop, engine, timeout_s: float = 5.0) -> int:
    """The engine's arena budget in use once the worker has the blocks read in place back (the
    budget follows them, with the next take RPC), or after timeout_s as it is."""
    for _ in range(int(timeout_s / 0.05)):
        if not engine.arena_budget.used:
            break
        loop.run(asyncio.sleep(0.05))
    return engine.arena_budget.used


@pytest.mark.engine
def test_logits_and_rows_of_a_long_prefill_computed_in_chunks_equal_hf(loop, small, tiny_models):
    from tests.conftest import ACTIVATION_TOL, LOGIT_TOL, assert_close
    from tests.hf_reference import hf_activations, hf_logits
    from tests.test_engine_capture import prompt_ids

    prompt = prompt_ids(100, seed=90)  # one prefill step of 100 rows: 13 chunks of logits
    hooks = ["blocks.0.hook_resid_pre", "blocks.3.hook_resid_post"]
    result = loop.run(small.generate({"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                      "capture": {"hooks": hooks}, "logits": {"positions": "all"}}))
    fed = prompt + result.token_ids[:-1]
    assert result.logits_positions == list(range(len(fed))) and result.logits.shape[0] == len(fed)
    assert_close(result.logits, hf_logits(tiny_models["llama"], fed), atol=LOGIT_TOL, rtol=0)
    reference = hf_activations(tiny_models["llama"], fed)
    assert_close(result.activations[hooks[0]], reference[(0, "resid_pre")], atol=ACTIVATION_TOL, rtol=0)
    assert_close(result.activations[hooks[1]], reference[(3, "resid_post")], atol=ACTIVATION_TOL, rtol=0)


@pytest.mark.engine
def test_requests_wait_for_room_in_the_arena_and_one_that_never_fits_is_refused(loop, small):
    from tests.conftest import ACTIVATION_TOL, assert_close
    from tests.test_engine_capture import prompt_ids, settled_stats

    # 8 hooks x 159 rows: 8 x 5 blocks of the arena's 64; two at once would need 80
    requests = [{"prompt": prompt_ids(100, seed=91 + k), "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                 "capture": {"hooks": hooks_of(8)}} for k in range(2)]
    with pytest.raises(InvalidRequestError, match=r"capture: 14 hooks x 159 positions need up to 70 blocks of 16384 bytes .* "
                                                  r"holds 64 \(arena_max_bytes=1048576\)"):
        loop.run(small.generate(requests[0] | {"capture": {"hooks": hooks_of(14)}}))
    with pytest.raises(InvalidRequestError, match=r"x n=2 completions need up to 80 blocks"):
        loop.run(small.generate(requests[0] | {"n": 2, "temperature": 1.0}))

    async def together():
        return await asyncio.gather(*(small.generate(r) for r in requests))

    waits = small._budget().waits
    both = loop.run(together())
    assert small._budget().waits == waits + 1  # the second waited for the first's blocks
    for request, got in zip(requests, both):
        alone = loop.run(small.generate(request))
        assert got.token_ids == alone.token_ids
        for name, rows in alone.activations.items():
            assert rows.shape == (159, 128)
            assert_close(got.activations[name], rows, atol=ACTIVATION_TOL, rtol=0)
    stats = loop.run(settled_stats(small))
    assert 0 < stats["arena_bytes"] <= ARENA_BYTES and stats["arena_bytes_in_use"] == 0
    assert small._budget().used == 0


@pytest.mark.engine
def test_a_result_that_views_the_arena_holds_its_blocks_until_its_arrays_are_dropped(loop, small):
    """By default (`view_share`) a result's rows are read in place, and its blocks and arena
    budget come back once no array of it is left, not before; with `view_share` 0 they are copied."""
    import gc

    from tests.test_engine_capture import prompt_ids, settled_stats

    request = {"prompt": prompt_ids(100, seed=93), "max_tokens": 20, "temperature": 0, "ignore_eos": True,
               "capture": {"hooks": hooks_of(4)}}
    small.view_share = 0.0
    try:
        copied = loop.run(small.generate(request))
    finally:
        small.view_share = 0.5
    viewed = loop.run(small.generate(request))
    for name, rows in copied.activations.items():
        assert rows.shape == (119, 128) and rows.flags.writeable
        np.testing.assert_array_equal(viewed.activations[name], rows)
        assert not viewed.activations[name].flags.writeable  # read in place
    # each result holds 16 of the arena's 64 blocks: views may hold 32, a third result is copied
    again, past = loop.run(small.generate(request)), loop.run(small.generate(request))
    assert not again.activations[hooks_of(4)[0]].flags.writeable and past.activations[hooks_of(4)[0]].flags.writeable
    np.testing.assert_array_equal(past.activations[hooks_of(4)[0]], copied.activations[hooks_of(4)[0]])
    part = viewed.activations[hooks_of(4)[2]][50:60]
    del viewed, again, past
    gc.collect()
    assert loop.run(settled_stats(small, timeout_s=1.0))["arena_bytes_in_use"] > 0 and small._budget().used > 0
    np.testing.assert_array_equal(part, copied.activations[hooks_of(4)[2]][50:60])  # its rows are still there
    del part
    gc.collect()
    assert loop.run(settled_stats(small))["arena_bytes_in_use"] == 0
    assert settled_budget(loop, small) == 0


@pytest.mark.engine
def test_a_shard_job_that_outgrows_the_arena_copies_its_lines_out_and_completes(loop, small, tiny_models, tmp_path):
    """A replica-side sink holds a job's lines, viewing the arena, until the shard is written: 8
    lines of 16 blocks need twice the arena's 64, so the later ones wait for room that only the
    job itself could give back. The sink copies the finished lines out when a request waits."""
    from safetensors.numpy import load_file

    from replicas.shards.sink import JobLine, RowSpec, ShardJob, ShardSink, run_shard
    from tests.conftest import ACTIVATION_TOL, assert_close
    from tests.hf_reference import hf_activations
    from tests.test_engine_capture import prompt_ids, settled_stats

    hooks = hooks_of(4)  # 4 hooks x 100 rows: 16 blocks a line
    prompts = [prompt_ids(100, seed=200 + k) for k in range(8)]
    lines = [JobLine(line=k, request={"prompt": p, "max_tokens": 1, "temperature": 0, "capture": {"hooks": hooks}})
             for k, p in enumerate(prompts)]
    job = ShardJob(folder=str(tmp_path), shard=0, spec=RowSpec(hooks=hooks), d_model=128, lines=lines, concurrency=8)
    sink = ShardSink()
    sink.watch(small.arena_budget)
    small.view_share = 1.0  # as in a replica: rows view the arena until the shard is written
    try:
        index = loop.run(asyncio.wait_for(run_shard(job, small.generate, sink), 120))
    finally:
        small.view_share = 0.5
        small.arena_budget.on_wait.remove(sink.relieve)
        sink.close()
    assert index.captured == 8 and index.rows == 800
    assert sink.totals["relieved_bytes"] > 0
    tensors = load_file(str(tmp_path / "shard-000000.safetensors"))
    for k, prompt in enumerate(prompts):
        reference = hf_activations(tiny_models["llama"], prompt)
        for hook in hooks:
            layer, kind = int(hook.split(".")[1]), hook.split("hook_")[1]
            assert_close(tensors[hook][100 * k : 100 * (k + 1)], reference[(layer, kind)], atol=ACTIVATION_TOL, rtol=0)
    assert loop.run(settled_stats(small))["arena_bytes_in_use"] == 0
    assert settled_budget(loop, small) == 0


@pytest.mark.engine
def test_capture_groups_of_finished_requests_are_forgotten(loop, small):
    from tests.test_engine_capture import prompt_ids, settled_stats

    async def many():
        return await asyncio.gather(*(small.generate({"prompt": prompt_ids(6, seed=k), "max_tokens": 3,
                                                      "capture": {"hooks": hooks_of(1 + k % 6), "dtype": dtype}})
                                      for k in range(12) for dtype in ("float32", "bfloat16")))

    assert len(loop.run(many())) == 24
    stats = loop.run(settled_stats(small))
    assert stats["capture_groups"] == 0 and stats["requests_held"] == 0


@pytest.mark.engine
def test_a_dead_outbox_fails_captures_as_the_replicas_fault_and_the_engine_goes_on(loop, small):
    """Runs last: it breaks the engine's outbox on purpose. A bad block number handed back kills
    the outbox thread (an unguarded thread died silently, and the next capture hung the engine)."""
    from tests.test_engine_capture import prompt_ids

    async def poison() -> None:
        small._taker.release(["not a block"])
        await small._taker.flushing

    loop.run(poison())
    capture = {"prompt": prompt_ids(8, seed=99), "max_tokens": 3, "capture": {"hooks": ["1:resid_post"]}}
    with pytest.raises(ReplicaUnavailableError, match=r"outbox thread died \(ValueError"):
        loop.run(asyncio.wait_for(small.generate(capture), 60))
    steps = loop.run(small.stats())["steps"]
    with pytest.raises(ReplicaUnavailableError, match="outbox thread died"):
        loop.run(small.generate(capture | {"logits": {"positions": "all"}}))
    assert loop.run(small.stats())["steps"] == steps  # failed at once: it never reached the engine
    plain = loop.run(small.generate({"prompt": prompt_ids(8, seed=99), "max_tokens": 3, "ignore_eos": True}))
    assert len(plain.token_ids) == 3  # the engine core goes on
