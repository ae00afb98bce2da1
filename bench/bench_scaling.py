"""Throughput over replica counts: the overhead workload through the capserve Router, 1..N replicas.

    python -m bench.bench_scaling --config llama8b --replicas 1 --out DIR   # one command per N on the
    python -m bench.bench_scaling --config llama8b --replicas 2 --out DIR   # GPU host (~3 min each)
    python -m bench.bench_scaling --config tiny --replicas 1 2              # CPU check (tiny dummy model)
    python -m bench.bench_scaling --config llama8b --replicas --merge A.json B.json   # merge, print only

Each replica count N gets a fresh Ray cluster and the whole capserve app (`deploy.app.build_app`:
Router -> N EngineReplicas, one GPU each), dummy weights of the config's shape, fed token ids (no
tokenizer). Per replica the load is the overhead workload (512 prompts x 512 token ids + 128
generated, ignore_eos; tiny: 16 x 64 + 16), so the fleet sees N x 512 requests and each replica
the same load at every N. Cases: plain generate, and generate with a capture of resid_post at the
middle layer for the last prompt token (the light capture an eval attaches to every sample).
Loads: 1x = as many concurrent clients as the fleet holds (N x replica_max_ongoing_requests, which
is set to the engine batch, 512), each sending one request; 2x = twice that, the overload where
plain Serve collapsed to 0.49x (shared/gpu/README.md): the Router must queue the rest and refill.

Reported: total tokens (prompt + generated) per second, the ratio to N=1 for the same case and
load (goal >= 0.95 N; plain Serve over AsyncLLM replicas gave 1.67-1.69x at N=2), the 2x/1x ratio
and each replica's share of the requests. Results merge into `<out>/scaling_<config>.json` (runs
keyed by N; an N that runs again replaces its entry), written after every measured case, so a run
cut short keeps what it finished. Several N in one command run one after another, each in its own
process, so every N starts from a clean GPU and a clean Ray cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench.common import (
    CONFIGS,
    VOCAB,
    WORKLOADS,
    Workload,
    closed_loop,
    default_device,
    dummy_engine_options,
    dummy_model_folder,
    engine_settings,
    environment,
    gpu_memory_used_mib,
    load_average,
    merged_runs,
    report_ray_failure,
    result_path,
    run_in_children,
    start_serve,
    stop_serve,
    wait_for_gpu_memory,
    write_runs,
)

# Per-replica load: bench_overhead's main workload on the GPU; a small one for the CPU check.
PER_REPLICA = {"llama8b": WORKLOADS["512x512+128"], "llama1b": WORKLOADS["512x512+128"],
               "tiny": WORKLOADS["16x64+16"]}
CASES = ("generate", "capture_last_prompt")


class Deadline(Exception):
    """Raised by SIGALRM: the run stops itself (and shuts Ray down) before the host's limit."""


# ---------------------------------------------------------------- one replica count


def case_fields(case: str, n_layers: int) -> dict[str, Any]:
    if case == "capture_last_prompt":
        return {"capture": {"hooks": [f"blocks.{n_layers // 2}.hook_resid_post"], "positions": "last_prompt"}}
    return {}


def app_args(config: str, model: str, replicas: int, slots: int, max_load: int, device: str,
             replicas_per_gpu: int = 1) -> dict[str, Any]:
    return {
        "model": model,
        "device": device,
        "num_replicas": replicas,
        "replicas_per_gpu": replicas_per_gpu,
        "replica_max_ongoing_requests": slots,
        # The overload run puts max_load x capacity requests in flight at once; none may be refused.
        "max_queued_requests": max_load * replicas * slots,
        "engine": dummy_engine_options(config, ["resid_post"], replicas_per_gpu),
        "drain_timeout_s": 10.0,  # nothing is in flight at shutdown; don't wait on stragglers
        "health_check_timeout_s": 60.0,  # a probe waits for the engine between two steps of a full batch
    }


def token_count(result: Any) -> int:
    return len(result.prompt_token_ids) + len(result.token_ids)


