"""A decode step's arena destinations, the step loop's host cost at many requests: the general
`ArenaWriter.destinations` (per-request Python) against `decode_destinations` (the table slots a
steady decode step keeps), on the 8B model's row shape. No engine and no GPU:

    python -m bench.bench_decode_destinations      # writes bench/results/decode_destinations_cpu.json

Each request has taken its blocks (as after its prefill); both ways give the same arena rows
(checked), timed alternately, median of `--rounds` rounds of `--steps` steps each.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

from bench.common import write_result
from replicas.worker.arena_writer import ArenaWriter, table_slots
from replicas.worker.outbox import Outbox, RequestBuffers

D_MODEL = 4096


def buffers_for(outbox: Outbox, requests: int) -> list[RequestBuffers]:
    """Requests capturing one hook at every position of 512 + 128 rows, in bf16, each with its blocks."""
    layout = outbox.arena_layout
    buffers = [RequestBuffers(plan=None) for _ in range(requests)]  # destinations reads their arena fields alone
    for b in buffers:
        b.rows_per_block = layout.rows_per_block(D_MODEL * 2)
        b.blocks_per_hook = -(-640 // b.rows_per_block)
    outbox.writer.destinations(buffers, np.full(requests, 512), np.zeros(requests, np.int64), 1)  # the prefill
    return buffers


def step_us(step: Callable[[], object], steps: int) -> float:
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - began) / steps * 1e6


def measure(writer: ArenaWriter, buffers: list[RequestBuffers], steps: int, rounds: int) -> dict[str, float]:
    n, per_block = len(buffers), buffers[0].rows_per_block
    ones, dests = np.ones(n, np.int64), np.full(n, 512, np.int64)
    slots = table_slots(buffers)
    general, steady = writer.destinations(buffers, ones, dests, 1), writer.decode_destinations(*slots, dests, 1, per_block)
    assert (general.arena_rows() == steady.arena_rows()).all()
    times: dict[str, list[float]] = {"destinations_us": [], "decode_destinations_us": []}
    for _ in range(rounds):
        times["destinations_us"].append(step_us(lambda: writer.destinations(buffers, ones, dests, 1).arena_rows(), steps))
        times["decode_destinations_us"].append(
            step_us(lambda: writer.decode_destinations(*slots, dests, 1, per_block).arena_rows(), steps))
    medians = {key: statistics.median(values) for key, values in times.items()}
    return medians | {"ratio": medians["destinations_us"] / medians["decode_destinations_us"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--label", default="cpu")
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args()
    results = {}
    for requests in args.requests:
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shared:
            outbox = Outbox(shared, D_MODEL, arena_max_bytes=requests * 16 << 20)
            results[str(requests)] = measure(outbox.writer, buffers_for(outbox, requests), args.steps, args.rounds)
        print(requests, "requests:", {k: round(v, 1) for k, v in results[str(requests)].items()})
    path = write_result(f"decode_destinations_{args.label}", {"steps": args.steps, "rounds": args.rounds, "results": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
