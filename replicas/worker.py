"""The vLLM worker side: hook sites installed before compilation, per-request bookkeeping per step.

`CaptureWorker` is vLLM's own worker class for the platform with one change: right after the
weights load (and before vLLM compiles the model and captures CUDA graphs) it installs the hook
sites. A worker *extension* cannot do this — vLLM only mixes it in as a base class after the
worker's own methods, so it never sees `load_model` — hence `worker_cls`. All methods and
attributes capserve adds carry the `capserve_` prefix; `collective_rpc("capserve_take", ...)` etc.

Per step (`_CaptureState.before_step` / `after_step`, run around the runner's model call):
before — read the step's request layout and write which rows each site edits into the static
buffers; after — gather the rows each request asked for from the staging buffers (on the device),
reduce, and keep them until the replica takes them.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replicas import _vllm, arrays
from replicas.hooks import LAYER_KINDS, HookPoint
from replicas.plans import PLAN_KEY, EditPlan, RequestPlan, position_mask, value_rows
from replicas.sites import Site

_CLOSED_KEYS_KEPT = 10_000
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class _Captured:
    """Rows kept for one request until the replica takes them."""

    plan: RequestPlan
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    positions: list[np.ndarray] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    logits: list[torch.Tensor] = field(default_factory=list)
    logits_positions: list[np.ndarray] = field(default_factory=list)
    logits_seen: set[int] = field(default_factory=set)
    slots: list[tuple[Site, int, int]] = field(default_factory=list)  # (site, stage, slot)
    finished: bool = False
    error: str | None = None


@dataclass
class _RowEdit:
    rows: np.ndarray  # rows of the step's flattened batch
    edit: EditPlan
    values: np.ndarray | None  # set: one value row per edited row


class _CaptureState:
    def __init__(self, runner: Any, options: dict[str, Any]):
        self.runner = runner
        self.layout = _vllm.model_layout(runner)
        self.device = _vllm.runner_device(runner)
        self.max_tokens = _vllm.max_num_tokens(runner)
        self.armed_kinds = list(options.get("armed_kinds") or LAYER_KINDS)
        self.edit_stages = int(options.get("edit_stages", 2))
        self.edit_slots = int(options.get("edit_slots", 64))
        model_dtype = next(runner.get_model().parameters()).dtype
        site_args = dict(
            d_model=self.layout.d_model,
            max_tokens=self.max_tokens,
            edit_slots=self.edit_slots + 1,
            dtype=model_dtype,
            device=self.device,
        )
        self.sites: dict[tuple[int | None, str], Site] = {}
        for layer in range(len(self.layout.layers)):
            for kind in self.armed_kinds:
                point = HookPoint(layer, kind)  # type: ignore[arg-type]
                self.sites[point] = Site(point, edit_stages=self.edit_stages, capture=True, **site_args)
        self.sites[HookPoint(None, "ln_final")] = Site(HookPoint(None, "ln_final"), edit_stages=0, capture=True, **site_args)
        self.eager = bool(options.get("eager", False))
        self._free_slots = {(id(s), st): list(range(self.edit_slots, 0, -1)) for s in self.sites.values() for st in range(s.edit_stages)}
        self.requests: dict[str, _Captured] = {}  # by vLLM's internal request id
        self.by_key: dict[str, list[str]] = {}
        self.closed_keys: dict[str, None] = {}  # insertion-ordered set of taken keys
        self._dirty_rows: dict[Site, int] = {}
        self._step: Any = None
        self.steps = 0
        self.rows_captured = 0
        self._install_hooks()
        _vllm.wrap_model_forward(runner, self.before_step, self.after_step)

    # ------------------------------------------------------------ hooks (traced into the graph)

    def _site(self, layer: int | None, kind: str) -> Site | None:
        return self.sites.get((layer, kind))

    def _install_hooks(self) -> None:
        layout = self.layout
        for i, layer in enumerate(layout.layers):
            for kind in self.armed_kinds:
                layer.add_module(f"capserve_{kind}", self.sites[(i, kind)])
            layer.register_forward_pre_hook(self._layer_pre_hook(i), with_kwargs=True)
            layer.register_forward_hook(self._layer_post_hook(i))
            layout.attention[i].register_forward_hook(self._attention_hook(i))
            layout.mlp[i].register_forward_hook(self._sublayer_hook(self._site(i, "mlp_out")))
        layout.final_norm.add_module("capserve_ln_final", self.sites[(None, "ln_final")])
        layout.final_norm.register_forward_hook(self._final_norm_hook(self.sites[(None, "ln_final")]))

    def _layer_pre_hook(self, i: int):
        layout, pre, mid = self.layout, self._site(i, "resid_pre"), self._site(i, "resid_mid")

        def hook(module, args, kwargs):
            if pre is None and mid is None:
                return None
            hidden, residual = _vllm.layer_inputs(layout, args, kwargs)
            value = hidden if residual is None else hidden + residual
            edited = value if pre is None else pre(value)
            module.capserve_resid_pre_value = edited  # read by the attention hook for resid_mid
            if pre is None or pre.edit_stages == 0:
                return None
            return _vllm.replace_layer_inputs(layout, args, kwargs, hidden + (edited - value), residual)

        return hook

    def _attention_hook(self, i: int):
        out_site, mid = self._site(i, "attn_out"), self._site(i, "resid_mid")
        layer = self.layout.layers[i]

        def hook(module, args, output):
            attn = output if out_site is None else out_site(output)
            if mid is not None:
                value = layer.capserve_resid_pre_value + attn
                attn = attn + (mid(value) - value)
            return attn

        return hook

    @staticmethod
    def _sublayer_hook(site: Site | None):
        def hook(module, args, output):
            return output if site is None else site(output)

        return hook

    def _layer_post_hook(self, i: int):
        site = self._site(i, "resid_post")

        def hook(module, args, output):
            if site is None:
                return output
            if isinstance(output, tuple):
                mlp_out, residual = output
                value = mlp_out + residual
                return (mlp_out + (site(value) - value), residual)
            return site(output)

        return hook

    @staticmethod
    def _final_norm_hook(site: Site):
        def hook(module, args, output):
            site(output[0] if isinstance(output, tuple) else output)
            return output

        return hook

    # ------------------------------------------------------------ per step, outside the graph

    def before_step(self) -> None:
        step = _vllm.step_layout(self.runner)
        self._step = step
        self.steps += 1
        self._release_finished()
        edits: dict[Site, list[_RowEdit]] = {}
        captured: set[Site] = set()
        for k, req_id in enumerate(step.req_ids):
            entry = self.requests.get(req_id) or self._admit(req_id)
            if entry is None or entry.error:
                continue
            plan = entry.plan
            if plan.capture is not None:
                captured.update(self.sites[(layer, kind)] for layer, kind, _ in plan.capture.sites)
            if plan.logits_positions is not None:
                captured.add(self.sites[(None, "ln_final")])
            lo, hi = int(step.offsets[k]), int(step.offsets[k + 1])
            positions = step.start_positions[k] + np.arange(hi - lo)
            for edit in plan.edits:
                mask = edit.row_mask(positions, plan.prompt_len)
                if not mask.any():
                    continue
                values = None
                if edit.op == "set":
                    values = edit.values[value_rows(edit.positions, positions[mask], plan.prompt_len, len(edit.values))]
                edits.setdefault(self.sites[edit.site], []).append(_RowEdit(lo + np.flatnonzero(mask), edit, values))
        if self.eager:
            for site in self.sites.values():
                site.run_capture = site in captured
                site.run_edits = site in edits
        self._write_edit_rows(edits, step.num_tokens)

    def _write_edit_rows(self, edits: dict[Site, list[_RowEdit]], num_tokens: int) -> None:
        """Point each edited row at its slot; reset the rows the previous step pointed."""
        for site in set(self._dirty_rows) | set(edits):
            previous = self._dirty_rows.pop(site, 0)
            site.slot[:, :previous] = 0
            site.set_stage[:previous] = -1
            if site not in edits:
                continue
            slot = np.zeros((site.edit_stages, num_tokens), dtype=np.int64)
            set_stage = np.full(num_tokens, -1, dtype=np.int64)
            for row_edit in edits[site]:
                slot[row_edit.edit.stage, row_edit.rows] = row_edit.edit.slot
                if row_edit.values is not None:
                    set_stage[row_edit.rows] = row_edit.edit.stage
                    site.values[torch.from_numpy(row_edit.rows).to(self.device)] = torch.from_numpy(
                        row_edit.values
                    ).to(self.device, site.values.dtype)
            site.slot[:, :num_tokens] = torch.from_numpy(slot).to(self.device, non_blocking=True)
            site.set_stage[:num_tokens] = torch.from_numpy(set_stage).to(self.device, non_blocking=True)
            self._dirty_rows[site] = num_tokens

    def after_step(self) -> None:
        step = self._step
        for k, req_id in enumerate(step.req_ids):
            entry = self.requests.get(req_id)
            if entry is None or entry.error:
                continue
            lo, hi = int(step.offsets[k]), int(step.offsets[k + 1])
            positions = step.start_positions[k] + np.arange(hi - lo)
            try:
                self._collect(entry, lo, positions)
            except Exception as exc:  # a failed capture fails its request, loudly, not the engine
                entry.error = f"capture failed in the worker: {type(exc).__name__}: {exc}"

    def _collect(self, entry: _Captured, lo: int, positions: np.ndarray) -> None:
        plan = entry.plan
        if plan.capture is not None:
            fresh = np.array([int(p) not in entry.seen for p in positions], dtype=bool)
            mask = position_mask(plan.capture.positions, positions, plan.prompt_len) & fresh
            if mask.any():
                rows = torch.from_numpy(lo + np.flatnonzero(mask)).to(self.device)
                dtype = TORCH_DTYPES[plan.capture.dtype]
                for layer, kind, name in plan.capture.sites:
                    picked = self.sites[(layer, kind)].staging.index_select(0, rows)
                    if plan.capture.reduce == "mean":
                        total = picked.float().sum(0)
                        entry.sums[name] = entry.sums[name] + total if name in entry.sums else total
                    else:
                        entry.rows.setdefault(name, []).append(picked.to(dtype))
                entry.positions.append(positions[mask])
                entry.seen.update(int(p) for p in positions[mask])
                self.rows_captured += int(mask.sum())
        if plan.logits_positions is not None:
            fresh = np.array([int(p) not in entry.logits_seen for p in positions], dtype=bool)
            mask = position_mask(plan.logits_positions, positions, plan.prompt_len) & fresh
            if mask.any():
                rows = torch.from_numpy(lo + np.flatnonzero(mask)).to(self.device)
                normed = self.sites[(None, "ln_final")].staging.index_select(0, rows)
                entry.logits.append(_vllm.compute_logits(self.runner, normed, self.layout.vocab_size))
                entry.logits_positions.append(positions[mask])
                entry.logits_seen.update(int(p) for p in positions[mask])

    # ------------------------------------------------------------ request lifecycle

    def _admit(self, req_id: str) -> _Captured | None:
        view = _vllm.request_view(self.runner, req_id)
        wire = view.extra_args.get(PLAN_KEY)
        if not wire:
            return None
        if wire["key"] in self.closed_keys:
            return None  # taken or cancelled while vLLM still ran it for a step
        entry = _Captured(plan=RequestPlan.from_wire(wire))
        self.requests[req_id] = entry
        self.by_key.setdefault(entry.plan.key, []).append(req_id)
        try:
            for edit in entry.plan.edits:
                self._assign_slot(entry, edit)
        except Exception as exc:
            entry.error = f"interventions could not be installed: {exc}"
            self._free(entry)
        return entry

    def _assign_slot(self, entry: _Captured, edit: EditPlan) -> None:
        site = self.sites[edit.site]
        free = self._free_slots[(id(site), edit.stage)]
        if not free:
            raise RuntimeError(f"all {self.edit_slots} edit slots of {site.point.canonical_name} are in use")
        edit.slot = slot = free.pop()
        stage = edit.stage
        dtype = site.add.dtype
        if edit.op == "project_out":
            site.proj[stage, slot] = torch.from_numpy(edit.direction).to(self.device, dtype)
        elif edit.op == "scale":
            site.factor[stage, slot] = edit.factor
        elif edit.op == "add":
            vector = edit.direction
            if edit.norm_match:
                site.add[stage, slot] = torch.from_numpy(vector / np.linalg.norm(vector)).to(self.device, dtype)
                site.norm_coef[stage, slot] = edit.scale
            else:
                site.add[stage, slot] = torch.from_numpy(vector * edit.scale).to(self.device, dtype)
                site.add_coef[stage, slot] = 1.0
        entry.slots.append((site, stage, slot))

    def _free(self, entry: _Captured) -> None:
        for site, stage, slot in entry.slots:
            site.proj[stage, slot] = 0
            site.factor[stage, slot] = 1
            site.add[stage, slot] = 0
            site.add_coef[stage, slot] = 0
            site.norm_coef[stage, slot] = 0
            self._free_slots[(id(site), stage)].append(slot)
        entry.slots.clear()

    def _release_finished(self) -> None:
        """Free the edit slots of requests vLLM has finished (their captures wait for `take`)."""
        for req_id, entry in self.requests.items():
            if not entry.finished and not _vllm.has_request(self.runner, req_id):
                entry.finished = True
                self._free(entry)

    def take(self, key: str) -> list[dict[str, Any]]:
        """Everything captured for the request(s) with this key, then forget them."""
        self.closed_keys[key] = None
        while len(self.closed_keys) > _CLOSED_KEYS_KEPT:
            self.closed_keys.pop(next(iter(self.closed_keys)))
        results = []
        for req_id in sorted(self.by_key.pop(key, [])):
            entry = self.requests.pop(req_id)
            self._free(entry)
            results.append(_result(entry))
        return results

    def stats(self) -> dict[str, Any]:
        held = sum(
            sum(t.numel() * t.element_size() for rows in e.rows.values() for t in rows) for e in self.requests.values()
        )
        return {"steps": self.steps, "rows_captured": self.rows_captured, "requests_held": len(self.requests), "bytes_held": held, "time": time.time()}


def _result(entry: _Captured) -> dict[str, Any]:
    """The wire form of one request's captures (bytes, dtypes and shapes; no pickle)."""
    positions = np.concatenate(entry.positions) if entry.positions else np.zeros(0, dtype=np.int64)
    order = np.argsort(positions, kind="stable")
    activations = {}
    if entry.plan.capture is not None:
        for _layer, _kind, name in entry.plan.capture.sites:
            if entry.plan.capture.reduce == "mean":
                total = entry.sums.get(name)
                mean = total / max(len(positions), 1) if total is not None else torch.zeros(0)
                activations[name] = arrays.to_raw(_to_numpy(mean.to(TORCH_DTYPES[entry.plan.capture.dtype])))
            else:
                rows = entry.rows.get(name)
                stacked = torch.cat(rows)[torch.from_numpy(order).to(rows[0].device)] if rows else torch.zeros(0)
                activations[name] = arrays.to_raw(_to_numpy(stacked))
    logits_positions = np.concatenate(entry.logits_positions) if entry.logits_positions else np.zeros(0, dtype=np.int64)
    logits = None
    if entry.logits:
        logits_order = torch.from_numpy(np.argsort(logits_positions, kind="stable"))
        logits = arrays.to_raw(_to_numpy(torch.cat(entry.logits)[logits_order.to(entry.logits[0].device)]))
    return {
        "positions": np.sort(positions).astype(np.int64).tolist(),
        "activations": activations,
        "logits": logits,
        "logits_positions": np.sort(logits_positions).astype(np.int64).tolist(),
        "error": entry.error,
    }


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(arrays.DTYPES["bfloat16"])
    return tensor.numpy()


class _CaptureWorkerMixin:
    """Methods capserve adds to vLLM's worker (all `capserve_`-prefixed)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        self.capserve_install()

    def capserve_install(self) -> None:
        options = _vllm.capserve_options(self.vllm_config)  # type: ignore[attr-defined]
        self.capserve_state = _CaptureState(_vllm.worker_runner(self), options)

    def capserve_take(self, key: str) -> list[dict[str, Any]]:
        return self.capserve_state.take(key)

    def capserve_stats(self) -> dict[str, Any]:
        return self.capserve_state.stats()


def __getattr__(name: str) -> type:
    """`replicas.worker.CaptureWorker` is built on first use from the platform's vLLM worker."""
    if name != "CaptureWorker":
        raise AttributeError(name)
    worker = type("CaptureWorker", (_CaptureWorkerMixin, _vllm.worker_base_class()), {"__module__": __name__})
    setattr(sys.modules[__name__], name, worker)
    return worker
