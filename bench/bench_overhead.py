"""Overhead of capserve's engine against plain vLLM on one GPU, measured side by side in one run.

    python bench/bench_overhead.py --config llama8b --workloads 512x512+128 32x512+256

Every case runs the same token-id prompts through an AsyncLLM-backed engine with the same
settings (TP 1, prefix caching off, dummy bf16 weights, ignore_eos) and reports total tokens per
second (prompt + generated) and the ratio to plain vLLM with CUDA graphs:
plain vLLM (CUDA graphs), plain vLLM (eager); a capture deployment (resid_post armed) with no
capture, resid_post at one layer for all positions and at every layer for the last prompt token;
a steering deployment (resid_post armed for edits too) with no edit and with one steering vector.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from typing import Any, Awaitable, Callable

import numpy as np

from bench.common import WORKLOADS, Workload, dummy_model_folder, write_result

VOCAB = 400  # prompt token ids are drawn below this, valid for every config here
ENGINE_SETTINGS = dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=512, gpu_memory_utilization=0.85, seed=0)


def capserve_cases(n_layers: int, d_model: int, steer: bool) -> dict[str, dict[str, Any]]:
    """Requests for a capture deployment (resid_post armed for capture) or a steering one (armed
    for capture and interventions)."""
    middle = n_layers // 2
    if steer:
        return {
            "capserve steering deployment, no edit": {},
            "steer 1 vector, 1 layer": {
                "interventions": [
                    {"hook": f"blocks.{middle}.hook_resid_post", "op": "add", "scale": 0.1,
                     "vector": np.random.default_rng(0).standard_normal(d_model).astype(np.float32)}
                ]
            },
        }
    return {
        "capserve, no capture": {},
        "capture resid_post 1 layer, all positions": {
            "capture": {"hooks": [f"blocks.{middle}.hook_resid_post"], "positions": "all", "dtype": "bfloat16"}
        },
        "capture resid_post all layers, last_prompt": {
            "capture": {"hooks": [f"blocks.{i}.hook_resid_post" for i in range(n_layers)], "positions": "last_prompt"}
        },
    }


async def timed(workload: Workload, submit: Callable[[list[int]], Awaitable[Any]]) -> dict[str, float]:
    prompts = workload.prompt_ids(vocab=VOCAB)
    await asyncio.gather(*(submit(p) for p in prompts[:8]))  # warm-up
    start = time.perf_counter()
    results = await asyncio.gather(*(submit(p) for p in prompts))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tok_per_s": workload.total_tokens / seconds, "requests": len(results)}


async def plain_vllm(model: str, eager: bool, workloads: list[Workload]) -> dict[str, dict[str, float]]:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=eager,
                        enable_prefix_caching=False, tensor_parallel_size=1, **ENGINE_SETTINGS)
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


async def capserve(model: str, workloads: list[Workload], armed: list[str], steer: bool) -> dict[str, dict[str, dict[str, float]]]:
    from replicas.engine import CaptureEngine, EngineConfig

    engine = await CaptureEngine.start(
        EngineConfig(model=model, load_format="dummy", armed_kinds=armed, steer_kinds=armed if steer else [],
                     max_capture_bytes=1 << 30, engine_kwargs={"skip_tokenizer_init": True}, **ENGINE_SETTINGS)
    )
    info = await engine.info()
    out: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for workload in workloads:
            for case, extra in capserve_cases(info.n_layers, info.d_model, steer).items():
                base = {"max_tokens": workload.max_tokens, "ignore_eos": True} | extra

                async def submit(prompt: list[int]) -> Any:
                    return await engine.generate(base | {"prompt": prompt})

                out.setdefault(workload.name, {})[case] = await timed(workload, submit)
                out[workload.name][case]["worker"] = await engine.check_health()
    finally:
        await engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="llama8b")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--armed", nargs="+", default=["resid_post"])
    parser.add_argument("--skip-eager", action="store_true")
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = parser.parse_args()
    model = dummy_model_folder(args.config)
    workloads = [WORKLOADS[w] for w in args.workloads]

    rows: dict[str, dict[str, dict[str, float]]] = {w.name: {} for w in workloads}
    for name, eager in (("plain vLLM, CUDA graphs", False), ("plain vLLM, eager", True)):
        if eager and args.skip_eager:
            continue
        for workload, result in asyncio.run(plain_vllm(model, eager, workloads)).items():
            rows[workload][name] = result
        gc.collect()
    for steer in (False, True):
        for workload, cases in asyncio.run(capserve(model, workloads, args.armed, steer)).items():
            rows[workload].update(cases)

    for workload, cases in rows.items():
        base = cases["plain vLLM, CUDA graphs"]["tok_per_s"]
        print(f"\n{workload} ({args.config}, armed {args.armed})")
        for case, result in cases.items():
            result["ratio"] = result["tok_per_s"] / base
            print(f"  {case:45s} {result['tok_per_s']:10.0f} tok/s  {result['ratio']:.3f}x")
    path = write_result(f"overhead_{args.config}", {"config": args.config, "armed": args.armed, "settings": ENGINE_SETTINGS, "results": rows}, args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
