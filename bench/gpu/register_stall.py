"""Does registering arena memory with CUDA on one thread stall the step loop on another?

    python bench/gpu/register_stall.py --out DIR     # GPU host, plain torch (no vLLM), ~1 min

The arena grows by 128 MiB chunks (fallocate, then cudaHostRegister) on a thread of its own
(`HostArena.grow_ahead`) while the step loop launches forwards. A stand-in step loop runs steps
of a few milliseconds on the GPU (matmuls captured in one CUDA graph, a few small kernels, one
event sync a step behind, as vLLM's async scheduling does); meanwhile another thread:
  idle        does nothing (the baseline)
  fallocate   reserves and faults in shared-memory chunks, no CUDA call
  register    reserves chunks and registers each with one cudaHostRegister
  pieces      the same in 8 MiB pieces, pausing after each as long as it took (what the arena does:
              `HostArena._register`)
  unregister  unregisters the chunks `register` registered (what `shrink` does)
Reported: the step loop's steps per second against idle, and each call's duration.

It calls cudaHostRegister through ctypes as copy_paths.py does, not through `replicas`, for the
reason copy_paths.py gives: a bare GPU host lacks the packages `replicas` imports.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from copy_paths import REGISTER_PORTABLE_MAPPED, cudart  # beside this script: run it as a file

CHUNK = 128 << 20
PIECE = 8 << 20


def step_loop(running: Callable[[], bool], graph: torch.cuda.CUDAGraph, small: torch.Tensor) -> tuple[float, float]:
    """(steps per second, longest step in ms) of the stand-in loop while running(), the CPU one
    step ahead of the GPU."""
    previous = None
    steps, began = 0, time.perf_counter()
    longest, last = 0.0, began
    while running():
        graph.replay()
        for _ in range(20):  # the step's own small launches (sampling, bookkeeping)
            small.add_(1)
        event = torch.cuda.Event()
        event.record()
        if previous is not None:
            previous.synchronize()
        previous = event
        steps += 1
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - began), 1e3 * longest


def for_seconds(seconds: float) -> Callable[[], bool]:
    end = time.perf_counter() + seconds
    return lambda: time.perf_counter() < end


def background(kind: str, lib: ctypes.CDLL, fd: int, base: int, chunks: range, calls: list[float]) -> None:
    """One call of `kind` per chunk of the file (mapped at base), 10 ms apart."""
    for chunk in chunks:
        address, offset = base + chunk * CHUNK, chunk * CHUNK
        began = time.perf_counter()
        if kind == "fallocate":
            os.posix_fallocate(fd, offset, CHUNK)
            ctypes.memset(address, 0, CHUNK)
        elif kind == "register":
            os.posix_fallocate(fd, offset, CHUNK)
            assert lib.cudaHostRegister(ctypes.c_void_p(address), ctypes.c_size_t(CHUNK), ctypes.c_uint(REGISTER_PORTABLE_MAPPED)) == 0
        elif kind == "pieces":
            os.posix_fallocate(fd, offset, CHUNK)
            for piece in range(address, address + CHUNK, PIECE):
                piece_began = time.perf_counter()
                assert lib.cudaHostRegister(ctypes.c_void_p(piece), ctypes.c_size_t(PIECE), ctypes.c_uint(REGISTER_PORTABLE_MAPPED)) == 0
                time.sleep(time.perf_counter() - piece_began)
        elif kind == "unregister":
            assert lib.cudaHostUnregister(ctypes.c_void_p(address)) == 0
        calls.append(time.perf_counter() - began)
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="of each idle round")
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--matmuls", type=int, default=3, help="8192^2 bf16 matmuls a step (~0.6 ms each on an H200)")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    lib = cudart()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    small = torch.zeros(64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            torch.mm(a, a)
        graph.capture_begin()
        for _ in range(args.matmuls):
            torch.mm(a, a)
        graph.capture_end()
    torch.cuda.synchronize()
    step_loop(for_seconds(1.0), graph, small)  # warm-up
    size = 3 * args.chunks * CHUNK
    path = os.path.join(tempfile.mkdtemp(dir="/dev/shm"), "arena.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    memory = mmap.mmap(fd, size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "chunk_bytes": CHUNK, "cases": {}}
    # register takes the first third of the file, fallocate the second, pieces the last
    first, second, third = (range(i * args.chunks, (i + 1) * args.chunks) for i in range(3))
    plans = [("idle", first), ("fallocate", second), ("register", first), ("pieces", third), ("unregister", first), ("idle", first)]
    registered = 0
    for round_, (kind, chunks) in enumerate(plans):
        chunks = range(registered) if kind == "unregister" else chunks
        calls: list[float] = []
        worker = threading.Thread(target=background, args=(kind, lib, fd, base, chunks, calls))
        if kind == "idle":
            rate, longest = step_loop(for_seconds(args.seconds), graph, small)
        else:  # the loop runs as long as the other thread
            worker.start()
            rate, longest = step_loop(worker.is_alive, graph, small)
            worker.join()
        registered = len(calls) if kind == "register" else registered
        name = f"{kind}#{round_}" if kind == "idle" else kind
        result["cases"][name] = {"steps_per_s": rate, "longest_step_ms": longest, "calls": len(calls),
                                 "call_ms_median": 1e3 * sorted(calls)[len(calls) // 2] if calls else None,
                                 "call_ms_max": 1e3 * max(calls) if calls else None}
        print(f"{name:12s} {rate:8.1f} steps/s, longest step {longest:.1f} ms, {len(calls)} calls, median {result['cases'][name]['call_ms_median']} ms", flush=True)
    idle = sorted(v["steps_per_s"] for k, v in result["cases"].items() if k.startswith("idle"))[-1]
    for case in result["cases"].values():
        case["vs_idle"] = case["steps_per_s"] / idle
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "register_stall_h200.json"), "w") as out:
        json.dump(result, out, indent=1)
    print(json.dumps({k: round(v["vs_idle"], 3) for k, v in result["cases"].items()}))
    os.unlink(path)


if __name__ == "__main__":
    main()
