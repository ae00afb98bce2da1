"""The hook sites on a model's decoder blocks: which `Site`s exist and how the blocks call them.

`install_sites` builds one `Site` per armed (layer, kind) and one for the final norm, adds them to
the model as submodules and registers the forward hooks that run them. It runs right after the
weights load, before vLLM compiles the model, so the hooks are traced into the graph.

The hooks follow TransformerLens's definitions for each block shape (replicas.engine.architectures):
`_vllm.model_layout` hands over, per layer, the module whose output is what attention adds to the
residual stream (the attention module, or for a sandwich block the norm after it) and the same for
the MLP, so one set of hooks serves every shape:
- resid_pre: the layer's input (hidden + residual where vLLM fuses the add into the next norm);
- attn_out, mlp_out: those modules' outputs;
- resid_mid = resid_pre + attn_out (sequential shapes only; a parallel block has none);
- resid_post: the layer's output (mlp_out + residual where fused);
- attn_unnormed, mlp_unnormed (sandwich blocks only; elsewhere they are attn_out and mlp_out): the
  attention and MLP modules' own outputs, before the post-norms.
A mixture-of-experts layer's router has two sites: router_logits on its gate's output (an edit there
changes the routing that follows), and expert_ids, which vLLM's router reports as it routes
(`_vllm.report_routing`); the ids are staged in the model's dtype, exact up to 256 experts in
bfloat16 (2048 in float16), and come back to the caller as ints.
Per-head sites (q, k, v, z; armed only when asked) wrap each layer's vLLM attention op
(`_vllm.wrap_attention`): q, k, v on the way in, z on the way out, as [tokens, heads x d_head];
the op writes z straight into its site's staging buffer (`_vllm.attend_into`).
An edited residual stream is handed to the next norm whole, as (0, edited), so the next layer
reads exactly the edited value; `hidden + (edited - value)` would be off by rounding, which the
next RMSNorm blows up when the edit zeroes the stream. vLLM's Transformers backend runs HF's own
layers on [1, tokens, d]: sites see [tokens, d] either way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from replicas import _vllm
from replicas.api.hooks import HEAD_KINDS, LAYER_KINDS, ROUTER_KINDS, UNNORMED_KINDS, HookPoint, captured_kinds
from replicas.worker.sites import Site

Sites = dict[tuple[int | None, str], Site]
Hook = Callable[..., Any]


@dataclass(frozen=True)
class SiteOptions:
    """Which sites a worker arms and how many edits they take, from the engine's worker options."""

    armed_kinds: list[str]
    steer_kinds: set[str]
    steer_layers: Collection[int] | None  # None: every layer takes edits
    edit_stages: int
    edit_slots: int  # per (site, stage), besides slot 0 (the identity)
    max_set_edits: int = 4  # `set` edits one request may carry: rows per token of the shared values buffer
    attention_in_place: bool = True  # the attention op writes z into its site's staging (replicas.worker.sites)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SiteOptions:
        armed_kinds = list(options.get("armed_kinds") or LAYER_KINDS)
        return cls(
            armed_kinds=armed_kinds,
            steer_kinds=set(options.get("steer_kinds", armed_kinds)),
            steer_layers=options.get("steer_layers"),
            edit_stages=int(options.get("edit_stages", 1)),
            edit_slots=int(options.get("edit_slots", 64)),
            max_set_edits=int(options.get("max_set_edits", 4)),
            attention_in_place=bool(options.get("attention_in_place", True)),
        )


def install_sites(
    layout: _vllm.ModelLayout, options: SiteOptions, *, max_tokens: int, dtype: torch.dtype, device: torch.device
) -> Sites:
    """Build the sites and hook them into the model's blocks."""
    sites = _build_sites(layout, options, max_tokens=max_tokens, dtype=dtype, device=device)
    _install_hooks(layout, options.armed_kinds, sites)
    return sites


