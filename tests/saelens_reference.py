"""SAELens's own SAEs and encodings, for tests/test_sae.py. Runs in the side venv `.venv-saelens`
(SAELens 6.54 cannot share capserve's venv); the tests call it as a subprocess.

    python tests/saelens_reference.py make OUT_DIR D_IN HOOK
        writes OUT_DIR/{relu,jumprelu,topk} with SAELens's own `save_model`: random weights, each
        kind with a different `apply_b_dec_to_input` / `normalize_activations`, so the test
        covers every branch of the encode; and OUT_DIR/{topk_pre6,topk_pre6_fn}, TopK SAEs in the
        format SAELens < 6 saved (a standard architecture whose activation_fn_str, or
        activation_fn, is "topk" with activation_fn_kwargs.k), which SAELens 6 loads as TopK.
    python tests/saelens_reference.py encode JOBS.json
        for each job {"sae_dir", "acts" (a .npy of rows x), "out" (.npz), "dtype" (or null)}: loads
        the SAE with `SAE.load_from_disk` (dtype overrides its own) and writes `acts` =
        sae.encode(x) (float32, dense) and `error` = x - sae.decode(acts) (float32).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

D_SAE = 256


def make(out_dir: str, d_in: int, hook: str) -> None:
    from sae_lens import (
        JumpReLUSAE,
        JumpReLUSAEConfig,
        StandardSAE,
        StandardSAEConfig,
        TopKSAE,
        TopKSAEConfig,
    )
    from sae_lens.saes.sae import SAEMetadata

    torch.manual_seed(0)
    kinds = {
        # ReLU, b_dec subtracted from the input, no normalisation
        "relu": StandardSAE(StandardSAEConfig(d_in=d_in, d_sae=D_SAE, metadata=SAEMetadata(hook_name=hook))),
        # JumpReLU, b_dec not subtracted, inputs rescaled to norm sqrt(d_in)
        "jumprelu": JumpReLUSAE(JumpReLUSAEConfig(
            d_in=d_in, d_sae=D_SAE, apply_b_dec_to_input=False, normalize_activations="constant_norm_rescale",
            metadata=SAEMetadata(hook_name=hook),
        )),
        # TopK with decoder-norm rescaling, inputs layer-normed
        "topk": TopKSAE(TopKSAEConfig(
            d_in=d_in, d_sae=D_SAE, k=12, rescale_acts_by_decoder_norm=True, normalize_activations="layer_norm",
            metadata=SAEMetadata(hook_name=hook),
        )),
    }
    for name, sae in kinds.items():
        with torch.no_grad():
            sae.W_enc.normal_(0, 0.3)
            sae.W_dec.normal_(0, 0.3)
            sae.b_enc.normal_(-0.2, 0.3)
            sae.b_dec.normal_(0, 0.1)
            if name == "jumprelu":
                sae.threshold.uniform_(0.0, 1.5)
        sae.save_model(f"{out_dir}/{name}")
    pre_6 = {
        "d_in": d_in, "d_sae": D_SAE, "dtype": "float32", "device": "cpu", "hook_point": hook, "hook_point_layer": 1,
        "apply_b_dec_to_input": True, "model_name": "tiny", "context_size": 128, "sae_lens_training_version": "3.13.0",
    }
    for name, cfg in {
        "topk_pre6": {"activation_fn_str": "topk", "activation_fn_kwargs": {"k": 9}, "normalize_activations": "none"},
        "topk_pre6_fn": {"activation_fn": "topk", "activation_fn_kwargs": {"k": 17}, "normalize_activations": False},
    }.items():
        sae = StandardSAE(StandardSAEConfig(d_in=d_in, d_sae=D_SAE))
        with torch.no_grad():
            for weight in (sae.W_enc, sae.W_dec, sae.b_enc, sae.b_dec):
                weight.normal_(0, 0.3)
        sae.save_model(f"{out_dir}/{name}")
        Path(f"{out_dir}/{name}/cfg.json").write_text(json.dumps(pre_6 | cfg))


def encode(sae_dir: str, acts_path: str, out_path: str, dtype: str | None = None) -> None:
    from sae_lens import SAE

    sae = SAE.load_from_disk(sae_dir, dtype=dtype)
    x = torch.from_numpy(np.load(acts_path))
    with torch.no_grad():
        acts = sae.encode(x)
        error = x.to(acts.dtype) - sae.decode(acts)
    np.savez(out_path, acts=acts.float().numpy(), error=error.float().numpy())


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "make":
        make(args[0], int(args[1]), args[2])
    else:
        for job in json.loads(Path(args[0]).read_text()):
            encode(job["sae_dir"], job["acts"], job["out"], job["dtype"])
