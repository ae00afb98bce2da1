"""Read-outs seen from outside the device: the engine options (`tuned_lens`, `probes`), what their
files say, request validation into the wire plan, the host buffers of a request's read-outs, and
the results handed to the caller. Torch-free; the device side is `replicas.readouts.device`.

A tuned lens is a folder in the tuned-lens project's layout (`TunedLens.save`) with its
parameters converted to safetensors: `config.json` (d_model, num_hidden_layers, bias, lens_type
linear_tuned_lens) and `params.safetensors` holding `{i}.weight` [d_model, d_model] and
`{i}.bias` [d_model] for each block i, the keys of `params.pt`. Translator i maps the input of
block i, so it reads `blocks.{i}.hook_resid_pre` (= `blocks.{i-1}.hook_resid_post`). A pickle is
never read: convert `params.pt` on your side (docs/readouts.md).

A probe is one `.safetensors` file: `weight` [n_out, d_model], optionally `bias` [n_out], and in its
metadata (`__metadata__`) `hook`, the hook it reads (the engine option may name it instead).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from replicas.api import GenerateRequest, HookPoint, ProbeInfo, ReadoutResult, arrays, resolve_hook
from replicas.api.hooks import served_point
from replicas.api.errors import PlanError
from replicas.api.readouts import check_lens_hook
from replicas.plans.readouts import ReadoutPlan
from replicas.plans.positions import captured_positions, check_positions, count_positions
from replicas.readouts.store import ProbeStore, ProbeStores

LENS_CONFIG = "config.json"
LENS_PARAMS = "params.safetensors"
FLOAT_DTYPES = ("F32", "F16", "BF16")
Parts = list[tuple[str, str, int, str]]  # check_bytes's (field, how, bytes, fix)


class ProbeConfig(BaseModel):
    """One linear probe the replica loads onto its device (engine option `probes`, keyed by name)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="A .safetensors file: weight [n_out, d_model], optional bias [n_out].")
    hook: str | None = Field(None, description="Hook it reads (any spelling); default: the file's metadata `hook`.")


@dataclass(frozen=True)
class TunedLensFacts:
    path: str
    d_model: int
    n_layers: int
    bias: bool

    @property
    def params_path(self) -> str:
        return str(Path(self.path) / LENS_PARAMS)


@dataclass(frozen=True)
class ProbeFacts:
    name: str
    path: str
    hook: str
    point: HookPoint
    n_out: int
    d_in: int
    bias: bool


def safetensors_header(path: Path, where: str) -> dict[str, Any]:
    """The file's header (tensor names, dtypes, shapes; `__metadata__`), loading no tensor."""
    try:
        with path.open("rb") as file:
            size = int.from_bytes(file.read(8), "little")
            if not 0 < size <= path.stat().st_size - 8:
                raise ValueError(f"header size {size} does not fit the file")
            return json.loads(file.read(size))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: {str(path)!r} is not a readable safetensors file ({exc})") from None


def _check_tensor(header: dict[str, Any], name: str, shape: list[int], where: str, file: str) -> None:
    entry = header.get(name)
    if entry is None:
        raise ValueError(f"{where}: {file} has no tensor {name!r} (expected shape {shape})")
    if entry.get("shape") != shape or entry.get("dtype") not in FLOAT_DTYPES:
        raise ValueError(f"{where}: {file}'s {name} is {entry.get('dtype')} {entry.get('shape')}; expected a float "
                         f"({', '.join(FLOAT_DTYPES)}) tensor of shape {shape}")


