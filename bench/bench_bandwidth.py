"""Activation bandwidth: resid_post at every layer and every position, delivered to the caller.

    python -m bench.bench_bandwidth --config llama8b --via engine --out DIR   # GPU host, ~3 min each
    python -m bench.bench_bandwidth --config llama8b --via serve --out DIR
    python -m bench.bench_bandwidth --config tiny --via engine serve          # CPU check (tiny dummy model)

One engine with dummy weights of the config's shape, fed token ids, resid_post armed for capture.
A batch of concurrent requests (8B: 64 x 512 prompt + 16 generated, ignore_eos) runs, in each
round, once plainly and once capturing `blocks.{i}.hook_resid_post` for every layer i at every
position, as bfloat16: 32 layers x 527 rows (the last sampled token is never fed through the
model) x 4096 x 2 B = 138 MB per request, 8.8 GB per batch. Reported per round and over all
rounds: GB/s of activations the caller received (array bytes / wall time of the batch) and total
tokens per second of both, side by side, so the capture's cost is a ratio measured in one run.

`--via engine` calls `replicas.engine.CaptureEngine` in this process, copying each result out of
the arena (`view_share` 0); `--via engine-inplace` lets its results view the arena instead (what a
replica does before Ray copies a result out); `--via serve` runs the
whole app (Router -> one EngineReplica) and asks for results by reference (`by_reference=True`:
the caller reads the replica's result from Ray's object store, zero-copy on one node). Each via
runs in its own process. Memory: the batch is capped so that two copies of it (the worker's
shared-memory arena, the caller's arrays) fit in `--host-budget-gb` and one copy in half of
/dev/shm's free space; the cap is reported.
Results merge into `<out>/bandwidth_<config>.json` (runs keyed by via).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

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
from replicas.arena.host import capture_arena_bytes

VIAS = ("engine", "engine-inplace", "serve")
DEFAULT_WORKLOAD = {"llama8b": Workload("64x512+16", 64, 512, 16), "llama1b": Workload("64x512+16", 64, 512, 16),
                    "tiny": Workload("8x64+8", 8, 64, 8)}
CAPTURE_DTYPE_BYTES = 2  # bfloat16
COPIES_IN_HOST_MEMORY = 2  # the worker's shared-memory arena, the caller's arrays


@dataclass(frozen=True)
class Plan:
    workload: Workload
    n_layers: int
    d_model: int

    @property
    def rows(self) -> int:
        return self.workload.prompt_len + self.workload.max_tokens - 1

    @property
    def bytes_per_request(self) -> int:
        return self.n_layers * self.rows * self.d_model * CAPTURE_DTYPE_BYTES

    def arena_reserve(self, requests: int) -> int:
        """arena_reserve_bytes for a batch of `requests` captures: what they take in the arena (their
        rows in whole blocks), so the first batch finds its memory registered, as a warm one does."""
        max_rows = self.workload.prompt_len + self.workload.max_tokens
        return requests * capture_arena_bytes(self.n_layers, max_rows, self.d_model * CAPTURE_DTYPE_BYTES, self.d_model)

    @property
    def capture_cap(self) -> int:
        """max_capture_bytes for the engine: the request's rows at float32 (the largest dtype)."""
        return self.n_layers * (self.workload.prompt_len + self.workload.max_tokens) * self.d_model * 4

    def capture_request(self) -> dict[str, Any]:
        return {"max_tokens": self.workload.max_tokens, "ignore_eos": True,
                "capture": {"hooks": [f"blocks.{i}.hook_resid_post" for i in range(self.n_layers)],
                            "positions": "all", "dtype": "bfloat16"}}

    def plain_request(self) -> dict[str, Any]:
        return {"max_tokens": self.workload.max_tokens, "ignore_eos": True}


