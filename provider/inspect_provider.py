"""`capserve/<model>`: an inspect_ai model provider that sends every sample to the Serve app.

    inspect eval task.py --model capserve/<model> -M app=capserve [-M address=auto] \\
        [-M capture=blocks.1.hook_resid_post,blocks.3.hook_mlp_out] [-M positions=last_prompt] \\
        [-M reduce=mean] [-M capture_dtype=float16] [-M capture_dir=DIR] [-M inline_bytes=262144]

In Python, `get_model("capserve/<model>", app=..., handle=<app handle>)` reuses a handle you
already hold (e.g. from `serve.run`) instead of connecting.

Each `generate()` awaits the app's Serve handle, so inspect's concurrent samples spread over
every replica (the Router balances them). Chat messages travel as `{role, content}` (assistant
turns with their `tool_calls`, tool results as `tool` turns) and the replica renders them, and
inspect's tools, with the served model's chat template. Tool calls are parsed on the replica by
the parser its engine config names (`tool_call_parser`, e.g. hermes) and come back as inspect
`ToolCall`s; `tool_choice` "any" is OpenAI's "required". Per-call options ride in
`GenerateConfig.extra_body`: any `GenerateRequest` field but `prompt`, e.g.
`{"capture": {...}, "interventions": [...], "logits": {"positions": "last_prompt"}, "readouts": [...]}`; a
`capture` there is merged over the `-M` capture defaults (`"capture": None` turns it off).

TransformerLens's inspect protocol (`extra_body={"extra_args": {...}}`, what its bridge sends its
`tl_bridge_vllm` provider) is answered in that protocol's format: `provider.tl_protocol`.

Activations land in `ModelOutput.metadata` (format: `provider.activations`); read them back with
`provider.read_activations(log_file, sample_id)`. `metadata["replica"]` names the replica that
served the call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from inspect_ai.model import (
    ChatCompletionChoice,
    ChatMessage,
    ChatMessageAssistant,
    GenerateConfig,
    Logprob,
    Logprobs,
    ModelAPI,
    ModelCall,
    ModelOutput,
    ModelUsage,
    RetryDecision,
    StopReason,
    TopLogprob,
)
from inspect_ai.tool import ToolCall, ToolChoice, ToolFunction, ToolInfo

from provider import activations as acts
from provider._serve import AppConnection, classify, unwrap
from provider.tl_protocol import TLCall
from replicas.api import GenerateRequest, GenerateResult, ModelInfo
from replicas.api.errors import InvalidRequestError

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_CONNECTIONS = 128  # the Router queues and balances; keep every replica's engine full
MODEL_ARGS = ("app", "address", "capture", "positions", "reduce", "capture_dtype", "capture_dir", "inline_bytes", "handle")
STOP_REASONS: dict[str | None, StopReason] = {"stop": "stop", "length": "max_tokens", "tool_calls": "tool_calls"}
# GenerateConfig fields with no capserve counterpart: ignored, with one warning per provider.
UNSUPPORTED = (
    "best_of",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "response_schema",
    "reasoning_effort",
    "reasoning_tokens",
)
CONTEXT_OVERFLOW = "max_model_len"  # the engine's prompt-too-long message names this setting


class CapserveAPI(ModelAPI):
    """inspect_ai `ModelAPI` over a capserve Serve app (see the module docstring for `-M` args)."""

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        config: GenerateConfig = GenerateConfig(),
        **model_args: Any,
    ) -> None:
        super().__init__(model_name=model_name, base_url=base_url, api_key=api_key, config=config)
        unknown = sorted(set(model_args) - set(MODEL_ARGS))
        if unknown:
            raise ValueError(f"capserve: unknown model arg(s) {unknown}; allowed -M args: {', '.join(MODEL_ARGS)}")
        self.capture_defaults = capture_defaults(model_args)
        self.capture_dir = model_args.get("capture_dir")
        self.inline_bytes = int(model_args.get("inline_bytes", acts.DEFAULT_INLINE_BYTES))
        app = str(model_args.get("app") or "capserve")
        self._conn = AppConnection(app, model_args.get("address") or base_url, model_args.get("handle"))
        self._info: ModelInfo | None = None
        self._vocab: Any = None  # a tokenizers.Tokenizer for logprob token text, or False
        self._warned: set[str] = set()

    # ------------------------------------------------------------ inspect hooks

    def connection_key(self) -> str:
        return self._conn.app

    def max_tokens(self) -> int | None:
        return DEFAULT_MAX_TOKENS

    def max_connections(self) -> int:
        return DEFAULT_MAX_CONNECTIONS

    def should_retry(self, ex: Exception) -> bool | RetryDecision:
        advice = classify(ex)
        if advice.kind == "rate_limit":
            return RetryDecision.rate_limit(advice.retry_after)
        if advice.kind == "transient":
            return RetryDecision.transient(advice.retry_after)
        return RetryDecision.no()

    def retry_wait(self) -> Any:
        # A full queue drains, and Serve replaces a dead replica, within seconds to a minute on a
        # fleet we own: back off from 1 s up to 60 s instead of inspect's 3 s .. 30 min.
        from tenacity import wait_exponential_jitter

        return wait_exponential_jitter(initial=1, max=60, jitter=1)

    async def generate(
        self,
        input: list[ChatMessage],
        tools: list[ToolInfo],
        tool_choice: ToolChoice,
        config: GenerateConfig,
    ) -> tuple[ModelOutput | Exception, ModelCall]:
        for name in UNSUPPORTED:
            if getattr(config, name, None) is not None:
                self._warn_once(name, f"capserve: GenerateConfig.{name} is not supported and is ignored")
        tl_call = TLCall.parse(config)  # TransformerLens's protocol (extra_body.extra_args), or None
        if tl_call is None:
            request = build_request(input, config, self.capture_defaults, tools=tools, tool_choice=tool_choice)
        handle = await self._handle()
        await self._check_model(handle)
        if tl_call is not None:
            request = tl_call.request([chat_message(m) for m in input], config, await self._model_info(handle))
        started = time.monotonic()
        response = handle.generate.remote(request, by_reference="auto")  # large captures skip the Router's copy
        try:
            result: GenerateResult = await response
            if not isinstance(result, GenerateResult):
                result = await result  # the replica's own object
        except asyncio.CancelledError:
            response.cancel()  # inspect gave up on the call (timeout): free the engine's slot too
            raise
        except InvalidRequestError as exc:
            cause = unwrap(exc)
            if CONTEXT_OVERFLOW in str(cause):
                call = ModelCall.create(request=request, response={"error": str(cause)}, time=time.monotonic() - started)
                output = ModelOutput.from_content(self.model_name, "", stop_reason="model_length", error=str(cause))
                return output, call
            raise cause from None
        except Exception as exc:
            raise unwrap(exc) from None
        elapsed = time.monotonic() - started
        output = await self._output(request, result, elapsed, tl_call)
        call = ModelCall.create(request=request, response=response_summary(result), time=elapsed)
        return output, call

    # ------------------------------------------------------------ internals

    async def _handle(self) -> Any:
        # Connecting (ray.init, looking the app up) blocks, so it runs off inspect's event loop.
        return self._conn.connected or await asyncio.to_thread(self._conn.handle)

    async def model_info(self) -> ModelInfo:
        """The served model's facts (fetched once per provider): layers, widths, armed kinds."""
        return await self._model_info(await self._handle())

    async def _model_info(self, handle: Any) -> ModelInfo:
        if self._info is None:
            self._info = await handle.info.remote()
        return self._info

    async def _check_model(self, handle: Any) -> None:
        if "model" in self._warned:
            return
        info = await self._model_info(handle)
        if self.model_name not in (info.model, Path(info.model.rstrip("/")).name):
            self._warn_once(
                "model",
                f"capserve: --model capserve/{self.model_name} but app {self._conn.app!r} serves "
                f"{info.model!r}; the served model answers",
            )
        self._warned.add("model")

    async def _output(
        self, request: dict[str, Any], result: GenerateResult, elapsed: float, tl_call: TLCall | None = None
    ) -> ModelOutput:
        top, prompt_top = request.get("logprobs"), request.get("prompt_logprobs")
        text = await self._token_text() if top is not None or prompt_top is not None else str
        choices = [
            ChatCompletionChoice(
                message=ChatMessageAssistant(
                    content=c.content or "",  # the text, less any tool-call markup
                    tool_calls=to_tool_calls(c.tool_calls),
                    model=self.model_name,
                    source="generate",
                ),
                stop_reason=STOP_REASONS.get(c.finish_reason, "unknown"),
                logprobs=to_logprobs(c.token_ids, c.logprobs, top or 0, text),
            )
            for c in result.choices
        ]
        if result.prompt_logprobs is not None and choices:
            # vLLM has no logprob for the first prompt token (row None): those rows are left out
            pairs = [(t, row) for t, row in zip(result.prompt_token_ids, result.prompt_logprobs) if row is not None]
            choices[0].prompt_logprobs = to_logprobs([t for t, _ in pairs], [r for _, r in pairs], prompt_top or 0, text)
        output_tokens = sum(len(c.token_ids) for c in result.choices)
        usage = ModelUsage(
            input_tokens=len(result.prompt_token_ids),
            output_tokens=output_tokens,
            total_tokens=len(result.prompt_token_ids) + output_tokens,
        )
        metadata = tl_call.metadata(result) if tl_call is not None else await self._metadata(request, result)
        return ModelOutput(model=self.model_name, choices=choices, usage=usage, time=elapsed, metadata=metadata)

    async def _metadata(self, request: dict[str, Any], result: GenerateResult) -> dict[str, Any]:
        meta: dict[str, Any] = {"replica": result.replica, "request_id": result.request_id}
        capture = request.get("capture")
        if capture is None and result.logits is None and not result.sae and not result.readouts:
            return meta
        encoded, tensors = acts.result_metadata(
            result,
            capture["hooks"] if capture else [],
            capture.get("reduce", "none") if capture else "none",
            inline_bytes=self.inline_bytes,
            capture_dir=self.capture_dir,
        )
        if tensors is not None:
            await asyncio.to_thread(acts.write_tensors, acts.file_of(encoded), tensors)
        return {**meta, **encoded}

    async def _token_text(self) -> Any:
        """id -> text for logprobs, from the served model's tokenizer.json when this machine has it."""
        if self._vocab is None:
            info = await self._model_info(await self._handle())
            self._vocab = await asyncio.to_thread(_load_vocab, info.model)
            if self._vocab is False:
                self._warn_once("vocab", f"capserve: no tokenizer.json for {info.model!r} here; logprob tokens are ids")
        vocab = self._vocab
        return (lambda i: vocab.decode([i], skip_special_tokens=False)) if vocab else str

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