def read_tuned_lens(path: str) -> TunedLensFacts:
    """The lens folder's config.json, checked; errors name `tuned_lens`."""
    folder = Path(path).expanduser()
    for name in (LENS_CONFIG, LENS_PARAMS):
        if not (folder / name).is_file():
            hint = " (convert params.pt: docs/readouts.md; capserve never unpickles)" if name == LENS_PARAMS else ""
            raise ValueError(f"tuned_lens: {str(folder)!r} has no {name}; give a folder saved by tuned-lens's "
                             f"TunedLens.save with params.safetensors{hint}")
    try:
        cfg = json.loads((folder / LENS_CONFIG).read_text())
        d_model, n_layers = int(cfg["d_model"]), int(cfg["num_hidden_layers"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"tuned_lens: {LENS_CONFIG} needs d_model and num_hidden_layers ({exc!r})") from None
    lens_type = cfg.get("lens_type", "linear_tuned_lens")
    if lens_type != "linear_tuned_lens":
        raise ValueError(f"tuned_lens: lens_type {lens_type!r} ({LENS_CONFIG}) is not served; only 'linear_tuned_lens'")
    return TunedLensFacts(str(folder), d_model, n_layers, bool(cfg.get("bias", True)))


def read_probe(name: str, config: ProbeConfig | dict[str, Any]) -> ProbeFacts:
    """The probe's file header, checked; errors name `probes.<name>.<field>`."""
    config = config if isinstance(config, ProbeConfig) else ProbeConfig.model_validate(config)
    where = f"probes.{name}"
    path = Path(config.path).expanduser()
    if not path.is_file():
        raise ValueError(f"{where}.path: {str(path)!r} is not a file; give a .safetensors file with weight [n_out, d_model]")
    header = safetensors_header(path, f"{where}.path")
    weight = header.get("weight", {}).get("shape")
    if not (isinstance(weight, list) and len(weight) == 2 and min(weight) > 0):
        raise ValueError(f"{where}.path: needs a tensor 'weight' of shape [n_out, d_model], found {weight}")
    _check_tensor(header, "weight", weight, f"{where}.path", path.name)
    has_bias = "bias" in header
    if has_bias:
        _check_tensor(header, "bias", weight[:1], f"{where}.path", path.name)
    hook = config.hook or (header.get("__metadata__") or {}).get("hook")
    if not hook:
        raise ValueError(f"{where}.hook: the file's metadata names no `hook`; set hook")
    try:
        point = resolve_hook(hook)
        check_lens_hook("probe", hook)
    except ValueError as exc:
        raise ValueError(f"{where}.hook: {exc}") from None
    return ProbeFacts(name, str(path), hook, point, n_out=weight[0], d_in=weight[1], bias=has_bias)


def check_readouts(
    tuned_lens: str | None, probes: dict[str, ProbeConfig], *, d_model: int, n_layers: int, armed_kinds: list[str],
    absent: dict[str, str],
) -> None:
    """At start: the tuned lens fits the model, and every probe reads a served hook of width d_model."""
    if tuned_lens is not None:
        facts = read_tuned_lens(tuned_lens)
        if (facts.d_model, facts.n_layers) != (d_model, n_layers):
            raise ValueError(f"tuned_lens: d_model={facts.d_model}, num_hidden_layers={facts.n_layers} ({LENS_CONFIG}) "
                             f"do not match the model's d_model={d_model}, {n_layers} layers")
        header = safetensors_header(Path(facts.params_path), "tuned_lens")
        for i in range(n_layers):
            _check_tensor(header, f"{i}.weight", [d_model, d_model], "tuned_lens", LENS_PARAMS)
            if facts.bias:
                _check_tensor(header, f"{i}.bias", [d_model], "tuned_lens", LENS_PARAMS)
    for name, config in probes.items():
        facts = read_probe(name, config)
        where = f"probes.{name}"
        if facts.d_in != d_model:
            raise ValueError(f"{where}.path: weight is [{facts.n_out}, {facts.d_in}]; its width must be the model's d_model={d_model}")
        served_point(where, facts.hook, n_layers, armed_kinds, absent)


class ReadoutCatalog:
    """The engine's view of its tuned lens and probes: validates requests against them."""

    def __init__(self, tuned_lens: TunedLensFacts | None, probes: dict[str, ProbeFacts]):
        self.tuned_lens = tuned_lens
        self.probes = probes

    @classmethod
    def read(cls, tuned_lens: str | None, probes: dict[str, ProbeConfig]) -> ReadoutCatalog:
        lens = read_tuned_lens(tuned_lens) if tuned_lens is not None else None
        return cls(lens, {name: read_probe(name, config) for name, config in probes.items()})

    def listing(self) -> dict[str, ProbeInfo]:
        """What ModelInfo tells clients about the probes."""
        return {name: ProbeInfo(hook=p.hook, n_out=p.n_out) for name, p in self.probes.items()}

    def wire(
        self, request: GenerateRequest, prompt_len: int, n_layers: int, d_vocab: int, parts: Parts,
        armed: Callable[[str, str], HookPoint],
    ) -> list[dict[str, Any]]:
        """The request's read-outs as the worker reads them; their bytes are added to `parts`.
        `armed(field, hook)` resolves a hook the deployment serves, or raises naming the field."""
        wired = []
        for i, spec in enumerate(request.readouts):
            where = f"readouts[{i}]"
            translator, probe = -1, None
            if spec.kind == "probe":
                probe = self.probe(f"{where}.probe", spec.probe)
                point = armed(f"{where}.hook", probe.hook)
                if spec.hook is not None and armed(f"{where}.hook", spec.hook) != point:
                    raise PlanError(f"{where}.hook: {spec.hook!r} is not the hook probe {spec.probe!r} reads ({probe.hook!r})")
                hook, width = spec.hook or probe.hook, probe.n_out
                how, size, fix = f"{probe.n_out} x 4", probe.n_out * 4, "ask for fewer probe positions"
            else:
                point = armed(f"{where}.hook", spec.hook)
                if spec.top_k > d_vocab:
                    raise PlanError(f"{where}.top_k: {spec.top_k} exceeds the vocabulary; allowed 1..{d_vocab} (d_vocab)")
                if spec.kind == "tuned_lens":
                    translator = self._translator(where, spec.hook, point, n_layers)
                hook, width = spec.hook, spec.top_k
                how, size, fix = f"{spec.top_k} x 8", spec.top_k * 8, "ask for fewer lens positions or a smaller top_k"
            check_positions(f"{where}.positions", spec.positions, prompt_len, request.max_tokens)
            rows = count_positions(spec.positions, prompt_len, request.max_tokens)
            parts.append((where, f"{rows} positions x {how} bytes", rows * size, fix))
            wired.append({
                "kind": spec.kind, "layer": point.layer, "site_kind": point.kind, "hook": hook, "positions": spec.positions,
                "max_rows": rows, "width": width, "translator": translator, "probe": None if probe is None else probe.name,
            })
        return wired

    def probe(self, field_name: str, name: str) -> ProbeFacts:
        facts = self.probes.get(name)
        if facts is None:
            served = sorted(self.probes) or "none"
            raise PlanError(f"{field_name}: unknown probe {name!r}; this replica serves {served} (engine option probes)")
        return facts

    def _translator(self, where: str, hook: str, point: HookPoint, n_layers: int) -> int:
        """The translator that maps the hook's rows: block i's for the input of block i."""
        if self.tuned_lens is None:
            raise PlanError(f"{where}.kind: 'tuned_lens', but this replica loaded no tuned lens (engine option "
                            f"tuned_lens); use 'logit_lens'")
        index = point.layer if point.kind == "resid_pre" else point.layer + 1
        if index >= n_layers:
            raise PlanError(f"{where}.hook: {hook!r} is the last block's output, which a tuned lens decodes with the "
                            f"model's own head (it has no translator there); use 'logit_lens' at that hook")
        return index


# ---------------------------------------------------------------- host side (outbox, engine)


ReadoutBlock = tuple[np.ndarray, np.ndarray | None]  # a probe's values and None, or a lens's ids and logprobs


def unpacked(block: np.ndarray, k_max: int) -> ReadoutBlock:
    """A step's block (replicas.readouts.device: a probe's float32 values, or a lens's int32
    [ids k_max | logprobs k_max, bit-cast]) as views, taken once a step: a decode step files a row
    for each of thousands of requests."""
    if block.dtype == np.float32:
        return block, None
    return block[:, :k_max], block[:, k_max:].view(np.float32)


@dataclass
class ReadoutRows:
    """One read-out of one request, filled by the outbox thread: a lens's arrays, or a probe's
    region in its probe's store (freed with this object)."""

    plan: ReadoutPlan
    ids: np.ndarray | None = None  # lenses: [max_rows, top_k] int32
    logprobs: np.ndarray | None = None  # lenses: [max_rows, top_k] float32
    store: ProbeStore | None = None  # probes

    @classmethod
    def for_plan(cls, plan: ReadoutPlan, stores: ProbeStores | None = None) -> ReadoutRows:
        if plan.kind == "probe":
            if stores is None:
                raise ValueError("a probe's rows go to the outbox's probe stores; none were given")
            store = stores.for_probe(plan.probe, plan.width)
            plan.region = store.allocate(plan.max_rows)
            rows = cls(plan, store=store)
            weakref.finalize(rows, store.free, plan.region)
            return rows
        shape = (plan.max_rows, plan.width)
        return cls(plan, ids=np.empty(shape, np.int32), logprobs=np.empty(shape, np.float32))

    def add(self, block: ReadoutBlock, lo: int, n: int, dest: int) -> None:
        """A lens's rows lo:lo+n of a step's block (`unpacked`)."""
        ids, logprobs = block
        k = self.plan.width
        self.ids[dest : dest + n] = ids[lo : lo + n, :k]
        self.logprobs[dest : dest + n] = logprobs[lo : lo + n, :k]

    def result(self, prompt_len: int) -> dict[str, Any]:
        plan = self.plan
        if self.store is not None:
            values = self.store.read(plan.region)
            n, raw = len(values), {"ids": None, "logprobs": None, "values": dict(arrays.to_raw(values))}
        else:
            n = plan.taken
            raw = {"ids": dict(arrays.to_raw(self.ids[:n])), "logprobs": dict(arrays.to_raw(self.logprobs[:n])), "values": None}
        return {"kind": plan.kind, "hook": plan.hook, "probe": plan.probe,
                "positions": captured_positions(plan.positions, prompt_len, n), **raw}


def readout_results(raw: list[dict[str, Any]], fed: int, texts: Callable[[list[int]], list[str]] | None) -> list[ReadoutResult]:
    """The worker's read-outs as the caller gets them, keeping rows of fed tokens only (the engine
    core may have run steps past the tokens returned); `texts` gives token ids their strings."""
    results = []
    for entry in raw:
        kept = int(np.searchsorted(entry["positions"], fed))
        cut = {name: None if entry[name] is None else arrays.from_raw(entry[name])[:kept] for name in ("ids", "logprobs", "values")}
        tokens = None
        if cut["ids"] is not None and texts is not None:
            unique = np.unique(cut["ids"]).tolist()
            text = dict(zip(unique, texts(unique)))
            tokens = [[text[i] for i in row] for row in cut["ids"].tolist()]
        results.append(ReadoutResult(kind=entry["kind"], hook=entry["hook"], probe=entry["probe"],
                                     positions=entry["positions"][:kept], tokens=tokens, **cut))
    return results

