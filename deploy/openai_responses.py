"""capserve results -> OpenAI responses, stream chunks and errors (the `openai` package's types).

Every body is built from the `openai` package's own models (ChatCompletion, ChatCompletionChunk,
Completion, CompletionUsage, Model) and dumped to JSON with the fields set, plus one extra
top-level field, `capserve` (`capserve_field`): positions, token ids, the replica, and the
activations/logits in the base64 wire format of `replicas.api.arrays`, or a download link when they
are larger than `openai.inline_bytes`. When streaming it rides on the last chunk.

Pure functions, no Ray: unit-tested in tests/test_openai_api.py.
"""

from __future__ import annotations

import json
from typing import Any

from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall, Function
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs as CompletionLogprobs
from fastapi.responses import JSONResponse

from replicas.api import arrays
from replicas.api import Choice, GenerateResult, ModelInfo
from replicas.api.error_messages import public_message, remote_cause
from replicas.api.streaming import ChoiceDelta as StreamChoice
from replicas.api.streaming import StreamDelta

from deploy.http_parts import HttpError, classify, logger
from deploy.openai_translate import OpenAIRequestError, Translated

CHAT_FINISH = {"stop", "length", "tool_calls", "content_filter"}
MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf (JSON has no infinity)


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_unset=True)


def usage(result: GenerateResult, echo_only: bool = False) -> CompletionUsage:
    prompt = len(result.prompt_token_ids)
    completion = 0 if echo_only else sum(len(c.token_ids) for c in result.choices)
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def finish_reason(reason: str | None, chat: bool = True) -> str:
    allowed = CHAT_FINISH if chat else {"stop", "length", "content_filter"}
    return reason if reason in allowed else "stop"  # vLLM's "abort" never reaches a finished result


def needed_token_ids(t: Translated, result: GenerateResult) -> list[int]:
    """Token ids whose text the answer shows (logprobs, echo): ask a replica for them once."""
    if t.logprobs is None:
        return []
    ids: set[int] = set()
    for c in result.choices:
        ids.update(c.token_ids)
        for row in c.logprobs or ():
            ids.update(row)
    if t.echo:
        ids.update(result.prompt_token_ids)
        for row in result.prompt_logprobs or ():
            ids.update(row or ())
    return sorted(ids)


# ---------------------------------------------------------------- logprobs


def _vllm_order(row: dict[int, float], token: int) -> list[tuple[int, float]]:
    """A position's logprobs in the order vLLM keeps them (vllm/logprobs.py
    append_logprobs_for_next_position): the token at that position (sampled, or the prompt's)
    first, then the top-k by rank, the token not repeated. vLLM's answers take their top_logprobs
    from the front of it: chat the first k (the sampled token, and k - 1 more when it is not among
    the top k), completions k + 1, so every position lists its own token."""
    rest = sorted(((t, v) for t, v in row.items() if t != token), key=lambda kv: -kv[1])  # stable: ties keep vLLM's rank order
    return ([(token, row[token])] if token in row else []) + rest


def _lp(value: float | None) -> float:
    return MIN_LOGPROB if value is None or value == float("-inf") else float(value)


def chat_logprobs(token_ids: list[int], rows: list[dict[int, float]] | None, k: int, text: dict[int, str]) -> list[ChatCompletionTokenLogprob]:
    out = []
    for i, token in enumerate(token_ids):
        row = rows[i] if rows is not None and i < len(rows) else {}
        word = text.get(token, "")
        top = [TopLogprob(token=text.get(t, ""), bytes=list(text.get(t, "").encode()), logprob=_lp(v))
               for t, v in _vllm_order(row, token)[:k]]
        out.append(ChatCompletionTokenLogprob(token=word, bytes=list(word.encode()), logprob=_lp(row.get(token)), top_logprobs=top))
    return out


