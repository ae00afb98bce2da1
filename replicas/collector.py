"""Per-step row selection, device gather and hand-over to the outbox.

After each step the collector picks the rows every request asked for from the sites' staging
buffers — one index_select per hook and capture group (requests that asked for the same hooks,
dtype and reduction) — reduces them on the device and starts one copy to host per group; the
outbox thread files them per request once the copy is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replicas import _vllm
from replicas.outbox import Outbox, StepRows
from replicas.plans import EXPLICIT, CapturePlan, concatenated_ranges, selected_offsets, selected_spans
from replicas.request_table import NO_LOGITS, Batch, Columns, Entry, RequestTable
from replicas.sites import Site

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Selection:
    """Rows of a step picked for a set of requests: request i owns rows[offsets[i]:][:counts[i]]."""

    requests: list[Entry]
    rows: np.ndarray  # rows of the step's flattened batch
    offsets: np.ndarray
    counts: np.ndarray
    dests: np.ndarray  # where request i's rows go in its buffer


class Collector:
    """Capture groups, and each step's gather of the rows they asked for."""

    def __init__(
        self,
        runner: Any,
        sites: dict[tuple[int | None, str], Site],
        vocab_size: int,
        device: torch.device,
        outbox: Outbox,
    ):
        self.runner = runner
        self.sites = sites
        self.final_norm = sites[(None, "ln_final")]
        self.vocab_size = vocab_size
        self.device = device
        self.outbox = outbox
        self.groups: dict[tuple, int] = {}  # (hooks, dtype, reduce) -> capture group
        self.group_sites: list[tuple[list[Site], str, str]] = []
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.rows_captured = 0

    def group(self, capture: CapturePlan) -> int:
        signature = (tuple((layer, kind) for layer, kind, _ in capture.sites), capture.dtype, capture.reduce)
        if signature not in self.groups:
            self.groups[signature] = len(self.group_sites)
            self.group_sites.append(([self.sites[site] for site in signature[0]], capture.dtype, capture.reduce))
        return self.groups[signature]

    def captured_sites(self, batch: Batch, columns: Columns) -> set[Site]:
        """The sites whose staging buffers some request of the step reads."""
        groups = np.unique(columns["group"][batch.rows])
        sites = {site for g in groups.tolist() if g >= 0 for site in self.group_sites[g][0]}
        if (columns["logits"][batch.rows] != NO_LOGITS).any():
            sites.add(self.final_norm)
        return sites

    def collect(self, batch: Batch, requests: RequestTable) -> None:
        """Hand over the rows and logits every request of the step asked for."""
        columns = requests.columns
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
                selection = self._select(requests, [c[picked] for c in chunks], columns["positions"][rows[picked]], "capture")
                if selection is not None:
                    self._hand_over("rows", self._gather_group(g, selection), selection)
        picked = logits_mode[k] != NO_LOGITS
        if picked.any():
            selection = self._select(requests, [c[picked] for c in chunks], logits_mode[k][picked], "logits")
            if selection is not None:
                normed = self.final_norm.staging.index_select(0, self._to_device(selection.rows))
                logits = _vllm.compute_logits(self.runner, normed, self.vocab_size)
                self._hand_over("logits", logits.unsqueeze(0), selection)

    def _select(self, requests: RequestTable, chunks: list[np.ndarray], modes: np.ndarray, what: str) -> Selection | None:
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
            entry = requests.entry_at[int(rows[i])]
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
        taken = requests.columns["rows_taken" if what == "capture" else "logits_taken"]
        dests = taken[picked]
        taken[picked] += counts_all
        self.rows_captured += int(counts_all.sum()) if what == "capture" else 0
        offsets = np.cumsum(counts_all) - counts_all
        entries = [requests.entry_at[h] for h in picked.tolist()]
        return Selection(entries, np.concatenate(picked_rows), offsets, counts_all, dests)

    def _gather_group(self, group: int, selection: Selection) -> torch.Tensor:
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

    def _hand_over(self, kind: str, picked: torch.Tensor, selection: Selection) -> None:
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
