"""Per-step row selection, device gather and hand-over to the outbox.

After each step the collector picks the rows every request asked for from the sites' staging
buffers — one index_select per hook and capture group (requests that asked for the same hooks,
dtype and reduction) — reduces them on the device and starts one copy to host per group; the
outbox thread files them per request once the copy is done.

Device memory outside vLLM's profile stays bounded: a step's gather (hooks x rows x d) and its
logits (rows x vocab, float32) are computed `max_step_bytes` at a time, in chunks of rows, each
copied into one host tensor before the next is computed. A large step's rows for the arena on a
GPU are the exception: gathered whole, so each request's rows go by one copy, and freed as the
copy engines read them. Capture groups live while a request uses them: `group` hands one out,
`release_group` gives it back, and an unused group is forgotten. A decode step like the one before
it skips the selection (`replicas.worker.steady_decode`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from replicas import _vllm
from replicas.worker.arena_graphs import ArenaGraphs
from replicas.worker.arena_writer import ArenaWriter, Destinations, table_slots
from replicas.worker.outbox import Outbox, StepRows, fail_all
from replicas.plans.request import CapturePlan
from replicas.plans.positions import EXPLICIT, concatenated_ranges, selected_offsets, selected_spans
from replicas.worker.request_table import NO_LOGITS, Batch, Columns, RequestTable
from replicas.readouts.device import DeviceReadouts
from replicas.sae.device import DeviceSae
from replicas.worker.sites import Site, stacked_rows, to_device
from replicas.worker.spec_handover import SpecHandOver
from replicas.worker.spec_select import KeyIds, Selection
from replicas.worker.steady_decode import SteadyDecode, decode_key

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_STEP_BYTES = 256 << 20  # EngineConfig.max_step_temp_bytes
GroupSites = tuple[list[Site], str, str]  # (sites, dtype, reduce)


class Collector(SpecHandOver):
    """Capture groups, and each step's gather of the rows they asked for."""

    def __init__(
        self,
        runner: Any,
        sites: dict[tuple[int | None, str], Site],
        vocab_size: int,
        device: torch.device,
        outbox: Outbox,
        max_step_bytes: int = MAX_STEP_BYTES,
        saes: dict[str, DeviceSae] | None = None,
        arena_graphs: bool = True,
        readouts: DeviceReadouts | None = None,
    ):
        self.runner = runner
        self.sites = sites
        self.final_norm = sites[(None, "ln_final")]
        self.vocab_size = vocab_size
        self.device = device
        self.outbox = outbox
        self.max_step_bytes = max_step_bytes
        self.groups: dict[tuple, int] = {}  # (hooks, dtype, reduce) -> capture group, while a request uses it
        self.group_sites: list[GroupSites | None] = []  # by group; None: free
        self._group_users: list[int] = []
        self._group_signatures: list[tuple | None] = []
        self._free_groups: list[int] = []
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # a decode step's arena writes by one graph replay, where the device writes the arena
        writer = outbox.writer
        on_gpu = writer is not None and writer.device.type == "cuda"
        self.arena_graphs = ArenaGraphs(writer, device) if arena_graphs and on_gpu else None
        self.saes = saes or {}
        self.sae_sites = {sites[sae.site] for sae in self.saes.values()}
        self.readouts = readouts
        self.key_ids = KeyIds()  # of SAE and read-out groups
        self.rows_captured = 0
        self.steady_steps = 0  # steps collected as a SteadyDecode
        self.steady: SteadyDecode | None = None  # the previous step's, while decode steps repeat it

    @property
    def live_groups(self) -> int:
        return len(self.groups)

    def group(self, capture: CapturePlan) -> int:
        """The capture group of requests that ask for these hooks, dtype and reduction; held until
        `release_group`."""
        signature = (tuple((layer, kind) for layer, kind, _ in capture.sites), capture.dtype, capture.reduce)
        group = self.groups.get(signature)
        if group is None:
            group = self._free_groups.pop() if self._free_groups else len(self.group_sites)
            if group == len(self.group_sites):
                self.group_sites.append(None)
                self._group_users.append(0)
                self._group_signatures.append(None)
            self.groups[signature] = group
            self.group_sites[group] = ([self.sites[site] for site in signature[0]], capture.dtype, capture.reduce)
            self._group_signatures[group] = signature
        self._group_users[group] += 1
        return group

    def release_group(self, group: int) -> None:
        """A request no longer reads its group (-1: it held none); the last one frees it."""
        if group < 0:
            return
        self._group_users[group] -= 1
        if self._group_users[group] == 0:
            del self.groups[self._group_signatures[group]]
            self.group_sites[group] = self._group_signatures[group] = None
            self._free_groups.append(group)

    def captured_sites(self, batch: Batch, requests: RequestTable) -> set[Site]:
        """The sites whose staging buffers some request of the step reads."""
        columns = requests.columns
        groups = np.unique(columns["group"][batch.rows])
        sites = {site for g in groups.tolist() if g >= 0 for site in self.group_sites[g][0]}
        if (columns["logits"][batch.rows] != NO_LOGITS).any():
            sites.add(self.final_norm)
        if (columns["sae"][batch.rows] > 0).any():
            sites.update(self.sae_sites)
        reading = batch.rows[columns["readouts"][batch.rows] > 0]  # retired read-outs read nothing more
        held = np.unique(columns["readout_sites"][reading])
        for site_set in held[held >= 0].tolist():
            sites.update(self.sites[site] for site in requests.site_sets.sets[site_set])
        return sites

    def collect(self, batch: Batch, requests: RequestTable) -> None:
        """Hand over the rows and logits every request of the step asked for."""
        columns = requests.columns
        steady, self.steady = self.steady, None
        if steady is not None and batch.repeats and batch.step.one_token_each:
            decode = (steady.key, steady.places)  # the steady step's requests, each on its next token
        else:
            decode = decode_key(batch, columns, arena=self.outbox.writer is not None)
        like_before = steady is not None and decode is not None and steady.key == decode[0]
        if like_before and self._collect_steady(batch, columns, steady):
            self.steady = steady
            self.steady_steps += 1
            return
        self._collect(batch, requests)
        if decode is not None:
            self.steady = self._steady_after(*decode, batch, requests)

    def _steady_after(self, key: bytes, places: np.ndarray, batch: Batch, requests: RequestTable) -> SteadyDecode | None:
        """The step just collected as a `SteadyDecode`, if its requests file into the arena."""
        rows = batch.rows[places]
        if not len(places):  # a quiet step: nothing to hand over while the same requests decode
            return SteadyDecode(key, places, rows)
        buffers = [requests.entry_at[int(r)].buffers for r in rows.tolist()]
        sites, dtype, reduce = self.group_sites[int(requests.columns["group"][rows[0]])]
        if reduce != "none" or any(b.rows_per_block == 0 or b.error is not None or b.table_slot < 0 for b in buffers):
            return None
        return SteadyDecode(key, places, rows, buffers, sites, *_row_shape(sites, dtype), table_slots(buffers))

    def _collect_steady(self, batch: Batch, columns: Columns, steady: SteadyDecode) -> bool:
        """`_collect` for a step like the one before it; False (nothing done) when a request failed meanwhile."""
        if not len(steady.places):
            return True
        dests = steady.advance(batch, columns)
        if dests is None:
            return False
        self.rows_captured += len(steady.rows)
        self._write_rows(steady.buffers, steady.places, np.ones(len(steady.places), np.int64), dests, steady.sites,
                         steady.width, steady.out, steady.row_bytes, steady.table_slots)
        return True

    def _collect(self, batch: Batch, requests: RequestTable) -> None:
        columns = requests.columns
        group = columns["group"][batch.rows]
        logits_mode = columns["logits"][batch.rows]
        sae, readouts = columns["sae"][batch.rows], columns["readouts"][batch.rows]
        k = np.flatnonzero((group >= 0) | (logits_mode != NO_LOGITS) | (sae > 0) | (readouts > 0))
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
                    self._hand_over_rows(g, selection)
        picked = logits_mode[k] != NO_LOGITS
        if picked.any():
            selection = self._select(requests, [c[picked] for c in chunks], logits_mode[k][picked], "logits")
            if selection is not None:
                self._hand_over_logits(selection)
        picked = sae[k] > 0
        if picked.any():
            self._hand_over_sae(requests, [c[picked] for c in chunks])
        picked = readouts[k] > 0
        if picked.any():
            self._hand_over_readouts(requests, [c[picked] for c in chunks])
        _retire_specs(batch, columns)

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

    def rows_per_chunk(self, row_bytes: int) -> int:
        """Rows computed at once when each takes row_bytes of device temporaries."""
        return max(1, self.max_step_bytes // max(row_bytes, 1))

    def _hand_over_rows(self, group: int, selection: Selection) -> None:
        """[hooks, rows, d] in the capture dtype, or [hooks, requests, d] float32 sums for reduce=mean;
        the rows of requests that file into the arena go straight there."""
        sites, dtype, reduce = self.group_sites[group]
        width, out, row_bytes = _row_shape(sites, dtype)
        if reduce == "mean":
            self._hand_over_sums(sites, width, sites[0].staging.element_size(), selection)
            return
        if self.outbox.writer is not None:
            in_arena = np.fromiter((e.buffers.rows_per_block > 0 for e in selection.requests), bool, len(selection.requests))
            if in_arena.any():
                self._write_to_arena(selection.subset(in_arena), sites, width, out, row_bytes)
                if in_arena.all():
                    return
                selection = selection.subset(~in_arena)
        rows = self._to_device(selection.rows)
        self._hand_over_chunked("rows", selection, (len(sites), len(rows), width), out, row_bytes,
                                lambda lo, hi: stacked_rows(sites, rows[lo:hi], width).to(out))

    def _hand_over_sums(self, sites: list[Site], width: int, itemsize: int, selection: Selection) -> None:
        rows = self._to_device(selection.rows)
        # per chunk: the index_selects, their stack and its float32 copy
        step = self.rows_per_chunk(len(sites) * width * (2 * itemsize + 4))
        segments = self._to_device(np.repeat(np.arange(len(selection.counts)), selection.counts))
        summed = torch.zeros(len(sites), len(selection.counts), width, dtype=torch.float32, device=self.device)
        for lo in range(0, len(rows), step):
            summed.index_add_(1, segments[lo : lo + step], stacked_rows(sites, rows[lo : lo + step], width).float())
        self._hand_over("rows", summed, selection)

    def _write_to_arena(self, selection: Selection, sites: list[Site], width: int, out: torch.dtype, row_bytes: int) -> None:
        """Gather the rows on the device and write them into their arena blocks, `rows_per_chunk`
        at a time; the outbox publishes no result of these requests before the write ends."""
        buffers = [entry.buffers for entry in selection.requests]
        live = np.fromiter((b.error is None for b in buffers), bool, len(buffers))
        if not live.all():  # failed requests write nothing more
            if not live.any():
                return
            selection = selection.subset(live)
            buffers = [entry.buffers for entry in selection.requests]
        self._write_rows(buffers, selection.rows, selection.counts, selection.dests, sites, width, out, row_bytes)

    def _write_rows(self, buffers: list, step_rows: np.ndarray, counts: np.ndarray, dests: np.ndarray, sites: list[Site],
                    width: int, out: torch.dtype, row_bytes: int, slots: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Request i's counts[i] rows, step_rows[offsets[i]:], go to its rows dests[i]... in the arena;
        `slots`: a steady decode step's requests' `table_slots` (one row each, their blocks taken)."""
        writer = self.outbox.writer
        try:
            index = (writer.decode_destinations(*slots, dests, len(sites), buffers[0].rows_per_block) if slots is not None
                     else writer.destinations(buffers, counts, dests, len(sites)))
        except OSError as exc:  # shared memory full: these requests fail, the others go on
            fail_all(buffers, f"capture could not be stored in shared memory: {exc}")
            return
        except Exception as exc:  # a bookkeeping bug must fail these requests, not the engine
            fail_all(buffers, f"capture failed in the worker: {exc!r}")
            return
        if self.arena_graphs is not None and self.arena_graphs.takes(sites, len(step_rows), width, out):
            try:
                event = self.arena_graphs.write(sites, width, out, step_rows, index.arena_rows())
            except RuntimeError as exc:  # as below
                fail_all(buffers, f"capture rows could not be written to shared memory: {exc}")
                return
            for b in buffers:
                b.graph_written = event
            return
        try:
            if writer.by_copy_engine(index):
                self._copy_rows(writer, index, step_rows, sites, width, out)
            else:
                rows, device_rows = index.index(self._to_device(index.packed(step_rows)))
                step = self.rows_per_chunk(row_bytes)
                for lo in range(0, len(rows), step):
                    block = stacked_rows(sites, rows[lo : lo + step], width).to(out)
                    writer.write(block, device_rows[:, lo : lo + step].reshape(-1), self.copy_stream)
        except RuntimeError as exc:  # a copy the runtime refused: these requests fail, the others go on
            fail_all(buffers, f"capture rows could not be written to shared memory: {exc}")
            return
        if self.copy_stream is not None:  # their results wait for it; nothing is handed over per step
            event = torch.cuda.Event()
            event.record(self.copy_stream)
            for b in buffers:
                b.written = event

    def _copy_rows(self, writer: ArenaWriter, index: Destinations, step_rows: np.ndarray, sites: list[Site], width: int,
                   out: torch.dtype) -> None:
        """A large step's rows by the copy engines: each hook's rows gathered whole into one
        [hooks, rows, width] buffer (a kernel a hook), then a copy per request, all hooks at once
        where its blocks allow (`Destinations.runs`). Gathering in row chunks, as the kernel path
        does, cut every run at each chunk's edge, and a copy per hook and run made hundreds of
        copies a step: a bulk prefill step's collect left the GPU idle 28% of the time (H200).
        The buffer stays on the device until the copy engines have read it."""
        rows = self._to_device(step_rows)
        gathered = torch.zeros if any(site.staging.shape[1] < width for site in sites) else torch.empty
        buffer = gathered((len(sites), len(rows), width), dtype=out, device=rows.device)
        for site, target in zip(sites, buffer):
            staged = site.staging
            if staged.dtype == out and staged.shape[1] == width:
                torch.index_select(staged, 0, rows, out=target)
            else:  # a narrower hook or another dtype: its columns, cast
                target[:, : staged.shape[1]] = staged.index_select(0, rows)
        writer.copy_runs(buffer, index, self.copy_stream)

    def _hand_over_logits(self, selection: Selection) -> None:
        """[1, rows, vocab] float32 logits of the final-normed rows."""
        rows = self._to_device(selection.rows)
        staging = self.final_norm.staging
        # per chunk: the normed rows, lm_head's output in the model dtype and its float32 copy
        row_bytes = staging.shape[1] * staging.element_size() + self.vocab_size * (staging.element_size() + 4)

        def logits(lo: int, hi: int) -> torch.Tensor:
            normed = staging.index_select(0, rows[lo:hi])
            return _vllm.compute_logits(self.runner, normed, self.vocab_size).unsqueeze(0)

        self._hand_over_chunked("logits", selection, (1, len(rows), self.vocab_size), torch.float32, row_bytes, logits)

    def _hand_over_chunked(
        self, kind: str, selection: Selection, shape: tuple[int, int, int], dtype: torch.dtype, row_bytes: int,
        compute: Callable[[int, int], torch.Tensor],
    ) -> None:
        self._queue(kind, *self._to_host(shape, dtype, row_bytes, compute), selection)

    def _to_host(
        self, shape: tuple[int, int, int], dtype: torch.dtype, row_bytes: int, compute: Callable[[int, int], torch.Tensor],
    ) -> tuple[torch.Tensor, Any]:
        """compute(0, rows) on its way to host memory, and the event its copy ends at (None: there
        already). Computed `rows_per_chunk` rows at a time once that is fewer than all: each chunk
        is copied into one host tensor before the next is computed, in stream order on the GPU, so
        the allocator reuses one chunk's memory for the next."""
        step = self.rows_per_chunk(row_bytes)
        if shape[1] <= step:
            return self._copy_to_host(compute(0, shape[1]))
        host = torch.empty(shape, dtype=dtype, pin_memory=self.copy_stream is not None)
        for lo in range(0, shape[1], step):
            host[:, lo : lo + step].copy_(compute(lo, min(lo + step, shape[1])), non_blocking=True)
        event = None
        if self.copy_stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return host, event

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def _hand_over(self, kind: str, picked: torch.Tensor, selection: Selection) -> None:
        self._queue(kind, *self._copy_to_host(picked), selection)

    def _copy_to_host(self, picked: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start the copy to host on a side stream (the next step does not wait for it) into
        pinned memory; the outbox thread files it once the event is done."""
        if self.copy_stream is None:
            return picked, None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
            host.copy_(picked, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        picked.record_stream(self.copy_stream)  # its memory is not reused before the copy ends
        return host, event

    def _queue(self, kind: str, host: torch.Tensor, event: Any, selection: Selection) -> None:
        buffers = [entry.buffers for entry in selection.requests]
        self.outbox.put(StepRows(kind, host, event, buffers, selection.offsets, selection.counts, selection.dests, selection.targets,
                                 selection.probe))


def _retire_specs(batch: Batch, columns: Columns) -> None:
    """SAE specs and read-outs that can select no later row stop counting: later steps skip their
    requests' selection, and a decode step of them may go steady (a lens at last_prompt asked by
    512 requests took ~2,000 (request, spec) pairs through the selection every decode step)."""
    ends = batch.step.start_positions + batch.counts
    for name in ("sae", "readouts"):
        columns[name][batch.rows[ends >= columns[f"{name}_end"][batch.rows]]] = 0


def _row_shape(sites: list[Site], dtype: str) -> tuple[int, torch.dtype, int]:
    """(width, torch dtype, device bytes per row) of a capture group's rows: as wide as its widest
    hook (narrower ones, attention heads, are padded); per row the gather, its stack and cast."""
    width, itemsize = max(site.staging.shape[1] for site in sites), sites[0].staging.element_size()
    out = TORCH_DTYPES[dtype]
    return width, out, len(sites) * width * (2 * itemsize + out.itemsize)
