"""SAEs a replica serves, seen from outside the device: the engine option, what each SAE's
`cfg.json` says, request validation into the wire plan, the host buffers of a request's features,
and the results handed to the caller. Torch-free (the engine process imports torch lazily for one
decoder row); the device side — weights, encode, top-k — is `replicas.sae.device`.

An SAE is a folder in SAELens's saved format (`SAE.save_model`): `cfg.json` plus
`sae_weights.safetensors` with W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in],
b_dec [d_in], and `threshold` [d_sae] for JumpReLU. Architectures: standard (ReLU), jumprelu,
topk (its `k`, and `rescale_acts_by_decoder_norm`). A cfg.json saved by SAELens < 6 is read as
SAELens 6 reads it (`saelens_6_config`), so its `activation_fn: topk` is the topk architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from replicas.api import arrays
from replicas.api import GenerateRequest, SaeFeatures, SaeInfo
from replicas.api.hooks import HookPoint, resolve_hook, served_point
from replicas.plans.request import PlanError, SaePlan
from replicas.plans.positions import captured_positions, check_positions, count_positions

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "jumprelu", "topk")
# What SAELens's SAE does at inference for each `normalize_activations` (SAE._setup_activation_
# normalization): only these two transform; expected_average_only_in's factor is folded into the
# weights by `from_pretrained` for hub releases, never applied by an SAE loaded from disk.
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm", "covariance_whitening")
SaeDtype = Literal["float32", "float16", "bfloat16"]
ERROR_WIDTH = {"none": 0, "norm": 1}  # "vector": d_model


class SaeConfig(BaseModel):
    """One SAE the replica loads onto its device (engine option `saes`, keyed by sae_id)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Folder in SAELens's saved format: cfg.json + sae_weights.safetensors.")
    hook: str | None = Field(
        None, description="Hook it reads (any accepted spelling); default: cfg.json's metadata.hook_name."
    )
    dtype: SaeDtype | None = Field(None, description="dtype of the weights on the device; default: cfg.json's dtype.")


@dataclass(frozen=True)
class SaeFacts:
    """What an SAE's cfg.json says, checked; `hook` is the hook it reads."""

    sae_id: str
    path: str
    hook: str
    point: HookPoint
    architecture: str
    d_in: int
    d_sae: int
    dtype: str
    apply_b_dec_to_input: bool
    normalize_activations: str
    k: int | None = None
    rescale_acts_by_decoder_norm: bool = False

    @property
    def weights_path(self) -> str:
        return str(Path(self.path) / WEIGHTS_FILE)


def read_facts(sae_id: str, config: SaeConfig | dict[str, Any]) -> SaeFacts:
    """The SAE's cfg.json, checked; errors name `saes.<sae_id>.<field>`."""
    config = config if isinstance(config, SaeConfig) else SaeConfig.model_validate(config)
    where = f"saes.{sae_id}"
    folder = Path(config.path).expanduser()
    for name in (CFG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise ValueError(f"{where}.path: {str(folder)!r} has no {name}; give a folder saved by SAELens's SAE.save_model")
    cfg = saelens_6_config(json.loads((folder / CFG_FILE).read_text()), where)
    architecture = cfg.get("architecture", "standard")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{where}: architecture {architecture!r} (cfg.json) is not served; served: {', '.join(ARCHITECTURES)}")
    if cfg.get("reshape_activations", "none") != "none":
        raise ValueError(f"{where}: reshape_activations={cfg['reshape_activations']!r} (cfg.json) is not served; only 'none'")
    normalize = cfg.get("normalize_activations") or "none"
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"{where}: normalize_activations={normalize!r} (cfg.json); allowed: {', '.join(NORMALIZATIONS)}")
    hook = config.hook or (cfg.get("metadata") or {}).get("hook_name") or cfg.get("hook_name")
    if not hook:
        raise ValueError(f"{where}.hook: cfg.json names no metadata.hook_name; set hook")
    try:
        point = resolve_hook(hook)
    except ValueError as exc:
        raise ValueError(f"{where}.hook: {exc}") from None
    k = cfg.get("k")
    if architecture == "topk" and not (isinstance(k, int) and 0 < k <= int(cfg["d_sae"])):
        raise ValueError(f"{where}: a topk SAE needs k in 1..d_sae in cfg.json, got {k!r}")
    dtype = config.dtype or str(cfg.get("dtype", "float32")).removeprefix("torch.")
    if dtype not in arrays.DTYPES or dtype.startswith("int"):
        raise ValueError(f"{where}.dtype: cfg.json's dtype {dtype!r} is not served; set dtype to float32, float16 or bfloat16")
    return SaeFacts(
        sae_id=sae_id, path=str(folder), hook=hook, point=point, architecture=architecture,
        d_in=int(cfg["d_in"]), d_sae=int(cfg["d_sae"]), dtype=dtype,
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)), normalize_activations=normalize,
        k=int(k) if architecture == "topk" else None,
        rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)) and architecture == "topk",
    )


