"""Which host-side copy leaves this process's kernels slower until another process runs a kernel.

On the H200, a capserve engine's decode forward runs ~3.4 % slower on the device after a capture
(forward_device_p50 5,387 -> 5,570 µs), until any other process launches a kernel (two tiny ones
suffice); an ablation (no host copies) does not start it. This script needs only torch: a
forward in a CUDA graph (`--forward decode`: an 8B decode step's kernels over 14 GB of weights and a
paged KV cache; `gemm`: long GEMMs only) is timed by CUDA events in each state, after each kind
of copy (between forwards, or while ten forwards run, as in the engine) and after a kernel of a
second process. Neither forward showed the state on the H200 (results copy_state_*_h200.json):
torch alone does not reproduce it; the engine's z-start and z-kick runs place it instead.

    python3 bench/gpu/copy_state.py --out bench/results
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import mmap
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable


def kicker(conn: Any) -> None:
    """A second process with a CUDA context of its own: one tiny kernel per message."""
    import torch

    t = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    conn.send("ready")
    while conn.recv() != "stop":
        t.add_(1)
        torch.cuda.synchronize()
        conn.send("done")


def gemm_forward(layers: int) -> Callable[[], Any]:
    """bf16 GEMMs over ~7.5 GB of weights for 32 rows: ~100 long kernels."""
    import torch

    up = [torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(layers)]
    down = [torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(layers)]
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)

    def forward() -> Any:
        y = x
        for a, b in zip(up, down):
            y = (y @ a).clamp_(-1, 1) @ b
        return y
    return forward


def decode_forward(layers: int, kv_gb: float) -> Callable[[], Any]:
    """A Llama-3.1-8B-shaped decode step of 32 requests, 768 tokens each: per layer a norm, the qkv,
    o, gate_up and down GEMMs and a GQA attention over a paged KV cache of `kv_gb` (each request's
    16-token blocks gathered by a block table spread over the cache), ~25 kernels a layer."""
    import torch

    d, kv_d, ff, requests, tokens, block, heads, kv_heads = 4096, 1024, 14336, 32, 768, 16, 32, 8
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}

    def weight(rows: int, cols: int) -> Any:
        return torch.randn(rows, cols, **bf16) * 0.01
    qkv = [weight(d, d + 2 * kv_d) for _ in range(layers)]
    o = [weight(d, d) for _ in range(layers)]
    gate_up = [weight(d, 2 * ff) for _ in range(layers)]
    down = [weight(ff, d) for _ in range(layers)]
    n_blocks = max(int(kv_gb * 1e9) // (layers * 2 * block * kv_d * 2), requests * tokens // block)
    cache = torch.randn(layers, n_blocks, 2, block, kv_d, **bf16)
    table = torch.randperm(n_blocks, device="cuda")[: requests * tokens // block]
    x = torch.randn(requests, d, **bf16)

    def norm(h: Any) -> Any:
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)

    def forward() -> Any:
        h = x
        for layer in range(layers):
            q = (norm(h) @ qkv[layer])[:, :d].view(requests, kv_heads, heads // kv_heads, d // heads)
            kv = cache[layer].index_select(0, table).view(requests, tokens // block, 2, block, kv_heads, d // heads)
            k = kv[:, :, 0].reshape(requests, tokens, kv_heads, d // heads)
            v = kv[:, :, 1].reshape(requests, tokens, kv_heads, d // heads)
            scores = torch.einsum("rgqe,rtge->rgqt", q, k) * (d // heads) ** -0.5
            attended = torch.einsum("rgqt,rtge->rgqe", scores.softmax(-1), v).reshape(requests, d)
            h = h + attended @ o[layer]
            up = norm(h) @ gate_up[layer]
            h = h + (torch.nn.functional.silu(up[:, :ff]) * up[:, ff:]) @ down[layer]
        return h
    return forward


def forward_graph(forward: Callable[[], Any]) -> Any:
    import torch

    with torch.cuda.stream(torch.cuda.Stream()):
        for _ in range(2):
            forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    torch.cuda.synchronize()
    return graph


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forward", choices=["gemm", "decode"], default="decode",
                        help="gemm: ~100 long GEMMs; decode: an 8B decode step's ~800 kernels with a paged KV cache")
    parser.add_argument("--kv-gb", type=float, default=20.0, help="the decode forward's KV cache")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="timed forwards per state")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    other = ctx.Process(target=kicker, args=(there,), daemon=True)
    other.start()
    assert here.recv() == "ready"

    def kick() -> None:
        here.send("kick")
        here.recv()

    dev = torch.device("cuda")
    forward = gemm_forward(args.layers) if args.forward == "gemm" else decode_forward(args.layers, args.kv_gb)
    began = time.perf_counter()
    graph = forward_graph(forward)  # `forward` holds the tensors the graph reads: it lives as long as main
    print(f"{args.forward} forward captured in {time.perf_counter() - began:.1f} s", flush=True)

    side = torch.cuda.Stream()
    rows = torch.randn(32, 4096, device=dev, dtype=torch.bfloat16)  # 256 KB, a decode step's rows of one layer
    big = torch.randn(64 * 1024 * 1024, device=dev, dtype=torch.bfloat16)  # 128 MB
    pinned = torch.empty(200, 32, 4096, dtype=torch.bfloat16).pin_memory()
    registered = torch.empty(200, 32, 4096, dtype=torch.bfloat16)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(registered.data_ptr(), registered.numel() * 2, 0)) == 0
    pageable = torch.empty(32, 4096, dtype=torch.bfloat16)
    # like the capture arena: a 4 GB shared mapping, pinned and mapped for every context in 128 MiB chunks
    arena_bytes, chunk = 4 << 30, 128 << 20
    fd = os.memfd_create("copy_state_arena")
    os.ftruncate(fd, arena_bytes)
    arena_map = mmap.mmap(fd, arena_bytes)
    arena = torch.frombuffer(arena_map, dtype=torch.bfloat16)
    arena.view(torch.uint8)[:: 4096].fill_(0)  # faulted in, as the arena is before its first batch
    registered_chunks = arena_bytes // chunk // 2  # the other half is registered by the actions, a chunk each
    for offset in range(0, registered_chunks * chunk, chunk):
        assert int(cudart.cudaHostRegister(arena.data_ptr() + offset, chunk, 3)) == 0
    arena_rows = arena.view(-1, 32, 4096)  # 256 KB blocks
    big_pinned = torch.empty(big.numel(), dtype=torch.bfloat16).pin_memory()
    scratch = torch.empty_like(big)

    def on(stream: torch.cuda.Stream | None, work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            if stream is None:
                work()
            else:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    work()
            torch.cuda.synchronize()
        return run

    def rows_to(host: torch.Tensor) -> Callable[[], None]:
        def copy() -> None:
            for i in range(host.shape[0]):
                host[i].copy_(rows, non_blocking=True)
        return copy

    def copy(into: torch.Tensor, source: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            into.copy_(source, non_blocking=True)
        return run

    def scale() -> None:
        scratch.mul_(1.0)

    def rows_across_arena(waiter: bool) -> Callable[[], None]:
        def copy() -> None:
            events = []
            for i in range(0, arena_rows.shape[0] // 2, 10):  # 800 blocks, 2.5 MB apart: 200 MB across 2 GB
                arena_rows[i].copy_(rows, non_blocking=True)
                events.append(torch.cuda.Event())
                events[-1].record()
            if waiter:  # a host thread waits for each copy, as the outbox does
                thread = threading.Thread(target=lambda: [event.synchronize() for event in events])
                thread.start()
                thread.join()
        return copy

    runtime = ctypes.CDLL("libcudart.so.13")  # torch's own, loaded by soname as the engine does (arena_writer)

    def rows_by_2d_copies() -> None:  # the engine's copy of a request's rows of every hook (arena_writer)
        stream = torch.cuda.current_stream().cuda_stream
        for i in range(0, arena_rows.shape[0] // 2, 10):
            target = arena_rows[i].data_ptr()
            assert runtime.cudaMemcpy2DAsync(ctypes.c_void_p(target), ctypes.c_size_t(8192), ctypes.c_void_p(rows.data_ptr()),
                                             ctypes.c_size_t(8192), ctypes.c_size_t(8192), ctypes.c_size_t(32), 4,
                                             ctypes.c_void_p(stream)) == 0

    class DeviceView:  # registered host memory as a CUDA tensor, as the arena's graphs write it
        def __init__(self, address: int, size: int):
            self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3}

    arena_on_device = torch.as_tensor(DeviceView(arena.data_ptr(), arena_bytes // 2), device=dev).view(torch.bfloat16).view(-1, 4096)
    blocks = torch.arange(0, arena_rows.shape[0] // 2, 10, device=dev)
    targets = (blocks[:, None] * 32 + torch.arange(32, device=dev)).reshape(-1)
    many_rows = rows.repeat(blocks.numel(), 1)

    def rows_by_kernel() -> None:  # SM stores over PCIe into mapped host memory
        arena_on_device.index_copy_(0, targets, many_rows)

    def register_chunk() -> None:
        nonlocal registered_chunks
        assert int(cudart.cudaHostRegister(arena.data_ptr() + registered_chunks * chunk, chunk, 3)) == 0
        registered_chunks += 1

    def during_forwards(work: Callable[[], None], after_each: bool) -> Callable[[], None]:
        """`work` on the side stream while the forward replays on its own, ten times: in the engine a
        step's rows go to the host while the next step's forward runs. `after_each`: the side stream
        first waits for the forward before it (an event wait a step, as the engine's copies wait for
        their gather)."""
        def run() -> None:
            main = torch.cuda.current_stream()
            for _ in range(10):
                graph.replay()
                if after_each:
                    side.wait_stream(main)
                with torch.cuda.stream(side):
                    work()
            torch.cuda.synchronize()
        return run

    def side_kernel() -> None:
        rows.mul_(1.0)

    actions: dict[str, Callable[[], None]] = {
        "during 10 forwards: 800 x 256 KB by cudaMemcpy2DAsync into the arena, each after the forward before it":
            during_forwards(rows_by_2d_copies, True),
        "during 10 forwards: the same, not waiting for the forward": during_forwards(rows_by_2d_copies, False),
        "during 10 forwards: an index_copy_ kernel into the arena's device view, after the forward before it":
            during_forwards(rows_by_kernel, True),
        "during 10 forwards: a small kernel on the side stream, after the forward before it": during_forwards(side_kernel, True),
        "during 10 forwards: 128 MB device->pinned, after the forward before it": during_forwards(copy(big_pinned, big), True),
        "register 128 MiB more of the shared arena (portable, mapped), as it grows": register_chunk,
        "800 x 256 KB device->4 GB shared arena (portable, mapped), side stream": on(side, rows_across_arena(False)),
        "the same, a host thread synchronizing on each copy's event": on(side, rows_across_arena(True)),
        "the same by cudaMemcpy2DAsync (ctypes), as the engine copies": on(side, rows_by_2d_copies),
        "the same by an index_copy_ kernel into the arena's device view": on(side, rows_by_kernel),
        "200 x 256 KB device->pinned (torch pin_memory), side stream": on(side, rows_to(pinned)),
        "200 x 256 KB device->registered (cudaHostRegister), side stream": on(side, rows_to(registered)),
        "200 x 256 KB device->pinned, the forward's stream": on(None, rows_to(pinned)),
        "128 MB device->pinned, side stream": on(side, copy(big_pinned, big)),
        "128 MB pinned->device, side stream": on(side, copy(scratch, big_pinned)),
        "128 MB device->device, side stream": on(side, copy(scratch, big)),
        "a kernel on a side stream": on(side, scale),
        "256 KB device->pageable": on(None, copy(pageable, rows)),
        "nothing (idle 1 s)": lambda: time.sleep(1.0),
    }

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def forward_us() -> float:
        times = []
        for _ in range(args.steps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    results: dict[str, list[dict[str, float]]] = {name: [] for name in actions}
    for p in range(args.passes):
        for name, action in actions.items():
            kick()
            reset = forward_us()
            action()
            after = forward_us()
            again = forward_us()
            kick()
            kicked = forward_us()
            results[name].append({"after_a_kick_us": reset, "after_it_us": after, "then_us": again, "after_another_kick_us": kicked})
            print(f"pass {p} {name:65s} {reset:8.1f} -> {after:8.1f} / {again:8.1f} -> kick {kicked:8.1f} us "
                  f"({after / reset:.4f})", flush=True)
    here.send("stop")
    summary = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    print("\nmedians over passes: forward after a kick -> after the action (ratio) -> after another kick")
    for name, s in summary.items():
        print(f"  {name:65s} {s['after_a_kick_us']:8.1f} -> {s['after_it_us']:8.1f} ({s['after_it_us'] / s['after_a_kick_us']:.4f})"
              f" -> {s['after_another_kick_us']:8.1f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
                  "summary": summary, "passes": results}
        (args.out / f"copy_state_{args.forward}_h200.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
