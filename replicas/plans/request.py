"""What one request wants from the worker, in the form the worker reads each step.

The engine validates a `GenerateRequest` and turns it into a `WirePlan` (plain dicts, lists and
bytes, so it rides on `SamplingParams.extra_args` through msgpack); the worker rebuilds a
`RequestPlan` from it once, the first time the request appears in a step. Selecting rows is pure
numpy on the positions of the step's rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replicas.api import arrays
from replicas.api import CaptureSpec, GenerateRequest, MoeInfo, Positions
from replicas.api.errors import PlanError
from replicas.plans.positions import EXPLICIT, PHASE_MODES, absolute_indices, check_positions, count_positions, mode_code, selected_offsets, selected_range
from replicas.plans.heads import HeadShapes, captured_sites, head_edit, hook_width, key_positions
from replicas.plans.readouts import ReadoutPlan
from replicas.api.hooks import HEAD_KINDS, PATTERN_KINDS, ROUTER_KINDS, HookPoint, resolve_hook

PLAN_KEY = "capserve"
WirePlan = dict[str, Any]


def reduced_on_replica(capture: CaptureSpec, prompt_len: int) -> bool:
    """A mean over rows that may include generated tokens is taken by the replica, not the worker:
    the engine core can run steps past the tokens the caller gets back (a stop string is matched
    in vLLM's front end after the core ran on), and only the replica knows where to cut."""
    if capture.reduce != "mean":
        return False
    if isinstance(capture.positions, str):
        return capture.positions in ("all", "generated")
    return any(index >= prompt_len for index in capture.positions)


# ---------------------------------------------------------------- engine side: request -> wire plan


def build_wire_plan(
    key: str,
    request: GenerateRequest,
    *,
    prompt_len: int,
    n_layers: int,
    d_model: int,
    armed_kinds: set[str],
    steer_kinds: set[str],
    edit_stages: int,
    max_capture_bytes: int,
    steer_layers: set[int] | None = None,
    absent_kinds: Mapping[str, str] | None = None,
    d_vocab: int | None = None,
    max_set_edits: int | None = None,
    head_shapes: HeadShapes | None = None,
    saes: Any = None,
    moe: MoeInfo | None = None,
    same_kinds: Mapping[str, str] | None = None,
    readouts: Any = None,
) -> WirePlan | None:
    """Validate everything that depends on the model and the prompt; None when nothing is asked.
    `d_vocab` is needed for requests that ask for logits; `max_set_edits` None: no limit;
    `head_shapes` for the attention hooks; `saes` (a `replicas.sae.specs.SaeCatalog`) for SAE
    features; `moe` for the router hooks of a mixture-of-experts model; `same_kinds` maps a kind to
    the kind whose site serves its value in this block shape (replicas.engine.architectures);
    `readouts` (a `replicas.readouts.specs.ReadoutCatalog`) for lenses and probes."""
    capture, logits = request.capture, request.logits
    if capture is None and logits is None and not request.interventions and not request.sae and not request.readouts:
        return None
    plan: WirePlan = {"key": key, "prompt_len": prompt_len}
    absent = absent_kinds or {}
    same = same_kinds or {}
    parts: list[tuple[str, str, int, str]] = []  # (field, how, bytes, fix) of what the worker holds
    if capture is not None:
        points = [
            _armed_point(f"capture.hooks[{i}]", name, n_layers, armed_kinds, absent=absent, moe=moe, same=same)
            for i, name in enumerate(capture.hooks)
        ]
        if capture.reduce == "mean" and any(p.kind == "expert_ids" for p in points):
            raise PlanError("capture.reduce: 'mean' does not apply to expert ids; use reduce='none' (or take the mean "
                            "of hook_router_logits)")
        check_positions("capture.positions", capture.positions, prompt_len, request.max_tokens)
        sites = captured_sites(points, capture.hooks)
        positions = capture.positions
        if any(p.kind in PATTERN_KINDS for p in points):
            positions = key_positions(capture, prompt_len)
        width = max(hook_width(kind, d_model, head_shapes, moe) for _, kind, _ in sites)
        # the worker keeps every row, in float32, when the replica takes the mean
        replica_mean = reduced_on_replica(capture, prompt_len)
        worker_reduces = capture.reduce == "mean" and not replica_mean
        wire_dtype = "float32" if replica_mean else capture.dtype
        rows = 1 if worker_reduces else count_positions(positions, prompt_len, request.max_tokens)
        itemsize = 4 if wire_dtype == "float32" else 2
        size = rows * width * itemsize * len(sites)
        parts.append((
            "capture", f"{len(sites)} hooks x {rows} positions x {width} x {itemsize} bytes", size,
            "capture fewer hooks or positions, use reduce='mean' or dtype='bfloat16'",
        ))
        plan["capture"] = {
            "sites": sites,
            "max_rows": count_positions(positions, prompt_len, request.max_tokens),
            "positions": positions,
            "reduce": "mean" if worker_reduces else "none",
            "dtype": wire_dtype,
            "width": width,
        }
    if logits is not None:
        check_positions("logits.positions", logits.positions, prompt_len, request.max_tokens)
        if d_vocab is None:
            raise ValueError("build_wire_plan: a request for logits needs d_vocab")
        logits_rows = count_positions(logits.positions, prompt_len, request.max_tokens)
        parts.append((
            "logits", f"{logits_rows} positions x {d_vocab} x 4 bytes", logits_rows * d_vocab * 4, "ask for fewer logits positions",
        ))
        plan["logits"] = {"positions": logits.positions, "max_rows": logits_rows}
    if request.sae:
        if saes is None or not saes.facts:
            raise PlanError("sae: this replica loaded no SAEs (engine option saes)")
        plan["sae"] = saes.wire(request, prompt_len, d_model, parts)
    if request.readouts:
        if readouts is None or d_vocab is None:
            raise ValueError("build_wire_plan: a request for readouts needs the replica's ReadoutCatalog and d_vocab")

        def armed(field_name: str, name: str) -> HookPoint:
            return _armed_point(field_name, name, n_layers, armed_kinds, absent=absent, moe=moe, same=same)

        plan["readouts"] = readouts.wire(request, prompt_len, n_layers, d_vocab, parts, armed)
    check_bytes(parts, request.n, max_capture_bytes)
    plan["edits"] = _wire_edits(request, prompt_len, n_layers, d_model, steer_kinds, steer_layers, edit_stages, absent,
                                head_shapes, moe, same)
    if max_set_edits is not None:
        _check_set_edits(request, max_set_edits)
    return plan


def check_bytes(parts: list[tuple[str, str, int, str]], n: int, max_capture_bytes: int) -> None:
    """What the worker holds for a request — activations and logits, for each of its n
    completions (each runs and captures in full; the first is returned) — against the cap."""
    total = sum(size for _, _, size, _ in parts) * n
    if total <= max_capture_bytes:
        return
    if len(parts) == 1:
        terms = f"{parts[0][1]} = {parts[0][2]} bytes"
    else:
        terms = " + ".join(f"{name}: {how} = {size} bytes" for name, how, size, _ in parts)
    if n > 1:
        terms = f"({terms}) x n={n} completions (each captures in full)"
    if n > 1 or len(parts) > 1:
        terms += f" = {total} bytes"
    fixes = [fix for _, _, _, fix in parts] + (["lower n"] if n > 1 else [])
    raise PlanError(
        f"{'/'.join(name for name, *_ in parts)}{'/n' if n > 1 else ''}: {terms}, over the replica's "
        f"max_capture_bytes={max_capture_bytes}; {', '.join(fixes)}"
    )


def _check_set_edits(request: GenerateRequest, max_set_edits: int) -> None:
    sets = [i for i, edit in enumerate(request.interventions) if edit.op == "set"]
    if len(sets) > max_set_edits:
        raise PlanError(
            f"interventions[{sets[max_set_edits]}]: {len(sets)} `set` interventions in one request; this "
            f"replica takes at most {max_set_edits} (engine option max_set_edits)"
        )


def _armed_point(
    field_name: str, name: str, n_layers: int, armed_kinds: set[str], option: str = "armed_kinds",
    absent: Mapping[str, str] | None = None, moe: MoeInfo | None = None, same: Mapping[str, str] | None = None,
) -> HookPoint:
    try:
        point = resolve_hook(name, n_layers)
    except ValueError as exc:
        raise PlanError(f"{field_name}: {exc}") from None
    if same and point.kind in same:
        point = HookPoint(point.layer, same[point.kind])  # type: ignore[arg-type]
    if absent and point.kind in absent:
        raise PlanError(f"{field_name}: hook {name!r} does not exist in this model: {absent[point.kind]}")
    if point.kind != "ln_final" and point.kind not in armed_kinds:
        raise PlanError(
            f"{field_name}: hook {name!r} is of kind {point.kind!r}, which this deployment has not "
            f"armed; armed kinds: {sorted(armed_kinds)} (engine option {option})"
        )
    if point.kind in ROUTER_KINDS and moe is not None and point.layer not in moe.layers:
        raise PlanError(f"{field_name}: layer {point.layer} of this model is dense (no router); the layers with a "
                        f"router are {moe.layers}")
    return point


def _wire_edits(
    request: GenerateRequest,
    prompt_len: int,
    n_layers: int,
    d_model: int,
    steer_kinds: set[str],
    steer_layers: set[int] | None,
    edit_stages: int,
    absent: Mapping[str, str],
    head_shapes: HeadShapes | None = None,
    moe: MoeInfo | None = None,
    same: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    edits: list[dict[str, Any]] = []
    # per hook, the edits so far: (stage, positions; None for a mode, which may select any row)
    placed: dict[HookPoint, list[tuple[int, set[int] | None]]] = {}
    for i, edit in enumerate(request.interventions):
        where = f"interventions[{i}]"
        if edit.vector_name is not None:
            raise PlanError(
                f"{where}.vector: {edit.vector_name!r} names a registered vector; the capserve app's Router puts "
                "registered vectors in place (serve_config `vectors`, POST /v1/vectors), an engine takes arrays only"
            )
        point = _armed_point(f"{where}.hook", edit.hook, n_layers, steer_kinds, "steer_kinds", absent, moe, same)
        if steer_layers is not None and point.layer not in steer_layers:
            raise PlanError(
                f"{where}.hook: layer {point.layer} of {edit.hook!r} does not accept interventions in this "
                f"deployment; steerable layers: {sorted(steer_layers)} (engine option steer_layers)"
            )
        check_positions(f"{where}.positions", edit.positions, prompt_len, request.max_tokens, repeats=True)
        if point.kind in HEAD_KINDS:
            vector, values, columns, factor = head_edit(where, edit, point.kind, head_shapes)
        else:
            vector, values, columns, factor = edit.vector, edit.values, None, edit.factor
            width = hook_width(point.kind, d_model, head_shapes, moe)
            what = "the router's n_experts" if point.kind in ROUTER_KINDS else "d_model"
            for name in ("vector", "values"):
                array = getattr(edit, name)
                if array is not None and array.shape[-1] != width:
                    raise PlanError(f"{where}.{name}: width {array.shape[-1]} does not match {what}={width}")
        gate = None if edit.when is None else _wire_gate(f"{where}.when", edit.when, point, hook_width(point.kind, d_model, head_shapes, moe))
        if values is not None and values.ndim == 2 and values.shape[0] != 1:
            needed = count_positions(edit.positions, prompt_len, request.max_tokens)
            if edit.positions in ("all", "generated"):
                raise PlanError(
                    f"{where}.values: positions={edit.positions!r} covers generated tokens, so values "
                    f"must be one row [d_model] broadcast to every position (got {values.shape[0]} rows)"
                )
            if values.shape[0] != needed:
                raise PlanError(
                    f"{where}.values: {values.shape[0]} rows but positions={edit.positions!r} "
                    f"selects {needed}; give one row per position or a single row to broadcast"
                )
        # A row takes one edit per stage, and stages run in order: an edit goes after every earlier
        # edit at its hook that may touch one of its rows, so edits at disjoint explicit positions
        # (a per-position add, one edit per row) share a stage.
        rows = None if isinstance(edit.positions, str) else set(absolute_indices(edit.positions, prompt_len).tolist())
        before = placed.setdefault(point, [])
        stage = 1 + max((s for s, other in before if rows is None or other is None or rows & other), default=-1)
        if stage >= edit_stages:
            raise PlanError(
                f"{where}: {stage + 1} edits at hook {edit.hook!r} may touch one position; this replica applies "
                f"at most {edit_stages} per hook at a position (engine option edit_stages); edits at disjoint "
                "explicit positions do not stack"
            )
        before.append((stage, rows))
        edits.append(
            {
                "layer": point.layer,
                "kind": point.kind,
                "stage": stage,
                "op": edit.op,
                "vector": None if vector is None else arrays.to_raw(vector),
                "values": None if values is None else arrays.to_raw(np.atleast_2d(values)),
                "columns": None if columns is None else arrays.to_raw(columns),
                "scale": edit.scale,
                "norm_match": edit.norm_match,
                "factor": factor,
                "min": edit.min,
                "max": edit.max,
                "gate": gate,
                "positions": edit.positions,
                "phase": edit.phase,
            }
        )
    return edits


def _wire_gate(where: str, when: Any, point: HookPoint, width: int) -> dict[str, Any]:
    """A resolved condition as the worker's test `x . vector + bias > threshold` (`below` flips all three)."""
    if when.vector is None:
        source = "probe" if when.probe is not None else "sae_id"
        raise PlanError(f"{where}.{source}: this replica resolves no {source}s (they need its engine options probes / saes)")
    if point.kind in HEAD_KINDS:
        raise PlanError(f"{where}: conditional steering reads a whole row; per-head hooks (q, k, v, z) are not served")
    if when.vector.shape[-1] != width:
        raise PlanError(f"{where}.vector: width {when.vector.shape[-1]} does not match the hook's {width}")
    sign = 1.0 if when.above is not None else -1.0
    return {"vector": arrays.to_raw(sign * when.vector.astype(np.float32)), "bias": sign * when.bias,
            "threshold": sign * when.threshold}


# ---------------------------------------------------------------- worker side


@dataclass
class EditPlan:
    site: tuple[int | None, str]
    stage: int
    op: str
    positions: Positions
    phase: str
    direction: np.ndarray | None = None  # unit vector for project_out and clamp (one per head at a per-head site); raw vector for add
    values: np.ndarray | None = None
    scale: float = 1.0
    norm_match: bool = False
    factor: float = 1.0
    columns: np.ndarray | None = None  # per-head sites: a factor per column (the head selector)
    lo: float = -math.inf  # clamp: the bounds of the component along `direction`
    hi: float = math.inf
    gate: tuple[np.ndarray, float, float] | None = None  # add only where x . vector + bias > threshold
    slot: int = 0  # assigned by the worker

    @property
    def vectorized(self) -> bool:
        """Range positions and no per-row values: the step loop selects its rows for every such
        request at once; the others go request by request (`offsets`)."""
        return self.op != "set" and mode_code(self.positions) != EXPLICIT

    def offsets(self, start: int, count: int, prompt_len: int) -> np.ndarray:
        """Offsets of the rows of a chunk this edit touches: its positions within its phase."""
        phase = selected_range(PHASE_MODES[self.phase], start, count, prompt_len)
        offsets = selected_offsets(self.positions, start, count, prompt_len)
        return offsets[(offsets >= phase[0]) & (offsets < phase[1])]


@dataclass
class CapturePlan:
    sites: list[tuple[int | None, str, str]]
    positions: Positions
    reduce: str
    dtype: str
    max_rows: int  # positions it can select: the size of its host buffer
    width: int = 0  # values per row: its widest hook's (narrower hooks are zero-padded); 0: d_model


@dataclass
class SaePlan:
    """One SAE spec of a request (replicas.sae.specs); `taken` counts the rows handed over so far."""

    sae_id: str
    hook: str
    top_k: int
    positions: Positions
    error: str  # none | norm | vector
    max_rows: int
    taken: int = 0

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> "SaePlan":
        return cls(wire["sae_id"], wire["hook"], int(wire["top_k"]), wire["positions"], wire["error"], int(wire["max_rows"]))


@dataclass
class RequestPlan:
    key: str
    prompt_len: int
    capture: CapturePlan | None
    logits_positions: Positions | None
    logits_rows: int = 0
    edits: list[EditPlan] = field(default_factory=list)
    sae: list[SaePlan] = field(default_factory=list)
    readouts: list[ReadoutPlan] = field(default_factory=list)

    @classmethod
    def from_wire(cls, wire: WirePlan) -> "RequestPlan":
        capture = wire.get("capture")
        logits = wire.get("logits")
        return cls(
            key=wire["key"],
            prompt_len=int(wire["prompt_len"]),
            capture=None if capture is None else CapturePlan(
                sites=[(layer, kind, name) for layer, kind, name in capture["sites"]],
                positions=capture["positions"],
                reduce=capture["reduce"],
                dtype=capture["dtype"],
                max_rows=int(capture["max_rows"]),
                width=int(capture.get("width", 0)),
            ),
            logits_positions=None if logits is None else logits["positions"],
            logits_rows=0 if logits is None else int(logits["max_rows"]),
            edits=[_edit_from_wire(e) for e in wire.get("edits", [])],
            sae=[SaePlan.from_wire(s) for s in wire.get("sae", [])],
            readouts=[ReadoutPlan.from_wire(r) for r in wire.get("readouts", [])],
        )


def _edit_from_wire(wire: dict[str, Any]) -> EditPlan:
    vector = None if wire["vector"] is None else arrays.from_raw(wire["vector"]).astype(np.float32)
    if wire["op"] in ("project_out", "clamp") and vector is not None and wire["kind"] not in HEAD_KINDS:
        vector = arrays.unit(vector)  # per-head kinds: one unit direction per head already (plans.heads.head_edit)
    return EditPlan(
        site=(wire["layer"], wire["kind"]),
        stage=int(wire["stage"]),
        op=wire["op"],
        positions=wire["positions"],
        phase=wire["phase"],
        direction=vector,
        values=None if wire["values"] is None else arrays.from_raw(wire["values"]).astype(np.float32),
        scale=float(wire["scale"]),
        norm_match=bool(wire["norm_match"]),
        factor=1.0 if wire["factor"] is None else float(wire["factor"]),
        columns=None if wire.get("columns") is None else arrays.from_raw(wire["columns"]).astype(np.float32),
        lo=-math.inf if wire.get("min") is None else float(wire["min"]),
        hi=math.inf if wire.get("max") is None else float(wire["max"]),
        gate=None if wire.get("gate") is None else (arrays.from_raw(wire["gate"]["vector"]).astype(np.float32),
                                                    float(wire["gate"]["bias"]), float(wire["gate"]["threshold"])),
    )