def saelens_6_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """A cfg.json saved by SAELens < 6 (no sae_lens_version, or below 6) in SAELens 6's terms, as
    6.54 reads it (loading/pretrained_sae_loaders.py handle_pre_6_0_config): hook_point is
    hook_name, activation_fn_str is activation_fn, a bool normalize_activations is
    'expected_average_only_in' or 'none', an SAE of hook_z reshapes its input, and a topk activation
    with activation_fn_kwargs.k is the topk architecture with that k. 6.54 runs any other
    activation as ReLU (its configs have no activation field); one that is not ReLU, or topk
    without its k, is refused here rather than misread."""
    version = cfg.get("sae_lens_version") or (cfg.get("metadata") or {}).get("sae_lens_version")
    if version and int(str(version).split(".")[0]) >= 6:
        return cfg
    renames = {"hook_point": "hook_name", "activation_fn_str": "activation_fn"}
    cfg = {renames.get(key, key): value for key, value in cfg.items()}
    activation = cfg.get("activation_fn") or "relu"
    k = (cfg.get("activation_fn_kwargs") or {}).get("k")
    if activation == "topk" and k is None:
        raise ValueError(f"{where}: activation_fn 'topk' (cfg.json, SAELens < 6) names no activation_fn_kwargs.k")
    if activation not in ("relu", "topk"):
        raise ValueError(f"{where}: activation_fn {activation!r} (cfg.json, SAELens < 6) is not served; served: relu, topk")
    if activation == "topk":
        cfg["architecture"], cfg["k"] = "topk", k
    if isinstance(cfg.get("normalize_activations"), bool):
        cfg["normalize_activations"] = "expected_average_only_in" if cfg["normalize_activations"] else "none"
    cfg.setdefault("reshape_activations", "hook_z" if "hook_z" in str(cfg.get("hook_name", "")) else "none")
    return cfg


def check_saes(
    saes: dict[str, SaeConfig], *, d_model: int, n_layers: int, armed_kinds: list[str], absent: dict[str, str]
) -> None:
    """At start: every SAE reads a served hook of width d_model."""
    for sae_id, config in saes.items():
        facts = read_facts(sae_id, config)
        where = f"saes.{sae_id}"
        if facts.d_in != d_model:
            raise ValueError(f"{where}: d_in={facts.d_in} (cfg.json) does not match the model's d_model={d_model}")
        served_point(where, facts.hook, n_layers, armed_kinds, absent)
        _check_weights(facts)


