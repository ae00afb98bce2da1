"""The host half of capture, alone: from the rows of each step on the host to the arrays the replica
holds, for an all-layer, all-position capture. No engine and no GPU: it times capserve's own
filing and reading code on steps of the benchmark workload's shape, so it runs anywhere.

    python -m bench.bench_host_path                      # 8B shape, 16 requests x (512 + 16), ~1 min
    python -m bench.bench_host_path --requests 64        # the GPU bandwidth batch (needs ~20 GB)

Three ways over the same steps, alternating in each round, so they compare within one run:
- `arena`: what the worker does now: rows of large captures written into reused blocks of
  shared-memory files (`replicas.worker.arena_writer`, here from CPU tensors as on the CPU engine; on a
  GPU the device writes them), the replica copying each capture out and handing the blocks back;
- `files`: the design before it: rows filed into fresh per-request arrays, written to a fresh
  shared-memory file when the request finishes, read back (and the file deleted) by the replica;
- `memcpy`: one copy of the same bytes into memory written before: the floor of any host path.
Steps follow vLLM's chunked prefill (`--step-tokens` rows per step, requests in turn), then one
decode row per request per step. Reported: GB/s of activations delivered, per round, for the
first round (cold: the arena reserves its memory then) and over the others (warm: a running
replica's steady state).
Results go to `<out>/host_path_<label>.json`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import torch

from bench.common import write_result
from replicas.api import arrays
from replicas.api import GenerateRequest
from replicas.arena.host import ArenaReader, stored_in
from replicas.worker.outbox import Outbox, RequestBuffers, StepRows
from replicas.plans.request import RequestPlan, build_wire_plan

WAYS = ("arena", "files", "memcpy")


def request_plan(args: argparse.Namespace, index: int) -> RequestPlan:
    request = GenerateRequest.model_validate({
        "prompt": [1] * args.prompt_len, "max_tokens": args.max_tokens,
        "capture": {"hooks": [f"blocks.{i}.hook_resid_post" for i in range(args.layers)], "positions": "all", "dtype": "bfloat16"},
    })
    wire = build_wire_plan(
        f"r{index}", request, prompt_len=args.prompt_len, n_layers=args.layers, d_model=args.d_model,
        armed_kinds={"resid_post"}, steer_kinds=set(), edit_stages=1, max_capture_bytes=1 << 40,
    )
    return RequestPlan.from_wire(wire)


def steps(args: argparse.Namespace) -> list[list[tuple[int, int]]]:
    """Per step, (request, rows) for each request in it."""
    out: list[list[tuple[int, int]]] = []
    step: list[tuple[int, int]] = []
    room = args.step_tokens
    for request in range(args.requests):
        left = args.prompt_len
        while left:
            n = min(left, room)
            step.append((request, n))
            left, room = left - n, room - n
            if not room:
                out.append(step)
                step, room = [], args.step_tokens
    if step:
        out.append(step)
    out.extend([(r, 1) for r in range(args.requests)] for _ in range(args.max_tokens - 1))
    return out


def run_way(way: str, args: argparse.Namespace, schedule: list[list[tuple[int, int]]], source: torch.Tensor,
            host: dict[str, Any]) -> dict[str, Any]:
    rows = args.prompt_len + args.max_tokens - 1
    total = args.requests * args.layers * rows * args.d_model * 2
    started = time.perf_counter()
    if way == "memcpy":
        floor = host["floor"]
        flat = source.view(torch.int16).numpy().reshape(-1)
        done = 0
        while done < floor.size:
            n = min(flat.size, floor.size - done)
            floor[done : done + n] = flat[:n]
            done += n
        return {"seconds": time.perf_counter() - started, "bytes": total}
    arena = host["outbox"].arena if way == "arena" else None
    layout = arena.layout if arena is not None else None
    writer, table = host["outbox"].writer, host["outbox"].table
    buffers = [RequestBuffers.for_plan(request_plan(args, i), args.d_model, 16, layout) for i in range(args.requests)]
    for step in schedule:
        counts = np.array([n for _, n in step])
        offsets = np.cumsum(counts) - counts
        members = [buffers[r] for r, _ in step]
        dests = np.array([b.n_rows for b in members])
        for b, (_, n) in zip(members, step):
            b.n_rows += n
        gathered = source.view(-1)[: args.layers * int(counts.sum()) * args.d_model].view(args.layers, -1, args.d_model)
        if arena is not None:
            destinations = writer.destinations(members, counts, dests, args.layers)
            writer.write(gathered, torch.from_numpy(destinations.arena_rows()).reshape(-1), None)
        else:
            StepRows("rows", gathered, None, members, offsets, counts, dests).file()
    delivered = 0
    for i, b in enumerate(buffers):
        spill = None if arena is not None else (lambda name, i=i: f"{host['dir']}/r{i}-{name}.bin")
        table_row = table.remove(b.table_slot) if b.table_slot >= 0 else np.empty(0, np.int64)
        result = b.finish(spill, layout, table_row)
        assert result["error"] is None, result["error"]
        for raw in result["activations"].values():
            array = host["reader"].read(raw) if "blocks" in raw else arrays.from_file(raw)
            delivered += array.nbytes
        if arena is not None:
            arena.release(stored_in(result)[0])
    assert delivered == total, (delivered, total)
    return {"seconds": time.perf_counter() - started, "bytes": total}


def gb_per_s(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """GB/s of each way over these rounds, and the arena's ratios to the others."""
    if not rounds:
        return {}
    speed = {way: sum(r[way]["bytes"] for r in rounds) / sum(r[way]["seconds"] for r in rounds) / 1e9 for way in WAYS}
    return speed | {"arena_over_files": speed["arena"] / speed["files"], "arena_over_memcpy": speed["arena"] / speed["memcpy"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--step-tokens", type=int, default=8192, help="rows per prefill step (max_num_batched_tokens)")
    parser.add_argument("--rounds", type=int, default=4, help="the first is reported apart (cold: the arena is new)")
    parser.add_argument("--label", default="llama8b_cpu")
    parser.add_argument("--out", default=None, help="result folder (default bench/results)")
    args = parser.parse_args(argv)

    schedule = steps(args)
    # a step's gathered rows are contiguous [hooks, rows, d]: views of the start of one buffer
    source = torch.randn(args.layers, args.step_tokens, args.d_model).to(torch.bfloat16)
    directory = tempfile.mkdtemp(prefix="capserve-bench-", dir="/dev/shm")
    rows = args.prompt_len + args.max_tokens - 1
    host = {
        "dir": directory, "reader": ArenaReader(), "outbox": Outbox(directory, args.d_model),
        "floor": np.ones(args.requests * args.layers * rows * args.d_model, np.int16),
    }
    print(f"{args.requests} requests x {rows} rows x {args.layers} hooks x {args.d_model} bf16 = "
          f"{args.requests * args.layers * rows * args.d_model * 2 / 1e9:.2f} GB per round, {len(schedule)} steps", flush=True)
    rounds = []
    try:
        for index in range(args.rounds):
            measured = {way: run_way(way, args, schedule, source, host) for way in WAYS}
            rounds.append(measured)
            print(f"  round {index}: " + " | ".join(f"{w} {m['bytes'] / m['seconds'] / 1e9:6.2f} GB/s" for w, m in measured.items()),
                  flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    summary = {"cold": gb_per_s(rounds[:1]), "warm": gb_per_s(rounds[1:])}
    for name, figures in summary.items():
        print(f"{name} GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    path = write_result(f"host_path_{args.label}", {"args": vars(args), "rounds": rounds, "summary": summary}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
