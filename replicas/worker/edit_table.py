"""Per-step edit slots: which row of a site's edit table each edited row of the step reads.

A request's edit holds a slot (a row of the site's table, see `replicas.worker.sites`) from admission to
retirement; requests with the same op share one. Edits at range positions are "vectorized": each
(site, stage) gets a lane of columns in the request table, so one numpy pass per lane points the
rows of every request of the step at its slot. The others (explicit positions, `set`) go request by
request.
"""

from __future__ import annotations

import numpy as np
import torch

from replicas.plans.request import EditPlan
from replicas.plans.positions import PHASE_MODES, concatenated_ranges, mode_code, selected_spans, value_rows
from replicas.worker.request_table import Batch, Columns, Entry, RequestTable
from replicas.worker.sites import Site, host_tensor, table_row, to_device

# Per steered site: the slot of every row of the step, per stage ([stages, tokens]).
Slots = dict[Site, np.ndarray]
# Per site: the values a `set` edit writes, as (stage, rows of the step, rows of the shared values buffer, values).
Sets = dict[Site, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]]


def fill_ranges(row: np.ndarray, starts: np.ndarray, ends: np.ndarray, values: np.ndarray) -> None:
    """row[s:e] = v for disjoint ranges, in one pass."""
    lengths = ends - starts
    row[concatenated_ranges(starts, lengths)] = np.repeat(values, lengths)


