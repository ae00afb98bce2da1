"""Where each HuggingFace architecture keeps the modules that define the hook points.

TransformerLens defines the hook points per block shape, and tests/hf_reference.py follows it:

  sequential (pre-norm): x + attn(ln1(x)) = mid; mid + mlp(ln2(mid)) = post.
      attn_out / mlp_out are the sublayer outputs; resid_mid is the second norm's input.
  sandwich (post-norm): x + ln_a(attn(...)) = mid; mid + ln_m(mlp(...)) = post.
      attn_out / mlp_out are the *normed* sublayer outputs, i.e. what the block adds to the
      stream, so resid_mid = resid_pre + attn_out still holds; resid_mid is the MLP branch input.
  parallel: x + attn(ln1(x)) + mlp(ln2(x)) = post. The MLP reads resid_pre, so no resid_mid.

An architecture missing here is refused, never guessed: a wrong table would make the oracle agree
with a wrong capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEQUENTIAL, SANDWICH, PARALLEL = "sequential", "sandwich", "parallel"
LAYER_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


@dataclass(frozen=True)
class BlockShape:
    """Block attribute names; each module's output (or input) is exactly one hook value."""

    shape: str
    attn_out: str  # output = what attention adds to the residual stream
    mlp_out: str  # output = what the MLP adds to the residual stream
    mlp_reads: str  # input = the residual the MLP branch reads (resid_mid; resid_pre if parallel)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k in LAYER_KINDS if not (k == "resid_mid" and self.shape == PARALLEL))


@dataclass(frozen=True)
class Layout:
    block: BlockShape
    blocks: list[torch.nn.Module]
    final_norm: torch.nn.Module


_PRE_NORM = BlockShape(SEQUENTIAL, "self_attn", "mlp", "post_attention_layernorm")
# Gemma 2/3 norm the MLP input too, so the residual is the input of pre_feedforward_layernorm;
# OLMo 2 has no pre-norms at all, so the MLP itself reads the residual.
_GEMMA_SANDWICH = BlockShape(
    SANDWICH, "post_attention_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm"
)
_OLMO2_SANDWICH = BlockShape(
    SANDWICH, "post_attention_layernorm", "post_feedforward_layernorm", "mlp"
)

# config.model_type -> block shape, for models whose blocks live in model.model.layers.
_DECODER_SHAPES = {
    "llama": _PRE_NORM,
    "mistral": _PRE_NORM,
    "qwen2": _PRE_NORM,
    "qwen3": _PRE_NORM,
    "gemma": _PRE_NORM,
    "phi3": _PRE_NORM,  # fused qkv_proj / gate_up_proj inside, same block shape as Llama
    "gemma2": _GEMMA_SANDWICH,
    "gemma3_text": _GEMMA_SANDWICH,
    "olmo2": _OLMO2_SANDWICH,
    # mixture of experts: the MLP is the routed block (HF 5 keeps every one at `mlp`)
    "qwen3_moe": _PRE_NORM,
    "mixtral": _PRE_NORM,
    "olmoe": _PRE_NORM,
    "gpt_oss": _PRE_NORM,
}
ROUTER_KINDS = ("router_logits", "expert_ids")
UNNORMED_KINDS = ("attn_unnormed", "mlp_unnormed")  # sandwich blocks: the modules the post-norms read


def router_of(block: torch.nn.Module) -> torch.nn.Module | None:
    """A sparse block's router: HF 5's routers return (logits, top-k weights, top-k expert ids)."""
    mlp = getattr(block, "mlp", None)
    for name in ("gate", "router"):
        module = getattr(mlp, name, None)
        if module is not None and hasattr(module, "top_k"):
            return module
    return None


def route(config, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, top-k expert ids) from router logits [tokens, n_experts], as each HF 5.19
    router computes them: what an edit of the logits changes downstream."""
    k = config.num_experts_per_tok
    if config.model_type == "gpt_oss":  # top-k of the logits, then a softmax over those k
        values, ids = torch.topk(logits, k, dim=-1)
        return torch.softmax(values, dim=1, dtype=values.dtype), ids
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = torch.topk(probs, k, dim=-1)
    if config.model_type == "mixtral" or getattr(config, "norm_topk_prob", False):
        values = values / values.sum(dim=-1, keepdim=True)
    return (values if config.model_type == "mixtral" else values.to(logits.dtype)), ids


def layout(model: torch.nn.Module) -> Layout:
    """The blocks, their shape, and the final norm of a supported HF causal LM."""
    model_type = model.config.model_type
    if model_type == "gpt2":
        shape = BlockShape(SEQUENTIAL, "attn", "mlp", "ln_2")
        return Layout(shape, list(model.transformer.h), model.transformer.ln_f)
    if model_type == "gpt_neox":  # Pythia is parallel; the same class also runs sequentially
        parallel = PARALLEL if model.config.use_parallel_residual else SEQUENTIAL
        shape = BlockShape(parallel, "attention", "mlp", "post_attention_layernorm")
        return Layout(shape, list(model.gpt_neox.layers), model.gpt_neox.final_layer_norm)
    if model_type in _DECODER_SHAPES:
        return Layout(_DECODER_SHAPES[model_type], list(model.model.layers), model.model.norm)
    raise TypeError(f"no hook table for {type(model).__name__} (model_type {model_type!r})")
