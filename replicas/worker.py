"""The vLLM worker side: hook sites installed before compilation, per-request bookkeeping per step.

`CaptureWorker` is vLLM's own worker class for the platform with one change: right after the
weights load (and before vLLM compiles the model and captures CUDA graphs) it installs the hook
sites. A worker *extension* cannot do this — vLLM only mixes it in as a base class after the
worker's own methods, so it never sees `load_model` — hence `worker_cls`. All methods and
attributes capserve adds carry the `capserve_` prefix; `collective_rpc("capserve_take", ...)` etc.

Per step (`_CaptureState.before_step` / `after_step`, run around the runner's model call):
before — read the step's request layout and point the rows each request edits at its slots in the
static buffers; after — gather the rows each request asked for from the staging buffers on the
device, reduce them there, and start their copy to host memory. Requests that capture and edit
nothing cost one set lookup per step.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from replicas import _vllm, arrays
from replicas.hooks import LAYER_KINDS, HookPoint
from replicas.plans import PLAN_KEY, EditPlan, RequestPlan, selected_offsets, value_rows
from replicas.sites import Site, identity_row, table_row

_CLOSED_KEYS_KEPT = 10_000
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class _Captured:
    """What one request asked for and what it has produced, until the replica takes it."""

    plan: RequestPlan
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    positions: list[np.ndarray] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    logits_positions: list[np.ndarray] = field(default_factory=list)
    # Rows below this position were already seen: a request recomputed after preemption
    # runs them again, and they must not be recorded twice.
    processed_upto: int = 0
    slots: list[tuple[Site, int, int]] = field(default_factory=list)  # (site, stage, slot)
    error: str | None = None

    @property
    def returns_data(self) -> bool:
        return self.plan.capture is not None or self.plan.logits_positions is not None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for rows in self.rows.values() for t in rows)


@dataclass
class _PendingCopy:
    """One step's gathered rows on their way to host memory."""

    event: Any  # CUDA event recorded after the copies; None on CPU
    tensors: list[torch.Tensor]
    parts: list[tuple[str, "_Captured", str, int, int, int]]  # (kind, entry, name, tensor, lo, hi)


@dataclass
class _RowEdit:
    rows: slice | np.ndarray  # rows of the step's flattened batch
    edit: EditPlan
    values: np.ndarray | None  # set: one value row per edited row


