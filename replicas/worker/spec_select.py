"""The rows of a step that each SAE spec or read-out of each request selects, for every (request,
spec) pair of the step at once.

A decode step of 512 requests that each ask 8 read-outs holds 4,096 pairs: selected one at a time
(a few small numpy arrays each) they took ~50 ms of the step loop's host time a step, longer than
the step on the GPU. A request's specs of one kind are read as arrays once (`SpecCodes`, cached on
its entry): their position mode codes and their group keys, interned as ints. A step then computes
every pair's span with numpy, takes explicit indices pair by pair (rare), and groups the pairs by
key with one stable sort, so each group keeps its pairs in request order, then spec order, and the
groups come in the order their first pair does. `Selection` is what a group, or a capture group,
hands over: its rows of the step and whose they are.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from replicas.plans.positions import EXPLICIT, concatenated_ranges, mode_code, selected_offsets, selected_spans

if TYPE_CHECKING:
    from replicas.readouts.store import ProbeStore
    from replicas.worker.request_table import Entry


@dataclass(frozen=True)
class SpecKind:
    """SAE specs or read-outs: the plan's field that lists them, the key of the specs one device
    computation serves, and the width a spec's rows take in its group's block."""

    field: str  # "sae" | "readouts"
    key: Callable[[Any], Hashable]
    width: Callable[[Any], int]
    region: Callable[[Any], int] = lambda spec: -1  # a probe's region in its store (replicas.readouts.store)


@dataclass
class SpecCodes:
    """A request's specs of one kind as the selection reads them."""

    specs: list[Any]
    modes: np.ndarray  # position mode codes (replicas.plans.positions.MODE_CODES, EXPLICIT)
    keys: np.ndarray  # group keys, interned
    widths: np.ndarray
    regions: np.ndarray  # probes' regions in their stores; -1 for the rest


class KeyIds:
    """Group keys as ints. Keys name loaded SAEs, probes and lens sites, so they stay few."""

    def __init__(self) -> None:
        self.ids: dict[Hashable, int] = {}

    def codes(self, specs: list[Any], kind: SpecKind) -> SpecCodes:
        keys = [self.ids.setdefault(kind.key(spec), len(self.ids)) for spec in specs]
        return SpecCodes(
            specs, np.array([mode_code(spec.positions) for spec in specs], np.int64), np.array(keys, np.int64),
            np.array([kind.width(spec) for spec in specs], np.int64), np.array([kind.region(spec) for spec in specs], np.int64),
        )


@dataclass
class Selection:
    """Rows of a step picked for a set of requests: request i owns rows[offsets[i]:][:counts[i]]."""

    requests: list[Entry]
    rows: np.ndarray  # rows of the step's flattened batch
    offsets: np.ndarray
    counts: np.ndarray
    dests: np.ndarray  # where request i's rows go in its buffer
    # SAE and read-out rows: (the index of request i's spec in its plan, the block's k_max or width)
    targets: tuple[list[int], int] | None = None
    probe: tuple[ProbeStore, np.ndarray] | None = None  # a probe's rows: its store, request i's region there

    def subset(self, keep: np.ndarray) -> Selection:
        """The rows of the requests where keep is True."""
        counts = self.counts[keep]
        rows = self.rows[concatenated_ranges(self.offsets[keep], counts)]
        requests = [entry for entry, kept in zip(self.requests, keep.tolist()) if kept]
        return Selection(requests, rows, np.cumsum(counts) - counts, counts, self.dests[keep])


@dataclass
class PairGroup:
    """One group's pairs, in order: request i of the step's list and its spec at `spec[i]` own
    rows[offsets[i]:][:counts[i]] of the step."""

    request: np.ndarray
    spec: np.ndarray
    counts: np.ndarray
    rows: np.ndarray
    width: int  # the widest member's
    pair: np.ndarray  # the pairs' indices in the step's list of every request's specs, in order

    @property
    def offsets(self) -> np.ndarray:
        return np.cumsum(self.counts) - self.counts


def pair_groups(codes: list[SpecCodes], chunks: list[np.ndarray]) -> list[PairGroup]:
    """The pairs of the step's requests that select rows, grouped by key: `codes[k]` are request
    k's specs, `chunks` its (handle, first row, start position, rows, prompt length, first fresh
    row) as in `Collector._collect`."""
    n_specs = np.fromiter((len(c.specs) for c in codes), np.int64, len(codes))
    request = np.repeat(np.arange(len(codes)), n_specs)
    spec = np.arange(len(request)) - np.repeat(np.cumsum(n_specs) - n_specs, n_specs)
    starts, lengths, explicit = _spans(codes, chunks, request, spec)
    kept = np.flatnonzero(lengths)
    if not len(kept):
        return []
    keys = np.concatenate([c.keys for c in codes])
    order = kept[np.argsort(keys[kept], kind="stable")]
    counts = lengths[order]
    rows = concatenated_ranges(starts[order], counts)
    ends = np.cumsum(counts)
    if explicit:  # their rows in place of the placeholders
        place = np.empty(len(request), np.int64)
        place[order] = np.arange(len(order))
        for p, picked in explicit.items():
            if len(picked):
                end = ends[place[p]]
                rows[end - len(picked) : end] = picked
    ordered_keys = keys[order]
    bounds = np.flatnonzero(np.concatenate([[True], ordered_keys[1:] != ordered_keys[:-1], [True]]))
    widths = np.concatenate([c.widths for c in codes])[order]
    groups = []
    # a group's first pair is its earliest (the sort is stable): groups in order of appearance
    for g in np.argsort(order[bounds[:-1]]).tolist():
        lo, hi = int(bounds[g]), int(bounds[g + 1])
        pairs = order[lo:hi]
        groups.append(PairGroup(request[pairs], spec[pairs], counts[lo:hi], rows[ends[lo] - counts[lo] : ends[hi - 1]],
                                int(widths[lo:hi].max()), pairs))
    return groups


def _spans(
    codes: list[SpecCodes], chunks: list[np.ndarray], request: np.ndarray, spec: np.ndarray
) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """Per pair, the first step row it selects and how many; the rows of explicit indices, pair by
    pair (the first row is a placeholder for those). Rows below a request's first fresh row were
    recorded before: it runs them again after preemption."""
    _, first, start, count, prompt_len, fresh = chunks
    modes = np.concatenate([c.modes for c in codes])
    a, b = selected_spans(modes, start[request], count[request], prompt_len[request])
    a = np.maximum(a, fresh[request])
    lengths = np.maximum(b - a, 0)
    explicit = {}
    for p in np.flatnonzero(modes == EXPLICIT).tolist():
        k = int(request[p])
        offsets = selected_offsets(codes[k].specs[spec[p]].positions, int(start[k]), int(count[k]), int(prompt_len[k]))
        explicit[p] = first[k] + offsets[offsets >= fresh[k]]
        lengths[p] = len(explicit[p])
    return first[request] + a, lengths, explicit
