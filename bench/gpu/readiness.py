"""How long `serve run` takes to serve, cold and warm (not CI): per model, `serve run` of a
serve_config.yaml twice in a row with one compile-cache folder, the first run into an empty folder
(cold: vLLM compiles and captures its graphs), the second into the folder the first filled (warm:
issue 46's target is /readyz within 60 s on the H200 for the tiny model).

    python -m bench.gpu.readiness --out DIR                   # GPU host: tiny and llama8b, ~8 min
    python -m bench.gpu.readiness --models tiny --out DIR     # the CPU build: that it runs

Per run: seconds from the launch to /healthz's first 200 (liveness: the Router answers) and to
/readyz's first 200 (an engine can serve), then to the first generated reply through the HTTP API;
after a SIGINT (what scripts/serve.sh sends for a SIGTERM too), the seconds to exit and what stayed
behind: /dev/shm/capserve-* entries and processes holding GPU memory. The warm run, before its
SIGINT, also kills the EngineReplica's actor process (SIGKILL) and times its replacement: seconds
to /readyz's 200 again and a reply, with the log's start marks (issue 46: <=45 s). A compiled
model finds its entries in the folder only if the cache key does not change from one start to the next
(replicas/engine/config.py), so warm - cold is the compile and graph capture that a replacement
replica skips too. Results go to DIR/readiness_<card>.json, written after every run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench.common import dummy_model_folder, engine_settings, environment, free_port, gpu_memory_used_mib, write_result

START_TIMEOUT_S = 540
EXIT_TIMEOUT_S = 120


def app_config(model: str, port: int, cache_dir: str, device: str) -> dict[str, Any]:
    """serve_config.yaml's shape: one replica, the model's dummy weights (tiny: the built-in one)."""
    engine: dict[str, Any] = {"max_model_len": 512, "compile_cache_dir": cache_dir}
    args: dict[str, Any] = {"model": None, "device": device, "num_replicas": 1, "engine": engine}
    if model != "tiny":
        args["model"] = dummy_model_folder(model, Path(cache_dir).parent / f"dummy_{model}")  # one path: one cache key
        engine |= engine_settings(model) | {"load_format": "dummy", "engine_kwargs": {"skip_tokenizer_init": True}}
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "capserve", "route_prefix": "/", "import_path": "deploy.app:build_app", "args": args}],
    }


def status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def generate(base: str, tiny: bool) -> float:
    """Seconds for one small generate through the HTTP API (token ids: the dummy models have no tokenizer)."""
    body = {"prompt": "the quick brown fox" if tiny else [11, 12, 13, 14], "max_tokens": 8}
    request = urllib.request.Request(f"{base}/v1/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=120) as reply:
        reply.read()
    return time.monotonic() - started


def replica_failure(log: Path) -> str | None:
    """The last error line of a replica that failed to start, from serve run's log."""
    lines = log.read_text(errors="replace").splitlines()
    if not any("the replica will be stopped" in line for line in lines):
        return None
    errors = [line for line in lines if "Error" in line and "Traceback" not in line]
    return errors[-1].strip()[-400:] if errors else "see the log"


def shm_entries() -> list[str]:
    return sorted(glob.glob("/dev/shm/capserve-*"))


# serve run's log lines that mark a replica's start, in order (Serve's, then vLLM's)
START_MARKS = {
    "replica_added": "Adding 1 replica to Deployment(name='EngineReplica'",
    "vllm_config": "Resolved architecture",
    "engine_core": "Initializing a V1 LLM engine",
    "engine_ready": "init engine (profile, create kv cache",
}


def start_marks(log: Path, after: int) -> dict[str, str]:
    """Wall-clock times (HH:MM:SS) of the start marks in the log's bytes past `after`."""
    text = log.read_bytes()[after:].decode(errors="replace")
    marks = {}
    for name, needle in START_MARKS.items():
        lines = [line for line in text.splitlines() if needle in line]
        found = re.findall(r"\d\d:\d\d:\d\d", lines[-1].split(")", 1)[-1]) if lines else []
        if found:
            marks[name] = found[0]
    return marks


