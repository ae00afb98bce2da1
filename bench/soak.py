"""The long soak, by hand: the reliability suite's mixed load for many minutes, with replica kills.

    python -m bench.soak --minutes 30                     # from the repo root; 2 CPU replicas
    python -m bench.soak --minutes 60 --fault-every 10    # kill a replica actor / engine in turn

Starts its own local Ray cluster and the app (tiny model), keeps `--concurrency` requests of the
mix (generate, capture, steer; every result checked against HuggingFace on the same weights) in
flight until the time is up, and every minute records the outcomes and each role's RSS, so a
leak shows as a rising column. Every `--fault-every` minutes it kills one replica's actor or its
engine process (alternately) and times the recovery. Writes bench/results/soak_cpu.json (or
--out DIR) and exits 1 if any accepted request was lost or wrong. Every loop is bounded: the run
stops at --minutes, every request has a timeout, every wait a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from typing import Any

from bench.common import write_result
from bench.load import Fleet, Mix, Stream, Tally, engine_core, kill_pids, rss_mib, wait_engine_gone, wait_until

ARGS = {
    "num_replicas": 2,
    "health_check_period_s": 2,
    "health_check_timeout_s": 10,
    "drain_timeout_s": 5,
    "max_queued_requests": 256,
    "replica_max_ongoing_requests": 64,
    "engine": {"max_model_len": 512, "max_num_seqs": 32},
}


def start(port: int) -> Fleet:
    import ray
    from ray import serve

    from deploy.app import build_app

    ray_dir = tempfile.mkdtemp(prefix="capsoak", dir="/tmp")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=ray_dir)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(build_app(ARGS), name="capserve", route_prefix="/")
    return Fleet(handle, serve.get_deployment_handle("EngineReplica", "capserve"))


def inject(fleet: Fleet, n: int) -> dict[str, Any]:
    """Fault n: even n kills a replica actor, odd n its EngineCore; returns what recovery needs."""
    import ray

    victim = fleet.identities()[0]
    if n % 2 == 0:
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
    else:
        kill_pids([engine_core(victim)])
    return victim


def recovered(fleet: Fleet, victim: dict[str, Any]) -> bool:
    import ray

    try:
        ray.get_actor(victim["actor_name"], namespace="serve")
        return False
    except ValueError:
        return fleet.running() == 2 and len(fleet.identities()) == 2


def delta(now: Tally, then: dict[str, int]) -> dict[str, int]:
    return {k: now.counts[k] - then.get(k, 0) for k in ("ok", "backpressure", "lost", "wrong", "invalid")}


async def soak(fleet: Fleet, minutes: float, concurrency: int, max_tokens: int, fault_every: float) -> dict[str, Any]:
    from tests.reliability.reference import Reference

    from replicas.tiny import make_tiny_model

    reference = Reference(make_tiny_model("llama"))
    stream = await Stream(fleet.router, Mix(max_tokens=max_tokens), reference.verify, concurrency,
                          max_requests=10**7, deadline_s=minutes * 60, timeout_s=600).start()
    timeline, faults = [], []
    last: dict[str, int] = {}
    end = time.monotonic() + minutes * 60
    next_fault = time.monotonic() + fault_every * 60 if fault_every else float("inf")
    while time.monotonic() < end:
        await asyncio.sleep(min(60.0, max(0.0, end - time.monotonic())))
        pids = await asyncio.to_thread(fleet.pids)
        row = {"minute": len(timeline) + 1, **delta(stream.tally, last), "rss_mib": rss_mib(pids)}
        last = dict(stream.tally.counts)
        timeline.append(row)
        print(json.dumps(row), flush=True)
        if time.monotonic() >= next_fault and time.monotonic() < end - 120:
            victim = await asyncio.to_thread(inject, fleet, len(faults))
            seconds = await asyncio.to_thread(wait_until, lambda: recovered(fleet, victim), "recovery", 600)
            wait_engine_gone(victim)  # its engine processes and shared memory went with it
            faults.append({"fault": "kill_actor" if len(faults) % 2 == 0 else "kill_engine", "recovery_s": round(seconds, 1)})
            print(json.dumps(faults[-1]), flush=True)
            next_fault = time.monotonic() + fault_every * 60
    tally = await stream.finish()
    return {"minutes": minutes, "concurrency": concurrency, "max_tokens": max_tokens, "totals": tally.summary(),
            "timeline": timeline, "faults": faults}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--fault-every", type=float, default=0.0, help="minutes between faults; 0 = none")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--out", default=None, help="result folder (default bench/results)")
    args = parser.parse_args()
    if not 0 < args.minutes <= 24 * 60:
        parser.error("--minutes must be in (0, 1440]")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    fleet = start(args.port)
    from ray import serve

    try:
        result = asyncio.run(soak(fleet, args.minutes, args.concurrency, args.max_tokens, args.fault_every))
    finally:
        import ray

        serve.shutdown()
        ray.shutdown()
    path = write_result("soak_cpu", result, args.out)
    totals = result["totals"]
    print(f"soak: {totals['requests']} requests, ok {totals['ok']}, backpressure {totals['backpressure']}, "
          f"lost accepted {totals['lost_accepted']}; {len(result['faults'])} faults; written to {path}")
    raise SystemExit(1 if totals["lost_accepted"] else 0)


if __name__ == "__main__":  # vLLM and Ray spawn processes
    main()
