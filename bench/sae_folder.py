"""A random-weight TopK SAE in SAELens's saved layout (cfg.json + sae_weights.safetensors), for
benchmarks: the GPU host has neither SAELens nor a network, and an SAE's cost does not depend on
its weights."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch


def random_sae_folder(d_in: int, d_sae: int, hook: str, k: int, dtype: str = "bfloat16", seed: int = 0) -> str:
    from safetensors.torch import save_file

    folder = Path(tempfile.mkdtemp(prefix="capserve-sae-"))
    generator = torch.Generator().manual_seed(seed)
    w_dec = torch.randn(d_sae, d_in, generator=generator) / d_in**0.5
    weights = {"W_enc": w_dec.T.contiguous(), "b_enc": torch.zeros(d_sae), "W_dec": w_dec, "b_dec": torch.zeros(d_in)}
    save_file({name: t.to(getattr(torch, dtype)) for name, t in weights.items()}, str(folder / "sae_weights.safetensors"))
    cfg = {"architecture": "topk", "d_in": d_in, "d_sae": d_sae, "k": k, "dtype": dtype, "apply_b_dec_to_input": True,
           "normalize_activations": "none", "metadata": {"hook_name": hook}}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return str(folder)
