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

Torch- and vLLM-free: the engine checks a checkpoint before it starts vLLM.
"""

from __future__ import annotations

from typing import Any, Literal

from replicas.api.hooks import LAYER_KINDS, LayerKind

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
}

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
    if shape is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported: capserve's hooks must follow each "
            f"block's shape, and it has not declared this one. Supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    if shape == "parallel" and not getattr(hf_config, "use_parallel_residual", True):
        return "pre_norm"
    return shape


def layer_kinds(shape: BlockShape) -> tuple[LayerKind, ...]:
    """The hook kinds a layer of this shape has, in LAYER_KINDS order."""
    return tuple(kind for kind in LAYER_KINDS if kind not in _ABSENT[shape])


def absent_kinds(shape: BlockShape) -> dict[LayerKind, str]:
    """Kinds this shape lacks, each with the reason a request error gives."""
    return dict(_ABSENT[shape])
