"""Overhead of capserve's engine against plain vLLM on one GPU, measured side by side in one run.

    python -m bench.bench_overhead --config llama8b                      # every deployment below
    python -m bench.bench_overhead --deployments plain capture --tag a   # a subset (one GPU each)

Every case runs the same token-id prompts through an AsyncLLM-backed engine with the same
settings (TP 1, prefix caching off, dummy bf16 weights, ignore_eos) and reports total tokens per
second (prompt + generated) and the ratio to plain vLLM with CUDA graphs, which every run
measures itself. Deployments (one engine each):
  plain      plain vLLM, CUDA graphs, its default runner (always run: the baseline)
  plain-v1   the same on the V1 model runner, which capserve's worker reads
  eager      plain vLLM, eager
  capture    capserve, resid_post armed for capture: no capture; resid_post at one layer for all
             positions; at every layer for the last prompt token; at every layer for all positions
             (skipped where the rows would not fit in --host-gb of host memory)
  steer      capserve, resid_post armed for capture and edits at every layer: no edit; one vector
  steer-layer  the same with edits armed at the steered layer only (`steer_layers`)
Attention internals (hook_z armed everywhere, a one-layer hook_z capture, a pattern at last_prompt,
a per-head ablation) and SAE features are measured by bench_side_by_side, which keeps plain vLLM
and capserve engines alive on one GPU and alternates their batches: their costs are ~1 %, below
what separate processes here resolve.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
from typing import Any, Awaitable, Callable

import numpy as np

from bench.common import (
    CONFIGS,
    GPU_WORKLOADS,
    VOCAB,
    WORKLOADS,
    Workload,
    dummy_model_folder,
    engine_settings,
    model_shape,
    write_result,
)


HOST_BYTES_PER_GB = 1 << 30


def capture_cases(n_layers: int, workload: Workload, d_model: int, host_gb: float) -> dict[str, dict[str, Any]]:
    middle = n_layers // 2
    every = [f"blocks.{i}.hook_resid_post" for i in range(n_layers)]
    cases = {
        "no capture": {},
        "capture resid_post 1 layer, all positions": {
            "capture": {"hooks": [f"blocks.{middle}.hook_resid_post"], "positions": "all", "dtype": "bfloat16"}
        },
        "capture resid_post all layers, last_prompt": {"capture": {"hooks": every, "positions": "last_prompt"}},
    }
    all_rows_bytes = workload.total_tokens * n_layers * d_model * 2
    if all_rows_bytes <= host_gb * HOST_BYTES_PER_GB:
        cases["capture resid_post all layers, all positions"] = {
            "capture": {"hooks": every, "positions": "all", "dtype": "bfloat16"}
        }
    return cases


def steer_cases(n_layers: int, d_model: int) -> dict[str, dict[str, Any]]:
    vector = np.random.default_rng(0).standard_normal(d_model).astype(np.float32)
    return {
        "no edit": {},
        "steer 1 vector, 1 layer": {
            "interventions": [{"hook": f"blocks.{n_layers // 2}.hook_resid_post", "op": "add", "scale": 0.1, "vector": vector}]
        },
    }


async def timed(workload: Workload, submit: Callable[[list[int]], Awaitable[Any]]) -> dict[str, float]:
    prompts = workload.prompt_ids(vocab=VOCAB)
    await asyncio.gather(*(submit(p) for p in prompts[:8]))  # warm-up
    start = time.perf_counter()
    results = await asyncio.gather(*(submit(p) for p in prompts))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tok_per_s": workload.total_tokens / seconds, "requests": len(results)}


async def plain_vllm(model: str, settings: dict[str, Any], eager: bool, workloads: list[Workload], v1_runner: bool = False) -> dict[str, dict[str, float]]:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    # vLLM's own default runner (V2 on GPU), or the V1 runner capserve's worker reads
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if v1_runner:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=eager,
                        enable_prefix_caching=False, tensor_parallel_size=1, **settings)
    )
    counter = iter(range(10**9))
    out = {}
    try:
        for workload in workloads:
            params = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True, detokenize=False)

            async def submit(prompt: list[int]) -> Any:
                final = None
                async for output in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=str(next(counter))):
                    final = output
                return final

            out[workload.name] = await timed(workload, submit)
    finally:
        llm.shutdown()
    return out


async def capserve(
    model: str, settings: dict[str, Any], workloads: list[Workload], deployment: str, host_gb: float, n_layers: int
) -> dict[str, dict[str, dict[str, float]]]:
    from replicas.engine import CaptureEngine, EngineConfig

    steer = deployment != "capture"
    engine = await CaptureEngine.start(
        EngineConfig(model=model, load_format="dummy", armed_kinds=["resid_post"], steer_kinds=["resid_post"] if steer else [],
                     steer_layers=[n_layers // 2] if deployment == "steer-layer" else None,
                     max_capture_bytes=4 << 30, engine_kwargs={"skip_tokenizer_init": True}, **settings)
    )
    info = await engine.info()
    label = {"capture": "capture deployment", "steer": "steering deployment (all layers)", "steer-layer": "steering deployment (1 layer)"}[deployment]
    out: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for workload in workloads:
            cases = steer_cases(info.n_layers, info.d_model) if steer else capture_cases(info.n_layers, workload, info.d_model, host_gb)
            for case, extra in cases.items():
                base = {"max_tokens": workload.max_tokens, "ignore_eos": True} | extra

                async def submit(prompt: list[int]) -> Any:
                    return await engine.generate(base | {"prompt": prompt})

                before = await engine.stats()
                result = await timed(workload, submit)
                after = await engine.stats()
                # worker seconds spent on this case, outside the forward (the profile)
                result["worker_seconds"] = {k: after["seconds"][k] - before["seconds"].get(k, 0.0) for k in after["seconds"]}
                out.setdefault(workload.name, {})[f"capserve {label}: {case}"] = result
    finally:
        await engine.shutdown()
    return out


DEPLOYMENTS = ("plain", "plain-v1", "eager", "capture", "steer", "steer-layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="llama8b", choices=CONFIGS)
    parser.add_argument("--workloads", nargs="+", default=GPU_WORKLOADS, choices=list(WORKLOADS))
    parser.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS), choices=DEPLOYMENTS)
    parser.add_argument("--host-gb", type=float, default=40.0, help="host memory the all-layer all-position capture may fill")
    parser.add_argument("--tag", default="", help="suffix of the result file (runs split over GPUs)")
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = parser.parse_args()
    model = dummy_model_folder(args.config)
    workloads = [WORKLOADS[w] for w in args.workloads]
    n_layers = model_shape(args.config)["n_layers"]
    settings = engine_settings(args.config)

    rows: dict[str, dict[str, dict[str, float]]] = {w.name: {} for w in workloads}
    plain = {"plain": ("plain vLLM, CUDA graphs", False, False), "plain-v1": ("plain vLLM, CUDA graphs, V1 runner", False, True),
             "eager": ("plain vLLM, eager", True, False)}
    name = f"overhead_{args.config}" + (f"_{args.tag}" if args.tag else "")
    payload = {"config": args.config, "armed": ["resid_post"], "settings": settings, "results": rows}
    for deployment in ["plain", *[d for d in args.deployments if d != "plain"]]:
        if deployment in plain:
            label, eager, v1_runner = plain[deployment]
            for workload, result in asyncio.run(plain_vllm(model, settings, eager, workloads, v1_runner)).items():
                rows[workload][label] = result
        else:
            for workload, cases in asyncio.run(capserve(model, settings, workloads, deployment, args.host_gb, n_layers)).items():
                rows[workload].update(cases)
        gc.collect()
        add_ratios(rows)
        path = write_result(name, payload, args.out)  # after every deployment: a cut-short run keeps what it measured
        print_table(rows, f"{args.config}, resid_post armed, after {deployment}")
    print(f"\nwrote {path}")


def print_table(rows: dict[str, dict[str, dict[str, Any]]], title: str) -> None:
    for workload, cases in rows.items():
        print(f"\n{workload} ({title})")
        for case, result in cases.items():
            print(f"  {case:78s} {result['tok_per_s']:10.0f} tok/s  {result['ratio']:.3f}x", flush=True)


def add_ratios(rows: dict[str, dict[str, dict[str, Any]]]) -> None:
    for cases in rows.values():
        base = cases["plain vLLM, CUDA graphs"]["tok_per_s"]
        for result in cases.values():
            result["ratio"] = result["tok_per_s"] / base


if __name__ == "__main__":
    main()