async def measure(handle: Any, load: int, capacity: int, prompts: list[list[int]], base: dict[str, Any],
                  hook: str | None) -> dict[str, Any]:
    """`load` x capacity clients, one request each; a capture case also checks what came back."""
    requests = load * capacity
    captured = {"bytes": 0, "missing": 0}

    async def call(i: int) -> Any:
        result = await handle.generate.remote(base | {"prompt": prompts[i]})
        if hook is not None:
            rows = result.activations.get(hook) if result.activations else None
            if rows is None or rows.shape[0] != 1:
                captured["missing"] += 1
            else:
                captured["bytes"] += rows.nbytes
        return result

    out = await closed_loop(call, clients=requests, requests=requests, tokens=token_count)
    out["busiest_share"] = max(out["per_replica"].values()) / requests
    if hook is not None:
        out["captured_bytes"] = captured["bytes"]
        out["captures_missing"] = captured["missing"]
    return out


async def run_cases(handle: Any, args: argparse.Namespace, n: int, capacity: int, record: Callable[[], None],
                    run: dict[str, Any]) -> None:
    from ray import serve

    info = await handle.info.remote()
    replicas = serve.get_deployment_handle("EngineReplica", "capserve")
    stats = await replicas.broadcast("stats").results_async(timeout_s=60)
    run["kv_cache_tokens"] = sorted(s["kv_cache_tokens"] for s in stats)  # replicas sharing a GPU: each its share
    print(f"N={n}: KV cache tokens per replica {run['kv_cache_tokens']}", flush=True)
    workload = PER_REPLICA[args.config]
    prompts = Workload("all", max(args.loads) * capacity, workload.prompt_len, 0).prompt_ids(vocab=VOCAB)
    run["model"] = {"n_layers": info.n_layers, "d_model": info.d_model}
    for case in args.cases:
        extra = case_fields(case, info.n_layers)
        hook = extra["capture"]["hooks"][0] if extra else None
        # Warm-up: every replica serves this case once before it is timed (first-use allocations).
        warm = {"max_tokens": 4, "ignore_eos": True} | extra
        warm_count = min(n * 16, len(prompts))
        await closed_loop(lambda i: handle.generate.remote(warm | {"prompt": prompts[i]}), clients=warm_count,
                          requests=warm_count, tokens=token_count)
        base = {"max_tokens": workload.max_tokens, "ignore_eos": True} | extra
        for load in args.loads:
            result = await measure(handle, load, capacity, prompts, base, hook)
            run["cases"].setdefault(case, {})[f"{load}x"] = result
            print(f"  N={n} {case:22s} {load}x: {result['tokens_per_s']:10.0f} tok/s  {result['seconds']:6.1f} s  "
                  f"split {list(result['per_replica'].values())}", flush=True)
            record()
    run["router_stats"] = await handle.stats.remote()


def run_one(args: argparse.Namespace, n: int) -> None:
    """Start Ray + the app with n replicas, measure every case and load, shut everything down."""
    from ray import serve

    from deploy.app import build_app

    workload = PER_REPLICA[args.config]
    slots = args.max_ongoing or workload.prompts
    capacity = n * slots
    path = result_path(result_name(args), args.out)
    run: dict[str, Any] = {
        "replicas": n, "replicas_per_gpu": min(n, args.replicas_per_gpu), "environment": environment(), "replica_max_ongoing_requests": slots, "capacity": capacity,
        "per_replica_workload": workload.name, "gpu_memory_used_mib_before": gpu_memory_used_mib(),
        "load_average_before": load_average(), "cases": {},
    }

    def record() -> None:
        save(args, path, {str(n): run})

    if args.deadline_s:
        signal.signal(signal.SIGALRM, _deadline)
        signal.alarm(args.deadline_s)
    started = time.perf_counter()
    start_serve(num_cpus=4 if args.device == "cpu" else None)  # as the tests: room for 2 CPU replicas
    try:
        model = dummy_model_folder(args.config)
        handle = serve.run(build_app(app_args(args.config, model, n, slots, max(args.loads), args.device,
                                              min(n, args.replicas_per_gpu))),
                           name="capserve", route_prefix="/")
        run["boot_s"] = time.perf_counter() - started
        print(f"N={n}: app up in {run['boot_s']:.0f} s", flush=True)
        asyncio.run(run_cases(handle, args, n, capacity, record, run))
    except BaseException as exc:
        run["error"] = repr(exc)
        print(f"N={n}: failed: {exc!r}", flush=True)
        report_ray_failure(args.out, f"scaling_{args.config}_n{n}")
        raise
    finally:
        run["seconds_total"] = time.perf_counter() - started
        run["load_average_after"] = load_average()
        record()
        signal.alarm(0)
        stop_serve()
        # A replica's engine process that outlived Ray would hold its GPU for the next N.
        run["gpu_memory_used_mib_after"] = wait_for_gpu_memory(run["gpu_memory_used_mib_before"], timeout_s=60)
        record()


