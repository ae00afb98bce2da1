"""Writing capture shards: the half of the shard format a replica needs to publish its own shards.

`provider.dataset.shards` documents the folder layout and holds the reader (`load_capture`); it
re-exports everything here. This module sits on the ground floor (numpy only) so that an
EngineReplica writing shards itself (`replicas.shards.sink`) and the driver-side writer
(`provider.dataset.harvest`) write byte-identical files through the same code.

A shard is published atomically: the .jsonl index is renamed into place first and the
.safetensors last, each written to a temporary name and renamed (`replicas.shards.store` says
what that means on each filesystem); the .safetensors file is the commit.
"""

from __future__ import annotations

import io
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replicas.api.arrays import DTYPES
from replicas.shards.store import LocalStore, Store, open_store, write_json_to

FORMAT = "capserve-capture/1"
INDEX_TENSORS = ("capserve.line", "capserve.position", "capserve.token_id")
_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32"}


def shard_name(k: int) -> str:
    return f"shard-{k:06d}"


# ---------------------------------------------------------------- writing


@dataclass
class LineRows:
    """What one input line contributed to a shard: its rows per hook, and its index record."""

    line: int
    arrays: dict[str, np.ndarray]  # hook -> [rows, d_model]
    positions: list[int]  # per row; -1 when reduced
    token_ids: list[int]  # per row; -1 when reduced
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.positions)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def write_shard(folder: Path | str | Store, k: int, lines: list[LineRows], hooks: list[str], dtype: str, d_model: int) -> int:
    """Write shard k atomically into a folder or fsspec URL (index first, tensors last: the
    tensors file is the commit). Returns the bytes written."""
    store = open_store(folder)
    lines = sorted(lines, key=lambda item: item.line)
    starts = np.cumsum([0] + [item.rows for item in lines])
    records = [{"line": item.line, "row": int(start), "rows": item.rows, **item.record} for item, start in zip(lines, starts)]
    index_text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    store.write_atomic(f"{shard_name(k)}.jsonl", lambda f: f.write(index_text.encode()))
    tensors = _shard_tensors(lines, hooks, dtype, d_model)
    size = store.write_atomic(f"{shard_name(k)}.safetensors", lambda f: write_safetensors(f, tensors, {"format": FORMAT}))
    store.sync()
    return size + len(index_text)


def _shard_tensors(lines: list[LineRows], hooks: list[str], dtype: str, d_model: int) -> list[tuple[str, str, list[int], list[np.ndarray]]]:
    """(name, dtype, shape, chunks) per tensor; chunks are the lines' own arrays, never concatenated."""
    rows = sum(item.rows for item in lines)
    tensors = [(hook, dtype, [rows, d_model], [item.arrays[hook] for item in lines if item.rows]) for hook in hooks]
    columns = {
        "capserve.line": [np.full(item.rows, item.line, np.int64) for item in lines],
        "capserve.position": [np.asarray(item.positions, np.int64) for item in lines],
        "capserve.token_id": [np.asarray(item.token_ids, np.int64) for item in lines],
    }
    return tensors + [(name, "int64", [rows], chunks) for name, chunks in columns.items()]


def write_safetensors(f: Any, tensors: list[tuple[str, str, list[int], list[np.ndarray]]], metadata: dict[str, str]) -> int:
    """Stream tensors, each given as row chunks in order, into an open binary file."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, chunks in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        got = sum(c.nbytes for c in chunks)
        if got != nbytes:
            raise ValueError(f"tensor {name!r}: chunks hold {got} bytes, shape {shape} {dtype} needs {nbytes}")
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, so every map is aligned
    f.write(struct.pack("<Q", len(raw)) + raw)
    pieces = []
    for name, dtype, _, chunks in tensors:
        for chunk in chunks:
            if chunk.dtype != DTYPES[dtype]:
                raise TypeError(f"tensor {name!r}: a chunk has dtype {chunk.dtype}, the shard stores {dtype}")
            pieces.append(np.ascontiguousarray(chunk).view(np.uint8).reshape(-1).data)  # bf16 has no buffer format; bytes do
    write_pieces(f, pieces)
    return 8 + len(raw) + offset


IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024  # buffers one writev takes (Linux: 1,024)


def write_pieces(f: Any, pieces: list[memoryview]) -> None:
    """Write byte buffers in order. Into an OS file, as few `os.writev` calls as the OS allows:
    each releases the GIL once for many buffers. A writer thread that returns to Python between
    pieces waits for the GIL, up to the interpreter's switch interval (5 ms) while another thread
    runs Python (a replica's event loop): on the H200 host 4 MiB pieces written one call each went
    at 0.20x the speed of whole files, vectored at 0.86x (`bench/bench_sink_source.py`)."""
    if not isinstance(f, (io.BufferedWriter, io.FileIO)):
        for piece in pieces:
            f.write(piece)
        return
    f.flush()  # what went through the buffer (the header) comes first
    pending = [piece for piece in pieces if len(piece)]
    while pending:
        written = os.writev(f.fileno(), pending[:IOV_MAX])
        done = 0
        while done < len(pending) and written >= len(pending[done]):  # a short write ends inside a piece
            written -= len(pending[done])
            done += 1
        pending = pending[done:]
        if written:
            pending[0] = pending[0][written:]


def write_json(path: Path, value: dict[str, Any]) -> None:
    """A JSON file in a local folder, written atomically."""
    write_json_to(LocalStore(path.parent), path.name, value)
