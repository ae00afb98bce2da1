"""HuggingFace reference for the attention hooks (a test helper).

HF's eager attention on the same weights is the oracle. Each model's attention module calls its
own `eager_attention_forward` through transformers' attention interface; registering a function
there that records its inputs and outputs, then runs that same eager function, gives per layer:

  q [pos, heads, d_head]    the query the attention reads (after q-norm and rotary)
  k, v [pos, kv_heads, d]   keys and values before GQA repeats them
  z [pos, heads, d_head_v]  each head's output before the output projection
  pattern [heads, q, k]     HF's attention weights (scale, soft cap, causal and sliding masks)

`head_edits` (layer -> fn(z) -> z on [pos, heads, d_head]) edits z before the output projection,
for per-head ablation and patching references.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tests.hf_reference import load_model

NAME = "capserve_reference"
HeadEdit = Callable[[torch.Tensor], torch.Tensor]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(NAME, _recording_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)


_records: list[dict[str, torch.Tensor]] = []
_edits: dict[int, HeadEdit] = {}


def _recording_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    eager = sys.modules[type(module).__module__].eager_attention_forward
    output, weights = eager(module, query, key, value, *args, **kwargs)  # output [b, pos, heads, d]
    layer = len(_records)
    if layer in _edits:
        output = _edits[layer](output[0]).unsqueeze(0)
    _records.append({"q": query[0].transpose(0, 1), "k": key[0].transpose(0, 1), "v": value[0].transpose(0, 1),
                     "z": output[0], "pattern": weights[0]})
    return output, weights


def hf_attention(path: str, token_ids: list[int], head_edits: dict[int, HeadEdit] | None = None) -> dict[tuple[int, str], np.ndarray]:
    """{(layer, kind): array} for kind in q, k, v, z, pattern (pattern as [q, heads, k], the
    hook's layout) over the whole sequence."""
    _register()
    model = load_model(path, "float32")
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    _records.clear()
    _edits.clear()
    _edits.update(head_edits or {})
    try:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids])).logits[0]
    finally:
        model.set_attn_implementation(previous)
    out: dict[tuple[int, str], np.ndarray] = {}
    for layer, record in enumerate(_records):
        for kind, value in record.items():
            array = value.float().numpy()
            out[(layer, kind)] = array.transpose(1, 0, 2) if kind == "pattern" else array
    out[(-1, "logits")] = logits.float().numpy()
    return out