def fitted_requests(requested: int, per_request: int, host_budget: float) -> tuple[int, str | None]:
    """The batch size memory allows, and why it was lowered (None when it was not)."""
    by_host = int(host_budget // (COPIES_IN_HOST_MEMORY * per_request))
    shm = Path("/dev/shm")
    by_shm = int(shutil.disk_usage(shm).free * 0.5 // per_request) if shm.is_dir() else requested
    fitted = max(1, min(requested, by_host, by_shm))
    if fitted == requested:
        return fitted, None
    return fitted, f"lowered from {requested}: host budget allows {by_host}, /dev/shm allows {by_shm}"


# ---------------------------------------------------------------- measurement


Submit = Callable[[dict[str, Any]], Awaitable[Any]]


async def one_batch(submit: Submit, base: dict[str, Any], prompts: list[list[int]], plan: Plan) -> dict[str, Any]:
    """Every prompt at once; each result is counted and dropped as it arrives, so the caller holds
    at most the results still in flight."""
    tally = {"tokens": 0, "bytes": 0, "bad": 0}

    async def one(prompt: list[int]) -> None:
        result = await submit(base | {"prompt": prompt})
        tally["tokens"] += len(result.prompt_token_ids) + len(result.token_ids)
        arrays = list((result.activations or {}).values())
        tally["bytes"] += sum(a.nbytes for a in arrays)
        if "capture" in base and (len(arrays) != plan.n_layers or any(a.shape != (plan.rows, plan.d_model) for a in arrays)):
            tally["bad"] += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens_per_s": tally["tokens"] / seconds, "bytes": tally["bytes"],
            "gb_per_s": tally["bytes"] / seconds / 1e9, "bad_results": tally["bad"]}


async def measure(submit: Submit, plan: Plan, requests: int, rounds: int) -> dict[str, Any]:
    prompts = Workload("batch", requests, plan.workload.prompt_len, 0).prompt_ids(vocab=VOCAB)
    warm = prompts[: min(4, requests)]  # full-shape requests: the arena reserves its first chunks
    await one_batch(submit, plan.plain_request(), warm, plan)
    await one_batch(submit, plan.capture_request(), warm, plan)
    out: dict[str, Any] = {"rounds": []}
    for index in range(rounds):
        plain = await one_batch(submit, plan.plain_request(), prompts, plan)
        capture = await one_batch(submit, plan.capture_request(), prompts, plan)
        out["rounds"].append({"plain": plain, "capture": capture})
        print(f"  round {index}: plain {plain['tokens_per_s']:9.0f} tok/s | capture {capture['tokens_per_s']:9.0f} tok/s, "
              f"{capture['gb_per_s']:6.2f} GB/s ({capture['bytes'] / 1e9:.2f} GB in {capture['seconds']:.2f} s)", flush=True)
    plain_s = sum(r["plain"]["seconds"] for r in out["rounds"])
    capture_s = sum(r["capture"]["seconds"] for r in out["rounds"])
    tokens = requests * (plan.workload.prompt_len + plan.workload.max_tokens) * rounds
    captured = sum(r["capture"]["bytes"] for r in out["rounds"])
    out["summary"] = {
        "plain_tokens_per_s": tokens / plain_s,
        "capture_tokens_per_s": tokens / capture_s,
        "capture_over_plain": plain_s / capture_s,
        "gb_per_s": captured / capture_s / 1e9,
        "gb_captured": captured / 1e9,
        "bad_results": sum(r["capture"]["bad_results"] for r in out["rounds"]),
    }
    return out


async def via_engine(model: str, args: argparse.Namespace, plan: Plan, requests: int, in_place: bool) -> dict[str, Any]:
    from replicas.engine import CaptureEngine, EngineConfig

    config = EngineConfig(model=model, max_capture_bytes=plan.capture_cap, arena_reserve_bytes=plan.arena_reserve(requests),
                          **dummy_engine_options(args.config, ["resid_post"]))
    started = time.perf_counter()
    engine = await CaptureEngine.start(config)
    engine.view_share = 1.0 if in_place else 0.0  # results view the arena, as a replica's do, or are copied out
    try:
        boot_s = time.perf_counter() - started
        out = await measure(engine.generate, plan, requests, args.rounds)
        out["worker"] = await engine.stats()  # the worker's step-loop timers: where the time went
        out["boot_s"] = boot_s
        return out
    finally:
        await engine.shutdown()


def via_serve(model: str, args: argparse.Namespace, plan: Plan, requests: int) -> dict[str, Any]:
    from ray import serve

    from deploy.app import build_app

    app = {"model": model, "device": args.device, "num_replicas": 1, "max_capture_bytes": plan.capture_cap,
           "replica_max_ongoing_requests": max(512, 2 * requests),
           "engine": dummy_engine_options(args.config, ["resid_post"]) | {"arena_reserve_bytes": plan.arena_reserve(requests)},
           "drain_timeout_s": 10.0, "health_check_timeout_s": 60.0}
    started = time.perf_counter()
    start_serve(num_cpus=4 if args.device == "cpu" else None)
    try:
        handle = serve.run(build_app(app), name="capserve", route_prefix="/")
        boot_s = time.perf_counter() - started

        async def submit(request: dict[str, Any]) -> Any:
            ref = await handle.generate.remote(request, by_reference=True)
            return await ref  # the replica's own result object, read from the object store

        out = asyncio.run(measure(submit, plan, requests, args.rounds))
        out["boot_s"] = boot_s
        return out
    except BaseException:
        report_ray_failure(args.out, f"bandwidth_{args.config}_serve")
        raise
    finally:
        stop_serve()


def run_one(args: argparse.Namespace, via: str) -> None:
    shape = model_shape(args.config)
    default = DEFAULT_WORKLOAD[args.config]
    workload = Workload("batch", args.requests or default.prompts, args.prompt_len or default.prompt_len,
                        args.max_tokens or default.max_tokens)
    plan = Plan(workload, shape["n_layers"], shape["d_model"])
    requests, lowered = fitted_requests(workload.prompts, plan.bytes_per_request, args.host_budget_gb * 1e9)
    print(f"{via}: {requests} requests x ({workload.prompt_len} + {workload.max_tokens}) tokens, "
          f"{plan.bytes_per_request / 1e6:.1f} MB of activations each{f' ({lowered})' if lowered else ''}", flush=True)
    run: dict[str, Any] = {
        "via": via, "environment": environment(), "requests": requests, "prompt_len": workload.prompt_len,
        "max_tokens": workload.max_tokens, "rows_per_request": plan.rows, "bytes_per_request": plan.bytes_per_request,
        "capture": plan.capture_request()["capture"] | {"hooks": f"blocks.0..{plan.n_layers - 1}.hook_resid_post"},
        "batch_lowered": lowered, "gpu_memory_used_mib_before": gpu_memory_used_mib(),
        "dev_shm_free_gb": shutil.disk_usage("/dev/shm").free / 1e9 if Path("/dev/shm").is_dir() else None,
    }
    path = result_path(f"bandwidth_{args.config}", args.out)
    model = dummy_model_folder(args.config)
    try:
        if via.startswith("engine"):
            run |= asyncio.run(via_engine(model, args, plan, requests, in_place=via == "engine-inplace"))
        else:
            run |= via_serve(model, args, plan, requests)
    except BaseException as exc:
        run["error"] = repr(exc)
        raise
    finally:
        run["gpu_memory_used_mib_after"] = wait_for_gpu_memory(run["gpu_memory_used_mib_before"], timeout_s=60)
        save(args, path, {via: run})


# ---------------------------------------------------------------- results


def save(args: argparse.Namespace, path: Path, runs: dict[str, Any]) -> Path:
    merged = merged_runs(path, args.merge) | runs
    return write_runs(path, {"config": args.config, "settings": engine_settings(args.config), "runs": merged})


def print_table(path: Path) -> None:
    import json

    runs = json.loads(path.read_text())["runs"]
    print(f"\n{'via':8s} {'requests':>8s} {'MB/req':>7s} {'plain tok/s':>12s} {'capture tok/s':>14s} {'ratio':>6s} {'GB/s':>7s}")
    for via, run in runs.items():
        if "summary" not in run:
            print(f"{via:8s} failed: {run.get('error')}")
            continue
        s = run["summary"]
        print(f"{via:8s} {run['requests']:8d} {run['bytes_per_request'] / 1e6:7.1f} {s['plain_tokens_per_s']:12.0f} "
              f"{s['capture_tokens_per_s']:14.0f} {s['capture_over_plain']:6.3f} {s['gb_per_s']:7.2f}")
    print(f"\nwrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama8b", choices=CONFIGS)
    parser.add_argument("--via", nargs="*", default=["engine"], choices=VIAS,
                        help="engine: CaptureEngine in this process (engine-inplace: its results view the arena, "
                        "as a replica's do); serve: the app, by reference; none = print only")
    parser.add_argument("--requests", type=int, default=None, help="batch size (8B default 64; tiny 8)")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3, help="plain + capture batches, alternating")
    parser.add_argument("--host-budget-gb", type=float, default=40.0)
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "gpu"], help="default: cpu for tiny, else gpu")
    parser.add_argument("--merge", nargs="*", default=[], help="earlier bandwidth JSON files to merge in")
    parser.add_argument("--out", default=None, help="result folder (default bench/results)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    args.device = args.device or default_device(args.config)
    path = result_path(f"bandwidth_{args.config}", args.out)
    if len(args.via) == 1:
        run_one(args, args.via[0])
    elif args.via:
        run_in_children("bench.bench_bandwidth", sys.argv[1:], "--via", args.via)
    if not args.via or args.merge:
        save(args, path, {})
    print_table(path)


if __name__ == "__main__":
    main()
