"""The handle path alone: capture results from a replica to the caller through Ray, with no engine.
It times what Ray and Serve add to an all-layer capture once the rows are in the replica, so it
runs anywhere; `bench_bandwidth --via serve` is the same path with a real engine in front.

    python -m bench.bench_handle_path                    # 16 requests x 69 MB (bf16), ~2 min
    python -m bench.bench_handle_path --requests 32 --rows 527   # bench_bandwidth's 138 MB requests, 4.4 GB a round

A stand-in replica deployment (Serve's request router and the real `Router` in front of it, as
`deploy.app` builds them) answers every request with a `GenerateResult` whose arrays are
read-only views of one buffer, as a replica's in-place results view its arena. Ways, alternating
in each round so they compare within one run; each round sends `--requests` at once:
- `ray`: a plain Ray actor returns one uint8 array of the same bytes: Ray's own ceiling;
- `ray-bf16`: that actor returns the result's arrays as a plain dict of bfloat16 arrays, which
  numpy pickles in-band (what every result paid before `replicas.api.arrays.OutOfBand`);
- `replica`: a Serve handle straight to the replica deployment;
- `router`: the app's Router, by reference (`by_reference=True`, what `CaptureClient` does for
  large results): the caller reads the replica's own object;
- `router-value`: the Router by value: Ray copies the result once more on the way out;
- `router-in-band`: `router` with the result pickled as before `replicas.api.arrays.OutOfBand`
  (bfloat16 in-band): the same path before the fix.
Reported: GB/s the caller received, for the first round (Ray's object store is new then) and over
the others, each way's ratio to `ray`, and `router` over `router-in-band` (the fix's gain).
Results go to `<out>/handle_path_<label>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any, Awaitable, Callable

import numpy as np
from pydantic import BaseModel

from bench.common import write_result
from replicas.api import GenerateRequest, GenerateResult, ModelInfo
from replicas.api.arrays import DTYPES

WAYS = ("ray", "ray-bf16", "replica", "router", "router-value", "router-in-band")
IN_BAND_SEED = 1  # a request with this seed gets its result pickled as before OutOfBand (router-in-band)


class InBandResult(GenerateResult):
    """A result pickled as before `replicas.api.arrays.OutOfBand`: numpy's own pickling of every array."""

    def __getstate__(self) -> dict[Any, Any]:
        return BaseModel.__getstate__(self)


class StandInReplica:
    """Answers like an EngineReplica whose engine has the rows already: a result that views them."""

    def __init__(self, layers: int, rows: int, d_model: int, dtype: str) -> None:
        self.buffer = np.ones((layers, rows, d_model), DTYPES[dtype])
        self.buffer.flags.writeable = False
        self.shape = (layers, rows, d_model, dtype)

    async def generate(self, request: Any, options: Any = None) -> Any:
        layers, rows = self.buffer.shape[:2]
        kind = InBandResult if request.seed == IN_BAND_SEED else GenerateResult
        return kind(
            request_id="r", text="", token_ids=[1], prompt_token_ids=[1] * rows, finish_reason="length", choices=[],
            activations={f"blocks.{i}.hook_resid_post": self.buffer[i] for i in range(layers)},
        )

    async def info(self) -> Any:
        layers, _, d_model, dtype = self.shape
        return ModelInfo(model="stand-in", architecture="LlamaForCausalLM", n_layers=layers, d_model=d_model,
                         d_vocab=32000, max_model_len=4096, dtype=dtype, hook_names=[], armed_kinds=["resid_post"])


class RayCeiling:
    """A plain actor: the same bytes as one array, or as the result's dict of arrays."""

    def __init__(self, layers: int, rows: int, d_model: int, dtype: str) -> None:
        self.bits = np.ones(layers * rows * d_model * DTYPES[dtype].itemsize, np.uint8)
        self.arrays = {f"blocks.{i}.hook_resid_post": np.ones((rows, d_model), DTYPES[dtype]) for i in range(layers)}

    def one_array(self) -> np.ndarray:
        return self.bits

    def result_arrays(self) -> dict[str, np.ndarray]:
        return self.arrays


def received_bytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, dict):
        return sum(a.nbytes for a in value.values())
    return value.activation_bytes


