"""`serve run serve_config.yaml` from a fresh copy of the repository, driven as a subprocess.

The copy holds what a clone holds (tracked and untracked-but-not-ignored files, no caches) and
the tiny model is built at replica start into an empty cache. The Ray head is started with
`ray start --head --block` (in a private temp dir, so no other Ray user here finds it) so the
test can reach the app's handle; both processes are ours and are stopped by pid at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HANDLE_CALL = """
import json, ray
from ray import serve
ray.init(address="{address}", log_to_driver=False)
handle = serve.get_app_handle("capserve")
result = handle.capture.remote({{"prompt": "Hello", "capture": {{"hooks": ["blocks.0.hook_resid_post"]}}}}).result()
print(json.dumps({{"shape": list(result.activations["blocks.0.hook_resid_post"].shape), "replica": result.replica}}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", "build"}


def repo_files() -> list[str]:
    """What a clone would hold: git's view (tracked + untracked, not ignored), else a plain walk."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0:
        return listed.stdout.splitlines()
    return [
        str(path.relative_to(ROOT)) for path in ROOT.rglob("*")
        if path.is_file() and not SKIP_DIRS & set(path.relative_to(ROOT).parts)
    ]


def fresh_copy(dest: Path) -> None:
    for name in repo_files():
        source = ROOT / name
        if "__pycache__" in name or not source.is_file():
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / name)


def stop(process: subprocess.Popen, sig: int, timeout: float = 120) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until_ready(url: str, serve_run: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert serve_run.poll() is None, "serve run exited early"
        try:
            if httpx.post(f"{url}/v1/generate", json={"prompt": "hi", "max_tokens": 1}, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise AssertionError("the app did not answer within the timeout")


def test_serve_run_from_a_fresh_copy_answers_handle_and_http(tmp_path):
    repo = tmp_path / "capserve"
    fresh_copy(repo)
    config = repo / "serve_config.yaml"
    http_port = yaml.safe_load(config.read_text())["http_options"]["port"]
    if port_in_use(http_port):  # someone else serves on 8000: same config on a free port
        http_port = free_port()
        config.write_text(config.read_text().replace("port: 8000", f"port: {http_port}"))
    gcs = f"127.0.0.1:{free_port()}"
    ray_tmp = Path(tempfile.mkdtemp(prefix="capserve-ray-", dir="/tmp"))  # short: Ray's sockets live here
    env = {
        **os.environ,
        "CAPSERVE_CACHE": str(tmp_path / "cache"),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "RAY_AUTH_MODE": "disabled",  # a throwaway head on this machine; no token to hand around
        # The head records its address under Ray's temp dir for `ray.init()`/"auto" callers; a
        # private one keeps other Ray users on this machine from finding (and joining) it.
        "RAY_TMPDIR": str(ray_tmp),
    }
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)  # the copy must import itself, not this checkout
    head = subprocess.Popen(
        ["ray", "start", "--head", f"--port={gcs.split(':')[1]}", "--num-cpus=4", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={ray_tmp}", "--block"],
        cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    serve_run = None
    try:
        time.sleep(10)  # the head's GCS comes up
        log = open(tmp_path / "serve_run.log", "w")
        serve_run = subprocess.Popen(
            ["serve", "run", "serve_config.yaml"], cwd=repo, env={**env, "RAY_ADDRESS": gcs}, stdout=log, stderr=log
        )
        url = f"http://127.0.0.1:{http_port}"
        wait_until_ready(url, serve_run)
        http = httpx.post(f"{url}/v1/generate", json={"prompt": "The river", "max_tokens": 5, "ignore_eos": True}, timeout=60)
        assert http.status_code == 200 and len(http.json()["token_ids"]) == 5
        assert httpx.get(f"{url}/healthz").json()["status"] == "ok"
        call = subprocess.run(
            [sys.executable, "-c", HANDLE_CALL.format(address=gcs)], cwd=repo, env=env, capture_output=True, text=True,
            timeout=300,
        )
        assert call.returncode == 0, call.stderr[-3000:]
        answer = json.loads(call.stdout.strip().splitlines()[-1])
        assert answer["shape"][1] == 128 and answer["replica"]
        assert any((tmp_path / "cache").iterdir())  # the replicas built the tiny model themselves
    finally:
        if serve_run is not None:
            stop(serve_run, signal.SIGINT)
        stop(head, signal.SIGTERM)
        shutil.rmtree(ray_tmp, ignore_errors=True)
