"""Where capture shards live: a local folder (the fast path) or any fsspec URL.

`open_store(url, field)` is the one place a capture folder's name becomes somewhere to read and
write; the shard writer (`replicas.shards.files`), the replica-side sink (`replicas.shards.sink`), the
driver's writer, the manifest and `load_capture` all go through the `Store` it returns.

- A plain path or a `file://` URL is a `LocalStore`: os calls, fsync, memory-mapped reads.
- Any other URL is an `FsspecStore` over the filesystem fsspec resolves it to (`s3://`, `gs://`,
  `abfs://`, `hdfs://`, `local://`, chained URLs such as `dir::`...), when its backend is
  installed where the store is opened; reads copy a shard into memory instead of mapping it.

What "atomic" means (a shard is published when its .safetensors name exists, so a reader, a
resume or a retried job sees a whole shard or none):
- local folders: temp name, fsync, `os.replace`, fsync of the folder: atomic and durable;
- fsspec filesystems with a move of their own (`local://`, sftp, hdfs...): temp name, then
  `fs.mv`, which is a rename: atomic;
- object stores (s3, gcs, azure; and `memory://`), which have none: the temp key is copied to
  the final key, then deleted. An object appears only whole, so the final key still never shows half a shard, at
  the cost of one server-side copy; a crash between copy and delete leaves a temp key that the
  next run deletes (`remove_temporaries`).
"""

from __future__ import annotations

import json
import mmap
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from replicas.api.errors import InvalidRequestError

Reach = Literal["node", "process", "cluster"]
Writer = Callable[[BinaryIO], Any]
LOCAL_SCHEMES = ("", "file")


def _temp_name(name: str) -> str:
    # Unique per call: two writers of one shard (a retried job while the first still runs) never share a file.
    return f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def is_temporary(name: str) -> bool:
    return name.startswith(".") and ".tmp-" in name


class LocalStore:
    """A folder on this node's filesystem."""

    reach: Reach = "node"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = str(path)

    def __str__(self) -> str:
        return self.url

    def mkdir(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def is_dir(self) -> bool:
        return self.path.is_dir()

    def names(self) -> list[str]:
        return [p.name for p in self.path.iterdir()] if self.path.is_dir() else []

    def exists(self, name: str) -> bool:
        return (self.path / name).exists()

    def read_bytes(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def open(self, name: str) -> BinaryIO:
        return open(self.path / name, "rb")  # the caller closes it

    def remove(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def map(self, name: str) -> Any:
        """The file as a read-only buffer: one memory map."""
        with open(self.path / name, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ValueError(f"{self.path / name} is empty")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def write_atomic(self, name: str, write: Writer) -> int:
        temp = self.path / _temp_name(name)
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name says the file exists
            size = f.tell()
        os.replace(temp, self.path / name)
        return size

    def sync(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)  # the renames themselves survive a power loss
        finally:
            os.close(fd)


class FsspecStore:
    """A folder on an fsspec filesystem (`fs`, the folder's path `root` on it)."""

    def __init__(self, url: str, fs: Any, root: str) -> None:
        from fsspec.implementations.local import LocalFileSystem
        from fsspec.implementations.memory import MemoryFileSystem

        self.url, self.fs, self.root = url, fs, root.rstrip("/")
        # A local or in-memory filesystem is only the same storage on the same node / in the same process.
        self.reach: Reach = "node" if isinstance(fs, LocalFileSystem) else "process" if isinstance(fs, MemoryFileSystem) else "cluster"

    def __str__(self) -> str:
        return self.url

    def _at(self, name: str) -> str:
        return f"{self.root}/{name}"

    def mkdir(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.root))

    def names(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False, refresh=True)]

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self._at(name)))

    def read_bytes(self, name: str) -> bytes:
        return self.fs.cat_file(self._at(name))

    def open(self, name: str) -> BinaryIO:
        return self.fs.open(self._at(name), "rb")

    def remove(self, name: str) -> None:
        if self.fs.exists(self._at(name)):
            self.fs.rm_file(self._at(name))

    def map(self, name: str) -> Any:
        data = self.read_bytes(name)
        if not data:
            raise ValueError(f"{self._at(name)} is empty")
        return np.frombuffer(data, np.uint8)  # read-only, like the local map

    def write_atomic(self, name: str, write: Writer) -> int:
        temp = self._at(_temp_name(name))
        try:
            with self.fs.open(temp, "wb") as f:
                write(f)
                size = f.tell()
            self._publish(temp, self._at(name))
        except BaseException:
            if self.fs.exists(temp):
                self.fs.rm_file(temp)
            raise
        return size

    def _publish(self, temp: str, final: str) -> None:
        from fsspec.spec import AbstractFileSystem

        if type(self.fs).mv is AbstractFileSystem.mv:
            # No move of its own (object stores, memory): the generic mv would also expand glob
            # characters ([, *) in the names, so copy the one file, then delete the temp.
            self.fs.cp_file(temp, final)
            self.fs.rm_file(temp)
        else:
            self.fs.mv(temp, final)  # the filesystem's own move: a rename (local, sftp, hdfs)

    def sync(self) -> None:
        """Nothing to do: fsspec has no directory fsync; the filesystem decides durability."""


Store = LocalStore | FsspecStore


def open_store(url: str | os.PathLike[str] | Store, field: str = "folder") -> Store:
    """The store a folder name or URL names. A URL fsspec cannot open (an unknown scheme, a
    backend not installed here) is an InvalidRequestError naming `field` and what is allowed."""
    if isinstance(url, (LocalStore, FsspecStore)):
        return url
    text = os.fspath(url)
    scheme, sep, rest = text.partition("://")
    if "::" not in text and (not sep or scheme in LOCAL_SCHEMES):
        return LocalStore(Path(rest if sep else text))
    try:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(text)
    except ImportError as exc:  # the scheme is known but its package is missing
        raise InvalidRequestError(f"{field}: {text!r} needs a package that is not installed here ({exc}); "
                                  f"install it where the shards are written, or use a local folder") from None
    except ValueError as exc:  # "Protocol not known"
        raise InvalidRequestError(f"{field}: {text!r}: {exc}; use a local folder, a file:// URL or a URL of a "
                                  f"filesystem fsspec knows ({', '.join(_known_protocols())})") from None
    return FsspecStore(text, fs, root)


def _known_protocols() -> list[str]:
    from fsspec.registry import known_implementations

    return sorted(known_implementations)[:40] + ["..."]


def write_json_to(store: Store, name: str, value: dict[str, Any]) -> None:
    store.write_atomic(name, lambda f: f.write((json.dumps(value, indent=2) + "\n").encode()))
    store.sync()
