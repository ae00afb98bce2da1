"""What each running request asked for, in columns the step loop reads for a whole batch at once.

A request gets a handle (a row of `Columns`) the first step it appears in, and gives it back once
vLLM has finished it; its `Entry` stays until the replica takes its result (or is forgotten at
once when it returns nothing). Taken keys are remembered for a while, so a completion of a
request whose result was taken or cancelled already runs unplanned.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, KeysView
from dataclasses import dataclass, field

import numpy as np

from replicas import _vllm
from replicas.worker.outbox import RequestBuffers
from replicas.plans.request import RequestPlan, WirePlan
from replicas.plans.positions import mode_code, selection_end
from replicas.worker.spec_select import SpecCodes

_CLOSED_KEYS_KEPT = 10_000

UNPLANNED = -2  # handle of a running request that asked for nothing
NEW = -1  # a request the worker has not seen yet
NO_LOGITS = -9


@dataclass
class Entry:
    """What one request asked for, until the replica takes its result."""

    plan: RequestPlan
    name: str  # unique among the worker's requests: names its result files
    handle: int
    buffers: RequestBuffers | None  # None when it captures nothing
    slots: list[tuple[int, int, bytes]] = field(default_factory=list)  # (site id, stage, table row) it holds
    group: int = -1  # its capture group while it holds one (the collector's, see Collector.group)
    finishing: bool = False
    error: str | None = None
    replica_fault: str = ""  # see RequestBuffers.replica_fault
    spec_codes: dict[str, SpecCodes] = field(default_factory=dict)  # its SAE specs and read-outs, as the collector reads them


class Columns:
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


class SiteSets:
    """The sets of sites that running requests' read-outs read, each an int while a request holds
    it: a step's sites are the union of its few distinct sets (`Collector.captured_sites`), not
    each request's."""

    def __init__(self) -> None:
        self.ids: dict[frozenset, int] = {}
        self.sets: list[frozenset] = []
        self._users: list[int] = []
        self._free: list[int] = []

    def hold(self, sites: frozenset) -> int:
        held = self.ids.get(sites)
        if held is None:
            held = self._free.pop() if self._free else len(self.sets)
            if held == len(self.sets):
                self.sets.append(sites)
                self._users.append(0)
            self.sets[held] = sites
            self.ids[sites] = held
        self._users[held] += 1
        return held

    def release(self, held: int) -> None:
        """The last request that held the set forgets it."""
        self._users[held] -= 1
        if not self._users[held]:
            del self.ids[self.sets[held]]
            self._free.append(held)


@dataclass
class Batch:
    """The step's layout and, per request, its row in `Columns`."""

    step: _vllm.StepLayout
    rows: np.ndarray
    # the same requests in the same order as the step before, none admitted, failed or retired
    # since: in decode, what each asks of this step is what it asked of that one
    repeats: bool = False

    @property
    def first_rows(self) -> np.ndarray:
        return self.step.offsets[:-1]

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.step.offsets)

    def is_decode(self, prompt_len: np.ndarray, places: np.ndarray | slice = slice(None)) -> bool:
        """Whether every request of the step runs one token, and those at `places` (all by
        default) a generated one: prompt_len is the step's requests' prompt lengths."""
        return self.step.one_token_each and bool((self.step.start_positions[places] >= prompt_len).all())


