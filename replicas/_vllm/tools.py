"""What vLLM's OpenAI server computes that the OpenAI routes must match: tool calling as `vllm serve
--enable-auto-tool-choice --tool-call-parser NAME` runs it, and logprob token texts."""

from __future__ import annotations

import inspect
from typing import Any

from replicas._vllm.errors import VllmInternalsError


# Tools are rendered, constrained and parsed by the code `vllm serve --enable-auto-tool-choice
# --tool-call-parser NAME` runs: vllm/renderers/chat_utils.py (arguments as dicts for templates),
# vllm/parser (Parser.adjust_request: structured outputs for required/named choices;
# Parser.parse: calls and content), vllm/tool_parsers (the parsers by name).


def tool_parser_names() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def check_tool_parser(name: str) -> None:
    names = tool_parser_names()
    if name not in names:
        raise ValueError(
            f"tool_call_parser: {name!r} is not one of vLLM's tool parsers (`vllm serve --tool-call-parser`); "
            f"choose one of: {', '.join(names)}"
        )


def tool_parser_class(name: str, tokenizer: Any, model_name: str | None = None, strict_level: str = "auto") -> Any:
    """The Parser class vLLM's chat serving composes for `--enable-auto-tool-choice
    --tool-call-parser name --tool-strict-level strict_level`, checked against the tokenizer (a
    parser may need marker tokens)."""
    check_tool_parser(name)
    from vllm.parser.parser_manager import ParserManager

    wanted = {"tool_parser_name": name, "enable_auto_tools": True, "model_name": model_name,
              "tokenizer": tokenizer, "tool_strict_level": strict_level}
    accepted = inspect.signature(ParserManager.get_parser).parameters  # 0.26 takes neither tokenizer nor strict level
    try:
        return ParserManager.get_parser(**{k: v for k, v in wanted.items() if k in accepted})
    except TypeError as exc:
        raise ValueError(f"tool_call_parser: {name!r} cannot parse this model's output: {exc}") from None


def chat_request(messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool | None) -> Any:
    """vLLM's ChatCompletionRequest for these messages and tools: what its parsers take."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body: dict[str, Any] = {"messages": messages, "tools": tools, "tool_choice": tool_choice}
    if parallel_tool_calls is not None:
        body["parallel_tool_calls"] = parallel_tool_calls
    return ChatCompletionRequest.model_validate(body)


def template_tools(request: Any) -> list[dict[str, Any]]:
    """The tools as vLLM hands them to the chat template (`tool.model_dump()`)."""
    return [tool.model_dump() for tool in request.tools]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to chat templates: assistant tool-call arguments decoded from
    JSON text into dicts (invalid JSON becomes {}), empty tool_calls dropped. In place."""
    _chat_utils("template_messages")._postprocess_messages(messages)
    return messages


def _chat_utils(function: str) -> Any:
    """vLLM's chat helpers: vllm.renderers.chat_utils from 0.32, vllm.entrypoints.chat_utils before."""
    try:
        from vllm.renderers import chat_utils
    except ImportError:
        try:
            from vllm.entrypoints import chat_utils
        except ImportError as exc:
            raise VllmInternalsError(function, f"no vllm.renderers.chat_utils nor vllm.entrypoints.chat_utils ({exc})") from None
    return chat_utils


def tool_parser(parser_cls: Any, tokenizer: Any, request: Any, model_config: Any = None) -> Any:
    """One parser for one completion (vLLM's parsers keep state, one per choice)."""
    return parser_cls(tokenizer, request.tools, model_config=model_config)


def tool_generation_options(parser: Any, request: Any, max_whitespace: int | None = None) -> dict[str, Any]:
    """What vLLM's parser changes in generation for this request (its `adjust_request`, run as the
    chat renderer runs it, not for tool_choice none): `structured_outputs` (for required or a named
    function: an xgrammar structural tag in the parser's call format, or a JSON schema of the
    call(s)) and `skip_special_tokens` (off where markers may be special tokens). Returns
    SamplingParams keyword arguments. `max_whitespace` bounds the whitespace between the JSON
    tokens of a structural tag's arguments (xgrammar's `max_whitespace_cnt`; vLLM leaves it free,
    and its `disable_any_whitespace` does not reach structural tags)."""
    if request.tool_choice == "none" and not parser.always_adjust_request:
        return {}
    adjusted = parser.adjust_request(request=request.model_copy(deep=True))
    options: dict[str, Any] = {"skip_special_tokens": adjusted.skip_special_tokens}
    structured = adjusted.structured_outputs
    if structured is not None and structured.structural_tag is not None and max_whitespace is not None:
        import json
        from dataclasses import replace

        tag = json.loads(structured.structural_tag)
        _bound_whitespace(tag, max_whitespace)
        structured = replace(structured, structural_tag=json.dumps(tag))
    if structured is not None:
        options["structured_outputs"] = structured
    return options


def _bound_whitespace(node: Any, most: int) -> None:
    if isinstance(node, dict):
        if node.get("type") == "json_schema":
            node["max_whitespace_cnt"] = most
        for value in node.values():
            _bound_whitespace(value, most)
    elif isinstance(node, list):
        for value in node:
            _bound_whitespace(value, most)


def parse_tool_calls(parser: Any, request: Any, text: str, token_ids: Any) -> tuple[str | None, list[tuple[str, str, str]] | None]:
    """(content, [(id, name, arguments JSON)] or None) of one completion, as vLLM's chat serving
    parses it (`Parser.parse` with auto tools enabled); ids made as vLLM makes them."""
    make_tool_call_id = _chat_utils("parse_tool_calls").make_tool_call_id
    _, content, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=token_ids)
    if calls is None:
        return content, None
    return content, [(call.id or make_tool_call_id(), call.name, call.arguments) for call in calls]


def parse_tool_delta(
    parser: Any, request: Any, delta_text: str, delta_token_ids: Any, prompt_token_ids: Any, finished: bool
) -> dict[str, Any] | None:
    """One streamed step of one completion through vLLM's `Parser.parse_delta` (the parser fed
    every step in order, as vLLM's chat streaming does): the DeltaMessage as a dict with `content`
    and/or `tool_calls` ([{index, id, type, function: {name, arguments}}], OpenAI's chunk deltas,
    fields absent when not sent), or None when the step emits nothing (a held-back marker)."""
    delta = parser.parse_delta(delta_text, list(delta_token_ids), request, list(prompt_token_ids), finished=finished)
    if delta is None:
        return None
    out = delta.model_dump(exclude_none=True)
    out.pop("reasoning", None)
    out.pop("role", None)
    return out or None


# ---------------------------------------------------------------- token text


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text as vLLM's OpenAI server shows it in logprobs: the `decoded_token` its
    output processor gives each Logprob (vllm/v1/engine/logprobs.py), i.e. decode() of the one
    token with the leading spaces of a SentencePiece piece restored ("▁hello" -> " hello";
    a byte-level "Ġhello" decodes to " hello" as it is). vLLM also re-decodes a byte-fallback
    piece that ends in U+FFFD with the tokens before it; without that context it stays as decoded.
    vllm.tokenizers.detokenizer_utils in 0.26 and 0.32 (vllm.transformers_utils before)."""
    try:
        from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    except ImportError:
        try:
            from vllm.transformers_utils.detokenizer_utils import convert_ids_list_to_tokens
        except ImportError as exc:
            raise VllmInternalsError("token_texts", f"no convert_ids_list_to_tokens ({exc})") from None
    return list(convert_ids_list_to_tokens(tokenizer, ids))
