"""TransformerLens's inspect protocol, spoken by the `capserve` provider.

TransformerLens 4.3 drives its own vLLM provider (`tl_bridge_vllm`) and its HF provider
(`tl_bridge`) from a `RemoteBridge`: every bridge forward is one inspect `generate` call with
`GenerateConfig(temperature=0, max_tokens=1, extra_body={"extra_args": {...}})`. The capserve
provider answers the same calls, so a TransformerLens bridge can run on a capserve fleet
(`provider.tl_bridge.boot_bridge`). This module translates; it imports neither TransformerLens
nor torch.

Request, `GenerateConfig.extra_body["extra_args"]` (no other extra_body key alongside it):

    input_ids       token ids of one sequence, fed as given (no chat template, no BOS added);
                    without them the sample's chat messages are rendered by the replica
    capture         wire keys "<layer>:<kind>": resid_pre, resid_mid, resid_post, attn_out, mlp_out
                    (and v, z, pattern where the deployment arms them)
    interventions   {wire key: {"op": "suppress" | "scale" | "add" | "set", "factor": float (scale),
                    "value": number, [width] or [n_positions, width] (add, set), "pos": int or
                    [int] (default: every position)}}
    return_logits   bool, default true
    attention_mask  all ones, or left out (capserve runs one unpadded sequence)

Answer, `ModelOutput.metadata`:

    activations     {wire key: {"data": base64, "dtype": "float32", "shape": [n_tokens, width]}}
                    (pattern: [n_heads, n_tokens, n_tokens], TransformerLens's axis order)
    tl_logits       {"data", "dtype": "float32", "shape": [n_tokens, d_vocab]}: the real logits at
                    every input position (not log-probs of the next token only, as tl_bridge_vllm
                    sends), so the bridge's loss works
    replica, request_id, activation_positions

The completion is the one greedy next token. The edit ops map onto capserve's: suppress is
`scale` by 0, scale is `scale`, add is `add` (a per-position value becomes one `add` per distinct
row, at disjoint positions, so all of them take one of the deployment's `edit_stages` edits per
hook), set is `set` (a scalar or a row is broadcast; on v and z over the flat heads x d_head row).
A position listed twice in `pos` is edited once, as TransformerLens's indexing does (a
per-position value: its last row for it). Bad input fails the call with an
`InvalidRequestError` naming the `extra_args` field and what is allowed; nothing reaches the replica.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replicas.api import arrays
from replicas.api.errors import InvalidRequestError

KEY = "extra_args"
FIELDS = ("input_ids", "capture", "interventions", "return_logits", "attention_mask")
OPS = {"suppress": ("op", "pos"), "scale": ("op", "factor", "pos"), "add": ("op", "value", "pos"), "set": ("op", "value", "pos")}
RESIDUAL_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
# capserve's q and k are taken after rotary (TransformerLens's hook_rot_q/rot_k); the protocol's
# "q"/"k" are the projections before it, so they are not offered.
HEAD_KINDS = ("v", "z", "pattern")
NOT_SERVED = {"q": "capserve's q is taken after rotary (hook_rot_q); the protocol's 'q' is before it",
              "k": "capserve's k is taken after rotary (hook_rot_k); the protocol's 'k' is before it",
              "attn_scores": "TransformerLens marks attention scores non-fireable on inspect providers"}


def requested(config: Any) -> bool:
    """Whether an inspect GenerateConfig carries a TransformerLens protocol call."""
    return KEY in (getattr(config, "extra_body", None) or {})


def served_kinds(armed_kinds: Sequence[str]) -> frozenset[str]:
    """The protocol kinds a deployment that arms `armed_kinds` answers."""
    return frozenset(k for k in armed_kinds if k in RESIDUAL_KINDS or k in HEAD_KINDS)


@dataclass(frozen=True)
class Edit:
    key: str
    op: str
    positions: list[int] | None  # None: every position
    factor: float | None = None
    value: np.ndarray | None = None  # float32, 0-D (a scalar), [width] or [n_positions, width]


@dataclass(frozen=True)
class TLCall:
    """One parsed protocol call: `request()` makes the capserve GenerateRequest, `metadata()` the answer."""

    input_ids: list[int] | None
    capture: list[str]
    edits: list[Edit] = field(default_factory=list)
    return_logits: bool = True

    @classmethod
    def parse(cls, config: Any) -> TLCall | None:
        """The call in `config.extra_body["extra_args"]`, checked for shape and type; None if there is none."""
        extra = dict(getattr(config, "extra_body", None) or {})
        if KEY not in extra:
            return None
        others = sorted(k for k in extra if k != KEY)
        if others:
            raise InvalidRequestError(
                f"extra_body: with {KEY} (TransformerLens's protocol) no other key is read; remove {others} "
                "or send capserve's own fields without extra_args"
            )
        args = extra[KEY]
        if not isinstance(args, Mapping):
            raise InvalidRequestError(f"{KEY}: expected a mapping with keys {', '.join(FIELDS)}, got {type(args).__name__}")
        unknown = sorted(set(args) - set(FIELDS))
        if unknown:
            raise InvalidRequestError(f"{KEY}: unknown key(s) {unknown}; allowed: {', '.join(FIELDS)}")
        ids = _input_ids(args.get("input_ids"))
        _attention_mask(args.get("attention_mask"), ids)
        want_logits = args.get("return_logits", True)
        if not isinstance(want_logits, (bool, np.bool_)):
            raise InvalidRequestError(f"{KEY}.return_logits: expected true or false, got {want_logits!r}")
        capture = _capture(args.get("capture"))
        edits = _edits(args.get("interventions"), ids)
        return cls(ids, capture, edits, bool(want_logits))

    def request(self, messages: list[dict[str, Any]], config: Any, info: Any) -> dict[str, Any]:
        """The capserve GenerateRequest (JSON-safe dict) for this call on the model `info` describes
        (a `ModelInfo`); `messages` (capserve chat messages) are the prompt when there are no input_ids."""
        served = served_kinds(info.armed_kinds)
        for where, key in [*((f"capture[{i}]", k) for i, k in enumerate(self.capture)),
                           *((f"interventions[{e.key!r}]", e.key) for e in self.edits)]:
            layer, kind = _split(key)
            if kind not in served:
                raise InvalidRequestError(
                    f"{KEY}.{where}: kind {kind!r} is not served by this deployment; served: {sorted(served)}"
                    + ("" if kind in RESIDUAL_KINDS or kind in HEAD_KINDS else " (set the engine's armed_kinds to add attention kinds)")
                )
            if not layer < info.n_layers:
                raise InvalidRequestError(f"{KEY}.{where}: layer {layer} out of range; the model has layers 0..{info.n_layers - 1}")
        request: dict[str, Any] = {
            "prompt": list(self.input_ids) if self.input_ids is not None else messages,
            "max_tokens": 1,
            "temperature": 0.0,
        }
        if getattr(config, "logprobs", None) or getattr(config, "top_logprobs", None) is not None:
            request["logprobs"] = getattr(config, "top_logprobs", None) or 0
        if self.capture:
            request["capture"] = {"hooks": list(self.capture), "positions": "prompt"}
        if self.return_logits:
            request["logits"] = {"positions": "prompt"}
        interventions = [i for edit in self.edits for i in _interventions(edit, info)]
        if interventions:
            request["interventions"] = interventions
        return request

    def metadata(self, result: Any) -> dict[str, Any]:
        """`ModelOutput.metadata` in the protocol's answer format for a capserve GenerateResult."""
        activations = {}
        for key in self.capture:
            array = np.asarray(result.activations[key], dtype=np.float32)
            if _split(key)[1] == "pattern":  # capserve: [q_pos, heads, k_pos]; the protocol: [heads, q_pos, k_pos]
                array = array.transpose(1, 0, 2)
            activations[key] = dict(arrays.to_base64(np.ascontiguousarray(array)))
        meta: dict[str, Any] = {
            "replica": result.replica,
            "request_id": result.request_id,
            "activations": activations,
            "activation_positions": list(result.positions),
        }
        if self.return_logits and result.logits is not None:
            meta["tl_logits"] = dict(arrays.to_base64(np.ascontiguousarray(result.logits, dtype=np.float32)))
        return meta


