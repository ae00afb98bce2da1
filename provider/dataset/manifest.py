"""The manifest of a capture folder: create it, check a rerun against it, mark it complete.

It pins what decides a shard's content (the options, the model, the input's fingerprint), so a
rerun that would mix shards of two different captures fails and names what differs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from provider.dataset.options import CaptureOptions
from provider.dataset.shards import (
    FORMAT,
    MANIFEST,
    finished_shards,
    remove_temporaries,
    shard_name,
    shard_rows,
)
from replicas.api import ModelInfo
from replicas.shards.store import LocalStore, Store, open_store, write_json_to


class ManifestMismatch(ValueError):
    """The output folder was started with other options, another model or another input."""


def open_folder(out: Path | Store, options: CaptureOptions, info: ModelInfo, source: dict[str, Any], n_lines: int, backend: str) -> dict[str, Any]:
    """Create the folder and its manifest, or check that a rerun matches the one there."""
    out = open_store(out)
    out.mkdir()
    if not out.exists(MANIFEST):
        if any(name.startswith("shard-") for name in out.names()):  # not ours: never overwrite
            raise ManifestMismatch(f"{out} holds shards but no {MANIFEST}; use an empty or new --out folder")
        manifest = new_manifest(options, info, source, n_lines, backend)
        write_json_to(out, MANIFEST, manifest)
        return manifest
    manifest = json.loads(out.read_bytes(MANIFEST))
    check_resume(manifest, options, info, source, out)
    remove_temporaries(out)
    return manifest


def lock_folder(out: Path | Store) -> Any:
    """Hold an exclusive lock on the folder for the whole run (released when the process dies,
    however it dies): two runs writing the same shards would only waste work, but say so. fsspec
    filesystems have no such lock: two runs on one URL go undetected (each shard stays whole)."""
    out = open_store(out)
    if not isinstance(out, LocalStore):
        return contextlib.ExitStack()  # a handle whose close() has nothing to release
    out.mkdir()
    handle = open(out.path / ".lock", "w")  # noqa: SIM115  held open for the run: the lock lives with it
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ManifestMismatch(f"another `capserve capture` is writing to {out}; wait for it or use another --out") from None
    return handle


def new_manifest(options: CaptureOptions, info: ModelInfo, source: dict[str, Any], n_lines: int, backend: str) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "model": info.model_dump(),
        "hooks": list(options.hooks),
        "options": options.pinned(),
        "input": source,
        "n_lines": n_lines,
        "n_shards": math.ceil(n_lines / options.shard_lines),
        "versions": versions(),
        "backend": backend,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "complete": False,
    }


def check_resume(manifest: dict[str, Any], options: CaptureOptions, info: ModelInfo, source: dict[str, Any], out: Store) -> None:
    if manifest.get("format") != FORMAT:
        raise ManifestMismatch(f"{out}/{MANIFEST} has format {manifest.get('format')!r}, not {FORMAT!r}")
    wanted = {f"options.{k}": v for k, v in options.pinned().items()}
    wanted |= {f"model.{k}": getattr(info, k) for k in ("model", "d_model", "n_layers")}
    wanted |= {f"input.{k}": source[k] for k in ("size", "sha256_first_mib")}
    had = {f"options.{k}": v for k, v in manifest["options"].items()}
    had |= {f"model.{k}": manifest["model"].get(k) for k in ("model", "d_model", "n_layers")}
    had |= {f"input.{k}": manifest["input"].get(k) for k in ("size", "sha256_first_mib")}
    diffs = [f"{key}: folder has {had.get(key)!r}, this run has {value!r}" for key, value in wanted.items() if had.get(key) != value]
    if diffs:
        raise ManifestMismatch(
            f"{out} was started by a different capture, so its shards cannot be resumed:\n  " + "\n  ".join(diffs)
            + "\nRerun with the folder's options and input, or write to a new --out folder."
        )


def finish_manifest(out: Path | Store, manifest: dict[str, Any], n_lines: int) -> bool:
    """Mark the folder complete when every shard of the input's `n_lines` lines exists."""
    out = open_store(out)
    n_shards = math.ceil(n_lines / manifest["options"]["shard_lines"])
    complete = set(range(n_shards)) <= finished_shards(out)
    if complete:
        rows = sum(_rows_of(out, k) for k in range(n_shards))
        finished = datetime.now(UTC).isoformat(timespec="seconds")
        write_json_to(out, MANIFEST, {**manifest, "n_lines": n_lines, "n_shards": n_shards, "rows": rows, "complete": True, "finished": finished})
    return complete


def _rows_of(out: Store, k: int) -> int:
    return shard_rows(out, f"{shard_name(k)}.safetensors")


def versions() -> dict[str, str]:
    found = {"python": sys.version.split()[0], "numpy": np.__version__}
    for name in ("capserve", "ray", "httpx"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "source checkout" if name == "capserve" else "not installed"
    return found


