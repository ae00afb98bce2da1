"""OpenAI request bodies -> `GenerateRequest` (+ how to answer), for the OpenAI-compatible routes.

Pure functions, no Ray: unit-tested in tests/test_openai_api.py. The responses are built in
`deploy.openai_responses`.

Rules (docs/openai.md):
- Every field is either honoured (mapped to a GenerateRequest field), accepted because it changes
  nothing capserve computes (`IGNORED`: user, metadata, ...), accepted only at the value that
  changes nothing (`NEUTRAL`: frequency_penalty 0, ...), or refused with a 400 naming the field.
  An unknown field is refused too: nothing that would change the result is silently dropped.
- capserve's own fields (`capture`, `interventions`, `logits`, `sae`, `readouts`) ride as top-level extra fields
  (what the openai client's `extra_body` sends), or inside `vllm_xargs`: either one key
  "capserve" holding a JSON string of an object with those fields, or one key per field holding
  a JSON string (or the object itself).
- Chat without max_tokens / max_completion_tokens gets all the room the context leaves after the
  prompt (vLLM's default), counted on the replica (`CallOptions.fill_max_tokens`); completions
  default to 16 tokens, as OpenAI and vLLM do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from replicas.api import ChatMessage, GenerateRequest
from replicas.api.errors import InvalidRequestError
from replicas.api.streaming import CallOptions
from replicas.plans.cost import estimate_prompt_tokens

# GenerateRequest fields that are capserve's own (not OpenAI's), validated by GenerateRequest itself.
CAPSERVE_FIELDS = ("capture", "interventions", "logits", "sae", "readouts")
XARGS_KEY = "capserve"

# Accepted, whatever their value: they change nothing capserve computes.
IGNORED = frozenset({"user", "metadata", "service_tier", "request_id", "cache_salt", "store", "safety_identifier",
                     "prompt_cache_key", "return_token_ids"})

# Accepted only at these values (the ones that change nothing); anything else is a 400.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "length_penalty": (None, 1),
    "logit_bias": (None, {}),
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "priority": (None, 0),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "truncate_prompt_tokens": (None,),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "reasoning_effort": (None,),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "functions": (None,),
    "function_call": (None,),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "add_special_tokens": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "mm_processor_kwargs": (None, {}),
    "return_tokens_as_token_ids": (None, False),
    "logits_processors": (None,),
    "kv_transfer_params": (None,),
    "prompt_embeds": (None,),
    "suffix": (None, ""),
}

_MESSAGES = TypeAdapter(list[ChatMessage])
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})


class OpenAIRequestError(InvalidRequestError):
    """A request the OpenAI routes refuse: 400 (or `status`), naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Body(BaseModel):
    # unknown fields are kept here and refused by `_check_fields`, naming them
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None
    capture: Any = None
    interventions: Any = None
    logits: Any = None
    sae: Any = None
    readouts: Any = None
    vllm_xargs: dict[str, Any] | None = None


