"""Overhead of capserve's attention hooks and SAE encoding against plain vLLM, side by side on one GPU.

    python -m bench.bench_side_by_side --config llama8b --rounds 3 [--out DIR]
    python -m bench.bench_side_by_side --config tiny --workloads 16x64+16 --rounds 2   # CPU check

Plain vLLM (CUDA graphs, its default runner) and two capserve engines (CUDA graphs) live on the
same GPU, a third of its memory each, and take turns: every round runs each case's batch once,
plain first, then plain again (a batch right after the same engine's batch, as every capserve case
but the first runs). On the H200 a capserve case right after another was slower than the first one
after plain, whether or not it carried a plan; the two plain batches say whether plain vLLM does
the same. A process-per-engine run drifts by a few percent; alternating in one process cancels
that. Reported per case: tokens per second (prompt + generated) of the first round and the median
of the later ones, each as a ratio to plain's batch of the same round(s), and that median against
plain's second batch (`warm_ratio_vs_plain_again`); the worker's step
loop time outside the forward (prepare, collect) per step and the engine's period from one decode
step to the next (`decode_period`), in microseconds; and per round the
batch's phases in milliseconds (`ms_per_phase`): until every request had its first output
(admission, prefill), from then to vLLM's last final output (decode), and after it (the take RPC,
reading results: a batch of requests finishing together pays it once), with the MB its results
copied out of the arena and those copies' milliseconds summed over threads (`arena_reads`). A case's cost shows in the
phase it lands in: per request (admission, the tail) or per step (decode). Per batch also the CPU
the engine's step loop (its engine core's main thread) and the driver's event loop ran on before
and after, and their context switches during it (`cpus`); `--pin` gives each a core of its own.

Deployments and cases:
  z        hook_z armed (capture) at every layer, edits on z at the middle layer (`steer_layers`):
           armed, unused | the same right after itself | and after a 4 s pause (idle about as long as
           plain's two batches at 32 requests) | hook_z at 1 layer, every position, bf16 |
           ablate 1 head at that layer;
           two cases split a capture's or edit's cost into per-request and per-step parts: hook_z
           at 1 layer for last_prompt (a plan, one row) | scale 1 head by 1.0 (an edit that
           changes nothing but runs every step); then armed, unused again, after the planned
           batches (whether a cost comes with a batch's plans or stays with the engine after them),
           and that after a 4 s pause
  z-nographs  the z engine with `arena_graphs: false` (small decode steps' rows by the side stream),
           `forward_timing` (each decode step's model call timed on the host and the device) and
           `switch_context_every_s: null` (so the slow state a capture starts stays, as it did before that option):
           armed, unused | hook_z at 1 layer, every position, bf16 | armed, unused, after the capture |
           that after 4 s of matrix products on the GPU by this process (a CUDA context of its own)
  z-reset  the z-nographs engine: which of this process's GPU work ends the slow state after a capture (two
           tiny kernels | 4 s of device copies | 4 s of matrix products, each after a capture of its own),
           and armed, unused after an ablation (plans, no host copies)
  z-start  the z-nographs engine: which captures start that state (hook_z at 1 layer for last_prompt, prompt,
           generated or all positions, each after two tiny kernels of another process, then armed, unused)
  z-kick   the z-nographs engine: whether its own process ends that state (an empty kernel in a second CUDA
           context of it, or a kernel on a side stream of its own context), and captures while another process
           runs two tiny kernels every 50 or 500 ms (and the armed engine beside such kicks: their own cost);
           its engine kicks need VLLM_ALLOW_INSECURE_SERIALIZATION, which slows every batch's tail after vLLM:
           compare its decode phases
  z-switch the z-nographs engine with `switch_context_every_s: 0.05` (the default since 2026-12-03; it ends that
           state itself: an empty kernel in a second CUDA context while steps write rows, and once after): armed |
           the capture | armed after it | the capture again | the ablation; run beside z-nographs for the engine
           without it. z-switch-20ms: 0.02
  z-copy   the z engine with `attention_in_place: false` (each layer's z copied into its staging buffer after
           vLLM's attention op, as before 2026-12-04, rather than written there by the op): armed, unused | hook_z
           at 1 layer, every position, bf16; run beside z, which then also checks that both capture the same rows
  pattern  hook_pattern armed at every layer (its q and k captured), resid_post armed, and with
           --sae a TopK SAE on the middle layer's resid_post: armed, unused | pattern at 1 layer
           for last_prompt (computed on the replica) | SAE top-32 at 1 layer, every position
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import time
from typing import Any, Awaitable, Callable

import numpy as np

from bench.cpu_placement import pin, placement
from bench.common import GPU_WORKLOADS, VOCAB, WORKLOADS, Workload, dummy_model_folder, engine_settings, model_shape, write_result
from bench.gpu_kicks import PeriodicKicks, gpu_burst

Submit = Callable[[list[int]], Awaitable[Any]]
PLAIN = "plain vLLM, CUDA graphs"
PLAIN_AGAIN = "plain vLLM, right after itself"
DEFAULT_DEPLOYMENTS = ["z", "pattern"]
PAUSE = "pause_s"  # a case's seconds of idle before its batch, not part of its requests
# a case's GPU work by this process (a CUDA context of its own) before its batch: (kind, seconds), kind one of
# "matmul" (tensor cores), "copy" (device memory copies, no arithmetic), "kernel" (two tiny kernels, seconds unused)
BURST = "gpu_burst"
# GPU work inside the engine's own process before a case's batch (bench.gpu_kicks.kick): "second context" (an
# empty kernel in a second CUDA context of that process) or "own side stream" (a kernel on a new stream of its own)
ENGINE_KICK = "engine_kick"
KICKS = "kicks_every_s"  # two tiny kernels by this process every so many seconds while the case's batch runs
NOT_REQUEST_FIELDS = (PAUSE, BURST, ENGINE_KICK, KICKS)
# switch_context_every_s of the z-switch deployments: another process's kicks every 50 ms kept the state mostly away
SWITCH_EVERY_S = {"z-switch": 0.05, "z-switch-20ms": 0.02}


def deployments(n_layers: int, sae: dict[str, Any] | None) -> dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]]]]:
    """name -> (EngineConfig fields, cases)."""
    middle = n_layers // 2
    z = {"armed_kinds": ["z"], "steer_kinds": ["z"], "steer_layers": [middle]}
    pattern = {"armed_kinds": ["resid_post", "pattern"], "steer_kinds": []} | ({"saes": sae["config"]} if sae else {})
    z_cases = {
        "hook_z armed, unused": {},
        # the same batch right after itself: a batch after the same engine's, no plan anywhere
        "hook_z armed, unused, right after itself": {},
        # and after idle about as long as plain's two batches at 32 requests: the time between, not the other engine
        "hook_z armed, unused, after a pause": {PAUSE: 4.0},
        "capture hook_z 1 layer, all positions (bf16)": {
            "capture": {"hooks": [f"blocks.{middle}.attn.hook_z"], "positions": "all", "dtype": "bfloat16"}
        },
        "ablate 1 head of hook_z, 1 layer": {
            "interventions": [{"hook": f"blocks.{middle}.attn.hook_z", "op": "scale", "factor": 0.0, "heads": [0]}]
        },
        "capture hook_z 1 layer, last_prompt": {
            "capture": {"hooks": [f"blocks.{middle}.attn.hook_z"], "positions": "last_prompt"}
        },
        "scale 1 head of hook_z by 1.0, 1 layer": {
            "interventions": [{"hook": f"blocks.{middle}.attn.hook_z", "op": "scale", "factor": 1.0, "heads": [0]}]
        },
        # the first case again, now after batches that carried plans: apart from the order, the same
        "hook_z armed, unused, after the planned cases": {},
        "hook_z armed, unused, after the planned cases and a pause": {PAUSE: 4.0},
    }
    pattern_cases = {
        "hook_pattern (+ resid_post) armed, unused": {},
        "pattern 1 layer, last_prompt": {"capture": {"hooks": [f"blocks.{middle}.attn.hook_pattern"], "positions": "last_prompt"}},
    } | (sae["cases"] if sae else {})
    capture = "capture hook_z 1 layer, all positions (bf16)"
    # the z engine with small decode steps' arena writes by the side stream, not a graph replay:
    # whether the graphs leave the engine slower after a capture
    z_nographs_cases = {"hook_z armed, unused": {}, capture: z_cases[capture], "hook_z armed, unused, after the capture": {},
                        # the engine stays slow after a capture until plain vLLM's batches run on the GPU: does any
                        # other process's GPU work (as long as plain's two batches) bring it back?
                        "hook_z armed, unused, after the capture and another process's GPU work": {BURST: ("matmul", 4.0)}}
    # which of another process's GPU work ends the slow state after a capture (each after a capture of its own),
    # and whether a batch with plans but no host copies (an ablation) starts it
    after_capture = "hook_z armed, unused, after the capture"
    z_reset_cases = {
        "hook_z armed, unused": {}, capture: z_cases[capture], after_capture: {},
        f"{after_capture} and two tiny kernels of another process": {BURST: ("kernel", 0.0)},
        f"{capture}, 2nd": z_cases[capture],
        f"{after_capture} and 4 s of another process's device copies": {BURST: ("copy", 4.0)},
        f"{capture}, 3rd": z_cases[capture],
        f"{after_capture} and 4 s of another process's matrix products": {BURST: ("matmul", 4.0)},
        "ablate 1 head of hook_z, 1 layer": z_cases["ablate 1 head of hook_z, 1 layer"],
        "hook_z armed, unused, after the ablation": {},
    }
    # which captures start it: each after two tiny kernels of another process (the state ended), then the
    # armed batch after it; a last_prompt capture copies one row a request in prefill, a prompt capture
    # rows in prefill steps only, a generated one in decode steps only
    kick = {BURST: ("kernel", 0.0)}
    z_start_cases = {"hook_z armed, unused": {}}
    for positions in ("last_prompt", "prompt", "generated", "all"):
        z_start_cases[f"capture hook_z 1 layer, {positions}, after two tiny kernels of another process"] = kick | {
            "capture": {"hooks": [f"blocks.{middle}.attn.hook_z"], "positions": positions, "dtype": "bfloat16"}}
        z_start_cases[f"hook_z armed, unused, after the {positions} capture"] = {}
    # whether the engine's own process can end the state (a kernel in a second CUDA context of it; a kernel on a
    # side stream of its own context as the control), and whether another process's kernels on a timer during a
    # capture keep it away, at what cost
    z_kick_cases = {
        "hook_z armed, unused": {}, capture: z_cases[capture], after_capture: {},
        f"{after_capture} and an empty kernel in a second CUDA context of the engine's process": {ENGINE_KICK: "second context"},
        f"{capture}, another process's tiny kernels every 50 ms": z_cases[capture] | {KICKS: 0.05},
        f"{capture}, another process's tiny kernels every 500 ms": z_cases[capture] | {KICKS: 0.5},
        f"{capture}, 2nd": z_cases[capture],
        f"{after_capture} and a kernel on a side stream of the engine's own context": {ENGINE_KICK: "own side stream"},
        "hook_z armed, unused, another process's tiny kernels every 50 ms": {KICKS: 0.05},
    }
    # the engine ending it itself (engine option switch_context_every_s): the capture, and armed after it
    z_switch_cases = {"hook_z armed, unused": {}, capture: z_cases[capture], after_capture: {}, f"{capture}, 2nd": z_cases[capture],
                      "ablate 1 head of hook_z, 1 layer": z_cases["ablate 1 head of hook_z, 1 layer"]}
    nographs = z | {"arena_graphs": False, "forward_timing": True, "switch_context_every_s": None}
    switching = {name: (nographs | {"switch_context_every_s": every}, z_switch_cases) for name, every in SWITCH_EVERY_S.items()}
    z_copy_cases = {"hook_z armed, unused": {}, capture: z_cases[capture]}
    return {"z": (z, z_cases), "z-copy": (z | {"attention_in_place": False}, z_copy_cases),
            "z-nographs": (nographs, z_nographs_cases), "z-reset": (nographs, z_reset_cases),
            "z-start": (nographs, z_start_cases), "z-kick": (nographs, z_kick_cases), **switching, "pattern": (pattern, pattern_cases)}


async def batch(workload: Workload, submit: Submit, prompts: list[list[int]], times: "OutputTimes") -> dict[str, float]:
    """Tokens per second (prompt + generated) and the batch's phases in seconds: until every
    request had its first output (admission and prefill), from then to vLLM's last final output
    (decode), and the tail after it (a capserve engine's take RPC and result reading)."""
    times.reset()
    start = time.perf_counter()
    await asyncio.gather(*(submit(p) for p in prompts))
    end = time.perf_counter()
    prefilled = max(times.firsts)
    return {"tok_per_s": workload.total_tokens / (end - start), "prefill": prefilled - start,
            "decode": times.last - prefilled, "tail": end - times.last}


class OutputTimes:
    """When each request of a batch got its first output from vLLM, and when vLLM gave the last
    final one: a batch's time splits into prefill, decode and the tail after vLLM."""

    def __init__(self, llm: Any):
        self.firsts: list[float] = []
        self.last = 0.0
        generate = llm.generate

        async def marked(*args: Any, **kwargs: Any) -> Any:
            first = True
            async for output in generate(*args, **kwargs):
                if first:
                    self.firsts.append(time.perf_counter())
                    first = False
                if output.finished:
                    self.last = time.perf_counter()
                yield output

        llm.generate = marked

    def reset(self) -> None:
        self.firsts.clear()
        self.last = 0.0


async def start_plain(model: str, settings: dict[str, Any]) -> Any:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # vLLM's own default runner
    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=False,
                        tensor_parallel_size=1, **settings)
    )