def _check_weights(facts: SaeFacts) -> None:
    """The weights file holds the tensors cfg.json promises (read from its header, loading nothing)."""
    path = Path(facts.weights_path)
    with path.open("rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    expected = {"W_enc": [facts.d_in, facts.d_sae], "b_enc": [facts.d_sae], "W_dec": [facts.d_sae, facts.d_in], "b_dec": [facts.d_in]}
    if facts.architecture == "jumprelu":
        expected["threshold"] = [facts.d_sae]
    for name, shape in expected.items():
        found = header.get(name, {}).get("shape")
        if found != shape:
            raise ValueError(
                f"saes.{facts.sae_id}.path: {WEIGHTS_FILE} has {name} of shape {found}, cfg.json implies {shape}"
            )


class SaeCatalog:
    """The engine's view of its SAEs: validates requests against them and resolves feature edits."""

    def __init__(self, facts: dict[str, SaeFacts]):
        self.facts = facts

    @classmethod
    def read(cls, saes: dict[str, SaeConfig]) -> SaeCatalog:
        return cls({sae_id: read_facts(sae_id, config) for sae_id, config in saes.items()})

    def listing(self) -> dict[str, SaeInfo]:
        """What ModelInfo tells clients about the SAEs."""
        return {sae_id: SaeInfo(hook=f.hook, d_sae=f.d_sae, architecture=f.architecture, k=f.k) for sae_id, f in self.facts.items()}

    def get(self, field_name: str, sae_id: str) -> SaeFacts:
        facts = self.facts.get(sae_id)
        if facts is None:
            served = sorted(self.facts) or "none"
            raise PlanError(f"{field_name}: unknown SAE {sae_id!r}; this replica serves {served} (engine option saes)")
        return facts

    def wire(self, request: GenerateRequest, prompt_len: int, d_model: int, parts: list[tuple[str, str, int, str]]) -> list[dict[str, Any]]:
        """The request's SAE specs as the worker reads them; their bytes are added to `parts`."""
        wired = []
        for i, spec in enumerate(request.sae):
            where = f"sae[{i}]"
            facts = self.get(f"{where}.sae_id", spec.sae_id)
            if spec.hook is not None and _point(f"{where}.hook", spec.hook)[:2] != facts.point[:2]:
                raise PlanError(f"{where}.hook: {spec.hook!r} is not the hook SAE {spec.sae_id!r} reads ({facts.hook!r})")
            if spec.top_k > facts.d_sae:
                raise PlanError(f"{where}.top_k: {spec.top_k} exceeds SAE {spec.sae_id!r}'s d_sae={facts.d_sae}")
            check_positions(f"{where}.positions", spec.positions, prompt_len, request.max_tokens)
            rows = count_positions(spec.positions, prompt_len, request.max_tokens)
            width = ERROR_WIDTH.get(spec.error, d_model)
            parts.append((
                where, f"{rows} positions x ({spec.top_k} x 8 + {width} x 4) bytes", rows * (spec.top_k * 8 + width * 4),
                "ask for fewer SAE positions or a smaller top_k",
            ))
            wired.append({
                "sae_id": spec.sae_id, "hook": spec.hook or facts.hook, "top_k": spec.top_k, "positions": spec.positions,
                "error": spec.error, "max_rows": rows,
            })
        return wired

    def resolve_features(self, request: GenerateRequest) -> GenerateRequest:
        """The request with each `add` by SAE feature turned into an `add` of that feature's decoder
        row W_dec[feature] (in the SAE's device dtype, as float32)."""
        if not any(edit.sae_id is not None for edit in request.interventions):
            return request
        edits = []
        for i, edit in enumerate(request.interventions):
            if edit.sae_id is None:
                edits.append(edit)
                continue
            where = f"interventions[{i}]"
            facts = self.get(f"{where}.sae_id", edit.sae_id)
            if _point(f"{where}.hook", edit.hook)[:2] != facts.point[:2]:
                raise PlanError(f"{where}.hook: {edit.hook!r} is not the hook SAE {edit.sae_id!r} reads ({facts.hook!r})")
            if not 0 <= edit.feature < facts.d_sae:
                raise PlanError(f"{where}.feature: {edit.feature} is out of range; SAE {edit.sae_id!r} has features 0..{facts.d_sae - 1}")
            row = decoder_row(facts, edit.feature)
            if not np.isfinite(row).all() or (edit.norm_match and not np.linalg.norm(row.astype(np.float64)) > 0):
                raise PlanError(f"{where}.feature: decoder row {edit.feature} of SAE {edit.sae_id!r} is zero or not finite")
            edits.append(edit.model_copy(update={"vector": row, "sae_id": None, "feature": None}))
        return request.model_copy(update={"interventions": edits})


def _point(field_name: str, hook: str) -> HookPoint:
    try:
        return resolve_hook(hook)
    except ValueError as exc:
        raise PlanError(f"{field_name}: {exc}") from None


def decoder_row(facts: SaeFacts, feature: int) -> np.ndarray:
    """W_dec[feature] from the weights file (one row read), rounded to the SAE's dtype."""
    import torch
    from safetensors import safe_open

    with safe_open(facts.weights_path, framework="pt") as weights:
        row = weights.get_slice("W_dec")[feature : feature + 1]
    return row[0].to(getattr(torch, facts.dtype)).float().numpy()


# ---------------------------------------------------------------- host side (outbox, engine)


SaeBlock = tuple[np.ndarray, np.ndarray, np.ndarray]  # ids, values, error columns (norm, then vector) of a step's rows


def unpacked(packed: np.ndarray, k_max: int) -> SaeBlock:
    """A step's packed int32 block (replicas.sae.device.encode_packed) as views of its columns,
    taken once a step: a decode step files a row for each of thousands of requests."""
    return packed[:, :k_max], packed[:, k_max : 2 * k_max].view(np.float32), packed[:, 2 * k_max :].view(np.float32)


@dataclass
class SaeRows:
    """One SAE spec's features of one request, filled by the outbox thread."""

    plan: SaePlan
    ids: np.ndarray  # [max_rows, top_k] int32
    values: np.ndarray  # [max_rows, top_k] float32
    error: np.ndarray | None  # [max_rows] or [max_rows, d_model] float32

    @classmethod
    def for_plan(cls, plan: SaePlan, d_model: int) -> SaeRows:
        rows, k = plan.max_rows, plan.top_k
        width = ERROR_WIDTH.get(plan.error, d_model)
        error = None if width == 0 else np.empty((rows, d_model) if plan.error == "vector" else (rows,), np.float32)
        return cls(plan, np.empty((rows, k), np.int32), np.empty((rows, k), np.float32), error)

    def add(self, block: SaeBlock, lo: int, n: int, dest: int) -> None:
        """Rows lo:lo+n of a step's block (`unpacked`)."""
        ids, values, error = block
        k = self.plan.top_k
        self.ids[dest : dest + n] = ids[lo : lo + n, :k]
        self.values[dest : dest + n] = values[lo : lo + n, :k]
        if self.error is not None and self.error.ndim == 1:
            self.error[dest : dest + n] = error[lo : lo + n, 0]
        elif self.error is not None:
            self.error[dest : dest + n] = error[lo : lo + n, 1 : 1 + self.error.shape[1]]

    def result(self, prompt_len: int) -> dict[str, Any]:
        n = self.plan.taken
        return {
            "sae_id": self.plan.sae_id, "hook": self.plan.hook,
            "positions": captured_positions(self.plan.positions, prompt_len, n),
            "ids": dict(arrays.to_raw(self.ids[:n])), "values": dict(arrays.to_raw(self.values[:n])),
            "error": None if self.error is None else dict(arrays.to_raw(self.error[:n])),
        }


def sae_results(raw: list[dict[str, Any]], fed: int) -> dict[str, SaeFeatures]:
    """The worker's SAE results as the caller gets them, keeping rows of fed tokens only (the
    engine core may have run steps past the tokens returned)."""
    results = {}
    for entry in raw:
        kept = int(np.searchsorted(entry["positions"], fed))
        results[entry["sae_id"]] = SaeFeatures(
            hook=entry["hook"], positions=entry["positions"][:kept],
            ids=arrays.from_raw(entry["ids"])[:kept], values=arrays.from_raw(entry["values"])[:kept],
            error=None if entry["error"] is None else arrays.from_raw(entry["error"])[:kept],
        )
    return results
