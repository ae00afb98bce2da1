"""Read-outs on the replica's device: the tuned lens's translators, the probes' weights, and the
computation for one group of a step's rows, as one block for one copy to host.

Lens, with the model's own head (what tuned-lens's `TunedLens.forward` computes with it):
    h' = h + h @ W_i.T + b_i                tuned_lens, translator i, in the model's dtype
    logits = lm_head(final_norm(h'))        `_vllm.compute_logits`: padded vocabulary rows cut, the
                                            model's final logit softcapping applied; float32
    the top_k of log_softmax(logits) over the whole vocabulary, most likely first
Rows of ln_final.hook_normalized are normed already: their logits are the model's own.
Probe: h @ W.T + b in float32 (weights kept in float32 whatever the file's dtype); probes read over the
same rows go by one product, their weights stacked.
Nothing here reads a value back to the host: the step loop only starts these kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from replicas.readouts.specs import read_probe, read_tuned_lens


MAX_PROBE_SETS = 64


@dataclass(frozen=True)
class Unembed:
    """The model's head, from the worker (`replicas._vllm`): its final norm alone (no fused
    residual, no hooks fired) and final-normed rows -> float32 logits [rows, vocab]."""

    norm: Callable[[torch.Tensor], torch.Tensor]
    logits: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DeviceProbe:
    weight: torch.Tensor  # float32 [n_out, d_model]
    bias: torch.Tensor  # float32 [n_out]


class DeviceReadouts:
    """The worker's lenses and probes."""

    def __init__(
        self, unembed: Unembed, translators: torch.Tensor | None = None, translator_bias: torch.Tensor | None = None,
        probes: dict[str, DeviceProbe] | None = None,
    ):
        self.unembed = unembed
        self.translators = translators  # [n_layers, d_model, d_model] (out, in), the model's dtype
        self.translator_bias = translator_bias  # [n_layers, d_model]
        self.probes = probes or {}
        self._stacks: dict[tuple[str, ...], DeviceProbe] = {}  # probe sets' weights side by side

    @classmethod
    def load(cls, options: dict[str, Any], unembed: Unembed, device: torch.device | str, dtype: torch.dtype) -> DeviceReadouts:
        """From the worker's options (engine options tuned_lens and probes, checked at start by the engine)."""
        from safetensors.torch import load_file

        translators = bias = None
        if options.get("tuned_lens"):
            facts = read_tuned_lens(options["tuned_lens"])
            state = load_file(facts.params_path, device="cpu")
            translators = torch.stack([state[f"{i}.weight"] for i in range(facts.n_layers)]).to(device, dtype)
            bias = (torch.stack([state[f"{i}.bias"] for i in range(facts.n_layers)]) if facts.bias
                    else torch.zeros(facts.n_layers, facts.d_model)).to(device, dtype)
        probes = {}
        for name, config in (options.get("probes") or {}).items():
            facts = read_probe(name, config)
            tensors = load_file(facts.path, device="cpu")
            weight = tensors["weight"].to(device, torch.float32)
            probe_bias = tensors["bias"] if facts.bias else torch.zeros(facts.n_out)
            probes[name] = DeviceProbe(weight, probe_bias.to(device, torch.float32))
        return cls(unembed, translators, bias, probes)

    def lens(self, x: torch.Tensor, translator: int, normed: bool, k: int) -> torch.Tensor:
        """[rows, ids k | logprobs k] as int32 (logprobs bit-cast), of rows x [rows, d_model]
        (`replicas.readouts.specs.ReadoutRows.add` unpacks it); translator -1: none."""
        if translator >= 0:
            x = x + torch.nn.functional.linear(x, self.translators[translator], self.translator_bias[translator])
        if not normed:
            x = self.unembed.norm(x)
        logprobs = torch.log_softmax(self.unembed.logits(x), dim=-1)
        values, ids = torch.topk(logprobs, k=k, dim=-1, sorted=True)
        return torch.cat([ids.to(torch.int32), values.view(torch.int32)], dim=-1)

    def probe_set(self, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
        """float32 [rows, sum of their n_out]: the named probes' outputs side by side, by one
        product with their weights stacked (kept for the next step's same set)."""
        stacked = self._stacks.get(names)
        if stacked is None:
            if len(self._stacks) >= MAX_PROBE_SETS:  # sets come from the requests' mixes: bounded
                self._stacks.clear()
            chosen = [self.probes[name] for name in names]
            stacked = self._stacks[names] = DeviceProbe(torch.cat([p.weight for p in chosen]), torch.cat([p.bias for p in chosen]))
        return torch.addmm(stacked.bias, x.float(), stacked.weight.T)


def lens_row_bytes(d_model: int, vocab: int, itemsize: int) -> int:
    """Device temporaries per row of a lens: the translated and normed rows, the head's output in
    the model's dtype, its float32 copy and the log-softmax."""
    return 3 * d_model * itemsize + vocab * (itemsize + 8)


def probe_row_bytes(d_model: int, n_out: int) -> int:
    return d_model * 4 + n_out * 4
