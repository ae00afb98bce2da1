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
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replicas import _vllm
from replicas.hooks import LAYER_KINDS, HookPoint
from replicas.outbox import Outbox, RequestBuffers, StepRows
from replicas.plans import (
    EXPLICIT,
    PHASE_MODES,
    PLAN_KEY,
    EditPlan,
    RequestPlan,
    concatenated_ranges,
    mode_code,
    selected_offsets,
    selected_spans,
    value_rows,
)
from replicas.sites import Site, table_row

_CLOSED_KEYS_KEPT = 10_000
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


UNPLANNED = -2  # handle of a running request that asked for nothing
NEW = -1  # a request the worker has not seen yet
NO_LOGITS = -9


@dataclass
class _Entry:
    """What one request asked for, until the replica takes its result."""

    plan: RequestPlan
    name: str  # unique among the worker's requests: names its result files
    handle: int
    buffers: RequestBuffers | None  # None when it captures nothing
    slots: list[tuple[int, int, bytes]] = field(default_factory=list)  # (site id, stage, table row) it holds
    finishing: bool = False
    error: str | None = None


class _Columns:
    """Per-request integers the step loop reads for a whole batch with one numpy gather: row h
    belongs to the request with handle h; the last row keeps every column's neutral value and
    stands for requests without a plan."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.free = list(range(capacity - 1, -1, -1))
        self.columns: dict[str, np.ndarray] = {}
        self.neutral: dict[str, int] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def add(self, name: str, neutral: int = 0) -> None:
        self.columns[name] = np.full(self.capacity + 1, neutral, np.int64)
        self.neutral[name] = neutral

    def allocate(self) -> int:
        if not self.free:
            self._grow()
        return self.free.pop()

    def reset(self, handle: int) -> None:
        for name, column in self.columns.items():
            column[handle] = self.neutral[name]

    def release(self, handle: int) -> None:
        self.reset(handle)
        self.free.append(handle)

    def rows(self, handles: np.ndarray) -> np.ndarray:
        return np.where(handles >= 0, handles, self.capacity)

    def _grow(self) -> None:
        grown = 2 * self.capacity
        for name, column in self.columns.items():
            wider = np.full(grown + 1, self.neutral[name], np.int64)
            wider[: self.capacity] = column[: self.capacity]
            self.columns[name] = wider
        self.free.extend(range(grown - 1, self.capacity - 1, -1))
        self.capacity = grown


@dataclass
class _Batch:
    """The step's layout and, per request, its row in `_Columns`."""

    step: _vllm.StepLayout
    rows: np.ndarray

    @property
    def first_rows(self) -> np.ndarray:
        return self.step.offsets[:-1]

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.step.offsets)


@dataclass
class _Selection:
    """Rows of a step picked for a set of requests: request i owns rows[offsets[i]:][:counts[i]]."""

    requests: list[_Entry]
    rows: np.ndarray  # rows of the step's flattened batch
    offsets: np.ndarray
    counts: np.ndarray
    dests: np.ndarray  # where request i's rows go in its buffer


def _fill_ranges(row: np.ndarray, starts: np.ndarray, ends: np.ndarray, values: np.ndarray) -> None:
    """row[s:e] = v for disjoint ranges, in one pass (a difference array)."""
    steps = np.zeros(len(row) + 1, np.int64)
    np.add.at(steps, starts, values)
    np.add.at(steps, ends, -values)
    row += np.cumsum(steps[:-1])