def _deadline(signum: int, frame: Any) -> None:
    raise Deadline("--deadline-s reached; stopping so Ray shuts down before the host's time limit")


# ---------------------------------------------------------------- results


def save(args: argparse.Namespace, path: Path, runs: dict[str, Any]) -> Path:
    merged = merged_runs(path, args.merge) | runs
    return write_runs(path, {"config": args.config, "settings": engine_settings(args.config),
                             "summary": summarize(merged), "runs": merged})


def summarize(runs: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, load, N): tok/s, ratio to N=1 (same case and load), ratio / N, 2x/1x."""
    rows = []
    for n_key in sorted(runs, key=int):
        for case, loads in runs[n_key].get("cases", {}).items():
            for load, result in loads.items():
                n = int(n_key)
                one = runs.get("1", {}).get("cases", {}).get(case, {}).get(load)
                ratio = result["tokens_per_s"] / one["tokens_per_s"] if one else None
                at_1x = loads.get("1x")
                rows.append({
                    "case": case, "load": load, "replicas": n, "tokens_per_s": round(result["tokens_per_s"], 1),
                    "ratio_to_1": round(ratio, 3) if ratio else None,
                    "ratio_over_n": round(ratio / n, 3) if ratio else None,
                    "over_1x": round(result["tokens_per_s"] / at_1x["tokens_per_s"], 3) if at_1x else None,
                    "busiest_share": round(result["busiest_share"], 3), "per_replica": result["per_replica"],
                })
    return rows


def print_table(path: Path) -> None:
    summary = json.loads(path.read_text())["summary"]
    print(f"\n{'case':22s} {'load':>4s} {'N':>2s} {'tok/s':>10s} {'vs N=1':>7s} {'/N':>6s} {'vs 1x':>6s} {'busiest':>7s}")
    for row in summary:
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        print(f"{row['case']:22s} {row['load']:>4s} {row['replicas']:2d} {row['tokens_per_s']:10.0f} "
              f"{fmt(row['ratio_to_1']):>7s} {fmt(row['ratio_over_n']):>6s} {fmt(row['over_1x']):>6s} "
              f"{row['busiest_share']:7.3f}")
    print(f"\nwrote {path}")


# ---------------------------------------------------------------- entry


def result_name(args: argparse.Namespace) -> str:
    return f"scaling_{args.config}" + (f"_{args.replicas_per_gpu}_per_gpu" if args.replicas_per_gpu > 1 else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama8b", choices=CONFIGS)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 2],
                        help="replica counts, each in its own process; none = only merge and print")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 2], help="multiples of the fleet's capacity")
    parser.add_argument("--max-ongoing", type=int, default=None,
                        help="replica_max_ongoing_requests (default: the per-replica prompt count, 512)")
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "gpu"], help="default: cpu for tiny, else gpu")
    parser.add_argument("--replicas-per-gpu", type=int, default=1,
                        help="replicas sharing a GPU (replicas_per_gpu, at most N): with 2, --replicas 1 2 compares one replica "
                             "holding the whole GPU with two sharing it")
    parser.add_argument("--deadline-s", type=int, default=540,
                        help="stop a replica count after this long (0 = never): the GPU host kills commands at 600 s")
    parser.add_argument("--merge", nargs="*", default=[], help="earlier scaling JSON files to merge in")
    parser.add_argument("--out", default=None, help="result folder (default bench/results)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    path = result_path(result_name(args), args.out)
    args.device = args.device or default_device(args.config)
    if len(args.replicas) == 1:
        run_one(args, args.replicas[0])
    elif args.replicas:
        run_in_children("bench.bench_scaling", sys.argv[1:], "--replicas", [str(n) for n in args.replicas])
    if not args.replicas or args.merge:
        save(args, path, {})
    print_table(path)


if __name__ == "__main__":
    main()
