"""The OpenAI-compatible API without a cluster: request translation, answers and chunks (checked
against the `openai` package's own types), errors and the capture store. Streams and routes:
tests/test_openai_routes.py."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from deploy.capture_store import CaptureGone, CaptureStore, CaptureTooLarge
from deploy.config import AppArgs, router_config
from deploy.http_parts import HttpError
from deploy.openai_responses import ChatStream, CompletionStream, capserve_field, chat_completion, completion, openai_error
from deploy.openai_translate import OpenAIRequestError, translate_chat, translate_completion, translate_tokenize
from replicas.api import arrays
from replicas.api import Choice, GenerateRequest, GenerateResult, ToolCall
from replicas.api.errors import BackPressureError, DeadlineExceededError, InvalidRequestError, ReplicaUnavailableError
from replicas.api.streaming import ChoiceDelta, StreamDelta
from tests.test_router import remote

SERVED = ["tiny-llama"]
KEY = "k-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
HOOK = "blocks.0.hook_resid_post"
USER = [{"role": "user", "content": "hi"}]


def chat(**body: Any):
    return translate_chat({"messages": USER, **body}, SERVED, 512)


def refused(fn, *args, param: str, status: int = 400) -> OpenAIRequestError:
    with pytest.raises(OpenAIRequestError) as info:
        fn(*args)
    assert info.value.param == param and info.value.status == status, (info.value.param, str(info.value))
    return info.value


# ---------------------------------------------------------------- requests


def test_chat_fields_map_to_the_generate_request():
    t = chat(model="tiny-llama", max_completion_tokens=7, temperature=0.25, top_p=0.5, top_k=-1, n=2, stop="END",
             seed=3, logprobs=True, top_logprobs=4, ignore_eos=True, user="u", metadata={"a": "b"}, frequency_penalty=0)
    r = t.request
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.n, r.stop, r.seed, r.logprobs, r.ignore_eos) == (
        7, 0.25, 0.5, 0, 2, ["END"], 3, 4, True)
    assert t.kind == "chat" and t.model == "tiny-llama" and t.logprobs == 4 and not t.stream
    assert not t.options.fill_max_tokens
    assert [m.model_dump(exclude_none=True) for m in r.prompt] == [{"role": "user", "content": "hi"}]
    assert chat(max_tokens=5).request.max_tokens == 5
    assert chat(logprobs=True).request.logprobs == 0  # the sampled token's logprob only
    assert chat().request.logprobs is None


def test_chat_without_max_tokens_fills_the_context_on_the_replica():
    t = chat()
    # a placeholder the replica replaces; the Router charges what the (estimated) prompt leaves room for:
    # 1 (BOS) + 4 template tokens + 0 for "hi" (2 bytes at 4 per token)
    assert t.options.fill_max_tokens and t.request.max_tokens == 512 - 5
    long = translate_chat({"messages": [{"role": "user", "content": "x" * 4000}]}, SERVED, 512)
    assert long.request.max_tokens == 1  # the estimate leaves no room: the replica, which counts, decides
    assert translate_completion({"prompt": "x"}, SERVED, 512).request.max_tokens == 16  # OpenAI's completions default


def test_messages_are_converted_as_vllm_renders_them():
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    r = translate_chat({"messages": messages}, SERVED, 512).request
    assert [m.role for m in r.prompt] == ["system", "user", "assistant", "tool"]
    assert r.prompt[1].content == "a\nb" and r.prompt[2].tool_calls[0].function.name == "f"
    refused(translate_chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            SERVED, 512, param="messages[0].content[0]")
    refused(translate_chat, {"messages": [{"role": "user", "content": "x", "audio": 1}]}, SERVED, 512, param="messages[0]")
    error = refused(translate_chat, {"messages": [{"role": "user"}]}, SERVED, 512, param="messages.0")
    assert str(error) == "messages.0: a user message needs content"  # named as the caller sent it


def test_tools_and_tool_choice_pass_through():
    tool = {"type": "function", "function": {"name": "add", "description": "adds", "strict": True,
                                             "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    t = chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False)
    assert t.request.tools[0].function.name == "add" and t.request.tool_choice.function.name == "add"
    assert t.request.tools[0].function.strict is True  # OpenAI's strict reaches the engine's constraint
    assert t.request.parallel_tool_calls is False and t.hold_tool_calls
    assert not chat(tools=[tool], tool_choice="none").hold_tool_calls
    refused(translate_chat, {"messages": USER, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            SERVED, 512, param="tool_choice")


def test_capserve_fields_ride_at_top_level_or_in_vllm_xargs():
    capture = {"hooks": [HOOK], "positions": "prompt"}
    steer = [{"hook": HOOK, "op": "scale", "factor": 0.5}]
    top = chat(capture=capture, interventions=steer, logits={"positions": "last_prompt"}).request
    one = chat(vllm_xargs={"capserve": json.dumps({"capture": capture, "interventions": steer, "logits": {}})}).request
    each = chat(vllm_xargs={"capture": json.dumps(capture), "interventions": json.dumps(steer)}).request
    for r in (top, one, each):
        assert r.capture.hooks == [HOOK] and r.capture.positions == "prompt"
        assert r.interventions[0].op == "scale" and r.interventions[0].factor == 0.5
    assert top.logits.positions == "last_prompt" and one.logits is not None and each.logits is None
    for xargs, param in [({"capture": "{not json"}, "vllm_xargs.capture"), ({"other": "1"}, "vllm_xargs.other"),
                         ({"capserve": json.dumps({"bogus": 1})}, "vllm_xargs.capserve")]:
        refused(translate_chat, {"messages": USER, "vllm_xargs": xargs}, SERVED, 512, param=param)
    refused(translate_chat, {"messages": USER, "capture": capture, "vllm_xargs": {"capture": json.dumps(capture)}},
            SERVED, 512, param="capture")
    refused(translate_chat, {"messages": USER, "capture": {"hooks": ["blocks.0.hook_nope"]}}, SERVED, 512, param="capture.hooks")


SAE = {"sae_id": "res0", "top_k": 4, "positions": "prompt", "error": "norm"}


def test_sae_rides_like_the_other_capserve_fields():
    native = GenerateRequest.model_validate({"prompt": "hi", "sae": [SAE]}).sae
    assert [spec.model_dump() for spec in native] == [{**SAE, "hook": None}]
    sent = [chat(sae=[SAE]).request, chat(sae=SAE).request,  # one spec or a list, as the native request takes
            chat(vllm_xargs={"capserve": json.dumps({"sae": [SAE]})}).request, chat(vllm_xargs={"sae": json.dumps([SAE])}).request,
            translate_completion({"prompt": "hi", "sae": [SAE]}, SERVED, 512).request]
    for request in sent:
        assert request.sae == native
    refused(translate_chat, {"messages": USER, "sae": [SAE], "vllm_xargs": {"sae": json.dumps([SAE])}}, SERVED, 512, param="sae")


READOUTS = [{"kind": "logit_lens", "hook": HOOK, "top_k": 3, "positions": "last_prompt"}, {"kind": "probe", "probe": "p"}]


def test_readouts_ride_like_the_other_capserve_fields():
    native = GenerateRequest.model_validate({"prompt": "hi", "readouts": READOUTS}).readouts
    sent = [chat(readouts=READOUTS).request, chat(vllm_xargs={"capserve": json.dumps({"readouts": READOUTS})}).request,
            chat(vllm_xargs={"readouts": json.dumps(READOUTS)}).request,
            translate_completion({"prompt": "hi", "readouts": READOUTS}, SERVED, 512).request]
    for request in sent:
        assert request.readouts == native
    assert chat(readouts=READOUTS[0]).request.readouts == native[:1]  # one spec or a list
    error = refused(translate_chat, {"messages": USER, "readouts": [{**READOUTS[0], "top_k": 0}]}, SERVED, 512,
                    param="readouts.0.logit_lens.top_k")
    assert "greater than or equal to 1" in str(error)


@pytest.mark.parametrize("sae, param, why", [
    ([{**SAE, "top_k": 0}], "sae.0.top_k", "greater than or equal to 1"), ([{**SAE, "error": "huge"}], "sae.0.error", "'vector'"),
    ([{**SAE, "bogus": 1}], "sae.0.bogus", "Extra inputs"), ([{"top_k": 4}], "sae.0.sae_id", "Field required"),
    ([SAE, SAE], "sae", "an sae_id twice"), ("res0", "sae", "a valid list"),
])
def test_a_bad_sae_spec_is_a_400_naming_its_field(sae, param, why):
    error = refused(translate_chat, {"messages": USER, "sae": sae}, SERVED, 512, param=param)
    assert str(error).startswith(param + ":") and why in str(error), str(error)


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 0.5), ("presence_penalty", 1), ("logit_bias", {"5": 10}), ("response_format", {"type": "json_object"}),
    ("reasoning_effort", "high"), ("add_generation_prompt", False), ("continue_final_message", True), ("min_tokens", 3),
    ("repetition_penalty", 1.2), ("stop_token_ids", [3]), ("echo", True), ("chat_template", "{{x}}"), ("best_of", 3),
    ("some_new_field", 1), ("skip_special_tokens", False),
])
def test_what_capserve_cannot_honour_is_a_400_naming_the_field(field, value):
    error = refused(translate_chat, {"messages": USER, field: value}, SERVED, 512, param=field)
    assert str(error).startswith(field)


def test_neutral_values_and_ignored_fields_are_accepted():
    t = chat(frequency_penalty=0.0, presence_penalty=0, logit_bias={}, response_format={"type": "text"}, min_p=0,
             repetition_penalty=1.0, skip_special_tokens=True, add_generation_prompt=True, best_of=1, store=False,
             service_tier="auto", echo=False, stream=True, stream_options={"include_usage": True})
    assert t.stream and t.include_usage
    refused(translate_chat, {"messages": USER, "stream_options": {"include_usage": True}}, SERVED, 512, param="stream_options")
    refused(translate_chat, {"messages": USER, "max_tokens": 2, "max_completion_tokens": 3}, SERVED, 512,
            param="max_completion_tokens")
    refused(translate_chat, {"messages": USER, "max_tokens": 0}, SERVED, 512, param="max_tokens")
    refused(translate_chat, {"messages": USER, "top_logprobs": 2}, SERVED, 512, param="top_logprobs")
    assert refused(translate_chat, {"messages": USER, "model": "gpt-4"}, SERVED, 512, param="model", status=404).code == "model_not_found"


def test_completion_prompts_echo_and_logprobs():
    t = translate_completion({"prompt": [[1, 2, 3]], "max_tokens": 4, "logprobs": 2, "echo": True}, SERVED, 512)
    assert t.request.prompt == [1, 2, 3] and t.request.logprobs == 2 and t.request.prompt_logprobs == 2 and t.echo
    only = translate_completion({"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 0}, SERVED, 512)
    assert only.echo_only and only.request.max_tokens == 1
    assert translate_completion({"prompt": ["one"]}, SERVED, 512).request.prompt == "one"
    refused(translate_completion, {"prompt": ["a", "b"]}, SERVED, 512, param="prompt")
    refused(translate_completion, {"prompt": "x", "max_tokens": 0}, SERVED, 512, param="max_tokens")
    refused(translate_completion, {"prompt": "x", "suffix": "y"}, SERVED, 512, param="suffix")
    refused(translate_completion, {"prompt": ""}, SERVED, 512, param="prompt")
    refused(translate_completion, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, SERVED, 512, param="echo")


def test_tokenize_takes_a_prompt_or_messages():
    request, special, strs = translate_tokenize({"prompt": "hi", "return_token_strs": True}, SERVED)
    assert request.prompt == "hi" and special and strs
    request, special, _ = translate_tokenize({"messages": USER}, SERVED)
    assert request.is_chat and not special
    refused(translate_tokenize, {"prompt": "x", "messages": USER}, SERVED, param="prompt")
    refused(translate_tokenize, {"messages": USER, "add_generation_prompt": False}, SERVED, param="add_generation_prompt")


def test_served_model_names_default_to_the_model_argument():
    assert router_config(AppArgs()).served_model_names == ["tiny-llama"]
    assert router_config(AppArgs(model="tiny:gpt2")).served_model_names == ["tiny-gpt2"]
    assert router_config(AppArgs(model="org/m")).served_model_names == ["org/m"]
    assert router_config(AppArgs(openai={"served_model_name": ["a", "b"]})).served_model_names == ["a", "b"]


# ---------------------------------------------------------------- answers


def result(n: int = 1, capture: bool = False, tool_calls: list[ToolCall] | None = None) -> GenerateResult:
    choices = [Choice(text=f"hello {i}", token_ids=[5, 6 + i], finish_reason="length",
                      logprobs=[{5: -0.5, 9: -1.0, 8: -3.0}, {6 + i: -0.25, 9: -2.0}]) for i in range(n)]
    if tool_calls:
        choices = [Choice(text="<call>", token_ids=[5], finish_reason="tool_calls", content=None, tool_calls=tool_calls)]
    return GenerateResult(
        request_id="r1", text=choices[0].text, token_ids=choices[0].token_ids, prompt_token_ids=[0, 7],
        finish_reason=choices[0].finish_reason, choices=choices, positions=[0, 1] if capture else [],
        capture_token_ids=[0, 7] if capture else [], replica="abc", prompt_logprobs=[None, {7: -1.5, 3: -0.5}],
        activations={HOOK: np.arange(6, dtype=np.float32).reshape(2, 3)} if capture else {},
    )


TEXT = {5: "hel", 6: "lo", 7: "o7", 8: "x", 9: "y", 0: "<s>", 3: "z"}


def test_chat_completion_is_openai_s_type_with_logprobs_usage_and_the_capserve_field():
    t = chat(n=2, logprobs=True, top_logprobs=1, capture={"hooks": [HOOK]})
    body = chat_completion(t, result(2, capture=True), "chatcmpl-1", 7, capserve_field(result(2, capture=True)), TEXT)
    parsed = ChatCompletion.model_validate(body)
    assert [c.message.content for c in parsed.choices] == ["hello 0", "hello 1"]
    assert [c.finish_reason for c in parsed.choices] == ["length", "length"]
    first = parsed.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in first] == [("hel", -0.5), ("lo", -0.25)]
    assert [(x.token, x.logprob) for x in first[0].top_logprobs] == [("hel", -0.5)]  # top 1 by logprob
    assert parsed.usage.model_dump() == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                                         "completion_tokens_details": None, "prompt_tokens_details": None}
    field = body["capserve"]
    assert field["replica"] == "abc" and field["positions"] == [0, 1] and field["capture_token_ids"] == [0, 7]
    assert field["choice_token_ids"] == [[5, 6], [5, 7]]
    np.testing.assert_array_equal(arrays.from_raw(field["activations"][HOOK]), result(capture=True).activations[HOOK])


def test_tool_calls_come_back_as_openai_tool_calls():
    call = ToolCall(id="call_1", function={"name": "add", "arguments": '{"a": 1}'})
    body = chat_completion(chat(), result(tool_calls=[call]), "chatcmpl-1", 7, {}, {})
    message = ChatCompletion.model_validate(body).choices[0]
    assert message.finish_reason == "tool_calls" and message.message.content is None
    assert message.message.tool_calls[0].function.name == "add" and message.message.tool_calls[0].id == "call_1"


def test_completion_echo_puts_the_prompt_and_its_logprobs_first():
    t = translate_completion({"prompt": [0, 7], "max_tokens": 2, "echo": True, "logprobs": 1}, SERVED, 512)
    body = completion(t, result(), "cmpl-1", 7, {}, TEXT, prompt_text="<s>o7")
    choice = body["choices"][0]
    assert choice["text"] == "<s>o7hello 0"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["<s>", "o7", "hel", "lo"] and logprobs["token_logprobs"] == [None, -1.5, -0.5, -0.25]
    # k + 1 per position, as vLLM: the position's own token first, then the top k
    assert list(logprobs["top_logprobs"][1].items()) == [("o7", -1.5), ("z", -0.5)] and logprobs["text_offset"] == [0, 3, 5, 8]
    only = translate_completion({"prompt": [0, 7], "max_tokens": 0, "echo": True, "logprobs": 0}, SERVED, 512)
    body = completion(only, result(), "cmpl-1", 7, {}, TEXT, prompt_text="<s>o7")
    assert body["choices"][0]["text"] == "<s>o7" and body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["logprobs"]["tokens"] == ["<s>", "o7"]


def test_chat_stream_chunks_carry_deltas_then_finish_usage_and_capserve_last():
    t = chat(stream=True, stream_options={"include_usage": True}, logprobs=True)
    stream = ChatStream(t, "chatcmpl-1", 7)
    chunks = stream.opening()
    chunks += stream.delta(StreamDelta([ChoiceDelta(0, "hel", [5], [{5: -0.5}])], {5: "hel"}))
    chunks += stream.delta(StreamDelta([ChoiceDelta(0, "lo 0", [6], [{6: -0.25}])], {6: "lo"}))
    chunks += stream.closing(result(), {"replica": "abc"})
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in parsed if c.choices) == "hello 0"
    assert [e.token for c in parsed[1:3] for e in c.choices[0].logprobs.content] == ["hel", "lo"]
    assert parsed[-2].choices[0].finish_reason == "length" and parsed[-1].choices == []
    assert parsed[-1].usage.completion_tokens == 2 and chunks[-1]["capserve"] == {"replica": "abc"}
    assert all("capserve" not in c for c in chunks[:-1])


def test_a_streamed_chat_with_tools_holds_content_and_sends_the_calls_last():
    tool = {"type": "function", "function": {"name": "add", "parameters": {}}}
    t = chat(stream=True, tools=[tool])
    stream = ChatStream(t, "chatcmpl-1", 7)
    assert stream.delta(StreamDelta([ChoiceDelta(0, "<call>", [5])])) == []
    call = ToolCall(id="call_1", function={"name": "add", "arguments": "{}"})
    last = ChatCompletionChunk.model_validate(stream.closing(result(tool_calls=[call]), {})[-1])
    assert last.choices[0].finish_reason == "tool_calls" and last.choices[0].delta.tool_calls[0].function.name == "add"


def test_completion_stream_echoes_a_text_prompt_first():
    t = translate_completion({"prompt": "Hi", "stream": True, "echo": True}, SERVED, 512)
    stream = CompletionStream(t, "cmpl-1", 7, prompt_text="Hi")
    chunks = stream.opening() + stream.delta(StreamDelta([ChoiceDelta(0, "hello", [5])])) + stream.closing(result(), {"x": 1})
    assert [c["choices"][0]["text"] for c in chunks] == ["Hi", "hello", " 0"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["capserve"] == {"x": 1}


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("exc, status, code", [
    (BackPressureError("the router's queue is full"), 429, "rate_limit_exceeded"),
    (InvalidRequestError("capture.hooks[0]: unknown hook"), 400, 400),
    (remote(InvalidRequestError("capture.hooks[0]: unknown hook")), 400, 400),
    (ReplicaUnavailableError("all died"), 503, 503),
    (DeadlineExceededError("no result within routing.request_timeout_s=1 s"), 504, 504),
    (InvalidRequestError("prompt: 600 prompt tokens + max_tokens 16 exceed the model's max_model_len=512; shorten"),
     400, "context_length_exceeded"),
])
def test_errors_are_openai_shaped_with_the_right_status(exc, status, code):
    got, body, headers = openai_error(exc)
    assert got == status and set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code
    assert "Traceback" not in body["error"]["message"] and "pid=" not in body["error"]["message"]
    if status == 429:
        assert headers["Retry-After"] == "1" and body["error"]["type"] == "rate_limit_error"
    if status == 400 and code == 400:
        assert body["error"]["param"] == "capture.hooks[0]"
    if code == "context_length_exceeded":
        assert "maximum context length" in body["error"]["message"]  # what inspect's vllm provider looks for


@pytest.mark.parametrize("exc, status, kind", [
    (HttpError(401, "unauthorized", "missing or wrong bearer token"), 401, "authentication_error"),
    (HttpError(413, "too_large", "request body exceeds max_request_bytes=10"), 413, "invalid_request_error"),
    (HttpError(400, "bad_json", "request body is not valid JSON"), 400, "invalid_request_error"),
    (OpenAIRequestError("The model `gpt-5` does not exist", "model", 404, "model_not_found"), 404, "not_found_error"),
    (InvalidRequestError("seed: too large"), 400, "invalid_request_error"),
    (BackPressureError("the router's queue is full"), 429, "rate_limit_error"),
    (ReplicaUnavailableError("all died"), 503, "server_error"),
    (DeadlineExceededError("no result within routing.request_timeout_s=1 s"), 504, "server_error"),
    (RuntimeError("boom"), 500, "server_error"),
])
def test_error_types_are_openais_whatever_raised_them(exc, status, kind):
    got, body, _ = openai_error(exc)
    assert (got, body["error"]["type"]) == (status, kind)


# ---------------------------------------------------------------- the capture store


def test_captures_are_read_once_expire_and_are_evicted_oldest_first():
    now = [100.0]
    store = CaptureStore(max_bytes=10, ttl_s=5, clock=lambda: now[0])
    a = store.put(b"aaaa")
    assert a.expires_at == 105.0 and store.take(a.id) == b"aaaa" and store.bytes == 0
    with pytest.raises(CaptureGone, match="already downloaded"):
        store.take(a.id)
    b = store.put(b"bbbb")
    now[0] = 106.0
    with pytest.raises(CaptureGone, match="expired"):
        store.take(b.id)
    c, d = store.put(b"cccc"), store.put(b"dddd")
    e = store.put(b"eeee")  # 12 > 10 bytes: the oldest goes
    with pytest.raises(CaptureGone, match="evicted"):
        store.take(c.id)
    assert store.take(d.id) == b"dddd" and store.take(e.id) == b"eeee" and len(store) == 0
    with pytest.raises(CaptureTooLarge, match="capture_store_bytes=10"):
        store.put(b"x" * 11)
    with pytest.raises(CaptureGone, match="never stored"):
        store.take("nope")