# ---------------------------------------------------------------- field checks


def _tolist(value: Any) -> Any:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    return value.tolist() if isinstance(value, np.ndarray) else value


def _input_ids(value: Any) -> list[int] | None:
    if value is None:
        return None
    ids = _tolist(value)
    if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
        ids = ids[0]  # one row of a [1, n] batch
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InvalidRequestError(
            f"{KEY}.input_ids: expected a non-empty list of token ids >= 0 (one sequence; batch size 1), got {value!r:.200}"
        )
    return ids


def _attention_mask(value: Any, ids: list[int] | None) -> None:
    if value is None:
        return
    mask = _tolist(value)
    if isinstance(mask, list) and len(mask) == 1 and isinstance(mask[0], list):
        mask = mask[0]
    if not isinstance(mask, list) or any(m != 1 for m in mask) or (ids is not None and len(mask) != len(ids)):
        raise InvalidRequestError(
            f"{KEY}.attention_mask: capserve runs one unpadded sequence; give a mask of all ones as long as "
            "input_ids, or leave it out (strip padding before the call)"
        )


def _split(key: str) -> tuple[int, str]:
    layer, _, kind = key.partition(":")
    return int(layer), kind


def _wire_key(key: Any, where: str) -> str:
    layer, sep, kind = str(key).partition(":") if isinstance(key, str) else ("", "", "")
    if not sep or not layer.isdigit() or not kind:
        raise InvalidRequestError(
            f"{KEY}.{where}: {key!r} is not a wire key; use '<layer>:<kind>' with kind in "
            f"{', '.join(RESIDUAL_KINDS + HEAD_KINDS)} (e.g. '1:resid_post')"
        )
    if kind in NOT_SERVED:
        raise InvalidRequestError(f"{KEY}.{where}: {key!r}: {NOT_SERVED[kind]}; served kinds: {', '.join(RESIDUAL_KINDS + HEAD_KINDS)}")
    if kind not in RESIDUAL_KINDS and kind not in HEAD_KINDS:
        raise InvalidRequestError(f"{KEY}.{where}: unknown kind {kind!r} in {key!r}; kinds: {', '.join(RESIDUAL_KINDS + HEAD_KINDS)}")
    return f"{int(layer)}:{kind}"


