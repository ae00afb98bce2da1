"""Attention internals on the replica: per-head shapes, and patterns computed from captured q and k.

The worker captures q, k, v and z as flat rows (heads x d_head), where vLLM's attention op reads
and writes them (replicas.worker.blocks). Here the replica gives them TransformerLens's shape
[pos, heads, d_head] and computes `hook_pattern` / `hook_attn_scores` for the query positions a
request selected, over every key position before them: [q_pos, heads, k_pos]. Nothing the size of
a batch's patterns is ever materialised; a pattern costs one request's q and k rows at one layer.

The scale, logit soft-capping and sliding window are read from vLLM's attention op of each layer
(`_vllm.attention_geometry`), so a pattern follows what the engine computed, e.g. Gemma 2's
query_pre_attn_scalar, its soft cap and its alternating windows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replicas.api import arrays
from replicas.api import AttentionInfo, CaptureSpec, MoeInfo
from replicas.api.hooks import HEAD_KINDS, PATTERN_KINDS, resolve_hook
from replicas.plans.heads import captured_sites, head_shapes, hook_width
from replicas.plans.positions import absolute_indices


async def attention_info(llm: Any) -> AttentionInfo:
    """Each layer's attention geometry, as the worker's vLLM attention ops hold it."""
    layers = (await llm.collective_rpc("capserve_attention"))[0]
    first = layers[0]
    for name in ("n_heads", "n_kv_heads", "d_head", "d_head_v"):
        if any(layer[name] != first[name] for layer in layers):
            raise ValueError(f"capserve serves attention hooks on models whose layers share one {name}; this one varies")
    return AttentionInfo(
        n_heads=first["n_heads"], n_kv_heads=first["n_kv_heads"], d_head=first["d_head"], d_head_v=first["d_head_v"],
        scale=[layer["scale"] for layer in layers],
        soft_cap=[layer["soft_cap"] for layer in layers],
        sliding_window=[layer["sliding_window"] for layer in layers],
        sinks=[layer["sinks"] for layer in layers] if any(layer["sinks"] for layer in layers) else None,
    )


def finish_capture(
    activations: dict[str, np.ndarray],
    positions: list[int],
    capture: CaptureSpec,
    prompt_len: int,
    d_model: int,
    attention: AttentionInfo | None,
    widened: bool,
    moe: MoeInfo | None = None,
) -> tuple[dict[str, np.ndarray], list[int]]:
    """The caller's arrays, keyed by the names it used: each hook cut to its own width (a
    request's rows are as wide as its widest hook), per-head hooks as [pos, heads, d_head],
    expert ids as int32, patterns computed; and, when the worker captured more positions for a
    pattern's keys (`widened`), only the rows at the positions the request asked for."""
    shapes = head_shapes(attention) or {}
    points = [resolve_hook(name) for name in capture.hooks]
    site_names: dict[tuple[int, str], str] = {}
    for layer, kind, name in captured_sites(points, capture.hooks):
        site_names.setdefault((layer, kind), name)
    all_positions = np.asarray(positions, dtype=np.int64)
    keep = requested_rows(capture.positions, all_positions, prompt_len) if widened else np.arange(len(positions))
    out: dict[str, np.ndarray] = {}
    for name, point in zip(capture.hooks, points):
        if point.kind in PATTERN_KINDS:
            q = _per_head(activations[site_names[(point.layer, "q")]], shapes["q"])
            k = _per_head(activations[site_names[(point.layer, "k")]], shapes["k"])
            scores = attention_scores(q[keep], all_positions[keep], k, attention, point.layer)
            result = scores if point.kind == "attn_scores" else softmax(scores, _sinks(attention, point.layer))
            out[name] = result.astype(arrays.DTYPES[capture.dtype])
            continue
        array = activations[name]
        if point.kind in HEAD_KINDS:
            array = _per_head(array, shapes[point.kind])
        else:
            array = array[..., : hook_width(point.kind, d_model, None, moe)]
        if point.kind == "expert_ids":  # staged in the model's dtype, which holds them exactly
            array = np.rint(array.astype(np.float32)).astype(np.int32)
        out[name] = array[keep] if widened else array
    return out, all_positions[keep].tolist()


def _per_head(array: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    heads, d_head = shape
    return array[..., : heads * d_head].reshape(*array.shape[:-1], heads, d_head)


def requested_rows(spec: Any, positions: np.ndarray, prompt_len: int) -> np.ndarray:
    """Indices of the rows at the positions `spec` selects, out of rows captured at `positions`."""
    if spec == "all":
        wanted = positions
    elif spec == "prompt":
        wanted = positions[positions < prompt_len]
    elif spec == "generated":
        wanted = positions[positions >= prompt_len]
    elif spec == "last_prompt":
        wanted = np.array([prompt_len - 1])
    else:
        wanted = absolute_indices(spec, prompt_len)
    return np.flatnonzero(np.isin(positions, wanted))


def attention_scores(
    q: np.ndarray, q_positions: np.ndarray, k: np.ndarray, attention: AttentionInfo | None, layer: int
) -> np.ndarray:
    """[q_pos, heads, k_pos] scores of queries at q_positions over keys 0..max(q_positions), as
    TransformerLens's hook_attn_scores: scaled, soft-capped, and -inf where the causal mask or
    a sliding window hides the key. GQA: query head h reads kv head h // (heads / kv_heads)."""
    if attention is None:
        raise ValueError("attention_scores: this replica did not report its attention geometry")
    n_keys = int(q_positions.max()) + 1 if len(q_positions) else 0
    keys = np.repeat(k[:n_keys].astype(np.float32), attention.n_heads // attention.n_kv_heads, axis=1)
    scores = np.einsum("qhd,khd->qhk", q.astype(np.float32), keys) * np.float32(attention.scale[layer])
    cap = attention.soft_cap[layer]
    if cap:
        scores = np.tanh(scores / np.float32(cap)) * np.float32(cap)
    distance = q_positions[:, None] - np.arange(n_keys)[None, :]
    visible = distance >= 0
    window = attention.sliding_window[layer]
    if window:
        visible &= distance < window
    return np.where(visible[:, None, :], scores, np.float32(-np.inf)).astype(np.float32)


def _sinks(attention: AttentionInfo | None, layer: int) -> np.ndarray | None:
    return None if attention is None or attention.sinks is None else np.asarray(attention.sinks[layer], np.float32)


def softmax(scores: np.ndarray, sinks: np.ndarray | None = None) -> np.ndarray:
    """Over the keys ([..., heads, keys]); with attention sinks (one logit per head), each head's
    sink takes its share of the weight as a key no one reads would, so rows sum to less than 1."""
    peak = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        peak = np.maximum(peak, sinks[:, None])
    weights = np.exp(scores - peak)
    total = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks[:, None] - peak)
    return weights / total