def _build_sites(
    layout: _vllm.ModelLayout, options: SiteOptions, *, max_tokens: int, dtype: torch.dtype, device: torch.device
) -> Sites:
    def steered(layer: int, kind: str) -> bool:
        return kind in options.steer_kinds and (options.steer_layers is None or layer in options.steer_layers)

    kinds = captured_kinds(options.armed_kinds)
    points = [HookPoint(layer, kind) for layer in range(len(layout.layers)) for kind in kinds  # type: ignore[arg-type]
              if (kind not in ROUTER_KINDS or layout.routers[layer] is not None)
              and (kind not in UNNORMED_KINDS or kind in layout.unnormed)]
    widths = {point: site_width(layout, point) for point in points}
    if "expert_ids" in kinds:
        _check_exact_ids(layout, dtype)
    # one `set` values buffer shared by every site (replicas.worker.sites), if any site takes edits
    steered_widths = [widths[p] for p in points if steered(p.layer, p.kind)]  # type: ignore[arg-type]
    steers = options.edit_stages > 0 and bool(steered_widths)
    values = torch.zeros(options.max_set_edits * max_tokens, max(steered_widths), dtype=dtype, device=device) if steers else None
    site_args = dict(max_tokens=max_tokens, edit_slots=options.edit_slots + 1, dtype=dtype, device=device, values=values)
    sites: Sites = {}
    for point in points:
        stages = options.edit_stages if steered(point.layer, point.kind) else 0  # type: ignore[arg-type]
        sites[point] = Site(
            point, d_model=widths[point], edit_stages=stages, capture=True, per_column=point.kind in HEAD_KINDS,
            written_in_place=point.kind == "z" and options.attention_in_place, d_head=head_width(layout, point), **site_args
        )
    final = HookPoint(None, "ln_final")
    sites[final] = Site(final, d_model=layout.d_model, edit_stages=0, capture=True, **site_args)
    return sites


def site_width(layout: _vllm.ModelLayout, point: HookPoint) -> int:
    """d_model, heads x d_head for the per-head kinds (k and v have the model's KV heads), and the
    experts (router_logits) or experts per token (expert_ids) of a router."""
    router = layout.routers[point.layer] if point.kind in ROUTER_KINDS else None  # type: ignore[index]
    if router is not None:
        return router.n_experts if point.kind == "router_logits" else router.top_k
    if point.kind not in HEAD_KINDS:
        return layout.d_model
    geometry = _vllm.attention_geometry(layout.attention[point.layer])  # type: ignore[index]
    heads = geometry.n_heads if point.kind in ("q", "z") else geometry.n_kv_heads
    return heads * (geometry.d_head_v if point.kind in ("v", "z") else geometry.d_head)


def head_width(layout: _vllm.ModelLayout, point: HookPoint) -> int | None:
    """d_head of a per-head kind's rows, the columns a per-head project_out takes at a time; None elsewhere."""
    if point.kind not in HEAD_KINDS:
        return None
    geometry = _vllm.attention_geometry(layout.attention[point.layer])  # type: ignore[index]
    return geometry.d_head_v if point.kind in ("v", "z") else geometry.d_head


_EXACT_IDS = {torch.bfloat16: 256, torch.float16: 2048}  # largest integer each holds exactly


def _check_exact_ids(layout: _vllm.ModelLayout, dtype: torch.dtype) -> None:
    n_experts = max((r.n_experts for r in layout.routers if r is not None), default=0)
    exact = _EXACT_IDS.get(dtype)
    if exact is not None and n_experts > exact:
        raise ValueError(f"armed_kinds: expert_ids are staged in the model's dtype, and {dtype} holds integers exactly "
                         f"only up to {exact}; this model has {n_experts} experts. Arm router_logits alone, or run in float32")


def _install_hooks(layout: _vllm.ModelLayout, armed_kinds: list[str], sites: Sites) -> None:
    kinds = captured_kinds(armed_kinds)
    for i, layer in enumerate(layout.layers):
        for kind in kinds:
            if (i, kind) in sites:
                layer.add_module(f"capserve_{kind}", sites[(i, kind)])
        for kind, modules in layout.unnormed.items():
            if (i, kind) in sites:
                modules[i].register_forward_hook(_sublayer_hook(sites[(i, kind)]))
        router = layout.routers[i]
        if router is not None and (i, "router_logits") in sites:
            router.gate.register_forward_hook(_sublayer_hook(sites[(i, "router_logits")]))
        if router is not None and (i, "expert_ids") in sites:
            _vllm.report_routing(router, _ids_hook(sites[(i, "expert_ids")]))
        if any(kind in HEAD_KINDS for kind in kinds):
            z = sites.get((i, "z"))
            _vllm.wrap_attention(layout.attention[i], _qkv_hook(sites, i), _head_hook(z))
            if z is not None and z.written_in_place:
                _vllm.attend_into(layout.attention[i], z.staging)
        layer.register_forward_pre_hook(_layer_pre_hook(layout, sites, i), with_kwargs=True)
        layer.register_forward_hook(_layer_post_hook(layout, sites, i))
        layout.attn_out[i].register_forward_hook(_attn_out_hook(layout, sites, i))
        layout.mlp_out[i].register_forward_hook(_sublayer_hook(sites.get((i, "mlp_out"))))
    layout.final_norm.add_module("capserve_ln_final", sites[(None, "ln_final")])
    layout.final_norm.register_forward_hook(_final_norm_hook(sites[(None, "ln_final")]))


