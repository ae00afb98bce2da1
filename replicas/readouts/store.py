"""Every request's rows of one probe in one array, so that a step files them with one copy.

A decode step of 512 requests with 8 probes at every position hands over 4,096 (request, probe)
pairs. Kept as one array per pair, each took a Python call to count and a slice copy to file
(~1 µs a pair on the step loop and the outbox thread together: milliseconds a step, longer than
the step on a GPU). Here a probe's pairs own regions of one float32 array and their row counts sit
in one numpy column, so a step's group counts its rows with one fancy-indexed add and files them
with one fancy-indexed copy.

Threads: the step loop allocates regions at admission and counts rows; the outbox thread files
and reads results; regions are freed when their `ReadoutRows` goes, from whichever thread drops
it. `lock` covers the array, which allocation may replace with a larger copy.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np

from replicas.plans.positions import concatenated_ranges

INITIAL_ROWS = 4096


class ProbeStore:
    """One probe's rows: region r is data[start[r]:start[r] + size[r]], its first taken[r] filled."""

    def __init__(self, width: int, rows: int = INITIAL_ROWS):
        self.width = width
        self.lock = threading.Lock()
        self.data = np.empty((rows, width), np.float32)
        self.start = np.zeros(0, np.int64)
        self.size = np.zeros(0, np.int64)
        self.taken = np.zeros(0, np.int64)
        self.free_regions: list[int] = []  # region ids to reuse
        self.holes: list[tuple[int, int]] = [(0, rows)]  # free (start, size) spans of data, by start

    def allocate(self, rows: int) -> int:
        """A region of `rows` rows (its count at 0)."""
        with self.lock:
            start = self._take_span(max(rows, 1))
            if self.free_regions:
                region = self.free_regions.pop()
            else:
                region = len(self.start)
                grown = max(2 * region, 64)
                self.start, self.size, self.taken = (np.resize(column, grown) for column in (self.start, self.size, self.taken))
                self.free_regions = list(range(grown - 1, region, -1))
            self.start[region], self.size[region], self.taken[region] = start, max(rows, 1), 0
            return region

    def free(self, region: int) -> None:
        with self.lock:
            start, size = int(self.start[region]), int(self.size[region])
            self.size[region] = 0
            self.free_regions.append(region)
            self._give_span(start, size)

    def count(self, regions: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Where each region's next rows go, and count them taken (the step loop, for one step's
        group: its regions are distinct). Rows past a region's size are refused in `file`."""
        dests = self.taken[regions]
        self.taken[regions] = dests + counts
        return dests

    def file(self, regions: np.ndarray, dests: np.ndarray, counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Copy a step's rows (request i's counts[i] of them in order) to their regions; returns
        the members whose rows would pass their region's end, whose rows are left out."""
        with self.lock:
            over = dests + counts > self.size[regions]
            if over.any():
                keep = ~over
                rows = rows[concatenated_ranges((np.cumsum(counts) - counts)[keep], counts[keep])]
                regions, dests, counts = regions[keep], dests[keep], counts[keep]
            self.data[concatenated_ranges(self.start[regions] + dests, counts)] = rows
            return np.flatnonzero(over)

    def read(self, region: int) -> np.ndarray:
        """A copy of the region's filled rows."""
        with self.lock:
            start, n = int(self.start[region]), int(min(self.taken[region], self.size[region]))
            return self.data[start : start + n].copy()

    def _take_span(self, rows: int) -> int:
        for i, (start, size) in enumerate(self.holes):  # first fit; holes stay few: regions come and go together
            if size >= rows:
                self.holes[i : i + 1] = [(start + rows, size - rows)] if size > rows else []
                return start
        end = len(self.data)
        tail = self.holes.pop()[1] if self.holes and sum(self.holes[-1]) == end else 0
        grown = np.empty((max(2 * end, end - tail + rows), self.width), np.float32)
        grown[:end] = self.data
        self.data = grown
        if len(grown) > end - tail + rows:
            self.holes.append((end - tail + rows, len(grown) - (end - tail + rows)))
        return end - tail

    def _give_span(self, start: int, size: int) -> None:
        i = bisect.bisect(self.holes, (start, size))
        if i < len(self.holes) and start + size == self.holes[i][0]:  # merge with the next hole
            size += self.holes.pop(i)[1]
        if i and sum(self.holes[i - 1]) == start:  # and the one before
            start, size = self.holes[i - 1][0], self.holes[i - 1][1] + size
            i -= 1
            self.holes.pop(i)
        self.holes.insert(i, (start, size))


class ProbeStores:
    """A store per probe, made when a request first asks for it."""

    def __init__(self) -> None:
        self.stores: dict[str, ProbeStore] = {}
        self.lock = threading.Lock()

    def __getitem__(self, probe: str) -> ProbeStore:
        return self.stores[probe]

    def for_probe(self, probe: str, width: int) -> ProbeStore:
        with self.lock:
            store = self.stores.get(probe)
            if store is None:
                store = self.stores[probe] = ProbeStore(width)
            return store
