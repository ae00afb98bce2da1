"""Capture output folders: safetensors shards, their indexes, the manifest, and `load_capture`.

A folder written by `capserve capture` holds:

    manifest.json               model (ModelInfo), hooks, options, input fingerprint, versions;
                                `complete: true` once every shard is written
    shard-000000.safetensors    one tensor per hook, rows of every input line of the shard
                                concatenated in line order: [rows, d_model] (one row per line when
                                reduced); plus int64 [rows] row index tensors `capserve.line`
                                (0-based input line), `capserve.position` (token position, -1 when
                                reduced) and `capserve.token_id` (token at it, -1 when reduced)
    shard-000000.jsonl          one record per captured input line: line, row (first row in the
                                shard), rows, prompt_token_ids, positions, token_ids (generated),
                                replica, id (when the input line had one); or line + error

Shard k covers input lines [k * shard_lines, (k + 1) * shard_lines), so a rerun knows which
lines a finished shard holds without reading it. A shard is finished exactly when its
.safetensors file exists: the .jsonl is renamed into place first and the .safetensors last,
each written to a temporary name, fsynced and renamed, so a crash leaves either a whole shard or
no shard (plus a temporary file that the next run deletes). The folder may be an fsspec URL
(`replicas.shards.store`, which says what atomic means there); local folders are memory-mapped,
other filesystems are read a shard at a time into memory.

The .safetensors files are written and read here directly (8-byte header length, JSON header,
raw little-endian data): the format is simple, bfloat16 needs no torch, and the loader maps the
file once instead of copying it. `safetensors.safe_open` reads the files too (torch for BF16).
This module imports neither Ray nor torch.
"""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replicas.api.arrays import DTYPES
from replicas.shards.files import (  # noqa: F401  (the writing half, re-exported: one format module to import)
    _ST_DTYPES,
    FORMAT,
    INDEX_TENSORS,
    LineRows,
    shard_name,
    write_json,
    write_safetensors,
    write_shard,
)
from replicas.shards.store import LocalStore, Store, is_temporary, open_store

