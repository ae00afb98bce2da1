"""The step loop's host work for SAE features and read-outs, alone: per step, which rows each
(request, spec) pair selects (`Collector._spec_groups`), the sites the step must capture
(`Collector.captured_sites`), and the outbox thread's filing of the step's blocks into each
request's arrays (`StepRows.file`). No engine and no GPU: the step loop's host time is what
bounds a decode step of 512 requests that each ask 8 read-outs, so it is timed here on the CPU.

    python -m bench.host_spec_selection                          # 512 requests x 8 specs
    python -m bench.host_spec_selection --requests 64 --specs 4

Scenarios: 8 probes at every position, 8 logit lenses (one a layer) at `last_prompt` (selects
nothing during decode), 8 SAEs top-32 at every position; each in a decode step (one row a
request) and a prefill step (`--prompt-len` rows a request). Reported: microseconds per step,
the median of `--repeats` calls. Results go to `<out>/host_spec_selection.json`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from bench.common import write_result
from replicas._vllm import StepLayout
from replicas.plans.readouts import ReadoutPlan
from replicas.plans.request import RequestPlan, SaePlan
from replicas.readouts.store import ProbeStores
from replicas.sae.device import packed_width
from replicas.worker.blocks import SiteOptions, _build_sites
from replicas.worker.collector import Collector
from replicas.worker.spec_handover import READOUT_SPECS, SAE_SPECS
from replicas.worker.outbox import RequestBuffers, StepRows
from replicas.worker.request_table import Batch, RequestTable

D_MODEL, VOCAB, LAYERS = 16, 64, 8
SCENARIOS = ("probe", "lens", "sae")


class Outbox:
    writer = None  # no arena: nothing is handed over here

    def __init__(self) -> None:
        self.probes = ProbeStores()


def spec_list(kind: str, specs: int, max_rows: int) -> list[Any]:
    if kind == "sae":
        return [SaePlan(f"sae{j}", f"blocks.{j}.hook_resid_post", 32, "all", "none", max_rows) for j in range(specs)]
    if kind == "probe":
        return [ReadoutPlan("probe", (j % LAYERS, "resid_post"), f"blocks.{j % LAYERS}.hook_resid_post", "all", max_rows, 1,
                            probe=f"probe{j}") for j in range(specs)]
    return [ReadoutPlan("logit_lens", (j % LAYERS, "resid_post"), f"blocks.{j % LAYERS}.hook_resid_post", "last_prompt", 1, 10)
            for j in range(specs)]


def table_of(kind: str, args: argparse.Namespace, outbox: Outbox) -> RequestTable:
    table = RequestTable()
    max_rows = args.prompt_len + args.decode_steps
    for i in range(args.requests):
        specs = spec_list(kind, args.specs, max_rows)
        plan = RequestPlan(f"k{i}", args.prompt_len, None, None, sae=specs if kind == "sae" else [],
                           readouts=[] if kind == "sae" else specs)
        buffers = RequestBuffers.for_plan(plan, D_MODEL, VOCAB, None, outbox.probes)
        table.admit(f"r{i}", plan, buffers, -1)
    return table


def batch_of(table: RequestTable, args: argparse.Namespace, decode: bool) -> Batch:
    n = args.requests
    counts = np.ones(n, np.int64) if decode else np.full(n, args.prompt_len, np.int64)
    start = np.full(n, args.prompt_len + 3 if decode else 0, np.int64)
    req_ids = [f"r{i}" for i in range(n)]
    step = StepLayout(req_ids, np.concatenate([[0], np.cumsum(counts)]), start)
    return Batch(step, table.columns.rows(table.handles(req_ids)))


def chunks_of(batch: Batch, table: RequestTable) -> list[np.ndarray]:
    """What `Collector._collect` hands `_spec_groups`: every request of the step asks."""
    rows, start, counts = batch.rows, batch.step.start_positions, batch.counts
    return [rows, batch.first_rows, start, counts, table.columns["prompt_len"][rows], np.zeros(len(rows), np.int64)]


def select(collector: Collector, table: RequestTable, chunks: list[np.ndarray], kind: str) -> list[tuple[list[Any], Any]]:
    return collector._spec_groups(table, chunks, SAE_SPECS if kind == "sae" else READOUT_SPECS)


def step_rows(kind: str, groups: list[tuple[list[Any], Any]]) -> list[StepRows]:
    """The blocks the device would hand over for these groups (zeros of the right shape)."""
    out = []
    for specs, selection in groups:
        width = selection.targets[1]
        shape, dtype = (1, len(selection.rows), width), torch.float32
        if kind == "sae":
            shape, dtype = (1, len(selection.rows), packed_width(width, "none", D_MODEL)), torch.int32
        elif kind == "lens":
            shape, dtype = (1, len(selection.rows), 2 * width), torch.int32
        buffers = [entry.buffers for entry in selection.requests]
        out.append(StepRows("sae" if kind == "sae" else "readout", torch.zeros(shape, dtype=dtype), None, buffers,
                            selection.offsets, selection.counts, selection.dests, selection.targets, selection.probe))
    return out


def median_us(call: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


def run(kind: str, decode: bool, collector: Collector, args: argparse.Namespace) -> dict[str, Any]:
    table = table_of(kind, args, collector.outbox)
    batch = batch_of(table, args, decode)
    chunks = chunks_of(batch, table)
    groups = select(collector, table, chunks, kind)
    blocks = step_rows(kind, groups)
    return {
        "groups": len(groups), "rows": sum(len(selection.rows) for _, selection in groups),
        "select_us": median_us(lambda: select(collector, table, chunks, kind), args.repeats),
        "captured_sites_us": median_us(lambda: collector.captured_sites(batch, table), args.repeats),
        "file_us": median_us(lambda: [block.file() for block in blocks], args.repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--specs", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    layout = SimpleNamespace(layers=[None] * LAYERS, d_model=D_MODEL)
    options = SiteOptions(armed_kinds=["resid_post"], steer_kinds=set(), steer_layers=None, edit_stages=0, edit_slots=1)
    sites = _build_sites(layout, options, max_tokens=8, dtype=torch.float32, device=torch.device("cpu"))
    saes = {f"sae{j}": SimpleNamespace(site=(j % LAYERS, "resid_post")) for j in range(args.specs)}
    collector = Collector(None, sites, VOCAB, torch.device("cpu"), Outbox(), saes=saes)  # type: ignore[arg-type]
    runs = {}
    print(f"{args.requests} requests x {args.specs} specs, prompt {args.prompt_len}: microseconds per step (median)")
    for kind in SCENARIOS:
        for decode in (True, False):
            name = f"{kind}_{'decode' if decode else 'prefill'}"
            runs[name] = run(kind, decode, collector, args)
            r = runs[name]
            print(f"{name:14s} groups {r['groups']:3d} rows {r['rows']:6d}  select {r['select_us']:9.0f}  "
                  f"captured_sites {r['captured_sites_us']:6.0f}  file {r['file_us']:7.0f}")
    path = write_result(f"host_spec_selection{'_' + args.label if args.label else ''}", {"args": vars(args), "runs": runs}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