def _capture(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidRequestError(f"{KEY}.capture: expected a list of wire keys like ['1:resid_post'], got {value!r:.200}")
    keys: list[str] = []
    for i, key in enumerate(value):
        wire = _wire_key(key, f"capture[{i}]")
        if wire not in keys:
            keys.append(wire)
    return keys


def _positions(pos: Any, where: str, ids: list[int] | None) -> list[int] | None:
    if pos is None:
        return None
    items = [pos] if isinstance(pos, int) and not isinstance(pos, bool) else pos
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(p, int) and not isinstance(p, bool) for p in items):
        raise InvalidRequestError(f"{where}.pos: expected an int or a non-empty list of ints (sequence positions), got {pos!r}")
    positions = [int(p) for p in items]
    if ids is not None:
        n = len(ids)
        bad = [p for p in positions if not -n <= p < n]
        if bad:
            raise InvalidRequestError(f"{where}.pos: position(s) {bad} outside the {n} input tokens (allowed {-n}..{n - 1})")
        positions = [p % n for p in positions]
    return positions  # a position listed twice is edited once (capserve's positions), as TransformerLens's indexing does


def _value(value: Any, where: str) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().float().numpy()
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{where}.value: expected a number or an array of numbers, got {value!r:.200}") from None
    if array.ndim > 2 or array.size == 0:
        raise InvalidRequestError(f"{where}.value: expected a number, [width] or [n_positions, width], got shape {list(array.shape)}")
    if not np.isfinite(array).all():
        raise InvalidRequestError(f"{where}.value: NaN or infinite values; only finite numbers are allowed")
    return array