class EditTable:
    """Hands out the slots of every steered site and writes each step's row-to-slot map."""

    def __init__(self, sites: dict[tuple[int | None, str], Site], edit_slots: int, device: torch.device, max_set_edits: int = 4):
        self.sites = sites
        self.edit_slots = edit_slots
        self.device = device
        self.max_set_edits = max_set_edits  # the j-th set edit of a request writes row `row * max_set_edits + j`
        self._free_slots = {
            (id(s), stage): list(range(edit_slots, 0, -1)) for s in sites.values() for stage in range(s.edit_stages)
        }
        self._slot_users: dict[tuple[int, int, bytes], list[int]] = {}  # table row content -> [slot, requests]
        self.lanes: dict[tuple[Site, int], str] = {}  # (site, stage) -> prefix of its edit columns
        self._dirty_rows: dict[Site, int] = {}  # rows of each site's slot map the previous step set
        self._dirty_sets: dict[Site, int] = {}  # rows of its set_stage and set_row map
        self._last_key: bytes | None = None  # the previous step's `_decode_key`, and its slots
        self._last_slots: Slots = {}

    # ------------------------------------------------------------ per request

    def assign(self, entry: Entry, columns: Columns) -> None:
        """Give each of the entry's edits a slot; raises when a site has none left (the caller
        gives back those it got)."""
        for edit in entry.plan.edits:
            self._assign_slot(entry, edit, columns)

    def _assign_slot(self, entry: Entry, edit: EditPlan, columns: Columns) -> None:
        """Point the edit at a table row holding its op; requests with the same op (one steering
        vector across an eval) share the row, so most admissions write nothing to the device."""
        site = self.sites[edit.site]
        row = table_row(edit, site.d_model, site.per_column)
        content = (id(site), edit.stage, row.tobytes())
        shared = self._slot_users.get(content)
        if shared is None:
            free = self._free_slots[(id(site), edit.stage)]
            if not free:
                raise RuntimeError(f"all {self.edit_slots} edit slots of {site.point.canonical_name} are in use")
            shared = self._slot_users[content] = [free.pop(), 0]
            # non_blocking from pinned memory: a blocking copy would wait for the step in flight on the GPU
            site.table[edit.stage, shared[0]].copy_(host_tensor(row, self.device), non_blocking=True)
        shared[1] += 1
        edit.slot = shared[0]
        entry.slots.append(content)
        if not edit.vectorized:
            columns["fallback"][entry.handle] = 1
            return
        lane = self.lanes.get((site, edit.stage))
        if lane is None:
            lane = self.lanes[(site, edit.stage)] = f"lane{len(self.lanes)}."
            for name in ("slot", "positions", "phase"):
                columns.add(lane + name)
        columns[lane + "slot"][entry.handle] = edit.slot
        columns[lane + "positions"][entry.handle] = mode_code(edit.positions)
        columns[lane + "phase"][entry.handle] = mode_code(PHASE_MODES[edit.phase])

    def free_slots_of(self, entry: Entry) -> None:
        """Give back the entry's table rows; a row no request uses returns to the free list (it is
        rewritten when next handed out, and no row of a step points at it meanwhile)."""
        for content in entry.slots:
            shared = self._slot_users[content]
            shared[1] -= 1
            if shared[1] == 0:
                del self._slot_users[content]
                self._free_slots[content[:2]].append(shared[0])
        entry.slots.clear()

    # ------------------------------------------------------------ per step

    def prepare(self, batch: Batch, requests: RequestTable) -> Slots:
        """Point the rows each request of the step edits at its slots, on the device; returns the
        sites edited in this step. A decode step whose rows edit as the previous step's did (the
        same requests in the same order) leaves the device maps as they are."""
        if batch.repeats and self._last_key is not None and batch.step.one_token_each:
            return self._last_slots  # the decode step before's requests, each on its next token
        key = self._decode_key(batch, requests.columns) if requests.requests else None
        if key is not None and key == self._last_key:
            return self._last_slots
        slots, sets = self._edit_slots(batch, requests) if requests.requests else ({}, {})
        if slots or self._dirty_rows or self._dirty_sets:
            self._write_edit_rows(slots, sets, batch.step.num_tokens)
        self._last_key, self._last_slots = key, slots
        return slots

    def _decode_key(self, batch: Batch, columns: Columns) -> bytes | None:
        """What a decode step's slot maps follow from, or None for any other step. Every row is one
        generated token, so each range mode selects it or not whatever its position, and the maps
        are the lanes' columns of the step's requests, in order; edits going request by request
        (`fallback`) are not."""
        rows = batch.rows
        if columns["fallback"][rows].any() or not batch.is_decode(columns["prompt_len"][rows]):
            return None
        lanes = [columns[lane + name][rows] for lane in self.lanes.values() for name in ("slot", "positions", "phase")]
        return np.concatenate(lanes).tobytes() if lanes else b""

    def _edit_slots(self, batch: Batch, requests: RequestTable) -> tuple[Slots, Sets]:
        """Per steered site, the slot of every row of the step and stage ([stages, tokens]); and
        the `set` values to write (stage, rows, values)."""
        step, columns = batch.step, requests.columns
        first, counts, start = batch.first_rows, batch.counts, step.start_positions
        prompt_len = columns["prompt_len"][batch.rows]
        slots: Slots = {}
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
            fill_ranges(table[stage], first[k] + a, first[k] + b, slot[k])
        sets: Sets = {}
        for k in np.flatnonzero(columns["fallback"][batch.rows]).tolist():
            entry = requests.entry_at[int(batch.rows[k])]
            lo, start_k, count = step.chunk(k)
            set_edits = 0  # set edits of this request so far: which row of the values buffer it writes
            for edit in entry.plan.edits:
                j = set_edits
                set_edits += edit.op == "set"
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
                    rows = lo + offsets
                    sets.setdefault(site, []).append((edit.stage, rows, rows * self.max_set_edits + j, values))
        return slots, sets

    def _write_edit_rows(self, slots: Slots, sets: Sets, num_tokens: int) -> None:
        """Copy each steered site's row slots to the device, and the rows `set` edits write where
        there are any; rows the previous step pointed at go back to neutral. One copy per site
        and step when no request patches (`set`): each copy costs the step loop more than its bytes."""
        for site in set(self._dirty_rows) | set(slots):
            width = max(self._dirty_rows.pop(site, 0), num_tokens if site in slots else 0)
            slot = np.zeros((site.edit_stages, width), dtype=np.int64)
            if site in slots:
                slot[:, :num_tokens] = slots[site]
                self._dirty_rows[site] = num_tokens
            site.slot[:, :width].copy_(host_tensor(slot, self.device), non_blocking=True)
        for site in set(self._dirty_sets) | set(sets):
            width = max(self._dirty_sets.pop(site, 0), num_tokens if site in sets else 0)
            set_stage_and_row = np.stack([np.full(width, -1, dtype=np.int64), np.zeros(width, dtype=np.int64)])
            for stage, rows, shared_rows, values in sets.get(site, ()):
                set_stage_and_row[0, rows] = stage
                set_stage_and_row[1, rows] = shared_rows
                site.values[to_device(shared_rows, self.device)] = to_device(values, self.device).to(site.values.dtype)
            if site in sets:
                self._dirty_sets[site] = num_tokens
            site.set_stage[:width].copy_(host_tensor(set_stage_and_row[0], self.device), non_blocking=True)
            site.set_row[:width].copy_(host_tensor(set_stage_and_row[1], self.device), non_blocking=True)
