"""Tiny pre-quantized 4-bit checkpoints (AWQ GEMM, GPTQ v1 symmetric), built from a tiny float model
with no network, and the float folder of their dequantized weights that HF loads as the reference.

Every projection of the decoder layers (attention, MLP, MoE experts) becomes 4-bit: weights
quantized per group of G input channels. Scales are chosen exactly representable in float16 and
bfloat16, so the dequantized weights are the very numbers vLLM's kernels multiply by. Formats, as
vLLM reads them (W is [out, in]):
  AWQ : qweight int32 [in, out/8], packed along out, nibble i holding column 8j + AWQ_ORDER[i];
        qzeros int32 [in/G, out/8] packed alike; scales fp16 [in/G, out]; w = (q - z) * s
  GPTQ: qweight int32 [in/8, out], packed along in, nibble j holding input row 8i + j;
        qzeros int32 [in/G, out/8] (v1 stores zero - 1 = 7; unread for symmetric); scales fp16
        [in/G, out]; g_idx int32 [in]; w = (q - 8) * s
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

Method = Literal["awq", "gptq"]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)$")


def _scales(values: torch.Tensor) -> torch.Tensor:
    """Scales exact in float16 and bfloat16 (vLLM casts the stored fp16 scales to the model dtype)."""
    return values.clamp(min=1e-6).to(torch.bfloat16).to(torch.float16).float()


def _pack(q: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] values 0..15 -> [R, C/8] int32, eight consecutive columns a word."""
    rows, cols = q.shape
    q = q.to(torch.int64).reshape(rows, cols // 8, 8)
    if order is not None:
        q = q[:, :, order]
    packed = (q << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _awq(weight: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out_f, in_f = weight.shape
    grouped = weight.t().reshape(in_f // group, group, out_f)
    low, high = grouped.amin(1).clamp(max=0), grouped.amax(1).clamp(min=0)
    scale = _scales((high - low) / 15)
    zero = torch.clamp(torch.round(-low / scale), 0, 15)
    q = torch.clamp(torch.round(grouped / scale[:, None]) + zero[:, None], 0, 15)
    dequantized = ((q - zero[:, None]) * scale[:, None]).reshape(in_f, out_f).t().contiguous()
    stored = {"qweight": _pack(q.reshape(in_f, out_f), AWQ_ORDER), "qzeros": _pack(zero, AWQ_ORDER), "scales": scale.half()}
    return stored, dequantized


def _gptq(weight: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out_f, in_f = weight.shape
    grouped = weight.t().reshape(in_f // group, group, out_f)
    scale = _scales(grouped.abs().amax(1) / 7)
    q = torch.clamp(torch.round(grouped / scale[:, None]), -8, 7) + 8
    dequantized = ((q - 8) * scale[:, None]).reshape(in_f, out_f).t().contiguous()
    stored = {
        "qweight": _pack(q.reshape(in_f, out_f).t().contiguous()).t().contiguous(),
        "qzeros": _pack(torch.full((in_f // group, out_f), 7)),
        "scales": scale.half(),
        "g_idx": torch.arange(in_f, dtype=torch.int32) // group,
    }
    return stored, dequantized


def quantized_model(source: str | Path, method: Method, out: Path, group: int = 32) -> tuple[str, str]:
    """(the quantized folder, the float16 folder of its dequantized weights) from a float model folder."""
    source, reference = Path(source), out.parent / f"{out.name}-dequantized"
    for folder in (out, reference):
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(source, folder)
    quantized, dequantized = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and QUANTIZED.search(prefix) and tensor.ndim == 2:
            stored, dequantized[name] = (_awq if method == "awq" else _gptq)(tensor.float(), group)
            quantized.update({f"{prefix}.{key}": value for key, value in stored.items()})
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    for folder, config in ((out, _quantization_config(method, group)), (reference, None)):
        path = folder / "config.json"
        fields = json.loads(path.read_text()) | {"dtype": "float16"}
        if config is not None:
            fields["quantization_config"] = config
        path.write_text(json.dumps(fields, indent=2))
    return str(out), str(reference)


def _quantization_config(method: Method, group: int) -> dict[str, object]:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True}
