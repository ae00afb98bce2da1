"""`bash scripts/serve.sh` (`serve run serve_config.yaml`) from a fresh copy of the repository,
driven as a subprocess.

The copy holds what a clone holds (tracked and untracked-but-not-ignored files, no caches; its
install step is stubbed: this venv is installed, and installing would reach the network) and the
tiny model is built at replica start into an empty cache. The Ray head is started with
`ray start --head --block` (in a private temp dir, so no other Ray user here finds it) so the
README's handle snippet can reach the app; both processes are ours and are stopped by pid at the
end. The app is started once for the module: its own checks and README.md's Quickstart snippets
(tests/test_readme.py extracts them) run against it, and last it is stopped by SIGTERM.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from bench.common import free_port
from tests.test_readme import quickstart_snippets, with_port

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


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


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def default_sigint() -> None:
    """Whatever pytest's own start left it as (a CI runner's background job inherits it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


@dataclass(frozen=True)
class Served:
    repo: Path  # the fresh copy `serve run` runs in
    process: subprocess.Popen  # bash scripts/serve.sh
    url: str
    http_port: int
    gcs: str
    env: dict[str, str]  # a second process's environment (the cluster's RAY_TMPDIR, no RAY_ADDRESS)


def wait_for_port(address: str, head: subprocess.Popen, timeout: float = 120) -> None:
    host, port = address.split(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start exited early"
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"the Ray head's GCS did not listen on {address} within {timeout} s")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    """`serve run serve_config.yaml` in a fresh copy of the repository, on a Ray head of its own."""
    tmp_path = tmp_path_factory.mktemp("serve_cli")
    repo = tmp_path / "capserve"
    fresh_copy(repo)
    (repo / "scripts" / "install.sh").write_text("#!/usr/bin/env bash\n# stubbed by tests/test_serve_cli.py\n")
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
        wait_for_port(gcs, head)  # serve run's ray.init then waits for the GCS to serve
        log = open(tmp_path / "serve_run.log", "w")
        serve_run = subprocess.Popen(  # with SIGINT ignored, as a shell's background job (nohup ... &) starts it
            ["bash", "scripts/serve.sh"], cwd=repo, env={**env, "RAY_ADDRESS": gcs}, stdout=log, stderr=log,
            preexec_fn=ignore_sigint,
        )
        url = f"http://127.0.0.1:{http_port}"
        wait_until_ready(url, serve_run)
        yield Served(repo=repo, process=serve_run, url=url, http_port=http_port, gcs=gcs, env=env)
    finally:
        if serve_run is not None:
            stop(serve_run, signal.SIGINT)
        stop(head, signal.SIGTERM)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_serve_run_from_a_fresh_copy_answers_http_and_builds_the_tiny_model(served):
    http = httpx.post(f"{served.url}/v1/generate", json={"prompt": "The river", "max_tokens": 5, "ignore_eos": True}, timeout=60)
    assert http.status_code == 200 and len(http.json()["token_ids"]) == 5
    assert httpx.get(f"{served.url}/healthz").json()["status"] == "ok"
    assert any(Path(served.env["CAPSERVE_CACHE"]).iterdir())  # the replicas built the tiny model themselves


def test_readme_quickstart_snippets_run_as_written(served):
    """README.md's Quickstart, Python and curl, against this app: the handle snippet from a second
    process joined to the cluster, the rest over HTTP. All start at once (the app batches them)."""
    snippets = quickstart_snippets((served.repo / "README.md").read_text())
    # curl with --fail-with-body: an HTTP error fails the block; the block's own text is unchanged
    fail_on_http_errors = 'set -e\ncurl() { command curl --fail-with-body "$@"; }\n'
    runs = []
    for snippet in snippets:
        code = with_port(snippet.code, served.http_port)
        command = [sys.executable, "-c", code] if snippet.kind == "python" else ["bash", "-c", fail_on_http_errors + code]
        env = {**served.env, "RAY_ADDRESS": served.gcs}  # the snippet's ray.init(address="auto") finds this cluster
        runs.append((snippet, subprocess.Popen(command, cwd=served.repo, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True)))
    outputs = []
    for snippet, run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, f"README {snippet.kind} snippet failed:\n{snippet.code}\n--- stderr\n{err[-3000:]}"
        outputs.append((snippet, out))
    for snippet, out in outputs:
        if "get_app_handle" in snippet.code:
            assert "128)" in out  # res.activations[...].shape: [n_prompt_tokens, the tiny model's d_model]
        if "OpenAI(" in snippet.code:
            assert "[1, 128]" in out  # the capserve field's last_prompt row
    curl_out = "".join(out for snippet, out in outputs if snippet.kind == "curl")
    decoder, at, values = json.JSONDecoder(), 0, []
    while at < len(curl_out.rstrip()):  # curl's answers, back to back
        value, at = decoder.raw_decode(curl_out, at)
        values.append(value)
        while at < len(curl_out) and curl_out[at].isspace():
            at += 1
    assert [v["n_layers"] for v in values if "n_layers" in v] == [4]
    assert (served.repo / "capture.safetensors").stat().st_size > 0