class RequestTable:
    """The worker's requests by vLLM id, by handle and by key, and the columns of the running ones."""

    def __init__(self) -> None:
        self.columns = Columns()
        for name, neutral in (
            ("prompt_len", 0), ("seen", 0), ("group", -1), ("positions", 0), ("logits", NO_LOGITS), ("fallback", 0),
            ("rows_taken", 0), ("logits_taken", 0),  # rows handed over so far, where the next ones go
            ("sae", 0), ("readouts", 0),  # SAE specs and read-outs it asks, until none can select a later row
            ("sae_end", 0), ("readouts_end", 0),  # the position past the last row they can select
            ("readout_sites", -1),  # the set of sites its read-outs read (`site_sets`)
        ):
            self.columns.add(name, neutral)
        self.site_sets = SiteSets()
        self.handle_of: dict[str, int] = {}  # vLLM request id -> handle (or UNPLANNED)
        self.entry_at: dict[int, Entry] = {}
        self.requests: dict[str, Entry] = {}  # by vLLM request id, until taken
        self.by_key: dict[str, list[str]] = {}
        self.closed_keys: dict[str, None] = {}  # insertion-ordered set of taken keys
        self.names = itertools.count()
        self.version = 0  # changes with any request's handle or columns (`Batch.repeats`)
        self._batch_version = -1  # the version the last `batch` looked its rows up at

    def running(self) -> KeysView[str]:
        return self.handle_of.keys()

    def handles(self, req_ids: list[str]) -> np.ndarray:
        """The handle of each request of a step; NEW for those not seen before."""
        return np.fromiter((self.handle_of.get(r, NEW) for r in req_ids), np.int64, len(req_ids))

    def batch(self, step: _vllm.StepLayout, last: Batch | None, admit: Callable[[str], int]) -> Batch:
        """The step's requests as rows of the columns; `admit` gives a new one its handle. A step
        of the requests the one before (`last`) ran, in its order, with the table unchanged
        since, takes its rows as they were (`Batch.repeats`): a decode step looks up no request."""
        if last is not None and step.req_ids == last.step.req_ids and self.version == self._batch_version:
            return Batch(step, last.rows, repeats=True)
        handles = self.handles(step.req_ids)
        for k in np.flatnonzero(handles == NEW).tolist():
            handles[k] = admit(step.req_ids[k])
        self._batch_version = self.version
        return Batch(step, self.columns.rows(handles))

    def plan(self, req_id: str, wire: WirePlan | None) -> RequestPlan | None:
        """The plan a new request carries; None (and the request runs unplanned) when it asks for
        nothing or its key was closed already: taken or cancelled."""
        if not wire or wire["key"] in self.closed_keys:
            self.handle_of[req_id] = UNPLANNED
            self.version += 1
            return None
        return RequestPlan.from_wire(wire)

    def admit(self, req_id: str, plan: RequestPlan, buffers: RequestBuffers | None, group: int) -> Entry:
        """Give the request a handle and fill its columns; `group` is its capture group."""
        handle = self.columns.allocate()
        self.version += 1
        entry = Entry(plan, f"{plan.key}-{next(self.names)}", handle, buffers, group=group)
        self.requests[req_id] = entry
        self.by_key.setdefault(plan.key, []).append(req_id)
        self.handle_of[req_id] = handle
        self.entry_at[handle] = entry
        columns = self.columns
        columns["prompt_len"][handle] = plan.prompt_len
        if plan.capture is not None:
            columns["group"][handle] = group
            columns["positions"][handle] = mode_code(plan.capture.positions)
        if plan.logits_positions is not None:
            columns["logits"][handle] = mode_code(plan.logits_positions)
        columns["sae"][handle] = len(plan.sae)  # SAE specs it asks (replicas.sae.specs)
        columns["readouts"][handle] = len(plan.readouts)  # lenses and probes (replicas.readouts.specs)
        columns["sae_end"][handle] = selection_end([spec.positions for spec in plan.sae], plan.prompt_len)
        columns["readouts_end"][handle] = selection_end([spec.positions for spec in plan.readouts], plan.prompt_len)
        if plan.readouts:
            columns["readout_sites"][handle] = self.site_sets.hold(frozenset(readout.site for readout in plan.readouts))
        return entry

    def fail(self, entry: Entry, error: str, replica_fault: str = "") -> None:
        """The request runs on, unsteered and capturing nothing: no row may point at the slots or
        the capture group it gave back, and its result is the error."""
        entry.error, entry.replica_fault, entry.group = error, replica_fault, -1
        self.version += 1
        self._drop_site_set(entry.handle)
        self.columns.reset(entry.handle)
        self.columns["prompt_len"][entry.handle] = entry.plan.prompt_len
        entry.buffers = None

    def finished(self, req_id: str) -> Entry | None:
        """The entry of a request vLLM has finished; an unplanned one is forgotten here (None)."""
        entry = self.requests.get(req_id)
        if entry is None:
            del self.handle_of[req_id]
            self.version += 1
        return entry

    def retire(self, req_id: str, entry: Entry) -> bool:
        """The request will run no more steps: record how many rows it got and free its handle.
        False when it was retired already."""
        if entry.finishing:
            return False
        if entry.buffers is not None:
            entry.buffers.n_rows, entry.buffers.n_logits = self.taken(entry)
        entry.finishing = True
        self.version += 1
        self.handle_of.pop(req_id, None)
        self.entry_at.pop(entry.handle, None)
        self._drop_site_set(entry.handle)
        self.columns.release(entry.handle)
        return True

    def _drop_site_set(self, handle: int) -> None:
        held = int(self.columns["readout_sites"][handle])
        if held >= 0:
            self.site_sets.release(held)

    def taken(self, entry: Entry) -> tuple[int, int]:
        """Rows and logits rows handed over for the entry so far."""
        if entry.finishing:
            return entry.buffers.n_rows, entry.buffers.n_logits
        return int(self.columns["rows_taken"][entry.handle]), int(self.columns["logits_taken"][entry.handle])

    def forget(self, req_id: str) -> None:
        entry = self.requests.pop(req_id)
        siblings = self.by_key.get(entry.plan.key, [])
        if req_id in siblings:
            siblings.remove(req_id)
        if not siblings:
            self.by_key.pop(entry.plan.key, None)

    def close(self, key: str) -> list[tuple[str, Entry]]:
        """Remove every completion of the key, first completion first; later completions of it
        that vLLM has not started yet will run unplanned."""
        self.closed_keys[key] = None
        while len(self.closed_keys) > _CLOSED_KEYS_KEPT:
            self.closed_keys.pop(next(iter(self.closed_keys)))
        req_ids = sorted(self.by_key.pop(key, []))
        return [(req_id, self.requests.pop(req_id)) for req_id in req_ids]

    def bytes_held(self) -> int:
        return sum(e.buffers.nbytes(*self.taken(e)) for e in self.requests.values() if e.buffers is not None)
