"""Conditions of conditional steering named by probe or SAE feature, turned into the inline read-out
(a direction and a bias on the edited hook's value) the worker tests row by row
(replicas.api.conditions; the test itself: replicas.worker.sites).

- probe p, output o: x . W[o] + b[o], the probe's own output.
- SAE feature f: its pre-activation (x - b_dec if the SAE applies b_dec to its input) . W_enc[:, f] +
  b_enc[f]. For a ReLU SAE the activation crosses a threshold t >= 0 exactly where that does; a
  JumpReLU feature is 0 below its own threshold theta, so it fires above max(t, theta). SAEs that
  normalize their input or keep the top k (whose activation depends on the other features) are
  not linear in x: refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replicas.api import GenerateRequest, resolve_hook
from replicas.api.conditions import Condition
from replicas.api.errors import PlanError


def resolve_conditions(request: GenerateRequest, probes: Any, saes: Any) -> GenerateRequest:
    """The request with every `when` by probe or SAE feature given as its inline read-out.
    `probes` is the engine's ReadoutCatalog, `saes` its SaeCatalog."""
    if not any(edit.when is not None and edit.when.vector is None for edit in request.interventions):
        return request
    edits = []
    for i, edit in enumerate(request.interventions):
        when = edit.when
        if when is not None and when.vector is None:
            where = f"interventions[{i}].when"
            vector, bias, threshold = (_probe_readout(where, when, edit.hook, probes) if when.probe is not None
                                       else _feature_readout(where, when, edit.hook, saes))
            inline = {"vector": vector, "bias": bias}
            inline |= {"above": threshold} if when.above is not None else {"below": threshold}
            edit = edit.model_copy(update={"when": Condition.model_validate(inline)})
        edits.append(edit)
    return request.model_copy(update={"interventions": edits})


def _same_hook(where: str, field: str, edit_hook: str, read_hook: str, what: str) -> None:
    if resolve_hook(edit_hook)[:2] != resolve_hook(read_hook)[:2]:
        raise PlanError(f"{where}.{field}: {what} reads {read_hook!r}, not the edited hook {edit_hook!r}; a condition "
                        f"is decided on the edited hook's own value")


def _probe_readout(where: str, when: Condition, hook: str, probes: Any) -> tuple[np.ndarray, float, float]:
    facts = probes.probe(f"{where}.probe", when.probe)
    _same_hook(where, "probe", hook, facts.hook, f"probe {when.probe!r}")
    if when.output >= facts.n_out:
        raise PlanError(f"{where}.output: {when.output} is out of range; probe {when.probe!r} has outputs 0..{facts.n_out - 1}")
    weight = _row(facts.path, "weight", when.output)
    bias = float(_row(facts.path, "bias", when.output)) if facts.bias else 0.0
    return weight, bias, when.threshold


def _feature_readout(where: str, when: Condition, hook: str, saes: Any) -> tuple[np.ndarray, float, float]:
    facts = saes.get(f"{where}.sae_id", when.sae_id)
    _same_hook(where, "sae_id", hook, facts.hook, f"SAE {when.sae_id!r}")
    if not 0 <= when.feature < facts.d_sae:  # type: ignore[operator]
        raise PlanError(f"{where}.feature: {when.feature} is out of range; SAE {when.sae_id!r} has features 0..{facts.d_sae - 1}")
    if facts.architecture not in ("standard", "jumprelu") or facts.normalize_activations != "none":
        raise PlanError(f"{where}.sae_id: SAE {when.sae_id!r} ({facts.architecture}, normalize_activations="
                        f"{facts.normalize_activations!r}) is not linear in the hook's value; a condition needs a "
                        f"standard or JumpReLU SAE without input normalization, or a probe")
    column = _column(facts.weights_path, "W_enc", when.feature)  # type: ignore[arg-type]
    bias = float(_row(facts.weights_path, "b_enc", when.feature))  # type: ignore[arg-type]
    if facts.apply_b_dec_to_input:
        bias -= float(np.dot(_tensor(facts.weights_path, "b_dec"), column))
    threshold = when.threshold
    if facts.architecture == "jumprelu":
        threshold = max(threshold, float(_row(facts.weights_path, "threshold", when.feature)))  # type: ignore[arg-type]
    return column, bias, threshold


def _row(path: str, name: str, index: int) -> Any:
    with _open(path) as weights:
        return weights.get_slice(name)[index : index + 1].float().numpy()[0]


def _column(path: str, name: str, index: int) -> np.ndarray:
    with _open(path) as weights:
        return weights.get_slice(name)[:, index : index + 1].float().numpy()[:, 0]


def _tensor(path: str, name: str) -> np.ndarray:
    with _open(path) as weights:
        return weights.get_tensor(name).float().numpy()


def _open(path: str) -> Any:
    """One tensor or slice read, in any float dtype the file holds (bfloat16 too)."""
    from safetensors import safe_open

    return safe_open(path, framework="pt")