# ---------------------------------------------------------------- pure pieces (unit-tested)


def capture_defaults(model_args: dict[str, Any]) -> dict[str, Any] | None:
    """The `-M` capture args as a CaptureSpec dict, or None when no hooks are given."""
    hooks = model_args.get("capture")
    if hooks in (None, "", []):
        for name in ("positions", "reduce", "capture_dtype"):
            if model_args.get(name) is not None:
                raise ValueError(f"capserve: -M {name} needs -M capture=<hooks> as well")
        return None
    spec: dict[str, Any] = {"hooks": _names(hooks)}
    if model_args.get("positions") is not None:
        spec["positions"] = parse_positions(model_args["positions"])
    if model_args.get("reduce") is not None:
        spec["reduce"] = str(model_args["reduce"])
    if model_args.get("capture_dtype") is not None:
        spec["dtype"] = str(model_args["capture_dtype"])
    return spec


def parse_positions(value: Any) -> str | list[int]:
    """`last_prompt` | `all` | `prompt` | `generated`, or indices: `-1`, `0,3,-1`, `[0, 3]`."""
    if isinstance(value, str) and not value.lstrip("-").isdigit() and "," not in value:
        return value
    items = value if isinstance(value, (list, tuple)) else [value] if isinstance(value, int) else str(value).split(",")
    try:
        return [int(str(v).strip()) for v in items]
    except ValueError:
        raise ValueError(
            f"capserve: positions={value!r}; use all | prompt | generated | last_prompt, or token indices like 0,3,-1"
        ) from None


