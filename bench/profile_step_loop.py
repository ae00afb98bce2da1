"""Where the worker's step loop spends its time: one capserve engine, one case, profiled.

    python -m bench.profile_step_loop --config llama8b --case z-capture --out DIR   # GPU host, ~3 min
    python -m bench.profile_step_loop --config llama8b --case bulk --out DIR
    python -m bench.profile_step_loop --config llama8b --case z-armed --after z-capture --out DIR
    python -m bench.profile_step_loop --config tiny --case z-capture --first-step 40 --steps 20   # CPU check

The engine starts with `step_profile` (replicas/worker/diagnostics/step_profile.py) set to a window of steps past
warm-up, then runs the case's batch until the worker has written its table of ops,
`step_profile-<pid>.txt` in `--out`: the window's garbage collections, then ops by self CPU time
and by total CPU time, with capserve's phases as `capserve.prepare` and `capserve.collect`. Cases:
  z-armed, z-capture, z-ablate   the `bench_side_by_side` z engine's three cases (32 x (512 + 256))
  bulk                           `bench_bandwidth`'s capture: resid_post at every layer and position, bf16
                                 (64 x (512 + 16))
  probes                         `bench_readouts`' 8 probes at every position on its lean deployment
                                 (512 x (512 + 128)): the probes' device work against the step loop's
                                 filing of 4,096 (request, probe) pairs a decode step
With `--after CASE` one batch of that case runs first on the same engine: on the H200 every batch
after a one-layer capture ran ~3 % slower, plan or none, until plain vLLM's batch ran between
(`bench_side_by_side`); the window of `--case z-armed --after z-capture` against `--case z-armed`
says whether the GPU then waits for the step loop (idle share) or its kernels take longer.
The engine's step-loop timers (`stats`) go beside it, in step_profile_<case>[_after_<case>].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench.bench_bandwidth import Plan
from bench.bench_readouts import probe_layers, random_probes
from bench.bench_side_by_side import capserve_submit, deployments, start_capserve
from bench.common import CONFIGS, VOCAB, Workload, dummy_model_folder, engine_settings, model_shape

Z_CASES = {"z-armed": "hook_z armed, unused", "z-capture": "capture hook_z 1 layer, all positions (bf16)",
           "z-ablate": "ablate 1 head of hook_z, 1 layer"}


def case_setup(case: str, config: str) -> tuple[dict[str, Any], dict[str, Any], Workload]:
    """(engine fields, request fields, workload) of a case."""
    shape = model_shape(config)
    n_layers = shape["n_layers"]
    small = config == "tiny"
    if case == "bulk":
        hooks = [f"blocks.{i}.hook_resid_post" for i in range(n_layers)]
        workload = Workload("bulk", 8 if small else 64, 64 if small else 512, 16)
        # as bench_bandwidth: the batch's rows find the start-up reserve (one registration), not
        # growth in 8 MiB pieces, where no copy spans a request's hooks
        reserve = Plan(workload, n_layers, shape["d_model"]).arena_reserve(workload.prompts)
        return ({"armed_kinds": ["resid_post"], "steer_kinds": [], "arena_reserve_bytes": reserve},
                {"capture": {"hooks": hooks, "positions": "all", "dtype": "bfloat16"}}, workload)
    if case == "probes":
        probes = random_probes(shape["d_model"], probe_layers(n_layers))
        fields = {"probes": probes, "armed_kinds": ["resid_post"], "steer_kinds": ["resid_post"],
                  "steer_layers": [n_layers // 2]}
        request = {"readouts": [{"kind": "probe", "probe": name, "positions": "all"} for name in probes]}
        return fields, request, Workload("probes", 16 if small else 512, 64 if small else 512, 16 if small else 128)
    fields, cases = deployments(n_layers, None)["z"]
    return fields, cases[Z_CASES[case]], Workload("z", 16 if small else 32, 64 if small else 512, 32 if small else 256)


async def profile(args: argparse.Namespace) -> dict[str, Any]:
    fields, extra, workload = case_setup(args.case, args.config)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    window = {"first_step": args.first_step, "steps": args.steps, "folder": str(out), "python": args.python}
    settings = engine_settings(args.config) | {"gpu_memory_utilization": args.memory_share}
    engine = await start_capserve(dummy_model_folder(args.config), settings, fields | {"step_profile": window})
    submit = capserve_submit(engine, workload, extra)
    prompts = workload.prompt_ids(vocab=VOCAB)
    before = set(out.glob("step_profile-*.txt"))
    try:
        if args.after:  # the window then falls in the case's first batch (--first-step past this one's steps)
            await asyncio.gather(*(capserve_submit(engine, workload, case_setup(args.after, args.config)[1])(p) for p in prompts))
            print(f"a batch of {args.after} first: worker at step {(await engine.stats())['steps']}", flush=True)
        for batch in range(args.max_batches):
            started = time.perf_counter()
            await asyncio.gather(*(submit(p) for p in prompts))
            stats = await engine.stats()
            print(f"batch {batch}: {time.perf_counter() - started:.2f} s, worker at step {stats['steps']}", flush=True)
            written = set(out.glob("step_profile-*.txt")) - before
            if written:
                return {"case": args.case, "after": args.after, "config": args.config, "window": window,
                        "table": str(written.pop()), "stats": stats}
        raise RuntimeError(f"the worker never reached step {args.first_step + args.steps} in {args.max_batches} batches")
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama8b", choices=CONFIGS)
    parser.add_argument("--case", default="z-capture", choices=[*Z_CASES, "bulk", "probes"])
    parser.add_argument("--after", default=None, choices=list(Z_CASES), help="one batch of this case first (z cases)")
    parser.add_argument("--first-step", type=int, default=None,
                        help="past the warm-up batch's steps (default: 300; bulk, whose batches take ~32 steps, 100)")
    parser.add_argument("--steps", type=int, default=None, help="default: 100; bulk 64")
    parser.add_argument("--max-batches", type=int, default=10)
    parser.add_argument("--python", action="store_true", help="also cProfile the step loop (python_profile-<pid>.txt)")
    parser.add_argument("--memory-share", type=float, default=0.5)
    parser.add_argument("--out", default="step_profile")
    args = parser.parse_args()
    bulk = args.case == "bulk"
    args.first_step = args.first_step if args.first_step is not None else 100 if bulk else 300
    args.steps = args.steps if args.steps is not None else 64 if bulk else 100
    result = asyncio.run(profile(args))
    path = Path(args.out) / f"step_profile_{args.case}{f'_after_{args.after}' if args.after else ''}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(Path(result["table"]).read_text()[:6000])
    print(f"wrote {result['table']} and {path}")


if __name__ == "__main__":
    main()
