"""Hook-point names: TransformerLens names, TransformerBridge aliases and wire keys.

Every accepted spelling resolves to a `HookPoint(layer, kind)`. The canonical names are the
HookedTransformer ones SAELens uses (`blocks.{i}.hook_resid_post`); the TransformerBridge names
(`blocks.{i}.hook_out`) and the compact wire keys (`"{i}:resid_post"`) are aliases. Results are
keyed by the name the caller used, so aliases are echoed back as given.
"""

from __future__ import annotations

import re
from typing import Iterable, Literal, NamedTuple, get_args

LayerKind = Literal[
    "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q", "k", "v", "z", "pattern", "attn_scores",
    "router_logits", "expert_ids", "attn_unnormed", "mlp_unnormed",
]
HookKind = Literal[
    "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q", "k", "v", "z", "pattern", "attn_scores",
    "router_logits", "expert_ids", "attn_unnormed", "mlp_unnormed", "ln_final",
]
ALL_LAYER_KINDS: tuple[LayerKind, ...] = get_args(LayerKind)
# The residual-stream kinds, armed by default; the attention kinds are armed by config.
LAYER_KINDS: tuple[LayerKind, ...] = ALL_LAYER_KINDS[:5]
# Per-head sites inside attention: [pos, heads, d_head], taken where vLLM's attention op reads
# q, k, v (after any q/k norm and rotary) and where it writes z (before the output projection).
HEAD_KINDS: tuple[LayerKind, ...] = ("q", "k", "v", "z")
# Computed on the replica from the layer's captured q and k: [q_pos, heads, k_pos].
PATTERN_KINDS: tuple[LayerKind, ...] = ("pattern", "attn_scores")
# A mixture-of-experts layer's router: its logits before the softmax [pos, n_experts], and the
# experts it chose [pos, top_k] (ints, in the router's order), as vLLM's router computed them.
ROUTER_KINDS: tuple[LayerKind, ...] = ("router_logits", "expert_ids")
# The attention and MLP modules' own outputs, TransformerBridge's `attn.hook_out` / `mlp.hook_out`.
# In a post-norm ("sandwich") block they are what the post-norms normalize; hook_attn_out and
# hook_mlp_out (TransformerLens, bridge included) are the normed values the block adds. In every
# other block shape the two are the same value, served by the attn_out / mlp_out sites.
UNNORMED_KINDS: dict[LayerKind, LayerKind] = {"attn_unnormed": "attn_out", "mlp_unnormed": "mlp_out"}
FINAL_NORM_HOOK = "ln_final.hook_normalized"

_CANONICAL_SUFFIX = {
    "hook_resid_pre": "resid_pre",
    "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post",
    "hook_attn_out": "attn_out",
    "hook_mlp_out": "mlp_out",
}
_ATTENTION_SUFFIX = {f"attn.hook_{kind}": kind for kind in (*HEAD_KINDS, *PATTERN_KINDS)} | {
    # served after rotary: TransformerLens's rotated names are the same values
    "attn.hook_rot_q": "q",
    "attn.hook_rot_k": "k",
}
_ROUTER_SUFFIX = {f"mlp.hook_{kind}": kind for kind in ROUTER_KINDS} | {
    "mlp.hook_expert_indices": "expert_ids",  # HookedTransformer's MoE name
}
_BRIDGE_SUFFIX = {
    "attn.q.hook_out": "q",
    "attn.k.hook_out": "k",
    "attn.v.hook_out": "v",
    "attn.o.hook_in": "z",
    "hook_in": "resid_pre",
    "ln2.hook_in": "resid_mid",
    "hook_out": "resid_post",
    "attn.hook_out": "attn_unnormed",
    "mlp.hook_out": "mlp_unnormed",
    "ln1_post.hook_in": "attn_unnormed",
    "ln2_post.hook_in": "mlp_unnormed",
    "ln1_post.hook_out": "attn_out",
    "ln2_post.hook_out": "mlp_out",
}
_BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")
_WIRE_KEY = re.compile(r"^(\d+):([a-z_]+)$")


class HookPoint(NamedTuple):
    """One capture or intervention site; `layer` is None for the final norm."""

    layer: int | None
    kind: HookKind

    @property
    def canonical_name(self) -> str:
        if self.kind == "ln_final":
            return FINAL_NORM_HOOK
        if self.kind in HEAD_KINDS or self.kind in PATTERN_KINDS:
            return f"blocks.{self.layer}.attn.hook_{self.kind}"
        if self.kind in ROUTER_KINDS:
            return f"blocks.{self.layer}.mlp.hook_{self.kind}"
        if self.kind in UNNORMED_KINDS:
            return f"blocks.{self.layer}.{self.kind.removesuffix('_unnormed')}.hook_out"
        return f"blocks.{self.layer}.hook_{self.kind}"

    @property
    def wire_key(self) -> str:
        """TransformerLens's `"<layer>:<kind>"` key; the final norm keeps its full name."""
        if self.kind == "ln_final":
            return FINAL_NORM_HOOK
        return f"{self.layer}:{self.kind}"