def build_request(
    messages: list[ChatMessage],
    config: GenerateConfig,
    capture: dict[str, Any] | None,
    tools: list[ToolInfo] | None = None,
    tool_choice: ToolChoice | None = None,
) -> dict[str, Any]:
    """The GenerateRequest (as a validated, JSON-safe dict) for one inspect generate call."""
    request: dict[str, Any] = {"prompt": [chat_message(m) for m in messages]}
    if tools:
        request["tools"] = [tool_param(t) for t in tools]
        if tool_choice is not None:
            request["tool_choice"] = tool_choice_param(tool_choice)
        if config.parallel_tool_calls is not None:
            request["parallel_tool_calls"] = config.parallel_tool_calls
    if config.max_tokens is not None:
        request["max_tokens"] = config.max_tokens
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed")):
        if getattr(config, theirs) is not None:
            request[ours] = getattr(config, theirs)
    if config.stop_seqs:
        request["stop"] = list(config.stop_seqs)
    if config.num_choices is not None:
        request["n"] = config.num_choices
    if config.logprobs or config.top_logprobs is not None:
        request["logprobs"] = config.top_logprobs or 0
    if config.prompt_logprobs is not None:
        request["prompt_logprobs"] = config.prompt_logprobs
    if capture is not None:
        request["capture"] = dict(capture)
    extra = dict(config.extra_body or {})
    if "prompt" in extra:
        raise InvalidRequestError("extra_body.prompt: the prompt comes from the sample's messages; remove it")
    if "capture" in extra:
        request["capture"] = merge_capture(capture, extra.pop("capture"))
        if request["capture"] is None:
            del request["capture"]
    request.update(extra)
    try:
        GenerateRequest.model_validate(request)
    except ValueError as exc:  # pydantic's ValidationError names the field
        raise InvalidRequestError(f"capserve request (GenerateConfig / extra_body): {exc}") from None
    return request


