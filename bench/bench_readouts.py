"""Read-outs on the replica (logit lens, probes, an SAE) and conditional steering against plain vLLM, on one GPU.

    python -m bench.bench_readouts --config llama8b --rounds 3                      # H200: both workloads
    python -m bench.bench_readouts --config tiny --workloads 16x64+16 --rounds 2    # CPU: that it runs

Plain vLLM and one capserve engine live on the GPU at once, each with an equal share of its
memory, and take turns batch by batch for several rounds (bench_side_by_side's method); reported
per case, the first round's and the later rounds' median tokens per second (prompt + generated)
against plain's of the same rounds. `--kv-cache-gib` gives both the same KV cache instead: at an
equal memory share capserve's sites and read-out weights come out of its KV cache, and vLLM's default
runner (V2, plain's) sizes its cache before counting CUDA graphs where the V1 runner (capserve's)
counts them first, so a workload the cache cannot hold (512 x 640 tokens at 0.45 of an H100) measures
the two caches' sizes as much as the read-outs. The JSON records both engines' KV tokens and what
capserve holds on the GPU. The capserve engine has 8 random probes (2 outputs each, at 4
layers) and a random TopK SAE of `--sae-features` features at the middle layer, on one of two
deployments (`--deployment`):
  lean      what a read-out user deploys: resid_post armed at every layer, steerable at the middle
            one only (`steer_layers`), so the cases measure the read-outs, not the armed sites
  default   capserve's defaults: the five residual-stream kinds armed and steerable at every layer
            (160 sites on the 8B shape; on an H100 at 0.45 of its memory this alone cost ~20%,
            docs/benchmarks.md)
Cases (issue 45's targets):
  armed, unused                     the engine as loaded, no read-out asked
  logit lens top-20, 4 layers       last_prompt, resid_post at 4 layers
  8 probes, every position          each at its own layer's resid_post
  conditional steering, 1 layer     an add at the middle layer gated by a probe there (fires on about half the rows)
  SAE top-32, every position        the SAE's top 32 features of every row
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_quantized import rounds_of
from bench.bench_side_by_side import PLAIN, PLAIN_AGAIN, OutputTimes, capserve_submit, plain_submit, start_capserve, start_plain, summarize
from bench.common import GPU_WORKLOADS, VOCAB, WORKLOADS, dummy_model_folder, engine_settings, model_shape, write_result
from bench.sae_folder import random_sae_folder
from replicas._vllm import kv_cache_tokens

N_PROBES = 8
PROBE_OUTPUTS = 2


def probe_layers(n_layers: int) -> list[int]:
    """Four layers spread over the model, the middle one among them (the conditional case's)."""
    return sorted({n_layers // 4, n_layers // 2, 3 * n_layers // 4, n_layers - 1})


def random_probes(d_model: int, layers: list[int], seed: int = 0) -> dict[str, dict[str, str]]:
    """N_PROBES probe files, two per layer, in the layout engine option `probes` reads."""
    from safetensors.torch import save_file
    import torch

    folder = Path(tempfile.mkdtemp(prefix="capserve-probes-"))
    generator = torch.Generator().manual_seed(seed)
    probes = {}
    for i in range(N_PROBES):
        hook = f"blocks.{layers[i % len(layers)]}.hook_resid_post"
        path = folder / f"probe{i}.safetensors"
        weight = torch.randn(PROBE_OUTPUTS, d_model, generator=generator) / d_model**0.5
        save_file({"weight": weight, "bias": torch.zeros(PROBE_OUTPUTS)}, str(path), metadata={"hook": hook})
        probes[f"probe{i}"] = {"path": str(path), "hook": hook}
    return probes


def cases(n_layers: int, d_model: int, probes: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    middle = n_layers // 2
    vector = np.random.default_rng(0).standard_normal(d_model).astype(np.float32)
    gate = next(name for name, probe in probes.items() if probe["hook"] == f"blocks.{middle}.hook_resid_post")
    return {
        "armed, unused": {},
        "logit lens top-20, 4 layers, last_prompt": {"readouts": [
            {"kind": "logit_lens", "hook": f"blocks.{layer}.hook_resid_post", "top_k": 20, "positions": "last_prompt"}
            for layer in probe_layers(n_layers)]},
        f"{N_PROBES} probes, every position": {"readouts": [{"kind": "probe", "probe": name, "positions": "all"} for name in probes]},
        "conditional steering (probe-gated add), 1 layer": {"interventions": [
            {"hook": f"blocks.{middle}.hook_resid_post", "op": "add", "scale": 0.1, "vector": vector,
             "when": {"probe": gate, "output": 0, "above": 0.0}}]},
        "SAE top-32, 1 layer, every position": {"sae": [{"sae_id": "bench", "top_k": 32, "positions": "all"}]},
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """{"memory": both engines' KV tokens and capserve's device bytes, "results": per workload, per case}"""
    shape = model_shape(args.config)
    n_layers, d_model = shape["n_layers"], shape["d_model"]
    middle_hook = f"blocks.{n_layers // 2}.hook_resid_post"
    probes = random_probes(d_model, probe_layers(n_layers))
    sae = random_sae_folder(d_model, args.sae_features, middle_hook, k=32)
    settings = engine_settings(args.config)
    if args.config != "tiny":
        settings["gpu_memory_utilization"] = args.memory_share
    if args.kv_cache_gib:
        settings["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    model = dummy_model_folder(args.config)
    plain = await start_plain(model, settings)
    fields = {"probes": probes, "saes": {"bench": {"path": sae, "hook": middle_hook}}}
    if args.deployment == "lean":
        fields |= {"armed_kinds": ["resid_post"], "steer_kinds": ["resid_post"], "steer_layers": [n_layers // 2]}
    engine = await start_capserve(model, settings, fields)
    times = {id(plain): OutputTimes(plain), id(engine): OutputTimes(engine.llm)}
    results: dict[str, Any] = {}
    try:
        memory = {"plain_kv_tokens": kv_cache_tokens(plain), "capserve_kv_tokens": engine.kv_cache_tokens,
                  "capserve_device_bytes": (await engine.stats())["device_bytes"]}
        for name in args.workloads:
            workload = WORKLOADS[name]
            plain_batch = plain_submit(plain, workload)
            submits = {PLAIN: plain_batch, PLAIN_AGAIN: plain_batch}
            submits |= {case: capserve_submit(engine, workload, extra) for case, extra in cases(n_layers, d_model, probes).items()}
            runners = {case: plain if case in (PLAIN, PLAIN_AGAIN) else engine for case in submits}
            results[name] = summarize(await rounds_of(submits, runners, times, workload, workload.prompt_ids(vocab=VOCAB), args.rounds))
            gc.collect()
    finally:
        await engine.shutdown()
        plain.shutdown()
    return {"memory": memory, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="llama8b")
    parser.add_argument("--workloads", nargs="+", default=GPU_WORKLOADS, choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sae-features", type=int, default=16384)
    parser.add_argument("--deployment", choices=["lean", "default"], default="lean")
    parser.add_argument("--memory-share", type=float, default=0.45, help="GPU memory fraction per engine (two engines)")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="the same KV cache for both engines (default: "
                        "what each has left of --memory-share)")
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = parser.parse_args()
    measured = asyncio.run(run(args))
    memory = measured["memory"]
    print(f"\nKV tokens: plain {memory['plain_kv_tokens']:,}, capserve {memory['capserve_kv_tokens']:,}; "
          f"capserve's sites and read-outs on the GPU: {memory['capserve_device_bytes'] / 2**30:.2f} GiB")
    for workload, per_case in measured["results"].items():
        print(f"\n{workload}: first round / median of later rounds, vs plain")
        for case, row in per_case.items():
            print(f"  {case:55s} {row['first_ratio']:.3f}  {row['warm_ratio']:.3f}")
    name = f"readouts_{args.config}" + ("_default" if args.deployment == "default" else "") + ("_equal_kv" if args.kv_cache_gib else "")
    path = write_result(name, {"args": vars(args), **measured}, args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