class HookNameError(ValueError):
    """A hook name that is not served; the message lists the accepted forms."""


def resolve_hook(name: str, n_layers: int | None = None) -> HookPoint:
    """Resolve any accepted spelling to a HookPoint, checking the layer range when known."""
    point = _parse(name)
    if point is None:
        raise HookNameError(
            f"hook {name!r} is not a known hook name; use blocks.<i>.hook_<kind> with kind in "
            f"{', '.join(LAYER_KINDS)} or blocks.<i>.attn.hook_<kind> with kind in "
            f"{', '.join(HEAD_KINDS + PATTERN_KINDS)} (TransformerLens names), blocks.<i>.mlp.hook_<kind> with kind in "
            f"{', '.join(ROUTER_KINDS)} (mixture-of-experts models), the TransformerBridge aliases "
            f"blocks.<i>.hook_in / ln2.hook_in / hook_out / attn.hook_out / mlp.hook_out / ln1_post.hook_in|out / "
            f"ln2_post.hook_in|out / attn.q.hook_out / "
            f"attn.k.hook_out / attn.v.hook_out / attn.o.hook_in, '<i>:<kind>' wire keys, or {FINAL_NORM_HOOK!r}"
        )
    if n_layers is not None and point.layer is not None and not 0 <= point.layer < n_layers:
        raise HookNameError(
            f"hook {name!r}: layer {point.layer} is out of range; this model has layers "
            f"0..{n_layers - 1}"
        )
    return point


def _parse(name: str) -> HookPoint | None:
    if name == FINAL_NORM_HOOK:
        return HookPoint(None, "ln_final")
    wire = _WIRE_KEY.match(name)
    if wire:
        kind = wire.group(2)
        return HookPoint(int(wire.group(1)), kind) if kind in ALL_LAYER_KINDS else None  # type: ignore[arg-type]
    block = _BLOCK_NAME.match(name)
    if block:
        suffix = block.group(2)
        kind = (_CANONICAL_SUFFIX.get(suffix) or _ATTENTION_SUFFIX.get(suffix) or _ROUTER_SUFFIX.get(suffix)
                or _BRIDGE_SUFFIX.get(suffix))
        return HookPoint(int(block.group(1)), kind) if kind else None  # type: ignore[arg-type]
    return None


def served_hook_names(n_layers: int, kinds: Iterable[str] = LAYER_KINDS, router_layers: Iterable[int] = ()) -> list[str]:
    """Canonical names of every hook point served on `n_layers` layers with these kinds armed; the
    router kinds on `router_layers` alone (a mixture-of-experts model's sparse layers)."""
    armed, routed = set(kinds), set(router_layers)
    names = [HookPoint(i, k).canonical_name for i in range(n_layers) for k in ALL_LAYER_KINDS
             if k in armed and (k not in ROUTER_KINDS or i in routed)]
    return names + [FINAL_NORM_HOOK]


def captured_kinds(armed: Iterable[str]) -> list[str]:
    """The kinds that get a site: a pattern is computed from its layer's q and k."""
    kinds = list(dict.fromkeys(armed))
    if any(kind in PATTERN_KINDS for kind in kinds):
        kinds += [kind for kind in ("q", "k") if kind not in kinds]
    return [kind for kind in kinds if kind not in PATTERN_KINDS]


def editable_hook(hook: str) -> str:
    """`hook` when an intervention may edit it; raises naming why not."""
    kind = resolve_hook(hook).kind
    if kind == "ln_final":
        raise ValueError(f"hook {hook!r} cannot be edited; edit a layer's hook instead")
    if kind in PATTERN_KINDS:
        raise ValueError(f"hook {hook!r} is computed from q and k and cannot be edited; edit hook_q or hook_k")
    if kind == "expert_ids":
        raise ValueError(
            f"hook {hook!r} is the router's choice and cannot be edited; to force or forbid an expert, add "
            f"+1e4 or -1e4 at its index to the same layer's mlp.hook_router_logits"
        )
    return hook


def served_point(where: str, hook: str, n_layers: int, armed_kinds: Iterable[str], absent: dict[str, str]) -> HookPoint:
    """The point a start-up option (an SAE's or a probe's hook) reads, checked against the model and
    the deployment; errors name `<where>.hook`."""
    try:
        point = resolve_hook(hook, n_layers)
    except ValueError as exc:
        raise ValueError(f"{where}.hook: {exc}") from None
    if point.kind in absent:
        raise ValueError(f"{where}.hook: {hook!r} does not exist in this model: {absent[point.kind]}")
    if point.kind != "ln_final" and point.kind not in armed_kinds:
        raise ValueError(f"{where}.hook: {hook!r} is of kind {point.kind!r}, which this deployment does not serve; "
                         f"armed kinds: {sorted(armed_kinds)} (engine option armed_kinds)")
    return point