def merge_capture(defaults: dict[str, Any] | None, override: Any) -> dict[str, Any] | None:
    """extra_body's `capture` over the -M defaults: None = off, hooks list/str = those hooks."""
    if override is None:
        return None
    if isinstance(override, (str, list)):
        override = {"hooks": _names(override)}
    if not isinstance(override, dict):
        raise InvalidRequestError(f"extra_body.capture: expected a capture spec dict, hook names or null, got {override!r}")
    return {**(defaults or {}), **override}


def chat_message(message: ChatMessage) -> dict[str, Any]:
    """An inspect message as a capserve ChatMessage dict (OpenAI's shape, as inspect's openai
    provider sends it: a failed tool call's result is its error text)."""
    if isinstance(message.content, list):
        other = sorted({c.type for c in message.content if c.type not in ("text", "reasoning")})
        if other:
            raise InvalidRequestError(f"messages: capserve serves text only; a {message.role} message holds {other} content")
    if message.role == "tool":
        content = f"Error: {message.error.message}" if message.error else message.text
        out: dict[str, Any] = {"role": "tool", "content": content, "tool_call_id": message.tool_call_id or ""}
        if message.function:
            out["name"] = message.function
        return out
    if message.role == "assistant" and message.tool_calls:
        calls = [
            {"id": call.id, "type": "function", "function": {"name": call.function, "arguments": json.dumps(call.arguments)}}
            for call in message.tool_calls
        ]
        return {"role": "assistant", "content": message.text or None, "tool_calls": calls}
    return {"role": message.role, "content": message.text}


def tool_param(tool: ToolInfo) -> dict[str, Any]:
    """inspect's ToolInfo as a capserve Tool (OpenAI's function tool)."""
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters.model_dump(exclude_none=True)}
    return {"type": "function", "function": function}


def tool_choice_param(choice: ToolChoice) -> str | dict[str, Any]:
    """inspect's ToolChoice as capserve's: "any" is OpenAI's "required"; a ToolFunction names one."""
    if isinstance(choice, ToolFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return "required" if choice == "any" else choice


def to_tool_calls(calls: list[Any] | None) -> list[ToolCall] | None:
    """capserve's parsed calls (arguments as JSON text) as inspect ToolCalls; arguments that are
    not a JSON object become {} with the reason in parse_error, which inspect reports to the model."""
    if not calls:
        return None
    out = []
    for call in calls:
        arguments, error = {}, None
        try:
            parsed = json.loads(call.function.arguments or "{}")
        except ValueError as exc:
            error = f"Error parsing the following tool call arguments:\n\n{call.function.arguments}\n\nError details: {exc}"
        else:
            if isinstance(parsed, dict):
                arguments = parsed
            else:
                error = f"Tool call arguments must be a JSON object, got: {call.function.arguments}"
        out.append(ToolCall(id=call.id, function=call.function.name, arguments=arguments, parse_error=error))
    return out


def to_logprobs(token_ids: list[int], rows: list[dict[int, float]] | None, top: int, text: Any) -> Logprobs | None:
    """vLLM's per-token {id: logprob} rows (the sampled token plus the top `top`) as inspect Logprobs."""
    if rows is None:
        return None
    content = []
    for token, row in zip(token_ids, rows):
        ranked = sorted(row.items(), key=lambda kv: -kv[1])[:top]
        content.append(
            Logprob(
                token=text(token),
                logprob=row.get(token, float("nan")),
                bytes=list(text(token).encode()),
                top_logprobs=[TopLogprob(token=text(t), logprob=lp, bytes=list(text(t).encode())) for t, lp in ranked] or None,
            )
        )
    return Logprobs(content=content)


def response_summary(result: GenerateResult) -> dict[str, Any]:
    """What the ModelCall logs of a result: everything but the arrays (their shapes instead)."""
    return {
        "request_id": result.request_id,
        "replica": result.replica,
        "choices": [
            {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
            | ({"tool_calls": [t.model_dump() for t in c.tool_calls]} if c.tool_calls else {})
            for c in result.choices
        ],
        "prompt_tokens": len(result.prompt_token_ids),
        "activations": {hook: list(a.shape) for hook, a in result.activations.items()},
        "positions": result.positions,
        "logits": list(result.logits.shape) if result.logits is not None else None,
    }


def _names(value: Any) -> list[str]:
    names = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return [str(n).strip() for n in names if str(n).strip()]


def _load_vocab(model: str) -> Any:
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return False
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    except Exception:  # no tokenizers package, or a file it cannot read: ids instead
        return False