class _CaptureState:
    def __init__(self, runner: Any, options: dict[str, Any]):
        self.runner = runner
        self.layout = _vllm.model_layout(runner)
        self.device = _vllm.runner_device(runner)
        self.max_tokens = _vllm.max_num_tokens(runner)
        self.armed_kinds = list(options.get("armed_kinds") or LAYER_KINDS)
        steer_kinds = set(options.get("steer_kinds", self.armed_kinds))
        self.edit_stages = int(options.get("edit_stages", 1))
        self.edit_slots = int(options.get("edit_slots", 64))
        self.eager = bool(options.get("eager", False))
        self.spill_dir = options.get("spill_dir")  # large results go through shared memory
        model_dtype = next(runner.get_model().parameters()).dtype
        site_args = dict(
            d_model=self.layout.d_model, max_tokens=self.max_tokens, edit_slots=self.edit_slots + 1,
            dtype=model_dtype, device=self.device,
        )
        self.sites: dict[tuple[int | None, str], Site] = {}
        for layer in range(len(self.layout.layers)):
            for kind in self.armed_kinds:
                point = HookPoint(layer, kind)  # type: ignore[arg-type]
                stages = self.edit_stages if kind in steer_kinds else 0
                self.sites[point] = Site(point, edit_stages=stages, capture=True, **site_args)
        final = HookPoint(None, "ln_final")
        self.sites[final] = Site(final, edit_stages=0, capture=True, **site_args)
        self._free_slots = {
            (id(s), stage): list(range(self.edit_slots, 0, -1)) for s in self.sites.values() for stage in range(s.edit_stages)
        }
        self.requests: dict[str, _Captured] = {}  # by vLLM's internal request id
        self.by_key: dict[str, list[str]] = {}
        self.unplanned: set[str] = set()  # running requests that asked for nothing
        self.closed_keys: dict[str, None] = {}  # insertion-ordered set of taken keys
        self._dirty_rows: dict[Site, int] = {}
        self._pending: deque[_PendingCopy] = deque()
        self._step: _vllm.StepLayout | None = None
        self.steps = 0
        self.rows_captured = 0
        self.seconds = {"prepare": 0.0, "collect": 0.0, "take": 0.0}
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
                edited = mid(value)
                if mid.edit_stages:
                    attn = attn + (edited - value)
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
                edited = site(value)
                return (mlp_out + (edited - value), residual) if site.edit_stages else output
            return site(output)

        return hook

    @staticmethod
    def _final_norm_hook(site: Site):
        def hook(module, args, output):
            site(output[0] if isinstance(output, tuple) else output)
            return output

        return hook

    # ------------------------------------------------------------ per step, outside the graph

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - began

    def before_step(self) -> None:
        with self._timed("prepare"):
            self._prepare()

    def _prepare(self) -> None:
        step = _vllm.step_layout(self.runner)
        self._step = step
        self.steps += 1
        self.unplanned.intersection_update(step.req_ids)
        if self.requests:
            self._release_finished()
        edits: dict[Site, list[_RowEdit]] = {}
        captured: set[Site] = set()
        for k, req_id in enumerate(step.req_ids):
            if req_id in self.unplanned:
                continue
            entry = self.requests.get(req_id) or self._admit(req_id)
            if entry is None or entry.error:
                continue
            plan = entry.plan
            if self.eager:
                captured.update(self._captured_sites(plan))
            if not plan.edits:
                continue
            lo, start, count = step.chunk(k)
            for edit in plan.edits:
                rows = edit.offsets(start, count, plan.prompt_len)
                if isinstance(rows, slice):
                    if rows.start == rows.stop:
                        continue
                    rows = slice(lo + rows.start, lo + rows.stop)
                elif len(rows):
                    rows = lo + rows
                else:
                    continue
                values = None
                if edit.op == "set":
                    positions = start - lo + (np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows)
                    values = edit.values[value_rows(edit.positions, positions, plan.prompt_len, len(edit.values))]
                edits.setdefault(self.sites[edit.site], []).append(_RowEdit(rows, edit, values))
        if self.eager:  # compiled graphs never read these flags; eager mode skips idle sites
            for site in self.sites.values():
                site.run_capture = site in captured
                site.run_edits = site in edits
        if edits or self._dirty_rows:
            self._write_edit_rows(edits, step.num_tokens)

    def after_step(self) -> None:
        with self._timed("collect"):
            self._collect_step()

    def _captured_sites(self, plan: RequestPlan) -> list[Site]:
        sites = [self.sites[(layer, kind)] for layer, kind, _ in plan.capture.sites] if plan.capture else []
        if plan.logits_positions is not None:
            sites.append(self.sites[(None, "ln_final")])
        return sites

    def _write_edit_rows(self, edits: dict[Site, list[_RowEdit]], num_tokens: int) -> None:
        """Point each edited row at its slot; reset the rows the previous step pointed."""
        for site in set(self._dirty_rows) | set(edits):
            previous = self._dirty_rows.pop(site, 0)
            if site not in edits:
                site.slot[:, :previous] = 0
                site.set_stage[:previous] = -1
                continue
            width = max(previous, num_tokens)
            slot = np.zeros((site.edit_stages, width), dtype=np.int64)
            set_stage = np.full(width, -1, dtype=np.int64)
            for row_edit in edits[site]:
                slot[row_edit.edit.stage, row_edit.rows] = row_edit.edit.slot
                if row_edit.values is not None:
                    set_stage[row_edit.rows] = row_edit.edit.stage
                    site.values[row_edit.rows if isinstance(row_edit.rows, slice) else torch.from_numpy(row_edit.rows)] = (
                        torch.from_numpy(row_edit.values).to(self.device, site.values.dtype)
                    )
            site.slot[:, :width].copy_(torch.from_numpy(slot), non_blocking=True)
            site.set_stage[:width].copy_(torch.from_numpy(set_stage), non_blocking=True)
            self._dirty_rows[site] = num_tokens

    def _collect_step(self) -> None:
        """Gather what every request asked for in one index_select per hook, reduce on the
        device, and start one copy to host per hook; the rows reach their requests when the copy
        is done (`_drain`)."""
        step = self._step
        if not self.requests or step is None:
            return
        groups: dict[tuple, list[tuple[_Captured, str, np.ndarray]]] = {}
        for k, req_id in enumerate(step.req_ids):
            entry = self.requests.get(req_id)
            if entry is None or entry.error or not entry.returns_data:
                continue
            lo, start, count = step.chunk(k)
            fresh_from = max(entry.processed_upto - start, 0)
            entry.processed_upto = max(entry.processed_upto, start + count)
            plan = entry.plan
            if plan.capture is not None:
                offsets = selected_offsets(plan.capture.positions, start, count, plan.prompt_len)
                offsets = offsets[offsets >= fresh_from]
                if len(offsets):
                    entry.positions.append(start + offsets)
                    self.rows_captured += len(offsets)
                    for layer, kind, name in plan.capture.sites:
                        group = ("rows", layer, kind, plan.capture.dtype, plan.capture.reduce)
                        groups.setdefault(group, []).append((entry, name, lo + offsets))
            if plan.logits_positions is not None:
                offsets = selected_offsets(plan.logits_positions, start, count, plan.prompt_len)
                offsets = offsets[offsets >= fresh_from]
                if len(offsets):
                    entry.logits_positions.append(start + offsets)
                    groups.setdefault(("logits",), []).append((entry, "", lo + offsets))
        if groups:
            self._pending.append(self._gather(groups))
            self._drain(wait=self.device.type != "cuda")

    def _gather(self, groups: dict[tuple, list[tuple[_Captured, str, np.ndarray]]]) -> "_PendingCopy":
        parts: list[tuple[str, _Captured, str, int, int]] = []
        tensors: list[torch.Tensor] = []
        for group, members in groups.items():
            rows = torch.from_numpy(np.concatenate([m[2] for m in members])).to(self.device, non_blocking=True)
            if group[0] == "logits":
                normed = self.sites[(None, "ln_final")].staging.index_select(0, rows)
                picked, kind = _vllm.compute_logits(self.runner, normed, self.layout.vocab_size), "logits"
            else:
                _, layer, site_kind, dtype, reduce = group
                picked = self.sites[(layer, site_kind)].staging.index_select(0, rows)
                kind = "sum" if reduce == "mean" else "rows"
                if reduce == "mean":  # one summed row per request, reduced on the device
                    segments = np.repeat(np.arange(len(members)), [len(m[2]) for m in members])
                    summed = torch.zeros(len(members), picked.shape[1], dtype=torch.float32, device=self.device)
                    picked = summed.index_add_(0, torch.from_numpy(segments).to(self.device), picked.float())
                else:
                    picked = picked.to(TORCH_DTYPES[dtype])
            offset = 0
            for entry, name, member_rows in members:
                n = 1 if kind == "sum" else len(member_rows)
                parts.append((kind, entry, name, len(tensors), offset, offset + n))
                offset += n
            tensors.append(self._to_host(picked))
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return _PendingCopy(event, tensors, parts)

    def _drain(self, wait: bool) -> None:
        """Hand finished copies to their requests, oldest first (waiting for them if asked)."""
        while self._pending:
            pending = self._pending[0]
            if pending.event is not None and not pending.event.query():
                if not wait:
                    return
                pending.event.synchronize()
            self._pending.popleft()
            for kind, entry, name, index, lo, hi in pending.parts:
                host = pending.tensors[index][lo:hi]
                if kind == "logits":
                    entry.logits.append(host.clone())
                elif kind == "sum":
                    entry.sums[name] = entry.sums[name] + host[0] if name in entry.sums else host[0].clone()
                else:
                    entry.rows.setdefault(name, []).append(host.clone())

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return tensor
        # pinned, so the copy overlaps the next step; the caching host allocator reuses the
        # block once `_drain` has cloned the rows out of it
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    # ------------------------------------------------------------ request lifecycle

    def _admit(self, req_id: str) -> _Captured | None:
        wire = _vllm.request_extra_args(self.runner, req_id).get(PLAN_KEY)
        if not wire or wire["key"] in self.closed_keys:  # closed: taken or cancelled already
            self.unplanned.add(req_id)
            return None
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
        edit.slot = free.pop()
        site.table[edit.stage, edit.slot] = torch.from_numpy(table_row(edit, site.d_model)).to(self.device, site.table.dtype)
        entry.slots.append((site, edit.stage, edit.slot))

    def _free(self, entry: _Captured) -> None:
        for site, stage, slot in entry.slots:
            site.table[stage, slot] = torch.from_numpy(identity_row(site.d_model)).to(self.device, site.table.dtype)
            self._free_slots[(id(site), stage)].append(slot)
        entry.slots.clear()

    def _release_finished(self) -> None:
        """Free the edit slots of requests vLLM has finished; forget those that return nothing
        (their captures, if any, wait for `take`)."""
        for req_id in [r for r in self.requests if not _vllm.has_request(self.runner, r)]:
            entry = self.requests[req_id]
            self._free(entry)
            if not entry.returns_data:
                self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        entry = self.requests.pop(req_id)
        siblings = self.by_key.get(entry.plan.key, [])
        if req_id in siblings:
            siblings.remove(req_id)
        if not siblings:
            self.by_key.pop(entry.plan.key, None)

    def take(self, key: str) -> list[dict[str, Any]]:
        """What the request with this key captured — from its first completion when n > 1, as
        GenerateRequest.n documents — then forget every completion of it."""
        with self._timed("take"):
            self.closed_keys[key] = None
            while len(self.closed_keys) > _CLOSED_KEYS_KEPT:
                self.closed_keys.pop(next(iter(self.closed_keys)))
            self._drain(wait=True)
            entries = [self.requests.pop(req_id) for req_id in sorted(self.by_key.pop(key, []))]
            for entry in entries:
                self._free(entry)
            return [_result(entries[0], self._spill_path(key))] if entries else []

    def _spill_path(self, key: str) -> Callable[[str], str] | None:
        if not self.spill_dir:
            return None
        numbers = itertools.count()
        return lambda name: os.path.join(self.spill_dir, f"{key}-{next(numbers)}.bin")

    def stats(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "rows_captured": self.rows_captured,
            "requests_held": len(self.requests),
            "bytes_held": sum(e.nbytes() for e in self.requests.values()),
            "seconds": dict(self.seconds),  # worker time outside the forward, for profiling
            "time": time.time(),
        }