def callers(args: argparse.Namespace) -> dict[str, Callable[[], Awaitable[Any]]]:
    import ray
    from ray import serve

    from deploy.app import ROUTER_BACKOFF
    from deploy.balance import router_class_path
    from deploy.router import Router

    shape = (args.layers, args.rows, args.d_model, args.dtype)
    actor = ray.remote(RayCeiling).options(num_cpus=0).remote(*shape)
    replica = serve.deployment(StandInReplica, name="EngineReplica").options(
        max_ongoing_requests=4 * args.requests, ray_actor_options={"num_cpus": 0},
        request_router_config={"request_router_class": router_class_path(), **ROUTER_BACKOFF},
    )
    router = serve.deployment(Router, name="Router").options(max_ongoing_requests=8 * args.requests,
                                                            ray_actor_options={"num_cpus": 0})
    config = {"replica_slots": 4 * args.requests, "max_queued_requests": 8 * args.requests}
    app = serve.run(router.bind(replica.bind(*shape), config), name="capserve", route_prefix=None)
    direct = serve.get_deployment_handle("EngineReplica", "capserve")
    request = {"prompt": [1, 2, 3], "max_tokens": 1}

    async def by_reference(request: dict[str, Any] = request) -> Any:
        return await (await app.generate.remote(request, by_reference=True))

    return {
        "ray": lambda: actor.one_array.remote(),
        "ray-bf16": lambda: actor.result_arrays.remote(),
        "replica": lambda: direct.generate.remote(GenerateRequest.model_validate(request)),  # as the Router sends it
        "router": by_reference,
        "router-value": lambda: app.generate.remote(request),
        "router-in-band": lambda: by_reference(request | {"seed": IN_BAND_SEED}),
    }


async def one_round(call: Callable[[], Awaitable[Any]], requests: int) -> dict[str, float]:
    started = time.perf_counter()
    results = await asyncio.gather(*(call() for _ in range(requests)))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "bytes": sum(received_bytes(r) for r in results)}


def gb_per_s(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Per way, the median GB/s over these rounds and its ratio to Ray's ceiling; the fix's gain."""
    if not rounds:
        return {}
    speed = {way: statistics.median(r[way]["bytes"] / r[way]["seconds"] / 1e9 for r in rounds) for way in WAYS}
    return speed | {f"{way}_over_ray": speed[way] / speed["ray"] for way in WAYS if way != "ray"} | {
        "router_over_router-in-band": speed["router"] / speed["router-in-band"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="sent at once in each round")
    parser.add_argument("--rows", type=int, default=264)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rounds", type=int, default=5, help="the first is reported apart (Ray's object store is new)")
    parser.add_argument("--object-store-gb", type=float, default=None, help="Ray's object store (default: Ray's)")
    parser.add_argument("--preallocate", action="store_true",
                        help="fault Ray's object store in at start (RAY_preallocate_plasma_memory=1), so a first round runs warm")
    parser.add_argument("--label", default="cpu")
    parser.add_argument("--out", default=None, help="result folder (default bench/results)")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    store = int(args.object_store_gb * 1e9) if args.object_store_gb else None
    ray.init(address="local", include_dashboard=False, log_to_driver=False, object_store_memory=store,
             _system_config={"preallocate_plasma_memory": True} if args.preallocate else None)
    rounds: list[dict[str, Any]] = []
    try:
        ways = callers(args)
        request_mb = args.layers * args.rows * args.d_model * DTYPES[args.dtype].itemsize / 1e6
        print(f"{args.requests} requests x {request_mb:.1f} MB ({args.dtype}) per way per round", flush=True)
        for index in range(args.rounds):
            measured = {way: asyncio.run(one_round(ways[way], args.requests)) for way in WAYS}
            rounds.append(measured)
            print(f"  round {index}: " + " | ".join(f"{w} {m['bytes'] / m['seconds'] / 1e9:5.2f}" for w, m in measured.items())
                  + " GB/s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    summary = {"first": gb_per_s(rounds[:1]), "warm": gb_per_s(rounds[1:])}
    for name, figures in summary.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    path = write_result(f"handle_path_{args.label}", {"args": vars(args), "rounds": rounds, "summary": summary}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