def plain_submit(llm: Any, workload: Workload) -> Submit:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True, detokenize=False)
    counter = iter(range(10**9))

    async def submit(prompt: list[int]) -> Any:
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=f"plain-{next(counter)}"):
            pass

    return submit


async def start_capserve(model: str, settings: dict[str, Any], fields: dict[str, Any]) -> Any:
    from replicas.engine import CaptureEngine, EngineConfig

    return await CaptureEngine.start(
        EngineConfig(model=model, load_format="dummy", max_capture_bytes=4 << 30, engine_kwargs={"skip_tokenizer_init": True},
                     **settings, **fields)
    )


def capserve_submit(engine: Any, workload: Workload, extra: dict[str, Any]) -> Submit:
    base = {"max_tokens": workload.max_tokens, "ignore_eos": True} | {k: v for k, v in extra.items() if k not in NOT_REQUEST_FIELDS}

    async def submit(prompt: list[int]) -> Any:
        return await engine.generate(base | {"prompt": prompt})

    return submit


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = dummy_model_folder(args.config)
    settings = engine_settings(args.config) | {"gpu_memory_utilization": args.memory_share}
    n_layers = model_shape(args.config)["n_layers"]
    sae = sae_case(args, n_layers)
    if "z-kick" in args.deployments:  # its engine kicks run a function of this script in the engine's process
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    plain = await start_plain(model, settings)
    engines, cases = {}, {}
    for name, (fields, deployment_cases) in deployments(n_layers, sae).items():
        if name not in args.deployments:
            continue
        engines[name] = await start_capserve(model, settings, fields)
        cases.update({f"{name}: {case}": (engines[name], extra) for case, extra in deployment_cases.items()})
    times = {id(plain): OutputTimes(plain)} | {id(engine): OutputTimes(engine.llm) for engine in engines.values()}
    from replicas import _vllm

    core_pid = {id(plain): _vllm.engine_core_pids(plain)[0]} | {id(engine): engine.engine_pids()[0] for engine in engines.values()}
    if args.pin:
        print(f"pinned (pid: core): {pin([os.getpid(), *core_pid.values()])}", flush=True)
    results: dict[str, Any] = {}
    try:
        for name in args.workloads:
            workload = WORKLOADS[name]
            prompts = workload.prompt_ids(vocab=VOCAB)
            plain_batch = plain_submit(plain, workload)  # one counter: request ids stay unique across both cases
            submits = {PLAIN: plain_batch, PLAIN_AGAIN: plain_batch} | {
                case: capserve_submit(engine, workload, extra) for case, (engine, extra) in cases.items()
            }
            for submit in submits.values():  # warm-up
                await asyncio.gather(*(submit(p) for p in prompts[:8]))
            rounds: dict[str, list[float]] = {case: [] for case in submits}
            phases: dict[str, dict[str, list[float]]] = {case: {"prefill": [], "decode": [], "tail": []} for case in submits}
            worker = {case: WorkerTime() for case in cases}
            cpus: dict[str, list[dict[str, Any]]] = {case: [] for case in submits}
            kick_counts: dict[str, list[int]] = {}
            engine_kick_s: dict[str, list[float]] = {}
            reads: dict[str, list[dict[str, float]]] = {}  # per batch: results' rows copied out of the arena
            for r in range(args.rounds):
                for case, submit in submits.items():
                    engine, extra = cases.get(case, (None, {}))
                    runner = engine or plain
                    before = await before_batch(engine, extra)
                    if before and "kick_s" in before:
                        engine_kick_s.setdefault(case, []).append(before.pop("kick_s"))
                    placed = placements(core_pid[id(runner)])
                    kicks = PeriodicKicks(extra[KICKS]).start() if KICKS in extra else None
                    read_before = engine.arena_reads if engine else {}
                    timed = await batch(workload, submit, prompts, times[id(runner)])
                    if engine:
                        reads.setdefault(case, []).append(arena_reads_since(read_before, engine.arena_reads))
                    if kicks:
                        kick_counts.setdefault(case, []).append(kicks.stop())
                    cpus[case].append(moved(placed, placements(core_pid[id(runner)])))
                    rounds[case].append(timed["tok_per_s"])
                    for phase, values in phases[case].items():
                        values.append(round(timed[phase] * 1e3, 2))
                    if engine:
                        worker[case].add(before, await engine.stats(), await engine.decode_periods(), await engine.forward_times())
                    print(f"{time.strftime('%H:%M:%S')} {name} round {r} {case}: {timed['tok_per_s']:.0f} tok/s; ms prefill {timed['prefill'] * 1e3:.1f}, "
                          f"decode {timed['decode'] * 1e3:.1f}, after vLLM {timed['tail'] * 1e3:.1f}; cpus {cpus[case][-1]}", flush=True)
            results[name] = summarize(rounds)
            for case, values in phases.items():
                results[name][case]["ms_per_phase"] = values
                results[name][case]["cpus"] = cpus[case]
            for case, time_spent in worker.items():
                results[name][case]["worker_us_per_step"] = time_spent.per_step()
            for case, counts in kick_counts.items():
                results[name][case]["kicks_per_batch"] = counts
            for case, seconds in engine_kick_s.items():
                results[name][case]["engine_kick_ms"] = [round(s * 1e3, 3) for s in seconds]
            for case, per_batch in reads.items():
                results[name][case]["arena_reads"] = per_batch
            gc.collect()
        if "z" in engines and "z-copy" in engines:
            results["z_in_place_vs_copy"] = await same_capture(engines["z"], engines["z-copy"], n_layers // 2)
    finally:
        for engine in engines.values():
            await engine.shutdown()
        plain.shutdown()
    return results


async def same_capture(in_place: Any, copied: Any, layer: int) -> dict[str, Any]:
    """One greedy request's hook_z rows (every position) and logits on the z engine and on z-copy: the
    same weights (vLLM's dummy weights are seeded), so rows written by the attention op must equal rows
    copied after it."""
    hook = f"blocks.{layer}.attn.hook_z"
    request = {"prompt": list(range(1000, 1200)), "max_tokens": 16, "temperature": 0, "ignore_eos": True,
               "capture": {"hooks": [hook], "positions": "all"}, "logits": {"positions": "all"}}
    a, b = await asyncio.gather(in_place.generate(request), copied.generate(request))
    return {"hook": hook, "rows": len(a.positions), "tokens_equal": a.token_ids == b.token_ids,
            "max_abs_diff_z": float(np.abs(a.activations[hook] - b.activations[hook]).max()),
            "max_abs_z": float(np.abs(b.activations[hook]).max()),
            "max_abs_diff_logits": float(np.abs(a.logits - b.logits).max())}


async def before_batch(engine: Any | None, extra: dict[str, Any]) -> dict[str, Any] | None:
    """A case's pause and burst, then its engine's stats (None for plain vLLM), its forward
    timings drained so that the next call holds this batch's steps."""
    await asyncio.sleep(extra.get(PAUSE, 0.0))
    gpu_burst(*extra.get(BURST, ("matmul", 0.0)))
    if engine is None:
        return None
    kick_s = None
    if ENGINE_KICK in extra:
        from bench import gpu_kicks

        try:
            kick_s = (await engine.llm.collective_rpc(gpu_kicks.kick, args=(extra[ENGINE_KICK],)))[0]
        except Exception as exc:  # the other cases still run; the case then measures no kick
            print(f"the engine kick {extra[ENGINE_KICK]!r} failed: {exc}", flush=True)
    await engine.forward_times()
    return await engine.stats() | ({"kick_s": kick_s} if kick_s is not None else {})


def arena_reads_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A batch's results read out of the arena: MB copied, and the copies' milliseconds summed over
    the threads that made them (the batch's tail after vLLM holds them, spread over those threads)."""
    return {"copied_mb": round((after["copied_bytes"] - before["copied_bytes"]) / 1e6, 1),
            "copy_ms_summed": round((after["copy_s"] - before["copy_s"]) * 1e3, 2)}


def placements(step_loop: int) -> dict[str, dict[str, int]]:
    return {"engine": placement(step_loop), "driver": placement(os.getpid())}


def moved(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The CPUs the engine's step loop and the driver's event loop were on before and after a batch,
    and the context switches each had during it."""
    return {f"{who}_{key}": (f"{b['cpu']}->{after[who]['cpu']}" if key == "cpu" else after[who][key] - b[key])
            for who, b in before.items() for key in b}


class WorkerTime:
    """The worker's step-loop time outside the forward (prepare, collect), per step over a case's
    rounds: where a case's cost goes when the step loop, not the GPU, sets the pace."""

    def __init__(self) -> None:
        self.steps = 0
        self.context_switches = 0  # the engine's own (switch_context_every_s), over the case's rounds
        self.decode_periods = 0
        self.seconds: dict[str, float] = {}
        self.periods_us: list[float] = []
        self.forward_us: dict[str, list[float]] = {"host": [], "device": []}

    def add(self, before: dict[str, Any], after: dict[str, Any], recent_us: list[float], forward_us: dict[str, list[float]]) -> None:
        self.steps += after["steps"] - before["steps"]
        self.context_switches += after["context_switches"] - before["context_switches"]
        new = after["decode_periods"] - before["decode_periods"]
        self.decode_periods += new
        for phase in ("prepare", "collect", "decode_period"):
            self.seconds[phase] = self.seconds.get(phase, 0.0) + after["seconds"][phase] - before["seconds"][phase]
        self.periods_us += recent_us[len(recent_us) - min(new, len(recent_us)):]  # this batch's
        for where, values in forward_us.items():
            self.forward_us[where] += values

    def per_step(self) -> dict[str, float]:
        """Microseconds a step: prepare and collect over every step; `decode_period` (from one
        decode step's start to the next's) over the decode steps that followed one, its mean and
        quantiles (a shift of every step, or a few long ones). With the engine's
        `forward_timing`, the decode steps' model call on the host and the device, p50
        (`forward_host_p50`, `forward_device_p50`): whether a slower period lies in the forward;
        and the engine's own context switches over the rounds (`switch_context_every_s`)."""
        seconds = dict(self.seconds)
        period = seconds.pop("decode_period", 0.0) / max(self.decode_periods, 1)
        quantiles = {}
        if self.periods_us:
            p50, p90, p99 = np.percentile(self.periods_us, [50, 90, 99])
            quantiles = {"decode_period_p50": p50, "decode_period_p90": p90, "decode_period_p99": p99,
                         "decode_period_max": max(self.periods_us)}
        for where, values in self.forward_us.items():
            if values:
                quantiles[f"forward_{where}_p50"] = float(np.percentile(values, 50))
        return ({phase: value / max(self.steps, 1) * 1e6 for phase, value in seconds.items()}
                | {"decode_period": period * 1e6, "context_switches": self.context_switches} | quantiles)


def summarize(rounds: dict[str, list[float]]) -> dict[str, Any]:
    """Per case: the first round and the median of the later ones against plain's, and that median
    against plain's second batch of those rounds (`warm_ratio_vs_plain_again`)."""
    def warm(values: list[float]) -> float:
        return statistics.median(values[1:] or values)

    base, again = rounds[PLAIN], rounds[PLAIN_AGAIN]
    return {case: {"tok_per_s": values, "first_ratio": values[0] / base[0], "warm_median_tok_per_s": warm(values),
                   "warm_ratio": warm(values) / warm(base), "warm_ratio_vs_plain_again": warm(values) / warm(again)}
            for case, values in rounds.items()}


def sae_case(args: argparse.Namespace, n_layers: int) -> dict[str, Any] | None:
    """An SAE of random weights at the middle layer's resid_post (`bench.sae_folder`), and its case."""
    if not args.sae:
        return None
    from bench.sae_folder import random_sae_folder

    hook = f"blocks.{n_layers // 2}.hook_resid_post"
    folder = random_sae_folder(model_shape(args.config)["d_model"], args.sae_features, hook, k=32)
    return {
        "config": {"bench": {"path": folder, "hook": hook}},
        "cases": {f"sae top-32 of {args.sae_features} features, 1 layer, all positions": {
            "sae": [{"sae_id": "bench", "top_k": 32, "positions": "all"}]}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="llama8b")
    parser.add_argument("--workloads", nargs="+", default=GPU_WORKLOADS, choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deployments", nargs="+", default=DEFAULT_DEPLOYMENTS,
                        choices=["z", "z-copy", "z-nographs", "z-reset", "z-start", "z-kick", *SWITCH_EVERY_S, "pattern"])
    parser.add_argument("--memory-share", type=float, default=0.3, help="GPU memory fraction per engine (three engines; 0.22 for four)")
    parser.add_argument("--sae", action="store_true", help="also arm a TopK SAE and measure encoding")
    parser.add_argument("--sae-features", type=int, default=16384)
    parser.add_argument("--pin", action="store_true",
                        help="each engine core's step loop and the driver's event loop on a core of their own (Linux)")
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    payload = {"config": args.config, "rounds": args.rounds, "pinned": args.pin, "results": results}
    deployed = ("" if args.deployments == DEFAULT_DEPLOYMENTS else "_" + "_".join(args.deployments)) + ("_pinned" if args.pin else "")
    path = write_result(f"side_by_side{deployed}_{args.config}", payload, args.out)
    for workload, cases in results.items():
        if workload not in WORKLOADS:
            print(f"\n{workload}: {cases}")
            continue
        print(f"\n{workload}: first round / median of later rounds, vs plain; that median vs plain right after itself")
        for case, row in cases.items():
            print(f"  {case:70s} {row['first_ratio']:.3f}  {row['warm_ratio']:.3f}  {row['warm_ratio_vs_plain_again']:.3f}")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