SPILL_BYTES = 64 << 10


def _result(entry: _Captured, spill_path: Callable[[str], str] | None) -> dict[str, Any]:
    """The wire form of one request's captures: dtype, shape and bytes (no pickle), or for large
    arrays a shared-memory file the replica reads and deletes. Rows arrive in position order:
    chunks run in order and re-run rows are skipped."""

    def encode(name: str, array: np.ndarray) -> dict[str, Any]:
        if spill_path is not None and array.nbytes >= SPILL_BYTES:
            return arrays.to_file(array, spill_path(name))
        return dict(arrays.to_raw(array))

    positions = np.concatenate(entry.positions).tolist() if entry.positions else []
    activations = {}
    capture = entry.plan.capture
    for _layer, _kind, name in capture.sites if capture is not None else ():
        if capture.reduce == "mean":
            total = entry.sums.get(name, torch.zeros(0))
            array = (total / max(len(positions), 1)).to(TORCH_DTYPES[capture.dtype])
        else:
            array = torch.cat(entry.rows[name]) if name in entry.rows else torch.zeros(0, dtype=TORCH_DTYPES[capture.dtype])
        activations[name] = encode(name, _to_numpy(array))
    return {
        "positions": positions,
        "activations": activations,
        "logits": encode("logits", _to_numpy(torch.cat(entry.logits))) if entry.logits else None,
        "logits_positions": np.concatenate(entry.logits_positions).tolist() if entry.logits_positions else [],
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

    def capserve_take(self, keys: list[str]) -> dict[str, list[dict[str, Any]]]:
        return {key: self.capserve_state.take(key) for key in keys}

    def capserve_stats(self) -> dict[str, Any]:
        return self.capserve_state.stats()


def __getattr__(name: str) -> type:
    """`replicas.worker.CaptureWorker` is built on first use from the platform's vLLM worker."""
    if name != "CaptureWorker":
        raise AttributeError(name)
    worker = type("CaptureWorker", (_CaptureWorkerMixin, _vllm.worker_base_class()), {"__module__": __name__})
    setattr(sys.modules[__name__], name, worker)
    return worker