MANIFEST = "manifest.json"
_NP_DTYPES = {code: DTYPES[name] for name, code in _ST_DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit
_OPEN_SHARDS = 64  # each open map holds a file descriptor; keep well under `ulimit -n`


def remove_temporaries(folder: Path | str | Store) -> int:
    """Delete what an interrupted run left half-written; returns how many files."""
    store = open_store(folder)
    stale = [name for name in store.names() if is_temporary(name)]
    for name in stale:
        store.remove(name)
    return len(stale)


def finished_shards(folder: Path | str | Store) -> set[int]:
    """Shard numbers whose .safetensors file (the commit) exists."""
    found = set()
    for name in open_store(folder).names():
        number = name.removeprefix("shard-").removesuffix(".safetensors")
        if name.startswith("shard-") and name.endswith(".safetensors") and number.isdigit():
            found.add(int(number))
    return found


# ---------------------------------------------------------------- reading


def read_header(buffer: Any) -> tuple[dict[str, Any], int]:
    """The JSON header and where the data starts, from a bytes-like object or a map."""
    if len(buffer) < 8:
        raise ValueError("not a safetensors file: shorter than its 8-byte header length")
    (size,) = struct.unpack("<Q", bytes(buffer[:8]))
    if size > _MAX_HEADER or 8 + size > len(buffer):
        raise ValueError(f"not a safetensors file: header length {size} does not fit in {len(buffer)} bytes")
    return json.loads(bytes(buffer[8 : 8 + size])), 8 + size


def tensors_from_buffer(buffer: Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Zero-copy numpy views of every tensor in a safetensors buffer, and its metadata."""
    header, start = read_header(buffer)
    metadata = header.pop("__metadata__", None) or {}
    out = {}
    for name, spec in header.items():
        dtype = _NP_DTYPES.get(spec["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} has dtype {spec['dtype']}; capserve reads {', '.join(_NP_DTYPES)}")
        begin, end = spec["data_offsets"]
        count = (end - begin) // dtype.itemsize
        out[name] = np.frombuffer(buffer, dtype=dtype, count=count, offset=start + begin).reshape(spec["shape"])
    return out, metadata


def map_shard(path: Path | str, store: Store | None = None) -> dict[str, np.ndarray]:
    """Read-only arrays of one shard file, views of one buffer (a memory map on a local folder).
    `path` is the file, or its name in `store`."""
    if store is None:
        store, path = LocalStore(Path(path).parent), Path(path).name
    return tensors_from_buffer(store.map(str(path)))[0]


class RowArray:
    """Rows of one tensor over every shard, in input order, without copying the shards.

    Indexing with an int, a slice or an int array reads just those rows (a copy); `parts` are
    the per-shard memory maps; `np.asarray(rows)` reads everything. Shards are mapped on first
    access and at most 64 maps are kept open at once.
    """

    def __init__(self, capture: Capture, name: str) -> None:
        self._capture = capture
        self.name = name
        first = capture._tensor(0, name) if capture.shards else None
        tail = list(first.shape[1:]) if first is not None else []
        self.shape = (capture.rows, *tail)
        self.dtype = first.dtype if first is not None else np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def parts(self) -> list[np.ndarray]:
        return [self._capture._tensor(i, self.name) for i in range(len(self._capture.shards))]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)):
            row = int(key) + len(self) if key < 0 else int(key)
            if not 0 <= row < len(self):
                raise IndexError(f"row {key} is out of range for {len(self)} rows")
            shard = int(np.searchsorted(self._capture.row_starts, row, side="right")) - 1
            return self._capture._tensor(shard, self.name)[row - self._capture.row_starts[shard]]
        rows = np.arange(len(self))[key] if isinstance(key, slice) else np.asarray(key, dtype=np.int64)
        rows = np.where(rows < 0, rows + len(self), rows)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        out = np.empty((len(rows), *self.shape[1:]), dtype=self.dtype)
        shards = np.searchsorted(self._capture.row_starts, rows, side="right") - 1
        for shard in np.unique(shards):
            mask = shards == shard
            out[mask] = self._capture._tensor(int(shard), self.name)[rows[mask] - self._capture.row_starts[shard]]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        parts = self.parts
        whole = np.concatenate(parts) if parts else np.empty(self.shape, self.dtype)
        return whole if dtype is None else whole.astype(dtype)

    def __repr__(self) -> str:
        return f"RowArray({self.name!r}, shape={self.shape}, dtype={self.dtype}, shards={len(self._capture.shards)})"


@dataclass
class Capture:
    """A loaded capture folder: `capture[hook]` -> RowArray [rows, d_model] in input order;
    `capture.line/position/token_id` -> RowArray [rows] (row -> 0-based input line, token
    position, token id); `capture.records()` -> per-line index records (`row` global)."""

    folder: Path | str  # as given: a path, or an fsspec URL
    manifest: dict[str, Any]
    shards: list[str]  # file names in the folder, in shard order
    row_starts: np.ndarray  # first global row of each shard, plus the total at the end
    store: Store = field(repr=False, default=None)  # type: ignore[assignment]  # set by load_capture
    _maps: OrderedDict[int, dict[str, np.ndarray]] = field(default_factory=OrderedDict, repr=False)

    @property
    def hooks(self) -> list[str]:
        return list(self.manifest["hooks"])

    @property
    def rows(self) -> int:
        return int(self.row_starts[-1])

    def __getitem__(self, hook: str) -> RowArray:
        if hook not in self.manifest["hooks"] and hook not in INDEX_TENSORS:
            raise KeyError(f"hook {hook!r} was not captured; this folder has {', '.join(self.hooks)}")
        return RowArray(self, hook)

    @property
    def line(self) -> RowArray:
        return RowArray(self, "capserve.line")

    @property
    def position(self) -> RowArray:
        return RowArray(self, "capserve.position")

    @property
    def token_id(self) -> RowArray:
        return RowArray(self, "capserve.token_id")

    def records(self) -> Iterator[dict[str, Any]]:
        """Index records of every captured line in input order; `row` is the global first row."""
        for shard, name in enumerate(self.shards):
            with self.store.open(name.removesuffix(".safetensors") + ".jsonl") as f:
                for text in f:
                    record = json.loads(text)
                    record["row"] += int(self.row_starts[shard])
                    yield record

    def _tensor(self, shard: int, name: str) -> np.ndarray:
        maps = self._maps.get(shard)
        if maps is None:
            maps = self._maps[shard] = map_shard(self.shards[shard], self.store)
            while len(self._maps) > _OPEN_SHARDS:
                self._maps.popitem(last=False)  # views handed out keep their own map alive
        self._maps.move_to_end(shard)
        return maps[name]


def load_capture(folder: str | os.PathLike[str], allow_partial: bool = False) -> Capture:
    """Open a `capserve capture` output folder (a path or an fsspec URL): arrays per hook
    (memory-mapped on a local folder) plus the index.

    A folder whose run has not finished raises (naming the missing shards) unless
    `allow_partial=True`, which loads the finished shards only."""
    store = open_store(folder, "folder")
    root = store.path if isinstance(store, LocalStore) else store.url
    if not store.exists(MANIFEST):
        raise FileNotFoundError(f"{root} has no {MANIFEST}; is it a `capserve capture --out` folder?")
    manifest = json.loads(store.read_bytes(MANIFEST))
    numbers = sorted(finished_shards(store))
    if not manifest.get("complete") and not allow_partial:
        expected = manifest.get("n_shards")
        missing = sorted(set(range(expected)) - set(numbers)) if expected is not None else "unknown"
        raise ValueError(
            f"the capture in {root} is not complete (finished shards: {len(numbers)}, missing: {missing}); "
            "rerun the same `capserve capture` command to finish it, or pass allow_partial=True"
        )
    shards = [f"{shard_name(k)}.safetensors" for k in numbers]
    counts = [shard_rows(store, name) for name in shards]
    return Capture(root, manifest, shards, np.cumsum([0] + counts).astype(np.int64), store)


def shard_rows(store: Store, name: str) -> int:
    """Rows of a finished shard, from its header alone."""
    with store.open(name) as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return int(header["capserve.line"]["shape"][0])

