"""Request and response schemas shared by the engine, the router, the client and the provider.

Imports neither torch nor vLLM, so the router and the inspect provider stay light. Requests are
accepted as these models or as plain dicts (`GenerateRequest.model_validate`); arrays as numpy
arrays, nested lists or the `{"dtype", "shape", "data"}` encoding of `replicas.api.arrays`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from replicas.api import arrays
from replicas.api.conditions import Condition
from replicas.api.fields import FloatArray, Positions, ResultArray, VectorOrName
from replicas.api.hooks import HEAD_KINDS, editable_hook, resolve_hook
from replicas.api.readouts import ReadoutList, ReadoutResult

_STRICT = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class CaptureSpec(BaseModel):
    """What to record from one request's forward passes."""

    model_config = _STRICT

    hooks: list[str] = Field(min_length=1, description="Hook names (TransformerLens, Bridge or '<i>:<kind>').")
    positions: Positions = Field("all", description="Positions to keep: all | prompt | generated | last_prompt | [indices].")
    reduce: Literal["none", "mean"] = Field("none", description="'mean' averages the kept positions on the device.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="dtype of the returned arrays.")

    @field_validator("hooks")
    @classmethod
    def _known_hooks(cls, hooks: list[str]) -> list[str]:
        for name in hooks:
            resolve_hook(name)
        if len(set(hooks)) != len(hooks):
            raise ValueError("hooks lists a name twice")
        return hooks


class Intervention(BaseModel):
    """One edit of the residual stream or a sublayer output, applied inside the forward pass.

    `add`: h + scale * vector (with norm_match, the vector is rescaled to scale * |h| per row);
    `scale`: h * factor (0 ablates); `set`: replace rows with `values` (one row per selected
    position, or one row broadcast); `project_out`: h - (h . v) v for the unit vector v along
    `vector`; `clamp`: h + (clip(h . v, min, max) - h . v) v, the component along v held within
    [min, max] (either bound may be left out: `max` 0 caps a direction, `min` and `max` 0 is
    project_out).

    On the attention hooks q, k, v and z (rows of n_heads x d_head), `heads` limits the edit to
    those heads: `scale` with factor 0 on `blocks.{i}.attn.hook_z` ablates them. `vector` and
    `values` are then full rows ([n_heads * d_head], or [n_heads, d_head] per row) of which only
    the chosen heads' columns are used, or one head's width [d_head], used for each chosen head.
    `project_out` and `clamp` there work head by head, as on TransformerLens's [pos, head, d_head]
    tensor: each chosen head's d_head slice loses (or has clamped) its component along that head's
    unit direction.

    `vector` may be the name of a vector registered with the app (serve_config `vectors`, or
    POST /v1/vectors): the app's Router puts the array in its place (and its default hook, when
    the request gives no `hook`) before any replica sees the request.

    A position listed twice in `positions` is edited once, as TransformerLens's act[:, pos] op= v
    (numpy's assignment): `set` gives it the last row listed for it. Edits at one hook run in list
    order; edits at disjoint explicit positions take one of the engine's `edit_stages` together.
    """

    model_config = _STRICT

    hook: str | None = Field(
        None,
        description="Hook name; the final norm cannot be edited. Required, unless `vector` names a registered "
        "vector that has a default hook.",
    )
    op: Literal["add", "scale", "set", "project_out", "clamp"]
    vector: VectorOrName | None = Field(
        None, description="[d_model], for add, project_out and clamp; or the name of a registered vector."
    )
    scale: float = Field(1.0, description="Multiplier of `vector` for add.")
    norm_match: bool = Field(False, description="add: scale the unit vector by |row| * scale.")
    factor: float | None = Field(None, description="Multiplier for scale.")
    values: FloatArray | None = Field(None, description="set: [n_positions, d_model] or [d_model].")
    min: float | None = Field(None, description="clamp: the least component along the unit vector (none: no floor).")
    max: float | None = Field(None, description="clamp: the greatest component along the unit vector (none: no cap).")
    positions: Positions = "all"
    phase: Literal["prefill", "decode", "all"] = "all"
    sae_id: str | None = Field(None, description="add by SAE feature: the SAE (engine option saes), with `feature`.")
    feature: int | None = Field(
        None, ge=0, description="add by SAE feature: its decoder row W_dec[feature] is the vector (give no `vector`)."
    )
    heads: list[int] | None = Field(
        None, min_length=1, description="Attention hooks only: the heads to edit (default: every head)."
    )
    when: Condition | None = Field(
        None, description="add only: apply at the positions where a read-out of the hook crosses a threshold "
        "(replicas.api.conditions), decided per row in the forward."
    )

    @field_validator("heads")
    @classmethod
    def _distinct_heads(cls, heads: list[int] | None) -> list[int] | None:
        if heads is not None and (min(heads) < 0 or len(set(heads)) != len(heads)):
            raise ValueError("heads must be distinct head indices >= 0")
        return heads

    @field_validator("hook")
    @classmethod
    def _editable_hook(cls, hook: str | None) -> str | None:
        return None if hook is None else editable_hook(hook)

    @property
    def vector_name(self) -> str | None:
        """The registered vector this edit names, or None when it carries its array."""
        return self.vector if isinstance(self.vector, str) else None

    @model_validator(mode="after")
    def _fields_match_op(self) -> "Intervention":
        needs = {"add": "vector", "project_out": "vector", "clamp": "vector", "scale": "factor", "set": "values"}[self.op]
        if self.sae_id is not None or self.feature is not None:
            _check_feature_edit(self)
        elif getattr(self, needs) is None:
            raise ValueError(f"op {self.op!r} needs field {needs!r}")
        for name in ("vector", "factor", "values"):
            if name != needs and getattr(self, name) is not None:
                raise ValueError(f"field {name!r} does not apply to op {self.op!r} (it takes {needs!r})")
        _check_bounds(self)
        if self.when is not None and self.op != "add":
            raise ValueError(f"when: conditional steering takes op 'add', not {self.op!r}")
        if self.hook is None and self.vector_name is None:
            raise ValueError("hook: required (it may be left out only when `vector` names a registered vector with a default hook)")
        # a named vector (and a hook left out) is checked again once the Router has put the array in its place
        per_head = self.hook is not None and resolve_hook(self.hook).kind in HEAD_KINDS
        array = None if self.vector_name is not None else self.vector
        if array is not None and array.ndim != 1 and not (per_head and array.ndim == 2):
            raise ValueError(f"vector must be 1-D [d_model] (or [n_heads, d_head] on q, k, v, z), got shape {list(array.shape)}")
        if self.values is not None and self.values.ndim == 3 and not per_head:
            raise ValueError(f"values must be [d_model] or [n_positions, d_model], got shape {list(self.values.shape)}")
        if self.heads is not None and self.hook is not None and not per_head:
            raise ValueError(f"heads applies to the attention hooks q, k, v and z only, not {self.hook!r}")
        if self.heads is not None and self.norm_match:
            raise ValueError("norm_match does not apply with heads (it matches the whole row's norm)")
        # each divides by |vector|: a zero (or underflowing) vector would make every edited row NaN
        nonzero = array is None or np.linalg.norm(array.astype(np.float64)) > 0
        if self.op in ("project_out", "clamp") and not nonzero:
            raise ValueError(f"vector: {self.op} needs a non-zero vector (it acts on the direction along it)")
        if self.op == "add" and self.norm_match and not nonzero:
            raise ValueError("vector: add with norm_match needs a non-zero vector (its direction is rescaled to scale * |h|)")
        if self.factor is not None and not np.isfinite(self.factor):
            raise ValueError("factor must be a finite number")
        if not np.isfinite(self.scale):
            raise ValueError("scale must be a finite number")
        return self


def _check_bounds(edit: Intervention) -> None:
    if edit.op != "clamp":
        for name in ("min", "max"):
            if getattr(edit, name) is not None:
                raise ValueError(f"field {name!r} does not apply to op {edit.op!r} (only clamp takes min and max)")
        return
    if edit.min is None and edit.max is None:
        raise ValueError("op 'clamp' needs 'min', 'max' or both: the bounds of the component along the unit vector")
    for name in ("min", "max"):
        if getattr(edit, name) is not None and not np.isfinite(getattr(edit, name)):
            raise ValueError(f"{name} must be a finite number; leave it out for no bound on that side")
    if edit.min is not None and edit.max is not None and edit.min > edit.max:
        raise ValueError(f"min ({edit.min}) exceeds max ({edit.max}); the component is held within [min, max]")
    given = sorted({"scale", "norm_match"} & edit.model_fields_set)
    if given:
        raise ValueError(f"field {given[0]!r} does not apply to op 'clamp' (it takes vector, min and max)")


def _check_feature_edit(edit: Intervention) -> None:
    if edit.op != "add":
        raise ValueError(f"sae_id/feature steer with op 'add' only, not {edit.op!r}")
    if edit.sae_id is None or edit.feature is None:
        raise ValueError("steering by SAE feature needs both sae_id and feature")
    if edit.vector is not None:
        raise ValueError("give either vector or sae_id + feature, not both")


class SaeSpec(BaseModel):
    """SAE features of one hook, encoded on the replica's device: per position the `top_k`
    largest feature activations of SAE `sae_id` (engine option saes), as ids and values."""

    model_config = _STRICT
    sae_id: str = Field(min_length=1, description="An SAE this replica loaded (engine option saes).")
    hook: str | None = Field(None, description="The SAE's hook; optional, checked against the SAE's own when given.")
    top_k: int = Field(32, ge=1, description="Features per position, at most the SAE's d_sae.")
    positions: Positions = Field("all", description="As for capture: all | prompt | generated | last_prompt | [indices].")
    error: Literal["none", "norm", "vector"] = Field(
        "none",
        description="Reconstruction error x - decode(encode(x)) per position: 'norm' its L2 norm [n_positions], "
        "'vector' the vector itself [n_positions, d_model] (ships d_model rows again).",
    )


def _sae_list(value: Any) -> Any:
    return [value] if isinstance(value, (dict, SaeSpec)) else value


class LogitsSpec(BaseModel):
    """Full-vocabulary float32 logits at the given positions."""

    model_config = _STRICT
    positions: Positions = "last_prompt"


class ToolFunction(BaseModel):
    """A function the model may call: its name, what it does, and a JSON Schema of its arguments."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, description="Function name, as the model is to call it.")
    description: str | None = Field(None, description="What the function does; shown to the model.")
    parameters: dict[str, Any] = Field(
        default_factory=dict, description="JSON Schema of the arguments object ({} = an object with any keys)."
    )
    strict: bool | None = Field(
        None,
        description="True: a constrained call's arguments must match `parameters` (OpenAI's strict; vLLM pins the "
        "schema in its structural tag). Otherwise per the engine's tool_strict_level.",
    )


class Tool(BaseModel):
    """A tool offered to the model (OpenAI's `tools[i]`); rendered by the model's chat template."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: ToolFunction


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str = Field(description="The arguments as JSON text (as OpenAI sends them).")


class ToolCall(BaseModel):
    """A call the model made (in a result), or made in an earlier turn (in an assistant message)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class NamedToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: the model must call exactly that one."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class ChatMessage(BaseModel):
    """One chat turn. Assistant turns may carry `tool_calls` (content then optional); a `tool`
    turn is a call's result and names the call it answers (`tool_call_id`)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = Field(None, description="Text; required for system and user turns.")
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: the calls it made.")
    tool_call_id: str | None = Field(None, description="tool: the id of the call this result answers.")
    name: str | None = Field(None, description="tool: the function's name (passed to the template).")

    @model_validator(mode="after")
    def _fields_match_role(self) -> "ChatMessage":
        if self.role in ("system", "user") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role} messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages, not {self.role} messages")
        return self


class GenerateRequest(BaseModel):
    """One prompt: sampling passed through to vLLM, plus captures, edits and logits."""

    model_config = _STRICT

    prompt: str | list[int] | list[ChatMessage] = Field(
        description="Text, token ids, or chat messages (rendered with the model's chat template)."
    )
    max_tokens: int = Field(16, ge=1, description="Tokens to generate.")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    seed: int | None = Field(
        None, ge=-(2**63), le=2**63 - 1,
        description="Sampling seed, a signed 64-bit integer (what vLLM's server accepts); None: random.",
    )
    stop: list[str] | None = None
    n: int = Field(1, ge=1, le=16, description="Completions; captures and edits follow the first.")
    logprobs: int | None = Field(None, ge=0, le=20, description="Top-k logprobs per generated token.")
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool = False
    capture: CaptureSpec | None = None
    interventions: list[Intervention] = Field(default_factory=list)
    logits: LogitsSpec | None = None
    sae: Annotated[list[SaeSpec], BeforeValidator(_sae_list)] = Field(
        default_factory=list, description="SAE features: one spec or a list, each a different sae_id."
    )
    readouts: ReadoutList = Field(
        default_factory=list,
        description="Read-outs computed on the replica's device (docs/readouts.md): one spec or a list, each "
        "{kind: logit_lens | tuned_lens, hook, top_k, positions} or {kind: probe, probe, positions}; results in "
        "GenerateResult.readouts, in the same order.",
    )
    tools: list[Tool] | None = Field(
        None,
        description="Functions the model may call (chat prompts only); rendered by the chat template, calls "
        "parsed by the engine's `tool_call_parser`.",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none: tools shown, no calls parsed; auto (the default with tools): the parser finds calls in "
        "the text; required / a named function: generation is constrained to a call (structured outputs).",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="False: tool_choice 'required' yields exactly one call (default: one or more)."
    )

    @field_validator("sae")
    @classmethod
    def _distinct_saes(cls, sae: list[SaeSpec]) -> list[SaeSpec]:
        ids = [spec.sae_id for spec in sae]
        if len(set(ids)) != len(ids):
            raise ValueError(f"sae lists an sae_id twice ({ids}); results are keyed by sae_id")
        return sae

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, prompt: Any) -> Any:
        if len(prompt) == 0:
            raise ValueError("prompt is empty")
        if isinstance(prompt, list) and isinstance(prompt[0], int) and min(prompt) < 0:
            raise ValueError("prompt token ids must be non-negative")
        return prompt

    @model_validator(mode="after")
    def _tools_fit_the_prompt(self) -> "GenerateRequest":
        # the same rules as vLLM's ChatCompletionRequest.check_tool_usage
        if self.tools is not None:
            if not self.tools:
                raise ValueError("tools: must not be an empty list; give at least one tool or leave tools out")
            if not self.is_chat:
                raise ValueError("tools: need a chat prompt (a list of messages); text and token-id prompts take no tools")
            names = [t.function.name for t in self.tools]
            if len(set(names)) != len(names):
                raise ValueError(f"tools: function names must be unique, got {names}")
        if self.tool_choice not in (None, "none") and self.tools is None:
            raise ValueError(f"tool_choice: {self.tool_choice_name!r} needs tools; set tools or leave tool_choice out")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: function {self.tool_choice.function.name!r} is not in tools {names}")
        return self

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list) and isinstance(self.prompt[0], ChatMessage)

    @property
    def tool_choice_name(self) -> str | None:
        """'none' | 'auto' | 'required' | the named function; 'auto' when tools are given without a choice."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        if self.tool_choice is None and self.tools:
            return "auto"
        return self.tool_choice


class Choice(BaseModel):
    """One completion. `text` is the raw generated text; with tools, `content` is that text with the
    tool-call markup removed (None when the output was only calls) and `tool_calls` the parsed calls
    (None without tools, or when the parser found none); finish_reason is then "tool_calls", as vLLM
    reports it (auto or required calls; a named call keeps "stop")."""

    model_config = ConfigDict(extra="forbid")
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="before")
    @classmethod
    def _content_defaults_to_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and "content" not in data and "tool_calls" not in data:
            data = {**data, "content": data.get("text")}
        return data


class SaeFeatures(BaseModel):
    """One SAE's features for a request; row i belongs to token position `positions[i]`. `ids`
    int32 [n_positions, top_k] and `values` float32 [n_positions, top_k], largest first; past the
    active features (value 0) the id is -1. `error`: see SaeSpec.error. In JSON each array is
    `{"dtype", "shape", "data": base64}`."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    hook: str
    positions: list[int]
    ids: ResultArray
    values: ResultArray
    error: ResultArray | None = None


