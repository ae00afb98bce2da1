"""How a step's captured rows should reach the host arena: SM kernel or copy engine.

    python bench/gpu/copy_paths.py --out DIR     # GPU host, plain torch (no vLLM), ~1 min

A bulk prefill step gathers [hooks, rows, d] bf16 on the device (32 x 2048 x 4096: 537 MB) and
writes it into registered, mapped host memory (the arena). Ways:
  kernel   one index_copy_ into the device view of the host memory (what ArenaWriter does today):
           the SMs write over PCIe
  dma      one cudaMemcpyAsync per (hook, request) run of contiguous rows: the copy engines write
  dma-one  one cudaMemcpyAsync of the whole block (the bound)
Each alone, then each on a side stream while the default stream runs matmuls (the forward's
stand-in): what the matmuls lose is what a step loses.

It repeats, on purpose, the few ctypes lines of `replicas.worker.arena_writer.CudaHostMemory`: importing
`replicas` needs pydantic and ml_dtypes, which a bare GPU host lacks, and this script answers its
question there in one device call, before the vLLM bundle is uploaded.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import time

import torch

REGISTER_PORTABLE_MAPPED = 1 | 2
MEMCPY_DEFAULT = 4


class _Window:
    def __init__(self, address: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3}


def cudart() -> ctypes.CDLL:
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no libcudart")


def timed(fn, stream: torch.cuda.Stream, repeats: int) -> float:
    """Seconds per call of fn on stream, from events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(repeats):
        fn()
    end.record(stream)
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hooks", type=int, default=32)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=4, help="requests the step's rows belong to (runs per hook)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    lib = cudart()
    device = torch.device("cuda")
    row_bytes = args.d * 2
    size = args.hooks * args.rows * row_bytes
    memory = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    code = lib.cudaHostRegister(ctypes.c_void_p(address), ctypes.c_size_t(size), ctypes.c_uint(REGISTER_PORTABLE_MAPPED))
    assert code == 0, f"cudaHostRegister: {code}"
    window = torch.as_tensor(_Window(address, size), device=device).view(torch.int64).view(-1, row_bytes // 8)
    block = torch.randn(args.hooks, args.rows, args.d, device=device, dtype=torch.bfloat16)
    source = block.reshape(-1, args.d).view(torch.int64)
    # the arena keeps each request's rows of a hook together, requests in some other order
    order = torch.randperm(args.hooks * args.requests, device=device)
    per_request = args.rows // args.requests
    run = torch.arange(args.hooks * args.requests, device=device).view(args.hooks, args.requests)
    destination_run = order[run]  # [hooks, requests] -> run slot in the arena
    index = (destination_run.unsqueeze(-1) * per_request + torch.arange(per_request, device=device)).reshape(-1)
    runs = [(int(destination_run[h, r]) * per_request * row_bytes, (h * args.rows + r * per_request) * row_bytes)
            for h in range(args.hooks) for r in range(args.requests)]
    run_bytes = per_request * row_bytes
    side = torch.cuda.Stream(device)

    def kernel() -> None:
        window.index_copy_(0, index, source)

    def dma() -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        base = block.data_ptr()
        for dst, src in runs:
            lib.cudaMemcpyAsync(ctypes.c_void_p(address + dst), ctypes.c_void_p(base + src), ctypes.c_size_t(run_bytes),
                                ctypes.c_int(MEMCPY_DEFAULT), stream)

    def dma_one() -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        lib.cudaMemcpyAsync(ctypes.c_void_p(address), ctypes.c_void_p(block.data_ptr()), ctypes.c_size_t(size),
                            ctypes.c_int(MEMCPY_DEFAULT), stream)

    ways = {"kernel": kernel, "dma": dma, "dma-one": dma_one}
    # correctness of the dma runs: the host rows equal the kernel's
    dma()
    torch.cuda.synchronize()
    by_dma = torch.frombuffer(memory, dtype=torch.int64).clone()
    kernel()
    torch.cuda.synchronize()
    same = bool(torch.equal(by_dma, torch.frombuffer(memory, dtype=torch.int64)))

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    matmuls = 40

    def forward() -> None:
        for _ in range(matmuls):
            torch.mm(a, a)

    main_stream = torch.cuda.current_stream()
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(device), "hooks": args.hooks,
              "rows": args.rows, "d": args.d, "requests": args.requests, "bytes": size,
              "dma_equals_kernel": same, "alone": {}, "beside_matmuls": {}}
    forward_alone = timed(forward, main_stream, args.repeats)
    result["matmuls_alone_s"] = forward_alone
    for name, way in ways.items():
        with torch.cuda.stream(side):
            seconds = timed(way, side, args.repeats)
        result["alone"][name] = {"s": seconds, "GB/s": size / seconds / 1e9}
        # overlapped: per forward, one step's write on the side stream
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(args.repeats):
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                way()
            forward()
        torch.cuda.synchronize()
        both = (time.perf_counter() - began) / args.repeats
        result["beside_matmuls"][name] = {"s_per_round": both, "matmuls_slowdown": both / forward_alone}
        print(f"{name:8s} alone {size / seconds / 1e9:6.1f} GB/s | beside matmuls: round {both * 1e3:.1f} ms "
              f"vs matmuls alone {forward_alone * 1e3:.1f} ms ({both / forward_alone:.3f}x)", flush=True)
    print(f"dma rows equal the kernel's: {same}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "copy_paths_h200.json"), "w") as out:
        json.dump(result, out, indent=1)
    lib.cudaHostUnregister(ctypes.c_void_p(address))


if __name__ == "__main__":
    main()