def _edits(value: Any, ids: list[int] | None) -> list[Edit]:
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{KEY}.interventions: expected a mapping of wire key to spec, got {type(value).__name__}")
    edits = []
    for raw_key, spec in value.items():
        where = f"{KEY}.interventions[{raw_key!r}]"
        key = _wire_key(raw_key, f"interventions[{raw_key!r}]")
        if not isinstance(spec, Mapping) or spec.get("op") not in OPS:
            op = spec.get("op") if isinstance(spec, Mapping) else spec
            raise InvalidRequestError(f"{where}: op {op!r} is not one of {', '.join(OPS)} (a spec is a dict with 'op')")
        op = spec["op"]
        extra = sorted(set(spec) - set(OPS[op]))
        if extra:
            raise InvalidRequestError(f"{where}: key(s) {extra} do not apply to op {op!r}; it takes {', '.join(OPS[op])}")
        positions = _positions(spec.get("pos"), where, ids)
        if op == "scale":
            factor = spec.get("factor")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
                raise InvalidRequestError(f"{where}.factor: op 'scale' needs a finite number, got {factor!r}")
            edits.append(Edit(key, op, positions, factor=float(factor)))
        elif op == "suppress":
            edits.append(Edit(key, op, positions))
        else:
            if "value" not in spec:
                raise InvalidRequestError(f"{where}.value: op {op!r} needs a value (a number, [width] or [n_positions, width])")
            array = _value(spec["value"], where)
            if array.ndim == 2:
                rows = len(positions) if positions is not None else len(ids) if ids is not None else None
                if rows is None:
                    raise InvalidRequestError(f"{where}.value: a per-position value needs pos or input_ids (to know the rows)")
                if array.shape[0] != rows:
                    raise InvalidRequestError(f"{where}.value: {array.shape[0]} rows for {rows} position(s); give one row per position")
            edits.append(Edit(key, op, positions, value=array))
    return edits


def _row_width(kind: str, info: Any) -> int:
    """Values per row at a protocol kind on the model `info` (a ModelInfo) describes: d_model, or
    the flat heads x d_head of v (the KV heads) and z."""
    if kind in RESIDUAL_KINDS:
        return info.d_model
    attention = info.attention
    if attention is None:
        raise InvalidRequestError(f"{KEY}.interventions: this replica reported no attention heads, so {kind!r} has no known width")
    return (attention.n_kv_heads if kind == "v" else attention.n_heads) * attention.d_head_v


def _interventions(edit: Edit, info: Any) -> list[dict[str, Any]]:
    """capserve Intervention dicts for one protocol edit (arrays in the base64 array format)."""
    positions: Any = edit.positions if edit.positions is not None else "prompt"
    base = {"hook": edit.key, "positions": positions}
    if edit.op == "suppress":
        return [{**base, "op": "scale", "factor": 0.0}]
    if edit.op == "scale":
        return [{**base, "op": "scale", "factor": edit.factor}]
    value = edit.value
    assert value is not None
    kind = _split(edit.key)[1]
    if value.ndim == 0:  # a number on every value of the row, the flat heads x d_head one on v and z too
        value = np.full(_row_width(kind, info), float(value), np.float32)
    width = value.shape[-1]
    if kind in RESIDUAL_KINDS and width != info.d_model:
        raise InvalidRequestError(f"{KEY}.interventions[{edit.key!r}].value: width {width}, the model's d_model is {info.d_model}")
    encode = lambda a: dict(arrays.to_base64(np.ascontiguousarray(a, dtype=np.float32)))
    if edit.op == "set":
        return [{**base, "op": "set", "values": encode(value)}]
    if value.ndim == 1:
        return [{**base, "op": "add", "vector": encode(value)}]
    # capserve's add takes one vector: one edit per distinct row, each at the positions that share it
    # (disjoint positions, so they take one of the deployment's `edit_stages`; each a row of its
    # `edit_slots`). A position listed twice takes its last row, as TransformerLens's
    # act[:, pos] = act[:, pos] + value assigns.
    last_rows = dict(zip(edit.positions if edit.positions is not None else range(len(value)), value))
    groups: dict[bytes, tuple[np.ndarray, list[int]]] = {}
    for p, row in last_rows.items():
        groups.setdefault(row.tobytes(), (row, []))[1].append(p)
    return [{**base, "op": "add", "vector": encode(row), "positions": rows} for row, rows in groups.values()]
