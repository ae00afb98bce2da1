"""A TransformerLens 4.3 `RemoteBridge` whose forward passes run on a capserve app.

Needs the `tl` extra (`pip install "capserve[tl]"`, transformer-lens 4.3):

    from provider.tl_bridge import boot_bridge
    bridge = boot_bridge("/models/llama", app="capserve", address="auto")
    logits, cache = bridge.run_with_cache(tokens, names_filter=["blocks.1.hook_out"])
    steered = bridge(tokens, intervene={"blocks.1.hook_out": {"op": "add", "value": v}})

Everything past the boot is TransformerLens's own code: its `InspectDriver` turns each forward into
an inspect `generate` call with the protocol's `extra_args` (built by its `TLBridgeProfile`, the
codec it uses for `tl_bridge_vllm`), the `capserve` provider answers it (`provider.tl_protocol`),
and the driver decodes `metadata["activations"]` and `tl_logits` into the bridge's cache.

Why not `RemoteBridge.boot_inspect(model, provider="capserve")`: TransformerLens 4.3 picks its
codec by provider name and refuses names other than tl_bridge, tl_bridge_vllm and vllm-lens*
(`sources/inspect/profiles.py`, `for_provider`). `boot_bridge` does what `boot_inspect` does for
`tl_bridge_vllm` (config, adapter, tokenizer from the HF folder; the driver and the bridge), with
the codec's capabilities read from the app: the kinds its engines arm, full-sequence logits (true
here: capserve returns real logits at every position), no attention mask. The TransformerLens
functions it calls are those of 4.3.0; they are internal to TransformerLens and may move.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from provider.tl_protocol import served_kinds

TL_VERSION = "4.3"


def boot_bridge(
    model: str,
    *,
    app: str = "capserve",
    address: str | None = None,
    hf_model: str | None = None,
    tokenizer: Any = None,
    dtype: Any = None,
) -> Any:
    """A TransformerLens `RemoteBridge` over the capserve app `app` on the Ray cluster at `address`
    (default `RAY_ADDRESS`, else `auto`; a process already connected to Ray keeps its connection).

    `model`: the name in `capserve/<model>` (the served model); `hf_model`: where to read the HF
    config and tokenizer the bridge needs (default `model`; a local folder works offline);
    `dtype`: the bridge config's dtype (default float32, as TransformerLens boots).
    """
    try:
        import torch
        import transformer_lens
        from inspect_ai.model import get_model
        from transformer_lens.factories.architecture_adapter_factory import (
            ArchitectureAdapterFactory,
        )
        from transformer_lens.model_bridge.remote_bridge import RemoteBridge
        from transformer_lens.model_bridge.sources._bridge_builder import (
            build_bridge_config_from_hf,
            configure_tokenizer,
        )
        from transformer_lens.model_bridge.sources._hf_format import (
            determine_architecture_from_hf_config,
        )
        from transformer_lens.model_bridge.sources.inspect.driver import InspectDriver
        from transformer_lens.model_bridge.sources.inspect.profiles import (
            TLBridgeProfile,
        )
        from transformers import AutoConfig, AutoTokenizer
    except ImportError as exc:
        raise ImportError(
            f"provider.tl_bridge needs transformer-lens {TL_VERSION} (pip install 'capserve[tl]'): {exc}"
        ) from exc
    version = getattr(transformer_lens, "__version__", None) or _dist_version("transformer-lens")
    if not str(version).startswith(TL_VERSION):
        raise ImportError(f"provider.tl_bridge is written against transformer-lens {TL_VERSION}.x, found {version}")

    import provider._registry  # noqa: F401  (registers capserve/<model> where the package is not installed)

    source = hf_model or model
    hf_config = AutoConfig.from_pretrained(source)
    architecture = determine_architecture_from_hf_config(hf_config)
    bridge_config = build_bridge_config_from_hf(hf_config, architecture, source, dtype or torch.float32)
    adapter = ArchitectureAdapterFactory.select_architecture_adapter(bridge_config)
    tokenizer = configure_tokenizer(tokenizer or AutoTokenizer.from_pretrained(source), adapter.cfg)

    inspect_model = get_model(f"capserve/{model}", app=app, address=address, memoize=False)
    info = _run(inspect_model.api.model_info())
    if info.n_layers != bridge_config.n_layers or info.d_model != bridge_config.d_model:
        raise ValueError(
            f"boot_bridge: app {app!r} serves {info.model!r} ({info.n_layers} layers, d_model {info.d_model}); "
            f"{source!r} has {bridge_config.n_layers} layers, d_model {bridge_config.d_model}: point hf_model at the served model"
        )
    profile = TLBridgeProfile(
        supported_kinds=served_kinds(info.armed_kinds),
        provides_sequence_logits=True,
        supports_attention_mask=False,
    )
    driver = InspectDriver(model=inspect_model, adapter=adapter, tokenizer=tokenizer, profile=profile)
    return RemoteBridge(adapter=adapter, tokenizer=tokenizer, driver=driver)


def _run(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, even inside a running loop (Jupyter)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