SPILL_DIRS = """
import json, time, ray
from ray import serve
ray.init(address="auto", log_to_driver=False)
replicas = serve.get_deployment_handle("EngineReplica", "capserve")
for _ in range(150):  # a broadcast reaches the running replicas: wait for both
    identities = replicas.broadcast("identity").results(timeout_s=60)
    if len(identities) == 2:
        break
    time.sleep(2)
print(json.dumps([identity["spill_dir"] for identity in identities]))
"""


def test_sigterm_stops_the_app_gracefully_and_leaves_no_shared_memory(served):
    """SIGTERM, as kill, docker stop and systemd send it, to serve.sh: the app stops gracefully and its
    engines take their shared-memory folders with them (the Ray head, which would kill them, still runs)."""
    call = subprocess.run([sys.executable, "-c", SPILL_DIRS], cwd=served.repo, env={**served.env, "RAY_ADDRESS": served.gcs},
                          capture_output=True, text=True, timeout=400)
    assert call.returncode == 0, call.stderr[-3000:]
    spill_dirs = json.loads(call.stdout.strip().splitlines()[-1])
    assert len(spill_dirs) == 2 and all(os.path.isdir(d) for d in spill_dirs)
    served.process.send_signal(signal.SIGTERM)
    status = served.process.wait(timeout=300)
    assert [d for d in spill_dirs if os.path.exists(d)] == []
    assert status == 0  # serve run's own graceful exit


def test_serve_run_warns_about_an_open_bind_without_a_key(tmp_path):
    """`serve run` with http_options.host 0.0.0.0 and no key logs the open-bind warning in its own
    output. Serve runs in a network namespace of its own, where 0.0.0.0 reaches only its loopback;
    the test stops it once the app is built (the warning comes from the build, before any engine)."""
    try:
        subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("unshare cannot make a network namespace here")
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["host"] = "0.0.0.0"
    (tmp_path / "open.yaml").write_text(yaml.safe_dump(config))
    ray_tmp = Path(tempfile.mkdtemp(prefix="capserve-ray-", dir="/tmp"))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(ray_tmp),
           "CAPSERVE_CACHE": str(tmp_path / "cache")}
    for name in ("RAY_ADDRESS", "CAPSERVE_API_KEY"):
        env.pop(name, None)
    output = tmp_path / "serve_run.log"
    with open(output, "w") as log:
        serve_run = subprocess.Popen(  # unshare and sh exec: this pid is serve run's
            ["unshare", "--user", "--map-root-user", "--net", "sh", "-c",
             f"ip link set lo up && exec serve run {tmp_path / 'open.yaml'}"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=default_sigint,  # stopped by SIGINT below
        )
    try:
        deadline = time.monotonic() + 300
        while "listens beyond this machine" not in output.read_text() and time.monotonic() < deadline:
            assert serve_run.poll() is None, output.read_text()[-3000:]
            time.sleep(1)
        warned = [line for line in output.read_text().splitlines() if "listens beyond this machine" in line]
        assert len(warned) == 1, "no open-bind warning in serve run's output:\n" + output.read_text()[-3000:]
        line = warned[0]
        assert "http_host=0.0.0.0" in line and "no API key is set" in line and "build_serve_application" in line
    finally:
        stop(serve_run, signal.SIGINT)
        shutil.rmtree(ray_tmp, ignore_errors=True)
