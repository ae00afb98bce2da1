"""SAEs on the replica's device: their weights, encode and decode as SAELens 6.54 computes them,
and the sparse top-k of a step's rows, packed for one copy to host.

Encode (SAELens `StandardSAE` / `JumpReLUSAE` / `TopKSAE.encode` on an SAE loaded from disk):
    x' = x in the SAE's dtype, normalised (constant_norm_rescale: x * sqrt(d_in) / |x|;
         layer_norm: (x - mean) / (std + 1e-5), std with Bessel's correction; other modes: x)
    h  = (x' - b_dec if apply_b_dec_to_input else x') @ W_enc + b_enc
    standard: relu(h); jumprelu: relu(h) * (h > threshold);
    topk: h * |W_dec rows| if rescale_acts_by_decoder_norm, then the k largest, relu'd, others 0.
Decode: acts (/ |W_dec rows| for a rescaled topk) @ W_dec + b_dec, then the normalisation undone.
A request gets the `top_k` largest activations per row, largest first; entries past the active
features (value 0) carry id -1, so ties among inactive features never show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from replicas.sae.specs import SaeFacts, read_facts

LAYER_NORM_EPS = 1e-5


@dataclass
class DeviceSae:
    """One SAE's weights on the device."""

    facts: SaeFacts
    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    threshold: torch.Tensor | None = None
    decoder_norms: torch.Tensor | None = None  # topk with rescale_acts_by_decoder_norm

    @property
    def site(self) -> tuple[int | None, str]:
        return self.facts.point.layer, self.facts.point.kind

    @classmethod
    def load(cls, facts: SaeFacts, device: torch.device | str = "cpu") -> DeviceSae:
        from safetensors.torch import load_file

        weights = load_file(facts.weights_path, device="cpu")
        dtype = getattr(torch, facts.dtype)
        missing = [name for name in ("W_enc", "b_enc", "W_dec", "b_dec") if name not in weights]
        if facts.architecture == "jumprelu" and "threshold" not in weights:
            missing.append("threshold")
        if missing:
            raise ValueError(f"saes.{facts.sae_id}: {facts.weights_path} lacks {missing}")
        tensors = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
        sae = cls(facts, tensors["W_enc"], tensors["b_enc"], tensors["W_dec"], tensors["b_dec"], tensors.get("threshold"))
        expected = {"W_enc": (facts.d_in, facts.d_sae), "b_enc": (facts.d_sae,), "W_dec": (facts.d_sae, facts.d_in), "b_dec": (facts.d_in,)}
        for name, shape in expected.items():
            if tuple(getattr(sae, name).shape) != shape:
                raise ValueError(f"saes.{facts.sae_id}: {name} has shape {list(getattr(sae, name).shape)}, cfg.json says {list(shape)}")
        if facts.rescale_acts_by_decoder_norm:
            sae.decoder_norms = sae.W_dec.norm(dim=-1)
        return sae

    def normalize(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """x in the SAE's dtype, normalised as cfg.json says; and what `denormalize` needs."""
        x = x.to(self.W_enc.dtype)
        mode = self.facts.normalize_activations
        if mode == "constant_norm_rescale":
            coeff = (self.facts.d_in**0.5) / x.norm(dim=-1, keepdim=True)
            return x * coeff, coeff
        if mode == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            x = x - mu
            std = x.std(dim=-1, keepdim=True)
            return x / (std + LAYER_NORM_EPS), (mu, std)
        return x, None

    def denormalize(self, x: torch.Tensor, state: Any) -> torch.Tensor:
        mode = self.facts.normalize_activations
        if mode == "constant_norm_rescale":
            return x / state
        if mode == "layer_norm":
            mu, std = state
            return x * std + mu
        return x

    def pre_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """What the activation function reads, [rows, d_sae] (a rescaled topk's rescaled); and the normaliser's state."""
        sae_in, state = self.normalize(x)
        if self.facts.apply_b_dec_to_input:
            sae_in = sae_in - self.b_dec
        hidden = sae_in @ self.W_enc + self.b_enc
        if self.facts.architecture == "topk" and self.decoder_norms is not None:
            hidden = hidden * self.decoder_norms
        return hidden, state

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Dense feature activations [rows, d_sae] of rows x [rows, d_in]; and the normaliser's state."""
        hidden, state = self.pre_activation(x)
        architecture = self.facts.architecture
        if architecture == "standard":
            return torch.relu(hidden), state
        if architecture == "jumprelu":
            return torch.relu(hidden) * (hidden > self.threshold).to(hidden.dtype), state
        values, ids = torch.topk(hidden, k=self.facts.k, dim=-1, sorted=False)
        return torch.zeros_like(hidden).scatter_(-1, ids, values.relu()), state

    def decode(self, acts: torch.Tensor, state: Any) -> torch.Tensor:
        if self.decoder_norms is not None:
            acts = acts * (1 / self.decoder_norms)
        return self.denormalize(acts @ self.W_dec + self.b_dec, state)


def load_saes(options: dict[str, dict[str, Any]] | None, device: torch.device | str) -> dict[str, DeviceSae]:
    """The worker's SAEs from its options (engine option saes, checked at start by the engine)."""
    return {sae_id: DeviceSae.load(read_facts(sae_id, config), device) for sae_id, config in (options or {}).items()}


def top_features(acts: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32, values float32) of the k largest activations per row, largest first; -1 and 0
    past the active (positive) ones."""
    values, ids = torch.topk(acts, k=k, dim=-1, sorted=True)
    active = values > 0
    return torch.where(active, ids, -1).to(torch.int32), torch.where(active, values, 0).float()


def packed_width(k_max: int, error: str, d_model: int) -> int:
    return 2 * k_max + {"none": 0, "norm": 1}.get(error, 1 + d_model)


def encode_packed(sae: DeviceSae, x: torch.Tensor, k_max: int, error: str) -> torch.Tensor:
    """[rows, ids k_max | values k_max | error norm | error vector] as int32 (floats bit-cast): one
    block, one copy to host (`replicas.sae.specs.SaeRows.add` unpacks it). `error` is the most any
    request of the block asked: none; norm (one float32); vector (the norm, then d_model float32)."""
    if error == "none" and sae.facts.architecture == "topk" and k_max <= sae.facts.k:
        # the k_max largest of the k kept are the k_max largest pre-activations: one top-k, no dense activations
        ids, values = top_features(sae.pre_activation(x)[0], k_max)
        return torch.cat([ids, values.view(torch.int32)], dim=-1)
    acts, state = sae.encode(x)
    ids, values = top_features(acts, k_max)
    parts = [ids, values.view(torch.int32)]
    if error != "none":
        residual = x.to(acts.dtype) - sae.decode(acts, state)
        residual = residual.float()
        parts.append(residual.norm(dim=-1, keepdim=True).view(torch.int32))
        if error == "vector":
            parts.append(residual.view(torch.int32))
    return torch.cat(parts, dim=-1)


def row_bytes(sae: DeviceSae, d_model: int) -> int:
    """Device temporaries per encoded row: hidden and dense acts (SAE dtype), their top-k, a decode."""
    itemsize = sae.W_enc.element_size()
    return sae.facts.d_sae * (3 * itemsize + 4) + d_model * 4 * 3
