"""Does the arena's state slow a shard writer that reads it? (bench_dataset case c: a replica's
writers ran at 0.74 GB/s each from the arena, 2-2.6 GB/s each in probes from plain memory.)

    python bench/gpu/pinned_source.py --out DIR     # GPU host, plain torch (no numpy, no vLLM), ~1 min

A shared-memory file stands in for the arena. This process maps it, as a replica maps the
worker's arena, and its threads write shard-sized files into /dev/shm from that mapping, each file
by vectored writes of 4 MiB pieces (as `replicas.shards.files.write_pieces` does). Modes:
  mapped      only this process maps the file (the probes' case)
  registered  another process has mapped it and registered it with cudaHostRegister (portable,
              mapped), as the worker registers its arena
  dma         that process also copies from the GPU into it meanwhile, at --dma-gbps, as the
              worker fills the arena while the writers read it
Each round runs the modes in turn; reported per round and as medians, each against `mapped`.
The registration goes through ctypes as copy_paths.py does (a bare GPU host lacks `replicas`'s
packages).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

PIECE = 4 << 20
IOV_MAX = 1024
MODES = ("mapped", "registered", "dma")


def write_files(source: memoryview, folder: str, threads: int, file_bytes: int, total: int) -> float:
    """GB/s of `total` bytes written as files of `file_bytes`, consecutive slices of `source`."""
    files = max(threads, total // file_bytes)

    def one(i: int) -> int:
        start = i * file_bytes % (len(source) - file_bytes + 1)
        pieces = [source[at : min(at + PIECE, start + file_bytes)] for at in range(start, start + file_bytes, PIECE)]
        fd = os.open(os.path.join(folder, f"piece-{i:04d}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while pieces:
                written = os.writev(fd, pieces[:IOV_MAX])
                while pieces and written >= len(pieces[0]):
                    written -= len(pieces[0])
                    pieces.pop(0)
                if written:
                    pieces[0] = pieces[0][written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        return file_bytes

    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        written = sum(pool.map(one, range(files)))
    seconds = time.perf_counter() - began
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    return written / seconds / 1e9


def worker(path: str, size: int, dma_gbps: float, registered: mp.Event, copying: mp.Event, stop: mp.Event) -> None:
    """The stand-in worker: map and register the file, then copy into it from the GPU while asked."""
    import torch
    from copy_paths import REGISTER_PORTABLE_MAPPED, cudart  # beside this script

    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), size)
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    lib = cudart()
    code = lib.cudaHostRegister(ctypes.c_void_p(host.data_ptr()), ctypes.c_size_t(size), ctypes.c_uint(REGISTER_PORTABLE_MAPPED))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister failed: {code}")
    chunk = 256 << 20
    device = torch.full((chunk,), 3, dtype=torch.uint8, device="cuda")
    registered.set()
    offset = 0
    while not stop.is_set():
        if not copying.wait(0.05):
            continue
        began = time.perf_counter()
        host[offset : offset + chunk].copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        offset = (offset + chunk) % (size - chunk)
        time.sleep(max(0.0, chunk / (dma_gbps * 1e9) - (time.perf_counter() - began)))  # hold the rate
    lib.cudaHostUnregister(ctypes.c_void_p(host.data_ptr()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=8.0, help="size of the stand-in arena, and bytes written per mode and round")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--file-mb", type=int, default=1800, help="file size (case c's shards: ~1,880 MB)")
    parser.add_argument("--dma-gbps", type=float, default=9.0, help="GPU -> arena rate in the dma mode")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", default="/dev/shm")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    size = int(args.gb * 1e9) // PIECE * PIECE
    fd, path = tempfile.mkstemp(prefix="capserve-pinned-source-", dir="/dev/shm")
    out_folder = tempfile.mkdtemp(prefix="capserve-pinned-out-", dir=args.folder)
    os.posix_fallocate(fd, 0, size)
    mapping = mmap.mmap(fd, size)
    source = memoryview(mapping)
    pattern = b"\7" * PIECE
    for at in range(0, size, PIECE):  # the worker's earlier writes: every page faulted in
        source[at : at + PIECE] = pattern
    ctx = mp.get_context("spawn")
    registered, copying, stop = ctx.Event(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=worker, args=(path, size, args.dma_gbps, registered, copying, stop), daemon=True)
    rounds: dict[str, list[float]] = {mode: [] for mode in MODES}
    total = int(args.gb * 1e9)
    try:
        for r in range(args.rounds):
            for mode in MODES:
                if mode == "registered" and not child.is_alive():
                    child.start()
                    while not registered.wait(1):
                        if not child.is_alive():
                            raise RuntimeError(f"the stand-in worker exited ({child.exitcode}) before registering the file")
                if mode == "dma":
                    copying.set()
                speed = write_files(source, out_folder, args.threads, args.file_mb << 20, total)
                copying.clear()
                rounds[mode].append(speed)
                print(f"round {r}: {mode:10s} {speed:6.2f} GB/s", flush=True)
    finally:
        stop.set()
        if child.is_alive():
            child.join(30)
        source.release()
        mapping.close()
        os.close(fd)
        os.unlink(path)
        os.rmdir(out_folder)
    medians = {mode: statistics.median(values) for mode, values in rounds.items()}
    result = {"gb": args.gb, "threads": args.threads, "file_mb": args.file_mb, "dma_gbps": args.dma_gbps,
              "gb_per_s": rounds, "median_gb_per_s": medians,
              "vs_mapped": {mode: medians[mode] / medians["mapped"] for mode in MODES}}
    for mode in MODES:
        print(f"{mode:10s} {medians[mode]:6.2f} GB/s ({result['vs_mapped'][mode]:.2f}x mapped)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pinned_source_h200.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