def engine_replica_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "ServeReplica:capserve:EngineReplica"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def replacement(base: str, log: Path, tiny: bool) -> dict[str, Any]:
    """SIGKILL the EngineReplica's actor process; seconds until /readyz says 200 again (Serve started
    a replacement, from the same compile cache) and it served a reply."""
    pids = engine_replica_pids()
    if len(pids) != 1:
        return {"error": f"expected one EngineReplica process, found {pids}"}
    offset = log.stat().st_size
    killed = time.monotonic()
    marks: dict[str, Any] = {"killed_at": time.strftime("%H:%M:%S")}
    os.kill(pids[0], signal.SIGKILL)
    while "not_ready_s" not in marks and time.monotonic() - killed < 30:
        if status(f"{base}/readyz") != 200:
            marks["not_ready_s"] = round(time.monotonic() - killed, 1)
        time.sleep(0.2)
    while time.monotonic() - killed < START_TIMEOUT_S:
        if status(f"{base}/readyz") == 200:
            marks["readyz_s"] = round(time.monotonic() - killed, 1)
            marks["first_generate_s"] = round(generate(base, tiny), 2)
            break
        time.sleep(0.5)
    return marks | {"log_marks": start_marks(log, offset)}


def one_run(model: str, cache_dir: str, device: str, work: Path, replace: bool = False) -> dict[str, Any]:
    port = free_port()
    config = work / f"serve_{model}.yaml"
    config.write_text(yaml.safe_dump(app_config(model, port, cache_dir, device)))
    base = f"http://127.0.0.1:{port}"
    shm_before = set(shm_entries())
    log = work / f"serve_{model}.log"
    # SIGINT back to its default, as scripts/serve.sh does: bench/gpu/session.sh runs in the background,
    # which hands SIGINT down as ignored, and serve run would never see the one sent below (2026-12-06:
    # both cards' runs were killed after 120 s with their shared memory and GPU memory still held)
    launch = ["env", "--default-signal=INT", sys.executable, "-c", "import sys; from ray.serve.scripts import cli; sys.exit(cli())",
              "run", str(config)]
    started = time.monotonic()
    server = subprocess.Popen(launch, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    marks: dict[str, Any] = {}
    try:
        while "readyz_s" not in marks:
            if server.poll() is not None:
                raise RuntimeError(f"serve run exited with {server.returncode} before /readyz (log: {log})")
            failure = replica_failure(log)
            if failure:  # Serve would retry the replica until the timeout: the same error each time
                raise RuntimeError(f"a replica failed to start: {failure} (log: {log})")
            elapsed = time.monotonic() - started
            if elapsed > START_TIMEOUT_S:
                raise TimeoutError(f"/readyz not 200 after {START_TIMEOUT_S} s")
            if "healthz_s" not in marks and status(f"{base}/healthz") == 200:
                marks["healthz_s"] = round(time.monotonic() - started, 1)
            if status(f"{base}/readyz") == 200:
                marks["readyz_s"] = round(time.monotonic() - started, 1)
            time.sleep(0.5)
        marks["first_generate_s"] = round(generate(base, model == "tiny"), 2)
        if replace:
            marks["replacement"] = replacement(base, log, model == "tiny")
    finally:
        stopping = time.monotonic()
        # serve run alone, as scripts/serve.sh does: a SIGINT to its whole group would also reach the
        # Ray processes it started, and the cluster would go before the app could shut down
        server.send_signal(signal.SIGINT)
        try:
            server.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            marks["killed_after_s"] = EXIT_TIMEOUT_S
        marks["exit_s"] = round(time.monotonic() - stopping, 1)
        marks["shm_left"] = sorted(set(shm_entries()) - shm_before)
        marks["gpu_mib_after"] = gpu_memory_used_mib()
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "llama8b"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cards = " ".join(environment()["gpu"])
    name = "readiness_" + ("h200" if "H200" in cards else "h100" if "H100" in cards else "cpu")
    work = Path(args.out or tempfile.mkdtemp(prefix="capserve-readiness-")) / "readiness_logs"  # serve run's logs, kept beside the results
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for model in args.models:
        cache_dir = str(work / f"compile_cache_{model}")  # empty: the first run is cold
        for start in ("cold", "warm"):
            try:
                results.setdefault(model, {})[start] = one_run(model, cache_dir, args.device, work, replace=start == "warm")
            except Exception as exc:  # the next model still runs; the file says what failed
                results.setdefault(model, {})[start] = {"error": f"{type(exc).__name__}: {exc}"}
            print(model, start, json.dumps(results[model][start]), flush=True)
            write_result(name, {"args": vars(args), "environment": environment(), "results": results}, args.out)


if __name__ == "__main__":
    main()