class _CaptureState:
    def __init__(self, runner: Any, options: dict[str, Any]):
        self.runner = runner
        self.layout = _vllm.model_layout(runner)
        self.device = _vllm.runner_device(runner)
        self.max_tokens = _vllm.max_num_tokens(runner)
        self.armed_kinds = list(options.get("armed_kinds") or LAYER_KINDS)
        steer_kinds = set(options.get("steer_kinds", self.armed_kinds))
        steer_layers = options.get("steer_layers")
        self.edit_stages = int(options.get("edit_stages", 1))
        self.edit_slots = int(options.get("edit_slots", 64))
        self.eager = bool(options.get("eager", False))
        model_dtype = next(runner.get_model().parameters()).dtype
        site_args = dict(
            d_model=self.layout.d_model, max_tokens=self.max_tokens, edit_slots=self.edit_slots + 1,
            dtype=model_dtype, device=self.device,
        )
        self.sites: dict[tuple[int | None, str], Site] = {}
        for layer in range(len(self.layout.layers)):
            for kind in self.armed_kinds:
                point = HookPoint(layer, kind)  # type: ignore[arg-type]
                steered = kind in steer_kinds and (steer_layers is None or layer in steer_layers)
                stages = self.edit_stages if steered else 0
                self.sites[point] = Site(point, edit_stages=stages, capture=True, **site_args)
        final = HookPoint(None, "ln_final")
        self.sites[final] = Site(final, edit_stages=0, capture=True, **site_args)
        self._free_slots = {
            (id(s), stage): list(range(self.edit_slots, 0, -1)) for s in self.sites.values() for stage in range(s.edit_stages)
        }
        self._slot_users: dict[tuple[int, int, bytes], list[int]] = {}  # table row content -> [slot, requests]
        self.columns = _Columns()
        for name, neutral in (
            ("prompt_len", 0), ("seen", 0), ("group", -1), ("positions", 0), ("logits", NO_LOGITS), ("fallback", 0),
            ("rows_taken", 0), ("logits_taken", 0),  # rows handed over so far, where the next ones go
        ):
            self.columns.add(name, neutral)
        self.lanes: dict[tuple[Site, int], str] = {}  # (site, stage) -> prefix of its edit columns
        self.groups: dict[tuple, int] = {}  # (hooks, dtype, reduce) -> capture group
        self.group_sites: list[tuple[list[Site], str, str]] = []
        self.handle_of: dict[str, int] = {}  # vLLM request id -> handle (or UNPLANNED)
        self.entry_at: dict[int, _Entry] = {}
        self.requests: dict[str, _Entry] = {}  # by vLLM request id, until taken
        self.by_key: dict[str, list[str]] = {}
        self.closed_keys: dict[str, None] = {}  # insertion-ordered set of taken keys
        self.names = itertools.count()
        self._dirty_rows: dict[Site, int] = {}
        self._batch: _Batch | None = None
        self.outbox = Outbox(options.get("spill_dir"), self.layout.d_model)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
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

    def after_step(self) -> None:
        with self._timed("collect"):
            self._collect_step()

    def _prepare(self) -> None:
        """Admit the step's new requests and point the rows each request edits at its slots."""
        step = _vllm.step_layout(self.runner)
        self.steps += 1
        self._release_finished()
        handles = np.fromiter((self.handle_of.get(r, NEW) for r in step.req_ids), np.int64, len(step.req_ids))
        for k in np.flatnonzero(handles == NEW).tolist():
            handles[k] = self._admit(step.req_ids[k])
        batch = self._batch = _Batch(step, self.columns.rows(handles))
        if not self.requests:
            slots, sets = {}, {}
        else:
            slots, sets = self._edit_slots(batch)
        if self.eager:  # compiled graphs never read these flags; eager mode skips idle sites
            captured = self._captured_sites(batch)
            for site in self.sites.values():
                site.run_capture = site in captured
                site.run_edits = site in slots
        if slots or self._dirty_rows:
            self._write_edit_rows(slots, sets, step.num_tokens)

    def _edit_slots(self, batch: _Batch) -> tuple[dict[Site, np.ndarray], dict[Site, list[tuple[int, np.ndarray, np.ndarray]]]]:
        """Per steered site, the slot of every row of the step and stage ([stages, tokens]); and
        the `set` values to write (stage, rows, values)."""
        step, columns = batch.step, self.columns
        first, counts, start = batch.first_rows, batch.counts, step.start_positions
        prompt_len = columns["prompt_len"][batch.rows]
        slots: dict[Site, np.ndarray] = {}
        for (site, stage), lane in self.lanes.items():
            slot = columns[lane + "slot"][batch.rows]
            k = np.flatnonzero(slot)
            if not len(k):
                continue
            rows = batch.rows[k]
            args = (start[k], counts[k], prompt_len[k])
            a, b = selected_spans(columns[lane + "positions"][rows], *args)
            phase_a, phase_b = selected_spans(columns[lane + "phase"][rows], *args)
            a = np.maximum(a, phase_a)
            b = np.maximum(np.minimum(b, phase_b), a)
            table = slots.setdefault(site, np.zeros((site.edit_stages, step.num_tokens), np.int64))
            _fill_ranges(table[stage], first[k] + a, first[k] + b, slot[k])
        sets: dict[Site, list[tuple[int, np.ndarray, np.ndarray]]] = {}
        for k in np.flatnonzero(columns["fallback"][batch.rows]).tolist():
            entry = self.entry_at[int(batch.rows[k])]
            lo, start_k, count = step.chunk(k)
            for edit in entry.plan.edits:
                if edit.vectorized:
                    continue
                offsets = edit.offsets(start_k, count, entry.plan.prompt_len)
                if not len(offsets):
                    continue
                site = self.sites[edit.site]
                table = slots.setdefault(site, np.zeros((site.edit_stages, step.num_tokens), np.int64))
                table[edit.stage, lo + offsets] = edit.slot
                if edit.op == "set":
                    values = edit.values[value_rows(edit.positions, start_k + offsets, entry.plan.prompt_len, len(edit.values))]
                    sets.setdefault(site, []).append((edit.stage, lo + offsets, values))
        return slots, sets

    def _write_edit_rows(
        self, slots: dict[Site, np.ndarray], sets: dict[Site, list[tuple[int, np.ndarray, np.ndarray]]], num_tokens: int
    ) -> None:
        """Copy each steered site's row slots to the device; reset the rows the previous step
        pointed at for sites no longer steered."""
        for site in set(self._dirty_rows) | set(slots):
            previous = self._dirty_rows.pop(site, 0)
            if site not in slots:
                site.slot[:, :previous] = 0
                site.set_stage[:previous] = -1
                continue
            width = max(previous, num_tokens)
            slot = np.zeros((site.edit_stages, width), dtype=np.int64)
            slot[:, :num_tokens] = slots[site]
            set_stage = np.full(width, -1, dtype=np.int64)
            for stage, rows, values in sets.get(site, ()):
                set_stage[rows] = stage
                site.values[torch.from_numpy(rows)] = torch.from_numpy(values).to(self.device, site.values.dtype)
            site.slot[:, :width].copy_(torch.from_numpy(slot), non_blocking=True)
            site.set_stage[:width].copy_(torch.from_numpy(set_stage), non_blocking=True)
            self._dirty_rows[site] = num_tokens

    def _captured_sites(self, batch: _Batch) -> set[Site]:
        groups = np.unique(self.columns["group"][batch.rows])
        sites = {site for g in groups.tolist() if g >= 0 for site in self.group_sites[g][0]}
        if (self.columns["logits"][batch.rows] != NO_LOGITS).any():
            sites.add(self.sites[(None, "ln_final")])
        return sites

    def _collect_step(self) -> None:
        """Pick the rows every request asked for — one index_select per hook and group of
        requests — reduce them on the device and start one copy to host per group; the outbox
        thread files them per request once the copy is done."""
        batch = self._batch
        if batch is None or not self.requests:
            return
        columns = self.columns
        group = columns["group"][batch.rows]
        logits_mode = columns["logits"][batch.rows]
        k = np.flatnonzero((group >= 0) | (logits_mode != NO_LOGITS))
        if not len(k):
            return
        rows = batch.rows[k]
        start, counts = batch.step.start_positions[k], batch.counts[k]
        # rows below `seen` were recorded already: a request recomputed after preemption runs them again
        fresh_from = np.maximum(columns["seen"][rows] - start, 0)
        columns["seen"][rows] = np.maximum(columns["seen"][rows], start + counts)
        chunks = (rows, batch.first_rows[k], start, counts, columns["prompt_len"][rows], fresh_from)
        for g in np.unique(group[k]).tolist():
            if g >= 0:
                picked = group[k] == g
                selection = self._select([c[picked] for c in chunks], columns["positions"][rows[picked]], "capture")
                if selection is not None:
                    self._hand_over("rows", self._gather_group(g, selection), selection)
        picked = logits_mode[k] != NO_LOGITS
        if picked.any():
            selection = self._select([c[picked] for c in chunks], logits_mode[k][picked], "logits")
            if selection is not None:
                normed = self.sites[(None, "ln_final")].staging.index_select(0, self._to_device(selection.rows))
                logits = _vllm.compute_logits(self.runner, normed, self.layout.vocab_size)
                self._hand_over("logits", logits.unsqueeze(0), selection)

    def _select(self, chunks: list[np.ndarray], modes: np.ndarray, what: str) -> _Selection | None:
        """The rows a set of requests selects in this step: position modes for all at once,
        explicit indices request by request."""
        rows, first, start, counts, prompt_len, fresh_from = chunks
        a, b = selected_spans(modes, start, counts, prompt_len)
        a = np.maximum(a, fresh_from)
        lengths = np.maximum(b - a, 0)
        explicit = modes == EXPLICIT
        lengths[explicit] = 0
        keep = np.flatnonzero(lengths)
        handles = [rows[keep]]
        picked_rows = [concatenated_ranges(first[keep] + a[keep], lengths[keep])]
        counts_out = [lengths[keep]]
        for i in np.flatnonzero(explicit).tolist():
            entry = self.entry_at[int(rows[i])]
            spec = entry.plan.capture.positions if what == "capture" else entry.plan.logits_positions
            offsets = selected_offsets(spec, int(start[i]), int(counts[i]), int(prompt_len[i]))
            offsets = offsets[offsets >= fresh_from[i]]
            if len(offsets):
                handles.append(rows[i : i + 1])
                picked_rows.append(first[i] + offsets)
                counts_out.append(np.array([len(offsets)]))
        picked = np.concatenate(handles)
        if not len(picked):
            return None
        counts_all = np.concatenate(counts_out)
        taken = self.columns["rows_taken" if what == "capture" else "logits_taken"]
        dests = taken[picked]
        taken[picked] += counts_all
        self.rows_captured += int(counts_all.sum()) if what == "capture" else 0
        offsets = np.cumsum(counts_all) - counts_all
        entries = [self.entry_at[h] for h in picked.tolist()]
        return _Selection(entries, np.concatenate(picked_rows), offsets, counts_all, dests)

    def _gather_group(self, group: int, selection: _Selection) -> torch.Tensor:
        """[hooks, rows, d] in the capture dtype, or [hooks, requests, d] float32 sums for reduce=mean."""
        sites, dtype, reduce = self.group_sites[group]
        rows = self._to_device(selection.rows)
        picked = torch.stack([site.staging.index_select(0, rows) for site in sites])
        if reduce != "mean":
            return picked.to(TORCH_DTYPES[dtype])
        segments = self._to_device(np.repeat(np.arange(len(selection.counts)), selection.counts))
        summed = torch.zeros(len(sites), len(selection.counts), picked.shape[-1], dtype=torch.float32, device=self.device)
        return summed.index_add_(1, segments, picked.float())

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _hand_over(self, kind: str, picked: torch.Tensor, selection: _Selection) -> None:
        """Start the copy to host on a side stream (the next step does not wait for it) into
        pinned memory, and queue it for the outbox thread."""
        event = None
        if self.copy_stream is None:
            host = picked
        else:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
                host.copy_(picked, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            picked.record_stream(self.copy_stream)  # its memory is not reused before the copy ends
        buffers = [entry.buffers for entry in selection.requests]
        self.outbox.put(StepRows(kind, host, event, buffers, selection.offsets, selection.counts, selection.dests))

    # ------------------------------------------------------------ request lifecycle

    def _admit(self, req_id: str) -> int:
        wire = _vllm.request_extra_args(self.runner, req_id).get(PLAN_KEY)
        if not wire or wire["key"] in self.closed_keys:  # closed: taken or cancelled already
            self.handle_of[req_id] = UNPLANNED
            return UNPLANNED
        plan = RequestPlan.from_wire(wire)
        returns_data = plan.capture is not None or plan.logits_positions is not None
        buffers = RequestBuffers.for_plan(plan, self.layout.d_model, self.layout.vocab_size, self.outbox.arena_layout) if returns_data else None
        handle = self.columns.allocate()
        entry = _Entry(plan, f"{plan.key}-{next(self.names)}", handle, buffers)
        self.requests[req_id] = entry
        self.by_key.setdefault(plan.key, []).append(req_id)
        self.handle_of[req_id] = handle
        self.entry_at[handle] = entry
        columns = self.columns
        columns["prompt_len"][handle] = plan.prompt_len
        if plan.capture is not None:
            columns["group"][handle] = self._group(plan.capture)
            columns["positions"][handle] = mode_code(plan.capture.positions)
        if plan.logits_positions is not None:
            columns["logits"][handle] = mode_code(plan.logits_positions)
        try:
            for edit in plan.edits:
                self._assign_slot(entry, edit)
        except Exception as exc:
            entry.error = f"interventions could not be installed: {exc}"
            self._free_slots_of(entry)
            # it runs unsteered and captures nothing: no row may point at slots it gave back
            columns.reset(handle)
            columns["prompt_len"][handle] = plan.prompt_len
            entry.buffers = None
        return handle

    def _group(self, capture: Any) -> int:
        signature = (tuple((layer, kind) for layer, kind, _ in capture.sites), capture.dtype, capture.reduce)
        if signature not in self.groups:
            self.groups[signature] = len(self.group_sites)
            self.group_sites.append(([self.sites[site] for site in signature[0]], capture.dtype, capture.reduce))
        return self.groups[signature]

    def _assign_slot(self, entry: _Entry, edit: EditPlan) -> None:
        """Point the edit at a table row holding its op; requests with the same op (one steering
        vector across an eval) share the row, so most admissions write nothing to the device."""
        site = self.sites[edit.site]
        row = table_row(edit, site.d_model)
        content = (id(site), edit.stage, row.tobytes())
        shared = self._slot_users.get(content)
        if shared is None:
            free = self._free_slots[(id(site), edit.stage)]
            if not free:
                raise RuntimeError(f"all {self.edit_slots} edit slots of {site.point.canonical_name} are in use")
            shared = self._slot_users[content] = [free.pop(), 0]
            # non_blocking: a blocking copy would wait for the step in flight on the GPU
            site.table[edit.stage, shared[0]].copy_(torch.from_numpy(row), non_blocking=True)
        shared[1] += 1
        edit.slot = shared[0]
        entry.slots.append(content)
        if not edit.vectorized:
            self.columns["fallback"][entry.handle] = 1
            return
        lane = self.lanes.get((site, edit.stage))
        if lane is None:
            lane = self.lanes[(site, edit.stage)] = f"lane{len(self.lanes)}."
            for name in ("slot", "positions", "phase"):
                self.columns.add(lane + name)
        self.columns[lane + "slot"][entry.handle] = edit.slot
        self.columns[lane + "positions"][entry.handle] = mode_code(edit.positions)
        self.columns[lane + "phase"][entry.handle] = mode_code(PHASE_MODES[edit.phase])

    def _free_slots_of(self, entry: _Entry) -> None:
        """Give back the entry's table rows; a row no request uses returns to the free list (it is
        rewritten when next handed out, and no row of a step points at it meanwhile)."""
        for content in entry.slots:
            shared = self._slot_users[content]
            shared[1] -= 1
            if shared[1] == 0:
                del self._slot_users[content]
                self._free_slots[content[:2]].append(shared[0])
        entry.slots.clear()

    def _retire(self, req_id: str, entry: _Entry) -> None:
        """The request will run no more steps: free its slots and handle, queue its result."""
        if entry.finishing:
            return
        if entry.buffers is not None:
            entry.buffers.n_rows, entry.buffers.n_logits = self._taken(entry)
        entry.finishing = True
        self._free_slots_of(entry)
        self.handle_of.pop(req_id, None)
        self.entry_at.pop(entry.handle, None)
        self.columns.release(entry.handle)
        if entry.buffers is not None and entry.error is None:
            self.outbox.finish(entry.name, entry.buffers)

    def _taken(self, entry: _Entry) -> tuple[int, int]:
        """Rows and logits rows handed over for the entry so far."""
        if entry.finishing:
            return entry.buffers.n_rows, entry.buffers.n_logits
        return int(self.columns["rows_taken"][entry.handle]), int(self.columns["logits_taken"][entry.handle])

    def _release_finished(self) -> None:
        """Retire the requests vLLM has finished; forget those that return nothing (the others
        wait for `take`)."""
        for req_id in _vllm.requests_gone(self.runner, self.handle_of.keys()):
            entry = self.requests.get(req_id)
            if entry is None:  # unplanned
                del self.handle_of[req_id]
                continue
            self._retire(req_id, entry)
            if entry.buffers is None and entry.error is None:
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
            req_ids = sorted(self.by_key.pop(key, []))
            entries = [self.requests.pop(req_id) for req_id in req_ids]
            for req_id, entry in zip(req_ids, entries):
                self._retire(req_id, entry)
            results = [_result(entry) for entry in entries]
            for sibling in results[1:]:
                self.outbox.discard(sibling)
            return results[:1]

    def stats(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "rows_captured": self.rows_captured,
            "requests_held": len(self.requests),
            "bytes_held": sum(e.buffers.nbytes(*self._taken(e)) for e in self.requests.values() if e.buffers is not None),
            # worker time outside the forward, for profiling; "outbox" runs on its own thread
            "seconds": dict(self.seconds, outbox=self.outbox.busy_seconds, backlog_wait=self.outbox.wait_seconds),
            **self.outbox.stats(),
            "time": time.time(),
        }


def _result(entry: _Entry) -> dict[str, Any]:
    if entry.error is not None or entry.buffers is None:
        return {"error": entry.error or "the request captured nothing"}
    entry.buffers.done.wait()
    return entry.buffers.result


class _CaptureWorkerMixin:
    """Methods capserve adds to vLLM's worker (all `capserve_`-prefixed)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        self.capserve_install()

    def capserve_install(self) -> None:
        options = _vllm.capserve_options(self.vllm_config)  # type: ignore[attr-defined]
        self.capserve_state = _CaptureState(_vllm.worker_runner(self), options)

    def capserve_take(self, keys: list[str], released: list[int] | None = None) -> dict[str, list[dict[str, Any]]]:
        """The results of these keys; `released`: arena blocks the replica has read."""
        self.capserve_state.outbox.release(released or [])
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
