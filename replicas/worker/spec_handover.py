"""The collector's SAE and read-out hand-over: a step's rows of every (request, spec) pair, grouped
so that one device computation serves each group (`replicas.worker.spec_select`), computed and
copied to host for the outbox.

Probes at one site that select the same rows (the usual case: the same requests ask for several
probes at every position) share one gather and one matrix product with their weights side by side,
and one copy to host, whose column slices the outbox files probe by probe. Eight probes at four
sites, two at each, ran as eight gathers, products and copies a step before; 512 requests reading
them at every position ran at 0.94 of the unused engine on an H100 (bench_readouts, 2026-12-07).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from replicas.readouts.device import DeviceReadouts, lens_row_bytes, probe_row_bytes
from replicas.sae.device import DeviceSae, encode_packed, packed_width, row_bytes
from replicas.worker.outbox import Outbox, fail_all
from replicas.worker.spec_select import KeyIds, Selection, SpecCodes, SpecKind, pair_groups

if TYPE_CHECKING:
    from replicas.plans.readouts import ReadoutPlan
    from replicas.worker.request_table import Entry, RequestTable
    from replicas.worker.sites import Site

SAE_SPECS = SpecKind("sae", lambda spec: spec.sae_id, lambda spec: spec.top_k)
READOUT_SPECS = SpecKind("readouts", lambda spec: spec.group, lambda spec: spec.width, lambda spec: spec.region)


class SpecHandOver:
    """Collector's part that serves SAE specs and read-outs; the attributes and the three
    hand-over methods below are the Collector's own."""

    sites: dict[tuple[int | None, str], Site]
    saes: dict[str, DeviceSae]
    readouts: DeviceReadouts | None
    vocab_size: int
    key_ids: KeyIds
    outbox: Outbox

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        raise NotImplementedError

    def _to_host(
        self, shape: tuple[int, int, int], dtype: torch.dtype, row_bytes: int, compute: Callable[[int, int], torch.Tensor],
    ) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def _hand_over_chunked(
        self, kind: str, selection: Selection, shape: tuple[int, int, int], dtype: torch.dtype, row_bytes: int,
        compute: Callable[[int, int], torch.Tensor],
    ) -> None:
        raise NotImplementedError

    def _queue(self, kind: str, host: torch.Tensor, event: Any, selection: Selection) -> None:
        raise NotImplementedError

    def _spec_groups(self, requests: RequestTable, chunks: list[np.ndarray], kind: SpecKind) -> list[tuple[list[Any], Selection]]:
        """The step's rows of SAE or read-out specs, in groups of specs that one device computation
        serves (`replicas.worker.spec_select`): the group's specs (a probe's first alone: its store
        counts and files every member's rows at once), and a Selection whose targets are each
        member's spec index and the group's width. Counts the rows as taken."""
        entries = [requests.entry_at[handle] for handle in chunks[0].tolist()]
        codes = [self._spec_codes(entry, kind) for entry in entries]
        groups, regions = [], None
        for group in pair_groups(codes, chunks):
            members, targets = group.request.tolist(), group.spec.tolist()
            probe, specs = None, [codes[members[0]].specs[targets[0]]]
            if getattr(specs[0], "kind", None) == "probe":
                regions = np.concatenate([c.regions for c in codes]) if regions is None else regions
                probe = (self.outbox.probes[specs[0].probe], regions[group.pair])
                dests = probe[0].count(probe[1], group.counts)
            else:
                specs = [codes[k].specs[j] for k, j in zip(members, targets)]
                dests = np.fromiter((spec.taken for spec in specs), np.int64, len(specs))
                for spec, n in zip(specs, group.counts.tolist()):
                    spec.taken += n
            groups.append((specs, Selection([entries[k] for k in members], group.rows, group.offsets, group.counts, dests,
                                            (targets, group.width), probe)))
        return groups

    def _spec_codes(self, entry: Entry, kind: SpecKind) -> SpecCodes:
        codes = entry.spec_codes.get(kind.field)
        if codes is None:
            codes = entry.spec_codes[kind.field] = self.key_ids.codes(getattr(entry.plan, kind.field), kind)
        return codes

    def _hand_over_sae(self, requests: RequestTable, chunks: list[np.ndarray]) -> None:
        """SAE features of the step's rows: per SAE, one gather, encode and top-k on the device
        for every request that asked it, and one [1, rows, packed] int32 block to host."""
        for specs, selection in self._spec_groups(requests, chunks, SAE_SPECS):
            sae = self.saes[specs[0].sae_id]
            k_max = selection.targets[1]
            errors = {spec.error for spec in specs}
            error = "vector" if "vector" in errors else "norm" if "norm" in errors else "none"
            staging = self.sites[sae.site].staging
            d_model = staging.shape[1]
            step_rows = self._to_device(selection.rows)
            width = packed_width(k_max, error, d_model)

            def packed(lo: int, hi: int, sae: DeviceSae = sae, rows: torch.Tensor = step_rows) -> torch.Tensor:
                return encode_packed(sae, staging.index_select(0, rows[lo:hi]), k_max, error).unsqueeze(0)

            self._hand_over_chunked("sae", selection, (1, len(selection.rows), width), torch.int32, row_bytes(sae, d_model), packed)

    def _hand_over_readouts(self, requests: RequestTable, chunks: list[np.ndarray]) -> None:
        """Lenses and probes of the step's rows: per lens group (a site and translator), and per
        set of probes at one site over the same rows, one gather and computation on the device for
        every request that asked it, and one block to host: a lens's int32 [ids | logprobs],
        the probes' float32 values side by side."""
        probes: dict[tuple[Any, bytes], list[tuple[ReadoutPlan, Selection]]] = {}
        for specs, selection in self._spec_groups(requests, chunks, READOUT_SPECS):
            plan = specs[0]
            if plan.kind == "probe":
                probes.setdefault((plan.site, selection.rows.tobytes()), []).append((plan, selection))
            else:
                self._hand_over_lens(plan, selection)
        for batch in probes.values():
            self._hand_over_probes(batch)

    def _hand_over_lens(self, plan: ReadoutPlan, selection: Selection) -> None:
        width, staging = selection.targets[1], self.sites[plan.site].staging
        rows, normed = self._to_device(selection.rows), plan.site[1] == "ln_final"

        def computed(lo: int, hi: int) -> torch.Tensor:
            return self.readouts.lens(staging.index_select(0, rows[lo:hi]), plan.translator, normed, width).unsqueeze(0)

        per_row = lens_row_bytes(staging.shape[1], self.vocab_size, staging.element_size())
        copied = self._read_out_to_host(selection, (1, len(rows), 2 * width), torch.int32, per_row, computed)
        if copied is not None:
            self._queue("readout", *copied, selection)

    def _hand_over_probes(self, batch: list[tuple[ReadoutPlan, Selection]]) -> None:
        """Probes at one site over the same rows: [1, rows, their widths side by side], one slice
        of its columns to each probe's selection."""
        names = tuple(plan.probe for plan, _ in batch)
        widths = [selection.targets[1] for _, selection in batch]
        staging = self.sites[batch[0][0].site].staging
        rows = self._to_device(batch[0][1].rows)

        def computed(lo: int, hi: int) -> torch.Tensor:
            return self.readouts.probe_set(names, staging.index_select(0, rows[lo:hi])).unsqueeze(0)

        # the same rows are the same requests' rows: on failure, the first selection's requests are all of them
        copied = self._read_out_to_host(batch[0][1], (1, len(rows), sum(widths)), torch.float32,
                                        probe_row_bytes(staging.shape[1], sum(widths)), computed)
        if copied is None:
            return
        host, event = copied
        ends = np.cumsum(widths).tolist()
        for (_, selection), start, end in zip(batch, [0, *ends], ends):
            self._queue("readout", host[:, :, start:end], event, selection)

    def _read_out_to_host(
        self, selection: Selection, shape: tuple[int, int, int], dtype: torch.dtype, row_bytes: int,
        compute: Callable[[int, int], torch.Tensor],
    ) -> tuple[torch.Tensor, Any] | None:
        """`_to_host` for read-outs; None once a failure (e.g. out of device memory) has failed the
        selection's requests: they fail, the engine goes on."""
        try:
            return self._to_host(shape, dtype, row_bytes, compute)
        except RuntimeError as exc:
            fail_all([entry.buffers for entry in selection.requests], f"read-out failed on the device: {exc}")
            return None