class GenerateResult(BaseModel):
    """What one request produced. `activations[hook]` is [n_positions, d_model] (or [d_model]
    when reduced); `positions` are the absolute token positions of its rows and
    `capture_token_ids` the tokens at them. The last sampled token is never fed through the
    model, so generated rows stop one short of the last generated token."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    choices: list[Choice]
    tool_calls: list[ToolCall] | None = None  # choice 0's
    activations: dict[str, np.ndarray] = Field(default_factory=dict)
    positions: list[int] = Field(default_factory=list)
    capture_token_ids: list[int] = Field(default_factory=list)
    logits: np.ndarray | None = None
    logits_positions: list[int] = Field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    sae: dict[str, SaeFeatures] = Field(default_factory=dict, description="SAE features by sae_id.")
    readouts: list[ReadoutResult] = Field(default_factory=list, description="Read-outs, in the request's order.")
    replica: str | None = None

    @property
    def activation_bytes(self) -> int:
        return sum(a.nbytes for a in self.activations.values())

    def __getstate__(self) -> dict[Any, Any]:
        # Ray pickles results; bfloat16 arrays would otherwise be copied on every hop
        state = super().__getstate__()
        state["__dict__"] = {**state["__dict__"], "activations": {k: arrays.out_of_band(a) for k, a in self.activations.items()}}
        return state
