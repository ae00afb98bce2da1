"""The parts of a request's plan that concern attention: the width of each hook's rows, the q and
k a pattern is computed from, and per-head edits as full rows with a factor per column
(replicas.worker.sites); project_out and clamp there take one unit direction per head. Used by `replicas.plans.request`
(engine side) and `replicas.engine.attention` (the replica). Router hooks (mixture-of-experts) have widths of their own, here too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from replicas.api import AttentionInfo, CaptureSpec, MoeInfo, Positions
from replicas.api.arrays import unit
from replicas.api.errors import PlanError
from replicas.api.hooks import HEAD_KINDS, PATTERN_KINDS, ROUTER_KINDS, HookPoint

HeadShapes = Mapping[str, tuple[int, int]]  # per-head kind -> (heads, d_head)


def head_shapes(info: AttentionInfo | None) -> HeadShapes | None:
    """(heads, d_head) of each per-head kind."""
    if info is None:
        return None
    return {
        "q": (info.n_heads, info.d_head),
        "k": (info.n_kv_heads, info.d_head),
        "v": (info.n_kv_heads, info.d_head_v),
        "z": (info.n_heads, info.d_head_v),
    }


def hook_width(kind: str, d_model: int, head_shapes: HeadShapes | None, moe: MoeInfo | None = None) -> int:
    """Values per row at a hook of this kind: d_model, heads x d_head inside attention, the
    experts (router_logits) or the experts per token (expert_ids) at a router."""
    if kind in ROUTER_KINDS:
        if moe is None:
            raise ValueError("hook_width: the router hooks need the model's MoeInfo")
        return moe.n_experts if kind == "router_logits" else moe.top_k
    if kind not in HEAD_KINDS:
        return d_model
    if not head_shapes:
        raise ValueError("hook_width: the attention hooks need the model's head shapes")
    heads, d_head = head_shapes[kind]
    return heads * d_head


def captured_sites(points: list[HookPoint], names: list[str]) -> list[list[Any]]:
    """[layer, kind, name] of the sites a capture reads, one per name asked for (aliases of one
    site included); a pattern reads its layer's q and k, under their canonical names unless the
    request asks for them itself."""
    sites = [[p.layer, p.kind, name] for p, name in zip(points, names) if p.kind not in PATTERN_KINDS]
    asked = {(layer, kind) for layer, kind, _ in sites}
    for p in points:
        for kind in ("q", "k") if p.kind in PATTERN_KINDS else ():
            if (p.layer, kind) not in asked:
                asked.add((p.layer, kind))
                sites.append([p.layer, kind, HookPoint(p.layer, kind).canonical_name])  # type: ignore[arg-type]
    return sites


def key_positions(capture: CaptureSpec, prompt_len: int) -> Positions:
    """Positions to capture for a pattern: every key its queries attend to. The replica picks
    the requested rows out of them."""
    if capture.reduce == "mean":
        raise PlanError("capture.reduce: 'mean' does not apply to hook_pattern / hook_attn_scores; use reduce='none'")
    spec = capture.positions
    if spec in ("prompt", "last_prompt"):
        return "prompt"
    if isinstance(spec, list) and all(i < prompt_len for i in (i + prompt_len if i < 0 else i for i in spec)):
        return "prompt"
    return "all"


def head_edit(
    where: str, edit: Any, kind: str, head_shapes: HeadShapes | None
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, float | None]:
    """(vector, values, columns, factor) of an edit at a per-head site, as full rows: the head
    selector becomes `columns` (replicas.worker.sites) and masks the vector or values."""
    heads, d_head = (head_shapes or {}).get(kind, (0, 0))
    if not heads:
        raise PlanError(f"{where}.hook: this replica did not report its attention heads")
    chosen = list(range(heads)) if edit.heads is None else edit.heads
    if max(chosen) >= heads:
        raise PlanError(f"{where}.heads: head {max(chosen)} is out of range; hook_{kind} has heads 0..{heads - 1}")
    mask = np.zeros((heads, d_head), np.float32)
    mask[chosen] = 1.0
    mask = mask.reshape(-1)

    def full_rows(name: str, array: np.ndarray | None, per_head_ndim: int) -> np.ndarray | None:
        """[.., heads x d_head] from full rows, [.., heads, d_head] (ndim per_head_ndim) or one head's [.., d_head]."""
        if array is None:
            return None
        if array.ndim == per_head_ndim:
            array = array.reshape(*array.shape[:-2], -1)
        elif array.shape[-1] == d_head:
            array = np.tile(array, heads)  # one head's width, for each chosen head
        if array.shape[-1] != heads * d_head:
            raise PlanError(
                f"{where}.{name}: width {array.shape[-1]} fits neither hook_{kind}'s rows ({heads} heads x {d_head} = "
                f"{heads * d_head}, or [{heads}, {d_head}]) nor one head ({d_head})"
            )
        return array * mask

    vector, values = full_rows("vector", edit.vector, 2), full_rows("values", edit.values, 3)
    if edit.op in ("project_out", "clamp"):
        # each head's slice is projected on its own direction, as a hook on [pos, head, d_head] would:
        # one unit vector per head (the site reduces per head), zero on heads it leaves alone
        per_head = vector.reshape(heads, d_head)
        if not per_head.any():
            raise PlanError(f"{where}.vector: zero on the chosen heads, so there is no direction to {edit.op} along")
        vector = np.stack([unit(head) if head.any() else head for head in per_head]).reshape(-1)
    if edit.op == "scale":  # the factor on the chosen heads' columns, 1 elsewhere
        return vector, values, 1.0 + (float(edit.factor) - 1.0) * mask, 1.0
    if edit.op == "set":  # zero the set heads; `values` (zero elsewhere) is added to the row
        return vector, values, 1.0 - mask, edit.factor
    return vector, values, None, edit.factor
