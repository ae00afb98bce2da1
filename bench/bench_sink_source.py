"""What a shard writer's source costs it: the same shard files written from a buffer the process
has touched, from a fresh mapping of a shared-memory file (as a replica maps the worker's arena:
the first read of each page faults it into the mapping) and from that mapping again; then from
the touched buffer in 4 MiB pieces (a line's rows of one hook) while another thread of the
process runs Python (as a replica's event loop does), written vectored (the shard writer) and
with one write call per piece (the writer before: each call's return waits for the GIL). With
--fill-gb, last, shard files written batch by batch and all kept, as bench_dataset's case c keeps
its shards: the sink folder's speed as it takes a case's volume (tmpfs allocates every page anew).
With --fill-passes, that fill again right after the last pass's files were deleted: in a VM that
hands freed memory back to its host (free page reporting), memory the guest has not touched lately
costs a fault in the host on first touch, and a pass into pages just freed does not pay it.

    python -m bench.bench_sink_source --folder /dev/shm --gb 8 --threads 4 --fill-gb 72 --fill-passes 2 --out DIR   # GPU host
    python -m bench.bench_sink_source --gb 1 --threads 2 --out /tmp                                 # CPU smoke run

`capserve capture`'s replica-side writers read the arena (bench_dataset case c); its probe of the
sink folder writes from a touched buffer. Each round runs the sources in turn (a new mapping each
round); reported per round and as medians, with each source's ratio to the touched buffer.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_result

SOURCES = ("touched buffer", "fresh mapping (first touch)", "the same mapping again")
BUSY = ("4 MiB pieces, process busy, vectored", "4 MiB pieces, process busy, one write each")
PIECE_BYTES = 4 << 20  # bench_dataset case c: 512 rows x 4,096 bf16 per line and hook


@contextmanager
def busy_python() -> Iterator[None]:
    """Another thread running Python the whole time, wanting the GIL back whenever it lets go."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def sink_write_speed(folder: Path, threads: int, total_bytes: int, file_bytes: int, source: np.ndarray | None = None,
                     piece_bytes: int | None = None, one_write_each: bool = False, by_batch: bool = False) -> dict[str, Any]:
    """GB/s of shard-sized safetensors files written into `folder` by `threads` threads, through
    the shard writer's own atomic write (temp name, fsync, rename); all kept until the last is
    written, then deleted. The files hold one random buffer, or consecutive slices of `source`
    (uint8) when given; each in one piece, or in pieces of `piece_bytes` as a shard holds its
    lines' rows per hook, written by one write call each with `one_write_each` (the shard writer
    before it wrote vectored). With `by_batch`, also each batch of `threads` files' GB/s and the
    GB the folder held after it (`batches`): how the sink slows as it fills."""
    from replicas.shards.files import write_safetensors
    from replicas.shards.store import open_store

    file_bytes = max(1 << 20, min(file_bytes, total_bytes // threads)) // 4 * 4
    files = max(threads, total_bytes // file_bytes)
    chunk = np.random.default_rng(0).integers(0, 255, file_bytes, dtype=np.uint8) if source is None else None
    probe = folder / "write-probe"
    store = open_store(probe)
    store.mkdir()

    def one(i: int) -> int:
        if source is None:
            data = chunk
        else:
            start = i * file_bytes % (len(source) - file_bytes + 1)
            data = source[start : start + file_bytes]
        step = piece_bytes or file_bytes
        pieces = [data[at : at + step].view(np.int32) for at in range(0, file_bytes, step)]
        tensors = [("x", "int32", [file_bytes // 4], pieces)]
        return store.write_atomic(f"probe-{i:04d}.safetensors",
                                  lambda f: write_safetensors(_OneWriteEach(f) if one_write_each else f, tensors, {}))

    batches, written, per_batch = [], 0, threads if by_batch else files
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for first in range(0, files, per_batch):
            began = time.perf_counter()
            in_batch = sum(pool.map(one, range(first, min(first + per_batch, files))))
            written += in_batch
            batches.append({"gb_held": written / 1e9, "gb_per_s": in_batch / (time.perf_counter() - began) / 1e9})
    seconds = time.perf_counter() - started
    shutil.rmtree(probe)
    return {"folder": str(folder), "threads": threads, "files": files, "file_mb": file_bytes / 1e6,
            "gb": written / 1e9, "seconds": seconds, "gb_per_s": written / seconds / 1e9} | ({"batches": batches} if by_batch else {})


class _OneWriteEach:
    """A file seen only through `write`: the shard writer then writes piece by piece."""

    def __init__(self, f: Any) -> None:
        self.write = f.write


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = int(args.gb * 1e9) // 4 * 4
    file_bytes = min(args.file_mb << 20, size)  # each file is a slice of the source
    folder = Path(args.folder)
    fd, arena = tempfile.mkstemp(prefix="capserve-sink-source-", dir=args.arena_dir)
    rounds: dict[str, list[float]] = {source: [] for source in (*SOURCES, *BUSY)}
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as worker:  # the worker's writes, through its own mapping
            np.frombuffer(worker, np.uint8)[:] = 7  # a view dropped at once, so the mapping can close
        touched = np.full(size, 7, np.uint8)
        for r in range(args.rounds):
            mapping = mmap.mmap(fd, 0)  # as ArenaReader maps the arena file
            fresh = np.frombuffer(mapping, np.uint8)
            for source, array in zip(SOURCES, (touched, fresh, fresh)):
                speed = sink_write_speed(folder, args.threads, size, file_bytes, array)["gb_per_s"]
                rounds[source].append(speed)
                print(f"round {r}: {source:42s} {speed:6.2f} GB/s", flush=True)
            for source, one_write_each in zip(BUSY, (False, True)):
                with busy_python():
                    speed = sink_write_speed(folder, args.threads, size, file_bytes, touched, PIECE_BYTES,
                                             one_write_each)["gb_per_s"]
                rounds[source].append(speed)
                print(f"round {r}: {source:42s} {speed:6.2f} GB/s", flush=True)
            del fresh, array  # the mapping's last views: it closes now
            mapping.close()
        # the sink as bench_dataset's case c fills it: shards kept until the last is written
        fills = [sink_write_speed(folder, args.threads, int(args.fill_gb * 1e9), file_bytes, touched, by_batch=True)
                 for _ in range(args.fill_passes if args.fill_gb else 0)]
    finally:
        os.close(fd)
        os.unlink(arena)
    medians = {source: statistics.median(values) for source, values in rounds.items()}
    base = medians[SOURCES[0]]
    return {"folder": str(folder), "gb": size / 1e9, "threads": args.threads, "file_mb": args.file_mb,
            "gb_per_s": rounds, "median_gb_per_s": medians, "vs_touched": {s: m / base for s, m in medians.items()},
            "fills": fills}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default="/dev/shm", help="the sink folder the shards go to")
    parser.add_argument("--arena-dir", default="/dev/shm", help="where the stand-in arena file lives")
    parser.add_argument("--gb", type=float, default=8.0, help="bytes written per source and round")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--file-mb", type=int, default=1800, help="shard size (bench_dataset case c: ~1,880 MB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fill-gb", type=float, default=0.0,
                        help="then write this much, every file kept, reporting each batch's GB/s (0: skip)")
    parser.add_argument("--fill-passes", type=int, default=1, help="fills, each right after the last one's files were deleted")
    parser.add_argument("--label", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run(args)
    for source, median in result["median_gb_per_s"].items():
        print(f"{source:42s} {median:6.2f} GB/s  ({result['vs_touched'][source]:.2f}x the touched buffer)")
    for k, fill in enumerate(result["fills"]):
        print(f"fill pass {k}: {fill['gb_per_s']:6.2f} GB/s over {fill['gb']:.1f} GB")
        for batch in fill["batches"]:
            print(f"  {batch['gb_per_s']:6.2f} GB/s, the folder then holding {batch['gb_held']:.1f} GB")
    print(f"wrote {write_result(f'sink_source_{args.label}', result, args.out)}")


if __name__ == "__main__":
    main()
