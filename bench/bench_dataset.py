"""`capserve capture` at scale: prompt-only captures into a sink folder, beside plain prefill.

    python -m bench.bench_dataset --config llama8b --replicas 1 2 --out DIR     # GPU host
    python -m bench.bench_dataset --config tiny --prompts 64 --prompt-len 64    # CPU smoke run

The whole app (Router -> N EngineReplicas, dummy weights of the config's shape, fed token ids,
resid_post armed) runs in this process's Ray cluster, as `bench_bandwidth --via serve` starts it.
Each case is one `capserve capture` run: `provider.dataset.run.run_capture` over a JSONL file of
token-id prompts through the Serve handle, exactly what `cmd_capture` runs (prompt only:
`--max-tokens 0`, which the Router runs as one greedy step, max_tokens=1). The cases:

    a  one layer (the middle one), all positions
    b  every layer, last_prompt
    c  every layer, all positions (the bulk case: 8B: 134 MB per 512-token prompt)

all stored as `--dtype` (bfloat16 by default). Plain prefill is the same prompts through the
same Router with max_tokens=1 and no capture, as many in flight as the capture path keeps, so
every ratio is measured in one run on warm engines. The sink folder's raw write speed is measured
too: shard-sized safetensors files written (fsynced, renamed) by as many threads as the replicas'
writers together (`--sink-threads` each, the app's `sink.threads`): once at start (`--probe-gb`),
and right before and right after each case's capture at that case's volume, its files kept until
the last is written, as the case keeps its shards. Where the sink is tmpfs in a VM that hands
freed memory back to its host (free page reporting), a write into memory the guest has not touched
lately pays a fault in the host and runs several times slower than one into pages just freed
(`bench_sink_source --fill-passes`): the probe before the capture meets the memory as the machine
left it, the capture meets the probe's pages just freed, the probe after meets the capture's.
Case c's GB/s is reported against all three. Per replica and run: the engine's steps and tokens
per step (how full its steps ran), and the seconds from its last step to the run's end (the last
shards' writes, which no engine work hid).

Memory: a case's prompt count is capped so that its shards fit in `--sink-fill` of the sink
folder's free space (the shards of each case are deleted before the next one), and a shard holds
about `--shard-gb` (replicas hold a shard job per writer, `--sink-threads`, and enough besides for
their share of `--concurrency`'s lines in the shortest shards, `max_unwritten`; their arenas are
reserved at start-up for the lines of the CLI's window: an arena that grows mid-run holds up the
step loop, as case c's did from 10 to 13.3 GB on the H200); caps are reported. Each replica
count runs in its own process (a fresh Ray cluster, engines warm across the cases within it).
Results merge into `<out>/dataset_<config>.json` (runs keyed by replica count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.bench_sink_source import sink_write_speed
from bench.common import (
    CONFIGS,
    VOCAB,
    Workload,
    default_device,
    dummy_engine_options,
    dummy_model_folder,
    engine_settings,
    environment,
    gpu_memory_used_mib,
    merged_runs,
    model_shape,
    report_ray_failure,
    result_path,
    run_in_children,
    start_serve,
    stop_serve,
    wait_for_gpu_memory,
    write_runs,
)
from replicas.engine.config import DEFAULT_ARENA_RESERVE_BYTES

CASES = ("a", "b", "c")
MAX_SHARD_LINES = 1024  # the CLI's default --shard-lines


@dataclass(frozen=True)
class Case:
    name: str
    hooks: list[str]
    positions: str
    rows_per_line: int
    bytes_per_line: int


def cases(n_layers: int, d_model: int, prompt_len: int, itemsize: int) -> dict[str, Case]:
    every = [f"blocks.{i}.hook_resid_post" for i in range(n_layers)]
    row = d_model * itemsize
    return {
        "a": Case("a", [f"blocks.{n_layers // 2}.hook_resid_post"], "all", prompt_len, prompt_len * row),
        "b": Case("b", every, "last_prompt", 1, n_layers * row),
        "c": Case("c", every, "all", prompt_len, n_layers * prompt_len * row),
    }


@dataclass(frozen=True)
class Plan:
    """What one case runs: how many prompts (capped by the sink's space), how many per shard."""

    case: Case
    prompts: int
    shard_lines: int
    capped: str | None

    @property
    def bytes_expected(self) -> int:
        return self.prompts * self.case.bytes_per_line


def case_table(args: argparse.Namespace) -> dict[str, Case]:
    shape = model_shape(args.config)
    return cases(shape["n_layers"], shape["d_model"], args.prompt_len, 4 if args.dtype == "float32" else 2)


def plan_case(case: Case, requested: int, sink_free: int, args: argparse.Namespace) -> Plan:
    fits = int(sink_free * args.sink_fill // case.bytes_per_line)
    prompts = max(1, min(requested, fits))
    capped = None if prompts == requested else f"lowered from {requested}: {args.sink_fill:.0%} of the sink's {sink_free / 1e9:.1f} GB free holds {fits}"
    return Plan(case, prompts, shard_lines_for(case, args), capped)


def shard_lines_for(case: Case, args: argparse.Namespace) -> int:
    return args.shard_lines or max(1, min(MAX_SHARD_LINES, int(args.shard_gb * 1e9 // case.bytes_per_line)))


def capture_options(plan: Plan, args: argparse.Namespace) -> Any:
    from provider.dataset.options import CaptureOptions

    return CaptureOptions(hooks=tuple(plan.case.hooks), positions=plan.case.positions, dtype=args.dtype, max_tokens=0,
                          shard_lines=plan.shard_lines, concurrency=args.concurrency, sink=args.sink)


def shard_window(plan: Plan, args: argparse.Namespace, replicas: int) -> int:
    """Shard jobs the CLI keeps in flight once the replicas answered (provider.dataset.remote.auto_window)."""
    from provider.dataset.remote import auto_window

    return auto_window(capture_options(plan, args), replicas, max_unwritten(args, replicas))


def in_flight(plan: Plan, args: argparse.Namespace, replicas: int) -> int:
    """Requests the capture path keeps on the engines at most (the CLI's shard window once the
    replicas answered, x each job's concurrency; the driver writer: --concurrency); plain prefill
    runs as many."""
    if args.sink == "driver":
        return args.concurrency
    shards = min(shard_window(plan, args, replicas), math.ceil(plan.prompts / plan.shard_lines))
    return shards * min(args.concurrency, plan.shard_lines, plan.prompts)


def write_prompts(path: Path, prompts: list[list[int]]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt_token_ids": ids}) + "\n" for ids in prompts)


# ---------------------------------------------------------------- measurement


def backend() -> Any:
    """A fresh HandleBackend, connected as `cmd_capture` connects it (outside the event loop)."""
    from provider.dataset.backends import HandleBackend

    made = HandleBackend("capserve")
    made.connect()
    return made


def plain_prefill(prompts: list[list[int]], clients: int) -> dict[str, Any]:
    """The prompts through the same Router without capture: one greedy step each, as the
    Router's capture() runs a prompt-only line. `clients` in flight, each sending its next
    prompt when one returns."""
    made = backend()
    return asyncio.run(_plain(made, prompts, clients))


async def _plain(made: Any, prompts: list[list[int]], clients: int) -> dict[str, Any]:
    issued = iter(prompts)
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        for ids in issued:
            result = await made.run({"prompt": ids, "max_tokens": 1, "temperature": 0.0}, prompt_only=False)
            tokens += len(result.prompt_token_ids)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(min(clients, len(prompts)))))
    finally:
        await made.close()
    seconds, ended_at = time.perf_counter() - started, time.time()
    return {"prompts": len(prompts), "in_flight": clients, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "ended_at": ended_at}


def capture_case(plan: Plan, source: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One `capserve capture` run (cmd_capture's own calls), timed end to end."""
    from provider.dataset.run import run_capture

    options = capture_options(plan, args)
    made = backend()

    async def run() -> Any:
        try:
            return await run_capture(source, out, options, made, progress=False)
        finally:
            await made.close()

    started = time.perf_counter()
    summary = asyncio.run(run())
    seconds, ended_at = time.perf_counter() - started, time.time()
    written = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return {"complete": summary.complete, "seconds": seconds, "lines": summary.captured, "rows": summary.rows,
            "shards": summary.shards_written, "retries": summary.retries, "per_replica": dict(summary.replicas),
            "gb_written": written / 1e9, "gb_per_s": written / seconds / 1e9, "ended_at": ended_at}


def measure_case(plan: Plan, prompts: list[list[int]], work: Path, args: argparse.Namespace, replicas: int) -> dict[str, Any]:
    """Plain prefill and the capture of the same (capped) prompts, after an untimed warm-up of
    both (the arena reserves its first chunks; every replica sees full-shape requests)."""
    source = work / f"prompts_{plan.case.name}.jsonl"
    warm = max(1, min(plan.prompts, 2 * replicas, plan.shard_lines))
    clients = in_flight(plan, args, replicas)
    write_prompts(source, prompts[:warm])
    plain_prefill(prompts[:warm], clients)
    capture_case(plan, source, work / f"warm_{plan.case.name}", args)
    shutil.rmtree(work / f"warm_{plan.case.name}")
    write_prompts(source, prompts[: plan.prompts])
    before = replica_stats(replicas)
    plain = plain_prefill(prompts[: plan.prompts], clients)
    between = replica_stats(replicas)
    plain["replicas"] = stats_spent(before, between)
    plain["after_last_step_s"] = after_last_step(plain)
    # the sink as this case uses it: as many bytes, in shard-sized files, all kept until the last
    volume, file_bytes = max(plan.bytes_expected, 1 << 20), plan.shard_lines * plan.case.bytes_per_line
    before_capture = sink_write_speed(work, args.sink_threads * replicas, volume, file_bytes)
    out = work / f"case_{plan.case.name}"
    try:
        captured = capture_case(plan, source, out, args)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # the next case needs the space
    captured["replicas"] = stats_spent(between, replica_stats(replicas))
    captured["after_last_step_s"] = after_last_step(captured)
    tokens = plan.prompts * args.prompt_len
    captured["tokens_per_s"] = tokens / captured["seconds"]
    at_volume = sink_write_speed(work, args.sink_threads * replicas, volume, file_bytes)
    return {"hooks": _hooks_text(plan.case.hooks), "positions": plan.case.positions, "prompts": plan.prompts,
            "prompts_capped": plan.capped, "shard_lines": plan.shard_lines, "bytes_per_line": plan.case.bytes_per_line,
            "plain": plain, "capture": captured, "ratio_vs_plain": captured["tokens_per_s"] / plain["tokens_per_s"],
            "sink_write_before": before_capture, "over_sink_before": captured["gb_per_s"] / before_capture["gb_per_s"],
            "sink_write_at_volume": at_volume, "over_sink_at_volume": captured["gb_per_s"] / at_volume["gb_per_s"]}


def after_last_step(run: dict[str, Any]) -> float:
    """Seconds from the engines' last step to the run's end: the last shards' writes (and the
    driver's index and manifest) that no engine work hid."""
    return run["ended_at"] - max(spent["last_step_at"] for spent in run["replicas"].values())


def replica_stats(replicas: int, tries: int = 50) -> dict[str, dict[str, Any]]:
    """Each EngineReplica's `stats` by name (the handle picks a replica per call: asked until all answered)."""
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", "capserve")
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(tries):
        stats = handle.stats.remote().result()
        seen[stats["replica"]] = stats
        if len(seen) == replicas:
            break
    return seen


def stats_spent(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per replica, what its worker and sink spent between two `replica_stats`: steps, the step
    loop's seconds outside the forward, the outbox thread's, the results' reads of the arena, and
    the sink's shards and seconds."""
    spent = {}
    for name, now in after.items():
        then = before.get(name)
        if then is None:
            continue
        engine, engine_then = now["engine"], then["engine"]
        spent[name] = {
            "steps": engine["steps"] - engine_then["steps"],
            "tokens": engine["tokens"] - engine_then["tokens"],
            "last_step_at": engine["last_step_at"],
            "rows_captured": engine["rows_captured"] - engine_then["rows_captured"],
            "worker_s": {k: round(v - engine_then["seconds"].get(k, 0.0), 3) for k, v in engine["seconds"].items()},
            "arena_gb": engine.get("arena_bytes", 0) / 1e9,
            "reads": {k: round(v - then["reads"][k], 3) for k, v in now["reads"].items()},
            "sink": {k: round(v - then["sink"][k], 3) for k, v in now["sink"].items()},
        }
    return spent


def _hooks_text(hooks: list[str]) -> str:
    return hooks[0] if len(hooks) == 1 else f"blocks.0..{len(hooks) - 1}.hook_resid_post"


def app_args(model: str, args: argparse.Namespace, replicas: int, shape: dict[str, int], reserve: int | None) -> dict[str, Any]:
    cap = shape["n_layers"] * (args.prompt_len + 1) * shape["d_model"] * 4  # every row, the largest dtype
    return {"model": model, "device": args.device, "num_replicas": replicas, "max_capture_bytes": cap,
            "replica_max_ongoing_requests": 1024,
            "drain_timeout_s": 10.0, "health_check_timeout_s": 120.0,
            "engine": {**dummy_engine_options(args.config, ["resid_post"]), "arena_reserve_bytes": reserve},
            "sink": {"threads": args.sink_threads, "max_unwritten": max_unwritten(args, replicas)}}


def arena_reserve(table: dict[str, Case], args: argparse.Namespace, replicas: int) -> int | None:
    """Each replica's arena_reserve_bytes: --arena-reserve-gb, else with replica-side sinks room for
    the lines of its share of the CLI's shard window (a shard job holds its lines until its shard is
    written), the largest case's, so that no run waits for the arena to grow; None (the engine's
    default) when that is less. Small shards make the window wider than the replicas' sink slots."""
    if args.arena_reserve_gb is not None:
        return int(args.arena_reserve_gb * 1e9)
    if args.sink == "driver":
        return None
    def held(case: Case) -> int:
        plan = Plan(case, args.prompts, shard_lines_for(case, args), None)
        return math.ceil(shard_window(plan, args, replicas) / replicas) * min(plan.shard_lines, args.prompts) * case.bytes_per_line

    most = max(held(table[name]) for name in args.cases)
    return most if most > DEFAULT_ARENA_RESERVE_BYTES[args.device] else None


def max_unwritten(args: argparse.Namespace, replicas: int) -> int:
    """Each replica's sink.max_unwritten: a slot for each writer, and enough besides for its share
    of --concurrency's lines in the shortest shards (a job holds its slot from its first line, so
    9 slots of 3-line shards kept 27 lines on the H200's engine, not 64:
    `provider.dataset.remote.short_of_lines`)."""
    from provider.dataset.remote import jobs_capturing

    table = case_table(args)
    plans = (Plan(table[name], args.prompts, min(shard_lines_for(table[name], args), args.prompts), None) for name in args.cases)
    return args.sink_threads + max(jobs_capturing(capture_options(plan, args), replicas) for plan in plans)


def wait_for_replicas(replicas: int, timeout_s: float = 900.0) -> None:
    """Serve's RUNNING means every EngineReplica constructor (its engine start) returned."""
    from provider.dataset.backends import HandleBackend

    deadline = time.monotonic() + timeout_s
    made = HandleBackend("capserve")
    while asyncio.run(made.replicas()) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {replicas} EngineReplicas RUNNING after {timeout_s:.0f} s")
        time.sleep(2)


def via_serve(model: str, args: argparse.Namespace, replicas: int, work: Path) -> dict[str, Any]:
    from ray import serve

    from deploy.app import build_app

    shape = model_shape(args.config)
    table = case_table(args)
    prompts = Workload("dataset", args.prompts, args.prompt_len, 0).prompt_ids(vocab=VOCAB)
    out: dict[str, Any] = {"cases": {}}
    started = time.perf_counter()
    start_serve(num_cpus=2 + 2 * replicas if args.device == "cpu" else None)
    try:
        app = build_app(app_args(model, args, replicas, shape, arena_reserve(table, args, replicas)))
        serve.run(app, name="capserve", route_prefix="/")
        wait_for_replicas(replicas)
        out["boot_s"] = time.perf_counter() - started
        out["sink_write"] = sink_write_speed(work, args.sink_threads * replicas, int(args.probe_gb * 1e9),
                                             int(min(args.shard_gb * 1e9, table["c"].bytes_per_line * MAX_SHARD_LINES)))
        print(f"  sink {work}: {out['sink_write']['gb_per_s']:.2f} GB/s raw write", flush=True)
        for name in args.cases:
            plan = plan_case(table[name], args.prompts, shutil.disk_usage(work).free, args)
            result = out["cases"][name] = measure_case(plan, prompts, work, args, replicas)
            _print_case(name, result)
        if "c" in out["cases"]:
            out["c_over_sink_write"] = out["cases"]["c"]["capture"]["gb_per_s"] / out["sink_write"]["gb_per_s"]
        return out
    except BaseException:
        report_ray_failure(args.out, f"dataset_{args.config}")
        raise
    finally:
        stop_serve()


def _print_case(name: str, result: dict[str, Any]) -> None:
    plain, captured = result["plain"], result["capture"]
    capped = f" ({result['prompts_capped']})" if result["prompts_capped"] else ""
    print(f"  case {name}: {result['prompts']} prompts{capped}: plain {plain['tokens_per_s']:9.0f} tok/s | capture "
          f"{captured['tokens_per_s']:9.0f} tok/s ({result['ratio_vs_plain']:.3f}x), {captured['gb_written']:.3f} GB "
          f"in {captured['seconds']:.1f} s = {captured['gb_per_s']:.2f} GB/s; the sink at that volume "
          f"{result['sink_write_before']['gb_per_s']:.2f} GB/s before ({result['over_sink_before']:.2f}x of it), "
          f"{result['sink_write_at_volume']['gb_per_s']:.2f} GB/s after ({result['over_sink_at_volume']:.2f}x); after the "
          f"engines' last step plain {plain['after_last_step_s']:.2f} s, capture {captured['after_last_step_s']:.2f} s", flush=True)
    for label, spent in (("plain", plain["replicas"]), ("capture", captured["replicas"])):
        for replica, used in spent.items():
            print(f"    {label} {replica}: {used['steps']} steps of {used['tokens'] / max(used['steps'], 1):.0f} tokens, worker {used['worker_s']}, arena reads {used['reads']}, "
                  f"sink {used['sink']}", flush=True)


def run_one(args: argparse.Namespace, replicas: int) -> None:
    base = Path(args.sink_dir) if args.sink_dir else (Path("/dev/shm") if args.device == "gpu" else Path(tempfile.gettempdir()))
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="capserve-bench-dataset-", dir=base))
    run: dict[str, Any] = {"replicas": replicas, "environment": environment(), "prompt_len": args.prompt_len,
                           "prompts_requested": args.prompts, "dtype": args.dtype, "sink": args.sink,
                           "concurrency": args.concurrency, "sink_dir": str(work),
                           "sink_free_gb": shutil.disk_usage(work).free / 1e9,
                           "gpu_memory_used_mib_before": gpu_memory_used_mib()}
    path = result_path(f"dataset_{args.config}", args.out)
    model = dummy_model_folder(args.config)
    try:
        run |= via_serve(model, args, replicas, work)
    except BaseException as exc:
        run["error"] = repr(exc)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        run["gpu_memory_used_mib_after"] = wait_for_gpu_memory(run["gpu_memory_used_mib_before"], timeout_s=60)
        save(args, path, {f"replicas={replicas}": run})


# ---------------------------------------------------------------- results


def save(args: argparse.Namespace, path: Path, runs: dict[str, Any]) -> Path:
    merged = merged_runs(path, args.merge) | runs
    _scaling(merged)
    return write_runs(path, {"config": args.config, "settings": engine_settings(args.config), "runs": merged})


def _scaling(runs: dict[str, Any]) -> None:
    """Each case's capture tokens/s on 2 replicas over 1, when both runs are there."""
    one, two = runs.get("replicas=1", {}).get("cases", {}), runs.get("replicas=2", {}).get("cases")
    if two:
        for name, case in two.items():
            if name in one:
                case["over_1_replica"] = case["capture"]["tokens_per_s"] / one[name]["capture"]["tokens_per_s"]


def print_table(path: Path) -> None:
    payload = json.loads(path.read_text())
    print(f"\n{'run':11s} {'case':4s} {'prompts':>7s} {'plain tok/s':>12s} {'capture tok/s':>14s} {'ratio':>6s} "
          f"{'GB':>7s} {'GB/s':>6s} {'x1 rep':>6s}")
    for key, run in payload["runs"].items():
        if "cases" not in run:
            print(f"{key:11s} failed: {run.get('error')}")
            continue
        for name, case in run["cases"].items():
            c = case["capture"]
            print(f"{key:11s} {name:4s} {case['prompts']:7d} {case['plain']['tokens_per_s']:12.0f} {c['tokens_per_s']:14.0f} "
                  f"{case['ratio_vs_plain']:6.3f} {c['gb_written']:7.3f} {c['gb_per_s']:6.3f} {case.get('over_1_replica', float('nan')):6.2f}")
        sink = run["sink_write"]
        over = f", case c at {run['c_over_sink_write']:.2f}x of it" if "c_over_sink_write" in run else ""
        if "over_sink_before" in run["cases"].get("c", {}):
            c = run["cases"]["c"]
            over += (f"; of the sink at its volume, before the capture {c['over_sink_before']:.2f}x "
                     f"({c['sink_write_before']['gb_per_s']:.2f} GB/s), after it {c['over_sink_at_volume']:.2f}x "
                     f"({c['sink_write_at_volume']['gb_per_s']:.2f} GB/s)")
        print(f"{key:11s} sink raw write {sink['gb_per_s']:.2f} GB/s ({sink['threads']} threads){over}")
    print(f"\nwrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama8b", choices=CONFIGS)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1], help="replica counts, each its own app start")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="bfloat16", help="stored dtype")
    parser.add_argument("--sink", choices=("replica", "driver"), default="replica", help="who writes the shards")
    parser.add_argument("--sink-dir", default=None, help="where the shards go (default /dev/shm on the GPU, else the temp folder)")
    parser.add_argument("--sink-threads", type=int, default=2,
                        help="each replica's shard writers (args sink.threads; the write probe uses as many per replica)")
    parser.add_argument("--sink-fill", type=float, default=0.5, help="fraction of the sink's free space a case may fill")
    parser.add_argument("--arena-reserve-gb", type=float, default=None,
                        help="each replica's arena reserved at start-up (engine arena_reserve_bytes; default: with --sink replica, "
                             "room for the lines of its share of the CLI's shard window, the largest case's, when that "
                             "exceeds the engine's default)")
    parser.add_argument("--concurrency", type=int, default=64, help="capserve capture --concurrency")
    parser.add_argument("--shard-lines", type=int, default=0, help="lines per shard (default 0: about --shard-gb, at most 1024)")
    parser.add_argument("--shard-gb", type=float, default=2.0, help="target shard size when --shard-lines is 0")
    parser.add_argument("--probe-gb", type=float, default=None, help="bytes of the sink write probe (default 2; tiny 0.2)")
    parser.add_argument("--device", default=None, choices=["cpu", "gpu"], help="default: cpu for tiny, else gpu")
    parser.add_argument("--merge", nargs="*", default=[], help="earlier dataset JSON files to merge in")
    parser.add_argument("--out", default=None, help="result folder (default bench/results)")
    args = parser.parse_args(argv)
    args.device = args.device or default_device(args.config)
    args.probe_gb = args.probe_gb if args.probe_gb is not None else (0.2 if args.config == "tiny" else 2.0)
    return args


def main() -> None:
    args = parse_args()
    path = result_path(f"dataset_{args.config}", args.out)
    if len(args.replicas) == 1:
        run_one(args, args.replicas[0])
    elif args.replicas:
        run_in_children("bench.bench_dataset", sys.argv[1:], "--replicas", [str(n) for n in args.replicas])
    if not args.replicas or args.merge:
        save(args, path, {})
    print_table(path)


if __name__ == "__main__":
    main()