class ChatBody(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    echo: bool | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: int | None = None
    echo: bool | None = None


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: `prompt` (text) or `messages` (a chat, rendered as chat completions render it)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


@dataclass
class Translated:
    """A request as capserve runs it, and what the answer must look like."""

    kind: Literal["chat", "completion"]
    request: GenerateRequest
    options: CallOptions
    model: str
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token in the answer; None = no logprobs
    echo: bool = False  # completions: the prompt comes first in the text (and logprobs)
    echo_only: bool = False  # completions with max_tokens 0: the one generated token is dropped
    hold_tool_calls: bool = False  # chat with tools: streamed content waits for the parsed calls


# ---------------------------------------------------------------- requests


def translate_chat(body: dict[str, Any], served: list[str], max_model_len: int) -> Translated:
    parsed = _parse(ChatBody, body)
    model = check_model(parsed.model, served)
    _check_fields(parsed, {"echo": (None, False)})
    if parsed.max_tokens is not None and parsed.max_completion_tokens is not None and parsed.max_tokens != parsed.max_completion_tokens:
        raise OpenAIRequestError(
            f"max_completion_tokens: {parsed.max_completion_tokens} differs from max_tokens {parsed.max_tokens}; give one",
            "max_completion_tokens",
        )
    max_tokens = parsed.max_completion_tokens if parsed.max_completion_tokens is not None else parsed.max_tokens
    fill = max_tokens is None
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIRequestError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if parsed.top_logprobs and not parsed.logprobs:
        raise OpenAIRequestError("top_logprobs: needs logprobs: true", "top_logprobs")
    logprobs = (parsed.top_logprobs or 0) if parsed.logprobs else None
    fields = _sampling(parsed)
    fields.update(prompt=chat_messages(parsed.messages), max_tokens=max_model_len - 1 if fill else max_tokens, logprobs=logprobs)
    if parsed.tools is not None:
        fields["tools"] = parsed.tools
    for name in ("tool_choice", "parallel_tool_calls"):
        if getattr(parsed, name) is not None:
            fields[name] = getattr(parsed, name)
    request = _request(fields)
    if fill:  # a placeholder the replica replaces; until then the Router charges what the prompt leaves room for
        request = request.model_copy(update={"max_tokens": max(1, max_model_len - estimate_prompt_tokens(request))})
    stream, include_usage = _streaming(parsed)
    holds = bool(request.tools) and request.tool_choice_name != "none"
    return Translated("chat", request, CallOptions(fill_max_tokens=fill, token_strs=stream and logprobs is not None),
                      model, stream, include_usage, logprobs, hold_tool_calls=holds)


def translate_completion(body: dict[str, Any], served: list[str], max_model_len: int) -> Translated:
    parsed = _parse(CompletionBody, body)
    model = check_model(parsed.model, served)
    _check_fields(parsed, {"add_special_tokens": (None, True)})  # text prompts get BOS etc., as vLLM's default
    prompt = _one_prompt(parsed.prompt)
    echo = bool(parsed.echo)
    max_tokens = parsed.max_tokens if parsed.max_tokens is not None else 16
    echo_only = max_tokens == 0
    if max_tokens < 0 or (echo_only and not echo):
        raise OpenAIRequestError(f"max_tokens must be at least 1 (0 only with echo: true), got {max_tokens}", "max_tokens")
    fields = _sampling(parsed)
    fields.update(prompt=prompt, max_tokens=max(max_tokens, 1), logprobs=parsed.logprobs)
    stream, include_usage = _streaming(parsed)
    if echo and parsed.logprobs is not None:
        if stream:
            raise OpenAIRequestError("echo: with logprobs it needs stream: false (prompt logprobs come at the end)", "echo")
        if parsed.prompt_logprobs not in (None, parsed.logprobs):
            raise OpenAIRequestError("prompt_logprobs: with echo and logprobs, leave it out (logprobs applies)", "prompt_logprobs")
        fields["prompt_logprobs"] = parsed.logprobs
    if echo_only and stream:
        raise OpenAIRequestError("max_tokens: 0 (echo only) needs stream: false", "max_tokens")
    request = _request(fields)
    return Translated("completion", request, CallOptions(token_strs=stream and parsed.logprobs is not None), model,
                      stream, include_usage, parsed.logprobs, echo=echo, echo_only=echo_only)


def translate_tokenize(body: dict[str, Any], served: list[str]) -> tuple[GenerateRequest, bool, bool]:
    """(request to render, add_special_tokens, return_token_strs)."""
    parsed = _parse(TokenizeBody, body)
    check_model(parsed.model, served)
    if (parsed.prompt is None) == (parsed.messages is None):
        raise OpenAIRequestError("give exactly one of prompt (text) and messages (a chat)", "prompt")
    if parsed.messages is None:
        if parsed.tools is not None:
            raise OpenAIRequestError("tools: only with messages", "tools")
        return _request({"prompt": parsed.prompt, "max_tokens": 1}), parsed.add_special_tokens is not False, bool(parsed.return_token_strs)
    for name, value, allowed in (("add_generation_prompt", parsed.add_generation_prompt, True),
                                 ("continue_final_message", parsed.continue_final_message, False),
                                 ("add_special_tokens", bool(parsed.add_special_tokens), False)):
        if value != allowed:
            raise OpenAIRequestError(f"{name}: capserve renders chats as chat completions do ({name}={allowed})", name)
    fields: dict[str, Any] = {"prompt": chat_messages(parsed.messages), "max_tokens": 1}
    if parsed.tools is not None:
        fields["tools"] = parsed.tools
    return _request(fields), False, bool(parsed.return_token_strs)


def translate_detokenize(body: dict[str, Any], served: list[str]) -> list[int]:
    parsed = _parse(DetokenizeBody, body)
    check_model(parsed.model, served)
    return parsed.tokens


def check_model(model: str | None, served: list[str]) -> str:
    if model is None:
        return served[0]
    if model not in served:
        raise OpenAIRequestError(
            f"The model `{model}` does not exist; this server serves {served}", "model", 404, "model_not_found"
        )
    return model


def chat_messages(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    """OpenAI messages as `replicas.api.ChatMessage`s: text parts joined (as vLLM joins them),
    "developer" as "system"; images, audio and files refused."""
    out = []
    for i, message in enumerate(messages):
        unknown = sorted(set(message) - MESSAGE_KEYS)
        if unknown:
            raise OpenAIRequestError(f"messages[{i}]: unknown field(s) {unknown}; allowed: {sorted(MESSAGE_KEYS)}", f"messages[{i}]")
        if message.get("refusal") is not None:
            raise OpenAIRequestError(f"messages[{i}].refusal: not supported; send the text as content", f"messages[{i}].refusal")
        converted = {k: v for k, v in message.items() if k != "refusal" and v is not None}
        if converted.get("role") == "developer":
            converted["role"] = "system"
        content = converted.get("content")
        if isinstance(content, list):
            converted["content"] = "\n".join(_text_part(part, i, j) for j, part in enumerate(content))
        out.append(converted)
    try:
        return _MESSAGES.validate_python(out)
    except ValidationError as exc:
        raise _invalid(exc, "messages.") from None


# ---------------------------------------------------------------- pieces


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError, prefix: str = "") -> OpenAIRequestError:
    """One 400 naming every bad field (`prefix` + pydantic's path); the first names `param`."""
    parts, params = [], []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        path = prefix + ".".join(str(p) for p in error["loc"])
        if not error["loc"]:  # a model-level rule: its message starts with the field
            path = message.split(":", 1)[0] if ":" in message and " " not in message.split(":", 1)[0] else prefix.rstrip(".")
            parts.append(message)
        else:
            parts.append(f"{path}: {message}")
        params.append(path or None)
    return OpenAIRequestError("; ".join(parts), params[0] if params else None)


def _check_fields(parsed: _Body, extra_neutral: dict[str, tuple[Any, ...]] | None = None) -> None:
    neutral = {**NEUTRAL, **(extra_neutral or {})}
    given = dict(parsed.model_extra or {})
    for name in neutral:
        if name in type(parsed).model_fields and name not in given:
            given[name] = getattr(parsed, name)
    for name, value in given.items():
        if name in IGNORED:
            continue
        if name not in neutral:
            raise OpenAIRequestError(
                f"{name}: unknown field; capserve refuses what it cannot honour rather than ignore it "
                f"(capserve's own fields: {', '.join(CAPSERVE_FIELDS)}, or vllm_xargs)",
                name,
            )
        if not any(value == ok and type(value) is not bool or value is ok for ok in neutral[name]):
            allowed = " or ".join(json.dumps(v) for v in neutral[name])
            raise OpenAIRequestError(f"{name}: {json.dumps(value)[:200]} is not supported by capserve; allowed: {allowed}", name)
    if parsed.best_of not in (None, parsed.n or 1):
        raise OpenAIRequestError(f"best_of: {parsed.best_of} is not supported; allowed: n ({parsed.n or 1}) or leave it out", "best_of")


def _sampling(parsed: _Body) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name in ("temperature", "top_p", "n", "seed", "ignore_eos", "prompt_logprobs"):
        value = getattr(parsed, name)
        if value is not None:
            fields[name] = value
    if parsed.top_k is not None:
        fields["top_k"] = 0 if parsed.top_k == -1 else parsed.top_k  # vLLM's -1 and capserve's 0 both disable it
    if parsed.stop:
        fields["stop"] = [parsed.stop] if isinstance(parsed.stop, str) else parsed.stop
    fields.update(capserve_fields(parsed))
    return fields


def capserve_fields(parsed: _Body) -> dict[str, Any]:
    """capture / interventions / logits / sae / readouts, from the top level and from vllm_xargs."""
    fields = {name: getattr(parsed, name) for name in CAPSERVE_FIELDS if getattr(parsed, name) is not None}
    for key, value in (parsed.vllm_xargs or {}).items():
        where = f"vllm_xargs.{key}"
        if key == XARGS_KEY:
            value = _json_value(value, where)
            if not isinstance(value, dict) or set(value) - set(CAPSERVE_FIELDS):
                raise OpenAIRequestError(
                    f"{where}: expected a JSON object with some of {list(CAPSERVE_FIELDS)}", where
                )
            found = value
        elif key in CAPSERVE_FIELDS:
            found = {key: _json_value(value, where)}
        else:
            raise OpenAIRequestError(
                f"{where}: unknown key; capserve reads {list(CAPSERVE_FIELDS)} (each a JSON string), or "
                f"'{XARGS_KEY}' holding all of them as one JSON string",
                where,
            )
        for name, spec in found.items():
            if name in fields:
                raise OpenAIRequestError(f"{name}: given twice (top level and vllm_xargs); give it once", name)
            fields[name] = spec
    return fields


def _json_value(value: Any, where: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise OpenAIRequestError(f"{where}: not valid JSON ({exc})", where) from None


def _streaming(parsed: _Body) -> tuple[bool, bool]:
    stream = bool(parsed.stream)
    options = parsed.stream_options
    if options is not None and not stream:
        raise OpenAIRequestError("stream_options: only with stream: true", "stream_options")
    if options is not None and options.continuous_usage_stats:
        raise OpenAIRequestError("stream_options.continuous_usage_stats: not supported; usage comes on the last chunk",
                                 "stream_options.continuous_usage_stats")
    return stream, bool(options and options.include_usage)


def _one_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise OpenAIRequestError(
                f"prompt: {len(prompt)} prompts in one request; capserve takes one prompt per request (send them "
                "concurrently: the router spreads them over the replicas)",
                "prompt",
            )
        return prompt[0]
    return prompt


def _text_part(part: Any, i: int, j: int) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise OpenAIRequestError(f"messages[{i}].content[{j}]: {kind!r} parts are not supported; text only",
                             f"messages[{i}].content[{j}]")


def _request(fields: dict[str, Any]) -> GenerateRequest:
    try:
        return GenerateRequest.model_validate(fields)
    except ValidationError as exc:
        raise _invalid(exc) from None
