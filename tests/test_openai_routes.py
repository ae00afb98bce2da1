"""The OpenAI-compatible API's streams and routes without a cluster: deltas on the replica,
streams through the Router (retries before the first item only), and the routes in front of a
Router on a fake replica pool (auth, 429, SSE, downloads)."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletion
from safetensors.numpy import load as load_safetensors

from deploy import openai_routes
from deploy.config import RouterConfig
from deploy.http import HttpRouter, api
from deploy.router import Router
from replicas.api import arrays
from replicas.api import GenerateRequest, GenerateResult, SaeFeatures
from replicas.api.errors import BackPressureError, InvalidRequestError, ReplicaUnavailableError
from replicas.api.streaming import ChoiceDelta, DeltaTracker, StreamDelta, StreamEnd, stream_generate
from tests.test_openai_api import AUTH, HOOK, KEY, SAE, USER, result
from tests.test_router import INFO, FakePool, FakeSlot


# ---------------------------------------------------------------- streaming on the replica


def output(*completions: tuple[int, str, list[int], str | None]) -> Any:
    return SimpleNamespace(outputs=[SimpleNamespace(index=i, text=text, token_ids=ids, finish_reason=reason,
                                                    logprobs=[{t: SimpleNamespace(logprob=-float(t))} for t in ids])
                                    for i, text, ids, reason in completions])


def test_delta_tracker_turns_cumulative_outputs_into_merged_deltas():
    tracker = DeltaTracker(lambda ids: [f"<{i}>" for i in ids])
    tracker.feed(output((0, "He", [1], None), (1, "X", [9], None)))
    tracker.feed(output((0, "Hello", [1, 2], None)))  # only the completions that advanced
    first = tracker.drain()
    assert [(c.index, c.text, c.token_ids) for c in first.choices] == [(0, "Hello", [1, 2]), (1, "X", [9])]
    assert first.choices[0].logprobs == [{1: -1.0}, {2: -2.0}] and first.tokens == {1: "<1>", 2: "<2>", 9: "<9>"}
    tracker.feed(output((0, "Hello!", [1, 2, 3], "stop")))
    tracker.feed(output((0, "Hello!", [1, 2, 3], "stop")))  # a finished completion repeated: nothing new
    last = tracker.drain()
    assert [(c.text, c.token_ids, c.finish_reason) for c in last.choices] == [("!", [3], "stop")]
    assert tracker.drain() is None


class StreamingEngine:
    """generate() feeds cumulative outputs to on_output, like CaptureEngine does."""

    def __init__(self, hang: bool = False) -> None:
        self.tokenizer = None
        self.hang = hang
        self.cancelled = False

    async def generate(self, request: GenerateRequest, on_output=None) -> GenerateResult:
        try:
            for n in range(1, 4):
                on_output(output((0, "ab"[: n] + "c" * (n > 2), list(range(1, n + 1)), "length" if n == 3 else None)))
                await asyncio.sleep(0)
                if self.hang:
                    await asyncio.Event().wait()
            return result()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def test_stream_generate_yields_deltas_then_the_result_and_cancels_the_engine_when_closed():
    async def main():
        items = [item async for item in stream_generate(StreamingEngine(), GenerateRequest(prompt="x"))]
        assert isinstance(items[-1], StreamEnd) and items[-1].result.text == "hello 0"
        deltas = [c for item in items[:-1] for c in item.choices]
        assert "".join(c.text for c in deltas) == "abc" and sum((c.token_ids for c in deltas), []) == [1, 2, 3]
        engine = StreamingEngine(hang=True)
        stream = stream_generate(engine, GenerateRequest(prompt="x"))
        assert (await anext(stream)).choices[0].text == "a"
        await stream.aclose()
        assert engine.cancelled

    asyncio.run(main())


# ---------------------------------------------------------------- streaming through the Router


class StreamSlot(FakeSlot):
    async def stream(self, method: str, *args: Any):
        request: GenerateRequest = args[0]
        self.pool.calls.append((self.replica, request))
        async for item in self.pool.streams(self.replica, request):
            yield item


class StreamPool(FakePool):
    def __init__(self, replicas, streams, **kwargs) -> None:
        super().__init__(replicas, lambda replica, request: _answer(request), **kwargs)
        self.streams = streams
        self.methods: list[str] = []

    @asynccontextmanager
    async def reserve(self, method: str, hint):
        self.methods.append(method)
        await self.open.wait()
        ranked = hint.ledger.rank(self.replicas, hint.avoid, self.capacity)
        yield StreamSlot(self, ranked[0])

    async def call_any(self, method: str, *args: Any) -> Any:
        if method == "info":
            return INFO
        if method == "token_strings":
            return [f"<{i}>" for i in args[0]]
        if method == "tokenize":
            return {"tokens": [1, 2, 3], "token_strs": ["a", "b", "c"] if args[2] else None, "max_model_len": 512}
        if method == "detokenize":
            return "decoded"
        raise AssertionError(method)


async def _answer(request: GenerateRequest) -> GenerateResult:
    return result(capture=request.capture is not None)


async def good(replica: str, request: GenerateRequest):
    yield StreamDelta([ChoiceDelta(0, "hel", [5])])
    yield StreamDelta([ChoiceDelta(0, "lo 0", [6])])
    yield StreamEnd(result(capture=request.capture is not None).model_copy(update={"replica": replica}))


def test_router_streams_retry_a_dead_replica_before_the_first_item_only():
    async def dies_first(replica: str, request: GenerateRequest):
        if replica == "a":
            raise ReplicaUnavailableError("engine died")
        async for item in good(replica, request):
            yield item

    async def dies_midway(replica: str, request: GenerateRequest):
        yield StreamDelta([ChoiceDelta(0, "hel", [5])])
        raise ReplicaUnavailableError("engine died")

    async def main():
        pool = StreamPool(["a", "b"], dies_first)
        router = Router(pool, {})
        items = [item async for item in router.generate_stream({"prompt": "x"})]
        assert [r for r, _ in pool.calls] in (["a", "b"], ["b"]) and items[-1].result.replica == "b"
        assert pool.methods[-1] == "generate_stream"
        pool = StreamPool(["a"], dies_midway)
        router = Router(pool, {})
        seen = []
        with pytest.raises(ReplicaUnavailableError, match="after the stream began"):
            async for item in router.generate_stream({"prompt": "x"}):
                seen.append(item)
        assert len(seen) == 1 and len(pool.calls) == 1  # not retried: the client had part of the answer
        stats = await router.stats()
        assert stats["queued"] == 0 and stats["replicas"] == {}  # nothing left charged

    asyncio.run(main())


def test_router_streams_refuse_bad_requests_and_a_full_queue_before_any_replica():
    async def main():
        pool = StreamPool(["a"], good)
        router = Router(pool, {"max_queued_requests": 0})
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            await router.open_stream({"prompt": "x", "max_tokens": 0}).first()
        stream = router.open_stream({"prompt": "x"})
        with pytest.raises(BackPressureError):
            await stream.first()
        await stream.aclose()
        assert pool.calls == []

    asyncio.run(main())


# ---------------------------------------------------------------- the routes, fake replicas


@pytest.fixture
def served(monkeypatch):
    from ray import serve

    def start(streams=good, **config: Any) -> tuple[TestClient, HttpRouter, StreamPool]:
        pool = StreamPool(["a", "b"], streams)
        router = HttpRouter(pool, RouterConfig(api_key=KEY, **config))
        monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=router))
        return TestClient(api, raise_server_exceptions=False), router, pool

    return start


ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("GET", "/v1/captures/abc")]


def test_every_openai_route_is_behind_the_key_and_answers_openai_s_error_shape(served):
    client, _, pool = served()
    for method, path in ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = client.request(method, path, headers=headers, json={"messages": USER})
            assert response.status_code == 401, path
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    assert pool.calls == []


def test_a_full_queue_is_429_with_retry_after_before_the_body_is_read(served, monkeypatch):
    client, router, pool = served(max_queued_requests=1)
    reads: list[int] = []
    monkeypatch.setattr(openai_routes, "read_body", lambda request, limit: reads.append(limit))
    router._queue.waiting = 1
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = client.post(path, headers=AUTH, content=b"x" * 100)
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert reads == [] and pool.calls == []


def test_client_errors_are_4xx_and_reach_no_replica(served):
    client, _, pool = served()
    cases = [({"messages": USER, "frequency_penalty": 1}, 400, "frequency_penalty"),
             ({"messages": USER, "model": "other"}, 404, "model"),
             ({"messages": USER, "capture": {"hooks": ["blocks.0.hook_bad"]}}, 400, "capture.hooks")]
    for body, status, param in cases:
        response = client.post("/v1/chat/completions", headers=AUTH, json=body)
        assert response.status_code == status and response.json()["error"]["param"] == param, response.json()
    assert client.post("/v1/chat/completions", headers=AUTH, content=b"{nope").status_code == 400
    assert pool.calls == []


def test_chat_and_completions_answer_through_the_router(served):
    client, router, pool = served()
    body = client.post("/v1/chat/completions", headers=AUTH,
                       json={"model": "tiny-llama", "messages": USER, "capture": {"hooks": [HOOK]}, "logprobs": True}).json()
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "hello 0" and parsed.choices[0].logprobs.content[0].token == "<5>"
    np.testing.assert_array_equal(arrays.from_raw(body["capserve"]["activations"][HOOK]), result(capture=True).activations[HOOK])
    (replica, sent), = pool.calls
    assert sent.capture.hooks == [HOOK] and sent.max_tokens == 512 - 5  # a placeholder; the replica fills the context
    body = client.post("/v1/completions", headers=AUTH, json={"prompt": [0, 7], "echo": True, "max_tokens": 2}).json()
    assert body["choices"][0]["text"] == "decodedhello 0"  # token prompt echoed through a replica's tokenizer
    assert client.get("/v1/models", headers=AUTH).json()["data"][0] | {"created": 0} == {
        "id": "tiny-llama", "object": "model", "created": 0, "owned_by": "capserve", "root": "fake", "max_model_len": 512}
    assert client.post("/tokenize", headers=AUTH, json={"prompt": "x", "return_token_strs": True}).json() == {
        "count": 3, "max_model_len": 512, "tokens": [1, 2, 3], "token_strs": ["a", "b", "c"]}
    assert client.post("/detokenize", headers=AUTH, json={"tokens": [1, 2]}).json() == {"prompt": "decoded"}


def test_sae_specs_reach_the_replica_and_their_features_come_back_in_the_capserve_field(served):
    client, _, pool = served()
    features = SaeFeatures(hook=HOOK, positions=[0, 1], ids=np.array([[3, -1], [1, 2]], np.int32),
                           values=np.array([[1.5, 0], [2, 1]], np.float32), error=np.array([0.5, 0.25], np.float32))

    async def with_features(replica: str, request: GenerateRequest) -> GenerateResult:
        return result().model_copy(update={"sae": {spec.sae_id: features for spec in request.sae}})

    pool.behaviour = with_features
    body = client.post("/v1/chat/completions", headers=AUTH, json={"messages": USER, "sae": [SAE]}).json()
    (_, sent), = pool.calls
    assert [spec.model_dump() for spec in sent.sae] == [{**SAE, "hook": None}]
    back = SaeFeatures.model_validate(body["capserve"]["sae"]["res0"])
    for name in ("ids", "values", "error"):
        np.testing.assert_array_equal(getattr(back, name), getattr(features, name))
    response = client.post("/v1/chat/completions", headers=AUTH, json={"messages": USER, "sae": [{**SAE, "top_k": 0}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "sae.0.top_k"
    assert len(pool.calls) == 1  # the bad spec reached no replica


def test_streams_are_server_sent_events_ending_with_done(served):
    client, _, _ = served()
    response = client.post("/v1/chat/completions", headers=AUTH,
                           json={"messages": USER, "stream": True, "capture": {"hooks": [HOOK]}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "hello 0"
    assert chunks[-1]["capserve"]["replica"] in ("a", "b") and HOOK in chunks[-1]["capserve"]["activations"]


def test_a_stream_that_sends_nothing_for_keepalive_s_sends_a_comment_the_openai_client_skips(served):
    """A chat with tools holds its content back until the calls are parsed at the end, so its
    deltas send nothing; each gap longer than openai.keepalive_s gets a comment instead. (The
    keepalive timer is due long before the replica's next item: the loop runs it first.)"""
    from openai._streaming import SSEDecoder

    async def slow(replica: str, request: GenerateRequest):
        for text, token in (("hel", 5), ("lo 0", 6)):
            await asyncio.sleep(0.5)
            yield StreamDelta([ChoiceDelta(0, text, [token])])
        await asyncio.sleep(0.5)
        yield StreamEnd(result())

    client, _, _ = served(slow, openai={"keepalive_s": 0.05})
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    response = client.post("/v1/chat/completions", headers=AUTH, json={"messages": USER, "stream": True, "tools": [tool]})
    events = response.text.split("\n\n")
    assert response.status_code == 200 and events[:-1].count(": keep-alive") >= 3  # the replica was silent 0.5 s three times
    data = [e.data for e in SSEDecoder().iter_bytes(iter([response.content]))]
    assert data[-1] == "[DONE]" and all(json.loads(d)["object"] == "chat.completion.chunk" for d in data[:-1])
    assert json.loads(data[-2])["choices"][0]["delta"]["content"] == "hello 0"  # held, then sent whole at the end
    fast, _, _ = served(good)  # tokens every moment: nothing but the chunks
    assert ": keep-alive" not in fast.post("/v1/chat/completions", headers=AUTH, json={"messages": USER, "stream": True}).text


def test_an_error_before_the_first_token_keeps_its_status_and_one_after_it_is_an_event(served):
    async def bad_request(replica, request):
        raise InvalidRequestError("capture.hooks[0]: layer 9 is out of range")
        yield

    async def dies_midway(replica, request):
        yield StreamDelta([ChoiceDelta(0, "hel", [5])])
        raise ReplicaUnavailableError("engine died")

    client, _, _ = served(bad_request)
    response = client.post("/v1/completions", headers=AUTH, json={"prompt": "x", "stream": True})
    assert response.status_code == 400 and "layer 9" in response.json()["error"]["message"]
    client, _, _ = served(dies_midway)
    response = client.post("/v1/completions", headers=AUTH, json={"prompt": "x", "stream": True})
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 503 and "after the stream began" in json.loads(events[-2])["error"]["message"]


def test_a_capture_over_the_inline_cap_is_a_one_time_safetensors_download(served):
    client, router, _ = served(openai={"inline_bytes": 8, "capture_ttl_s": 60})
    body = client.post("/v1/completions", headers=AUTH, json={"prompt": "x", "capture": {"hooks": [HOOK]}}).json()
    field = body["capserve"]
    assert field["activations"] is None and field["download"]["format"] == "safetensors"
    assert field["download"]["url"].endswith(field["download"]["path"]) and field["download"]["path"].startswith("/v1/captures/")
    assert client.get(field["download"]["path"]).status_code == 401  # behind the key like every route
    data = client.get(field["download"]["path"], headers=AUTH)
    assert data.status_code == 200 and data.headers["content-type"] == "application/octet-stream"
    np.testing.assert_array_equal(load_safetensors(data.content)[HOOK], result(capture=True).activations[HOOK])
    again = client.get(field["download"]["path"], headers=AUTH)
    assert again.status_code == 404 and "already downloaded" in again.json()["error"]["message"]
    assert router._captures.bytes == 0