def completion_logprobs(
    token_ids: list[int], rows: list[dict[int, float] | None], k: int, text: dict[int, str], offset: int = 0
) -> CompletionLogprobs:
    tokens, values, tops, offsets = [], [], [], []
    for i, token in enumerate(token_ids):
        row = rows[i] if i < len(rows) else None
        word = text.get(token, "")
        tokens.append(word)
        offsets.append(offset)
        offset += len(word)
        values.append(None if row is None else _lp(row.get(token)))
        tops.append(None if row is None else {text.get(t, ""): _lp(v) for t, v in _vllm_order(row, token)[: k + 1]})
    # construct: an echoed prompt's first token has no logprob (null), which the type does not allow for
    return CompletionLogprobs.model_construct(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def prompt_logprobs_field(result: GenerateResult, text: dict[int, str]) -> list[Any] | None:
    """vLLM's top-level `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, decoded_token}}."""
    if result.prompt_logprobs is None:
        return None
    return [None if row is None else {str(t): {"logprob": _lp(v), "decoded_token": text.get(t)} for t, v in row.items()}
            for row in result.prompt_logprobs]


# ---------------------------------------------------------------- whole answers


def chat_completion(t: Translated, result: GenerateResult, id: str, created: int, capserve: dict[str, Any],
                    text: dict[int, str]) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(result.choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.tool_calls:
            message["tool_calls"] = [_tool_call(call) for call in c.tool_calls]
        logprobs = None
        if t.logprobs is not None:
            logprobs = ChoiceLogprobs(content=chat_logprobs(c.token_ids, c.logprobs, t.logprobs, text))
        choices.append(ChatChoice(index=i, message=ChatCompletionMessage(**message),
                                  finish_reason=finish_reason(c.finish_reason), logprobs=logprobs))
    body = _dump(ChatCompletion(id=id, object="chat.completion", created=created, model=t.model, choices=choices,
                                usage=usage(result)))
    if t.request.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_field(result, text)
    body["capserve"] = capserve
    return body


def completion(t: Translated, result: GenerateResult, id: str, created: int, capserve: dict[str, Any],
               text: dict[int, str], prompt_text: str = "") -> dict[str, Any]:
    choices = []
    for i, c in enumerate(result.choices):
        ids, rows = ([], []) if t.echo_only else (c.token_ids, list(c.logprobs or []))
        out = (prompt_text if t.echo else "") + ("" if t.echo_only else c.text)
        logprobs = None
        if t.logprobs is not None:
            if t.echo:
                ids = result.prompt_token_ids + ids
                rows = list(result.prompt_logprobs or [None] * len(result.prompt_token_ids)) + rows
            logprobs = completion_logprobs(ids, rows, t.logprobs, text)
        reason = "length" if t.echo_only else finish_reason(c.finish_reason, chat=False)
        choices.append(CompletionChoice(index=i, text=out, logprobs=logprobs, finish_reason=reason))
    body = _dump(Completion(id=id, object="text_completion", created=created, model=t.model, choices=choices,
                            usage=usage(result, t.echo_only)))
    if t.request.prompt_logprobs is not None and not t.echo:
        body["prompt_logprobs"] = prompt_logprobs_field(result, text)
    body["capserve"] = capserve
    return body


def _tool_call(call: Any) -> ChatCompletionMessageFunctionToolCall:
    return ChatCompletionMessageFunctionToolCall(
        id=call.id, type="function", function=Function(name=call.function.name, arguments=call.function.arguments)
    )


def capserve_field(result: GenerateResult, download: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `capserve` response field. `download` (from the capture store) replaces the inline arrays."""
    field: dict[str, Any] = {
        "replica": result.replica,
        "request_id": result.request_id,
        "prompt_token_ids": result.prompt_token_ids,
        "token_ids": result.token_ids,
        "positions": result.positions,
        "capture_token_ids": result.capture_token_ids,
        "logits_positions": result.logits_positions,
    }
    if result.sae:  # SAE features (replicas.api.SaeFeatures), arrays in the base64 format
        field["sae"] = {sae_id: features.model_dump(mode="json") for sae_id, features in result.sae.items()}
    if result.readouts:  # lenses and probes (replicas.api.ReadoutResult), in the request's order
        field["readouts"] = [readout.model_dump(mode="json") for readout in result.readouts]
    if len(result.choices) > 1:
        field["choice_token_ids"] = [c.token_ids for c in result.choices]
    if download is not None:
        field.update(activations=None, logits=None, download=download)
    else:
        field["activations"] = {name: arrays.to_base64(a) for name, a in result.activations.items()}
        field["logits"] = arrays.to_base64(result.logits) if result.logits is not None else None
    return field


def model_list(served: list[str], info: ModelInfo, created: int) -> dict[str, Any]:
    cards = [_dump(Model(id=name, object="model", created=created, owned_by="capserve", root=info.model,
                         max_model_len=info.max_model_len)) for name in served]
    return {"object": "list", "data": cards}


# ---------------------------------------------------------------- streams


class ChatStream:
    """The chunks of one streamed chat completion: `opening()`, `delta(item)` per StreamDelta,
    `closing(result, capserve)`. With tools (and a tool_choice other than none), content is held
    back and the last chunk carries it with the parsed tool calls."""

    def __init__(self, t: Translated, id: str, created: int) -> None:
        self.t, self.id, self.created = t, id, created
        self._sent: dict[int, str] = {}
        self._held: dict[int, list[ChatCompletionTokenLogprob]] = {}

    def _chunk(self, choices: list[ChunkChoice], **extra: Any) -> dict[str, Any]:
        return _dump(ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                         model=self.t.model, choices=choices, **extra))

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""), finish_reason=None)])
                for i in range(self.t.request.n)]

    def delta(self, item: StreamDelta) -> list[dict[str, Any]]:
        chunks = []
        for c in item.choices:
            entries = self._logprobs(c, item.tokens)
            if self.t.hold_tool_calls:
                self._held.setdefault(c.index, []).extend(entries or [])
                continue
            if not c.text and not entries:
                continue
            self._sent[c.index] = self._sent.get(c.index, "") + c.text
            logprobs = ChunkLogprobs(content=entries) if entries is not None else None
            chunks.append(self._chunk([ChunkChoice(index=c.index, delta=ChoiceDelta(content=c.text), logprobs=logprobs,
                                                   finish_reason=None)]))
        return chunks

    def closing(self, result: GenerateResult, capserve: dict[str, Any]) -> list[dict[str, Any]]:
        choices = []
        for i, c in enumerate(result.choices):
            delta, logprobs = self._last_delta(i, c)
            choices.append(ChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish_reason(c.finish_reason)))
        chunks = [self._chunk(choices)]
        if self.t.include_usage:
            chunks.append(self._chunk([], usage=usage(result)))
        chunks[-1]["capserve"] = capserve
        return chunks

    def _last_delta(self, i: int, c: Choice) -> tuple[ChoiceDelta, ChunkLogprobs | None]:
        if not self.t.hold_tool_calls:
            sent = self._sent.get(i, "")
            rest = c.text[len(sent):] if c.text.startswith(sent) else ""
            return ChoiceDelta(content=rest) if rest else ChoiceDelta(), None
        calls = [ChoiceDeltaToolCall(index=k, id=call.id, type="function",
                                     function=ChoiceDeltaToolCallFunction(name=call.function.name, arguments=call.function.arguments))
                 for k, call in enumerate(c.tool_calls or [])]
        delta = ChoiceDelta(content=c.content, tool_calls=calls or None)
        held = self._held.get(i)
        return delta, (ChunkLogprobs(content=held) if self.t.logprobs is not None else None)

    def _logprobs(self, c: StreamChoice, text: dict[int, str]) -> list[ChatCompletionTokenLogprob] | None:
        if self.t.logprobs is None:
            return None
        return chat_logprobs(c.token_ids, c.logprobs, self.t.logprobs, text)


class CompletionStream:
    """The chunks of one streamed completion (echo of a text prompt comes first)."""

    def __init__(self, t: Translated, id: str, created: int, prompt_text: str = "") -> None:
        self.t, self.id, self.created = t, id, created
        self._echo = prompt_text if t.echo else ""
        self._sent: dict[int, str] = {}

    def _chunk(self, choices: list[CompletionChoice], **extra: Any) -> dict[str, Any]:
        # model_construct: a streamed choice has no finish_reason yet, which the type (made for whole answers) requires
        return _dump(Completion.model_construct(id=self.id, object="text_completion", created=self.created,
                                                model=self.t.model, choices=choices, **extra))

    def opening(self) -> list[dict[str, Any]]:
        if not self._echo:
            return []
        return [self._chunk([CompletionChoice.model_construct(index=i, text=self._echo, logprobs=None, finish_reason=None)
                             for i in range(self.t.request.n)])]

    def delta(self, item: StreamDelta) -> list[dict[str, Any]]:
        chunks = []
        for c in item.choices:
            if not c.text and not (self.t.logprobs is not None and c.token_ids):
                continue
            logprobs = None
            if self.t.logprobs is not None:
                offset = len(self._echo) + len(self._sent.get(c.index, ""))
                logprobs = completion_logprobs(c.token_ids, list(c.logprobs or []), self.t.logprobs, item.tokens, offset)
            self._sent[c.index] = self._sent.get(c.index, "") + c.text
            chunks.append(self._chunk([CompletionChoice.model_construct(index=c.index, text=c.text, logprobs=logprobs,
                                                                        finish_reason=None)]))
        return chunks

    def closing(self, result: GenerateResult, capserve: dict[str, Any]) -> list[dict[str, Any]]:
        choices = []
        for i, c in enumerate(result.choices):
            sent = self._sent.get(i, "")
            rest = c.text[len(sent):] if c.text.startswith(sent) else ""
            choices.append(CompletionChoice.model_construct(index=i, text=rest, logprobs=None,
                                                            finish_reason=finish_reason(c.finish_reason, chat=False)))
        chunks = [self._chunk(choices)]
        if self.t.include_usage:
            chunks.append(self._chunk([], usage=usage(result)))
        chunks[-1]["capserve"] = capserve
        return chunks


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------- errors


# OpenAI's error types by status; every other 4xx is invalid_request_error, every 5xx server_error
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}
CONTEXT_MARKERS = ("exceed the model's max_model_len", "leaves no room for a prompt in the model's max_model_len")


def openai_error(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, `{"error": {message, type, param, code}}`, headers) for an exception on the OpenAI
    routes. Client errors are 4xx (never worth a retry); a full queue is 429 with Retry-After
    (clients and inspect back off as from a rate limit); a request past the model's context says
    "maximum context length" with code context_length_exceeded, which inspect maps to a
    model_length stop rather than an error."""
    cause = remote_cause(exc)
    param = getattr(cause, "param", None)
    code: Any = getattr(cause, "code", None)
    if isinstance(cause, OpenAIRequestError):
        status, headers = cause.status, {}
    else:
        status, kind, headers = classify(exc)
        if kind == "backpressure":
            status, code = 429, "rate_limit_exceeded"
        elif kind == "invalid_request":
            status = 400
        elif kind == "unauthorized":
            code = "invalid_api_key"
    if status == 500:
        logger.error("HTTP 500 (OpenAI route): %s", public_message(exc), exc_info=exc)
        message = f"internal error ({type(cause).__name__}); the router's log has the details"
    else:
        message = cause.message if isinstance(cause, HttpError) else public_message(exc)
        if status not in (401, 429):
            logger.warning("HTTP %d (OpenAI route): %s", status, message)
    if status == 400 and any(marker in message for marker in CONTEXT_MARKERS):
        message, code = f"This model's maximum context length is exceeded: {message}", "context_length_exceeded"
    if param is None and status == 400:
        param = _leading_field(message)
    kind = OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    error = {"message": message, "type": kind, "param": param,
             "code": code if code is not None else status}
    return status, {"error": error}, headers


def openai_error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = openai_error(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def _leading_field(message: str) -> str | None:
    """'capture.hooks[0]: unknown hook' -> 'capture.hooks[0]'; None when the message names no field first."""
    head = message.removeprefix("invalid request: ").split(":", 1)[0]
    return head if head and " " not in head else None
