"""Read-outs: small results computed on the replica's device from a hook's rows, so a caller gets
kilobytes back instead of d_model rows (docs/readouts.md).

- `logit_lens`: per position the `top_k` tokens of log_softmax(unembed(final_norm(h))), h the
  hook's row: the model's own final norm and output embedding (with its final logit softcapping,
  Gemma 2), over the whole vocabulary, in float32.
- `tuned_lens`: the same after the layer's translator h + W h + b (engine option `tuned_lens`).
- `probe`: a linear probe's raw outputs h @ W.T + b in float32 (engine option `probes`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from replicas.api.fields import Positions, ResultArray
from replicas.api.hooks import resolve_hook

# Kinds whose rows are d_model-wide points of the residual stream or what a sublayer adds to it.
LENS_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_unnormed", "mlp_unnormed", "ln_final")
# A tuned lens's translator i reads the input of block i (resid_pre[i] = resid_post[i-1]).
TUNED_KINDS = ("resid_pre", "resid_post")

_STRICT = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


def check_lens_hook(kind: str, hook: str) -> None:
    """A lens reads a d_model-wide hook; a tuned lens the residual stream between blocks."""
    point = resolve_hook(hook)
    allowed = TUNED_KINDS if kind == "tuned_lens" else LENS_KINDS
    if point.kind not in allowed:
        raise ValueError(
            f"hook: {hook!r} is of kind {point.kind!r}; {kind} reads the kinds {', '.join(allowed)}"
            + (" (a translator maps the input of one block)" if kind == "tuned_lens" else "")
        )


class LensSpec(BaseModel):
    """Logit lens or tuned lens at one hook: per position the `top_k` most likely next tokens."""

    model_config = _STRICT
    kind: Literal["logit_lens", "tuned_lens"]
    hook: str = Field(
        description="Hook whose rows are decoded: blocks.<i>.hook_resid_pre / _mid / _post, hook_attn_out, "
        "hook_mlp_out (any spelling), or ln_final.hook_normalized (already normed: the model's own output). "
        "tuned_lens: resid_pre or resid_post only."
    )
    top_k: int = Field(10, ge=1, description="Tokens per position, at most the vocabulary (d_vocab).")
    positions: Positions = Field("all", description="As for capture: all | prompt | generated | last_prompt | [indices].")

    @model_validator(mode="after")
    def _lens_reads_the_stream(self) -> "LensSpec":
        check_lens_hook(self.kind, self.hook)
        return self


class ProbeSpec(BaseModel):
    """A linear probe the replica loaded: per position its raw outputs h @ W.T + b."""

    model_config = _STRICT
    kind: Literal["probe"]
    probe: str = Field(min_length=1, description="A probe this replica loaded (engine option probes).")
    hook: str | None = Field(None, description="The probe's hook; optional, checked against the probe's own when given.")
    positions: Positions = Field("all", description="As for capture: all | prompt | generated | last_prompt | [indices].")

    @field_validator("hook")
    @classmethod
    def _known_hook(cls, hook: str | None) -> str | None:
        if hook is not None:
            resolve_hook(hook)
        return hook


ReadoutSpec = Annotated[Union[LensSpec, ProbeSpec], Field(discriminator="kind")]


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (dict, LensSpec, ProbeSpec)) else value


ReadoutList = Annotated[list[ReadoutSpec], BeforeValidator(_as_list)]
"""One spec or a list of them; results come back in the same order."""


class ReadoutResult(BaseModel):
    """One read-out of a request (results are in the request's order); row i belongs to token
    position `positions[i]`. Lenses: `ids` int32 [n_positions, top_k], most likely first,
    `logprobs` float32 [n_positions, top_k] (log_softmax over the whole vocabulary) and `tokens`,
    each id's text (None on a replica without a tokenizer). Probes: `values` float32
    [n_positions, n_out]. In JSON each array is `{"dtype", "shape", "data": base64}`."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    kind: Literal["logit_lens", "tuned_lens", "probe"]
    hook: str
    probe: str | None = None
    positions: list[int]
    ids: ResultArray | None = None
    logprobs: ResultArray | None = None
    tokens: list[list[str]] | None = None
    values: ResultArray | None = None