# The hooks are traced into the graph: they branch only on what is fixed at install time.


def _run(site: Site, x: torch.Tensor) -> torch.Tensor:
    """The site on [tokens, d] rows, whatever leading dimensions the model gives them."""
    return site(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def _run_heads(site: Site | None, x: torch.Tensor) -> torch.Tensor:
    """The site on [tokens, heads x d_head] rows; models hand q, k, v over flat or as [tokens, heads, d_head]."""
    return x if site is None else site(x.reshape(x.shape[0], -1)).reshape(x.shape)


def _qkv_hook(sites: Sites, i: int) -> Callable[..., tuple]:
    q, k, v = (sites.get((i, kind)) for kind in ("q", "k", "v"))

    def hook(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple:
        return _run_heads(q, query), _run_heads(k, key), _run_heads(v, value)

    return hook


def _ids_hook(site: Site) -> Callable[[torch.Tensor], None]:
    def report(topk_ids: torch.Tensor) -> None:
        site(topk_ids.to(site.staging.dtype))

    return report


def _head_hook(site: Site | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda z: _run_heads(site, z)


def _first(output: Any) -> torch.Tensor:
    """HF modules (the Transformers backend) return (hidden, extras...); vLLM's return hidden."""
    return output[0] if isinstance(output, tuple) else output


def _with_first(output: Any, value: torch.Tensor) -> Any:
    return (value, *output[1:]) if isinstance(output, tuple) else value


def _handed_over(edited: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) that a fused add-and-norm turns into exactly `edited`. The fused op
    works in place: vLLM's compiler donates both inputs to it, so a tensor handed over here must
    not be read afterwards (the caller hands over a copy of one it still needs)."""
    return torch.zeros_like(edited), edited


def _layer_pre_hook(layout: _vllm.ModelLayout, sites: Sites, i: int) -> Hook:
    pre, mid = sites.get((i, "resid_pre")), sites.get((i, "resid_mid"))

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if pre is None and mid is None:
            return None
        hidden, residual = _vllm.layer_inputs(layout, args, kwargs)
        value = hidden if residual is None else hidden + residual
        edited = value if pre is None else _run(pre, value)
        module.capserve_resid_pre_value = edited  # read by the attention hook for resid_mid
        if pre is None or pre.edit_stages == 0:
            return None
        if residual is None:
            return _vllm.replace_layer_inputs(layout, args, kwargs, edited, None)
        # resid_mid reads `edited` after the layer's first norm has taken what it is handed
        return _vllm.replace_layer_inputs(layout, args, kwargs, *_handed_over(edited.clone() if mid is not None else edited))

    return hook


def _attn_out_hook(layout: _vllm.ModelLayout, sites: Sites, i: int) -> Hook:
    out_site, mid = sites.get((i, "attn_out")), sites.get((i, "resid_mid"))
    layer = layout.layers[i]

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        attn = _first(output)
        if out_site is not None:
            attn = _run(out_site, attn)
        if mid is not None:
            value = layer.capserve_resid_pre_value + attn
            edited = _run(mid, value)
            if mid.edit_stages:
                # the block adds attn to resid_pre itself, out of reach of a hook
                attn = attn + (edited - value)
        return _with_first(output, attn)

    return hook


def _sublayer_hook(site: Site | None) -> Hook:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return output if site is None else _with_first(output, _run(site, _first(output)))

    return hook


def _layer_post_hook(layout: _vllm.ModelLayout, sites: Sites, i: int) -> Hook:
    site = sites.get((i, "resid_post"))

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if site is None:
            return output
        if layout.fused_residual:
            mlp_out, residual = output
            edited = _run(site, mlp_out + residual)
            return _handed_over(edited) if site.edit_stages else output
        return _with_first(output, _run(site, _first(output)))

    return hook


def _final_norm_hook(site: Site) -> Hook:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        _run(site, _first(output))
        return output

    return hook
