"""HTTP without a cluster: the pieces (bearer check, body limit, JSON, encodings, errors), and the
whole FastAPI app in front of a Router on a fake replica pool (Serve's replica context faked, so
the class-based views resolve `self` as they do in a replica)."""

from __future__ import annotations

import base64
import json
import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from safetensors.numpy import load as load_safetensors

from deploy import http
from deploy.config import RouterConfig
from deploy.http import (
    OPEN_PATHS,
    HttpError,
    HttpRouter,
    api,
    check_bearer,
    encode_result,
    error_response,
    parse_json_object,
    read_body,
    to_safetensors,
)
from deploy.readiness import FleetStates
from replicas.api import arrays
from replicas.api import GenerateRequest, GenerateResult
from replicas.api.errors import (
    BackPressureError,
    CaptureFailedError,
    DeadlineExceededError,
    InvalidRequestError,
    ReplicaUnavailableError,
)
from tests.test_router import ANSI_RED, FakePool, remote

KEY = "k-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


def result() -> GenerateResult:
    return GenerateResult(
        request_id="r1", text="hi", token_ids=[5], prompt_token_ids=[0, 7], finish_reason="length",
        choices=[], positions=[0, 1], capture_token_ids=[0, 7], replica="abc",
        activations={"blocks.0.hook_resid_post": np.arange(6, dtype=np.float32).reshape(2, 3)},
        logits=np.ones((1, 4), dtype=np.float32), logits_positions=[1],
    )


def test_bearer_token_is_required_and_compared_exactly():
    check_bearer("Bearer s3cret", "s3cret")
    check_bearer("bearer s3cret", "s3cret")
    for header in (None, "", "Bearer", "Bearer wrong", "Basic s3cret", "Bearer s3cret-and-more"):
        with pytest.raises(HttpError) as info:
            check_bearer(header, "s3cret")
        assert info.value.status == 401 and info.value.headers == {"WWW-Authenticate": "Bearer"}


def test_request_bodies_over_the_limit_get_413_with_or_without_content_length():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        try:
            return {"n": len(await read_body(request, 10))}
        except HttpError as exc:
            return error_response(exc)

    client = TestClient(app)
    assert client.post("/echo", content=b"x" * 10).json() == {"n": 10}
    too_big = client.post("/echo", content=b"x" * 11)
    assert too_big.status_code == 413 and "max_request_bytes=10" in too_big.json()["error"]["message"]
    chunked = client.post("/echo", content=iter([b"x" * 6, b"x" * 6]))  # no Content-Length
    assert chunked.status_code == 413


def test_bodies_must_be_json_objects():
    assert parse_json_object(b'{"prompt": "x"}') == {"prompt": "x"}
    for body in (b"{nope", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(HttpError) as info:
            parse_json_object(body)
        assert info.value.status == 400


def test_json_results_carry_arrays_as_base64_wire_arrays():
    response = encode_result(result(), safetensors=False)
    body = json.loads(response.body)
    assert body["text"] == "hi" and body["replica"] == "abc" and body["positions"] == [0, 1]
    encoded = body["activations"]["blocks.0.hook_resid_post"]
    assert encoded["dtype"] == "float32" and encoded["shape"] == [2, 3]
    np.testing.assert_array_equal(arrays.from_raw(encoded), result().activations["blocks.0.hook_resid_post"])
    assert np.frombuffer(base64.b64decode(body["logits"]["data"]), np.float32).tolist() == [1.0] * 4


def test_json_bodies_built_in_chunks_equal_json_dumps_of_the_encoded_result(monkeypatch):
    import ml_dtypes

    from deploy import http_parts

    monkeypatch.setattr(http_parts, "BASE64_CHUNK", 9)  # many chunks per array, the last one short
    many = result().model_copy(update={"activations": {
        "blocks.0.hook_resid_post": np.arange(6, dtype=np.float32).reshape(2, 3),
        "blocks.1.hook_resid_post": np.linspace(-1, 1, 10).astype(ml_dtypes.bfloat16),
        "blocks.2.hook_resid_post": np.zeros((0, 3), np.float32),
        "blocks.3.hook_mlp_out": np.float16(np.arange(7)),
    }, "text": 'a "quoted" \u00e9 text'})
    expected = http_parts.result_fields(many)
    expected["activations"] = {name: arrays.to_base64(a) for name, a in many.activations.items()}
    expected["logits"] = arrays.to_base64(many.logits)
    assert json.loads(http_parts.json_body(many)) == expected


def test_safetensors_results_hold_arrays_and_the_other_fields():
    data = to_safetensors(result())
    tensors = load_safetensors(data)
    np.testing.assert_array_equal(tensors["blocks.0.hook_resid_post"], result().activations["blocks.0.hook_resid_post"])
    assert tensors["logits"].shape == (1, 4)
    header_len = int.from_bytes(data[:8], "little")
    metadata = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["capserve"])
    assert metadata["prompt_token_ids"] == [0, 7] and "activations" not in metadata
    response = encode_result(result(), safetensors=True)
    assert response.media_type == "application/octet-stream"


@pytest.mark.parametrize(
    "exc, status",
    [
        (InvalidRequestError("capture.hooks[0]: unknown hook"), 422),
        (BackPressureError("queue full"), 503),
        (ReplicaUnavailableError("all died"), 503),
        (DeadlineExceededError("no result within routing.request_timeout_s=1 s"), 504),
        (CaptureFailedError("worker"), 500),
    ],
)
def test_errors_map_to_status_codes_and_keep_the_message(exc, status):
    response = error_response(exc)
    assert response.status_code == status
    assert json.loads(response.body)["error"]["message"] == str(exc)
    if status == 503:
        assert response.headers["retry-after"] == "1"


def test_an_internal_error_says_only_its_type_and_is_logged_on_the_router(caplog):
    caplog.set_level(logging.ERROR, logger="capserve.http")
    response = error_response(RuntimeError("boom at /srv/secret/path pid=77"))
    assert response.status_code == 500
    assert json.loads(response.body)["error"] == {
        "type": "internal", "message": "internal error (RuntimeError); the router's log has the details"}
    assert "boom" in caplog.text and caplog.records[0].exc_info  # the details stay in the router's log


def test_a_remote_invalid_request_keeps_its_message_and_loses_ray_s_traceback_pid_and_colours(caplog):
    caplog.set_level(logging.WARNING, logger="capserve.http")
    message = "capture.hooks[0]: layer 9 is out of range; allowed layers: 0..3"
    wrapped = remote(InvalidRequestError(message))
    assert "pid=4242, ip=10.4.5.6" in str(wrapped) and ANSI_RED in str(wrapped)  # what Ray's text carries
    response = error_response(wrapped)
    body = json.loads(response.body)
    assert response.status_code == 422 and body["error"] == {"type": "invalid_request", "message": message}
    raw = response.body.decode()
    for leak in ("Traceback", "pid=", "10.4.5.6", "\\u001b", ANSI_RED):
        assert leak not in raw
    (record,) = caplog.records  # one WARNING line, no traceback
    assert record.levelno == logging.WARNING and record.exc_info is None and message in record.getMessage()


def test_openapi_documents_the_endpoints_and_the_request_schema():
    schema = api.openapi()
    assert {"/v1/generate", "/v1/capture", "/v1/info", "/healthz"} <= set(schema["paths"])
    body = schema["paths"]["/v1/capture"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/GenerateRequest"}
    components = schema["components"]["schemas"]
    assert "capture" in components["GenerateRequest"]["properties"] and "CaptureSpec" in components
    assert "self" not in json.dumps(schema["paths"]["/v1/generate"])  # the class-based view took self


# ---------------------------------------------------------------- the whole app, fake replicas


async def answers(replica: str, request: GenerateRequest) -> GenerateResult:
    return result()


@pytest.fixture
def served(monkeypatch):
    """A factory: the FastAPI app in front of an HttpRouter on a FakePool, as a TestClient."""
    from ray import serve

    def start(pool: FakePool | None = None, **config: Any) -> tuple[TestClient, HttpRouter, FakePool]:
        pool = pool or FakePool(["a", "b"], answers)
        router = HttpRouter(pool, RouterConfig(api_key=KEY, **config))
        monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=router))
        return TestClient(api, raise_server_exceptions=False), router, pool

    return start


NATIVE_PATHS = {"/v1/generate", "/v1/capture", "/v1/info", "/docs", "/openapi.json"}


def test_one_auth_dependency_guards_every_route_but_the_probes(served):
    client, _, _ = served()
    assert [d.dependency for d in api.router.dependencies] == [http.require_key]  # declared once, app-wide
    routes = [(r.path, sorted(r.methods)[0]) for r in api.routes if hasattr(r, "methods") and r.path.startswith("/")]
    guarded = [(path, method) for path, method in routes if path not in OPEN_PATHS]
    assert {p for p, _ in guarded} >= {"/v1/generate", "/v1/capture", "/v1/info", "/docs", "/openapi.json"}
    for path, method in guarded:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
            response = client.request(method, path, headers=headers, json={"prompt": "x"})
            assert response.status_code == 401, (path, headers)
            kind = "unauthorized" if path in NATIVE_PATHS or path.startswith("/v1/vectors") else "authentication_error"  # the OpenAI routes' type
            assert response.json()["error"]["type"] == kind and response.headers["www-authenticate"] == "Bearer"
        # with the key every route gets past auth (the OpenAI routes then want their own bodies)
        status = client.request(method, path, headers=AUTH, json={"prompt": "x", "capture": {"hooks": ["0:resid_post"]}}).status_code
        assert status == 200 if path in NATIVE_PATHS else status != 401, (path, status)
    for path in OPEN_PATHS:
        assert client.get(path).status_code == 200  # probes carry no token


def test_readyz_is_503_with_retry_after_until_an_engine_runs_and_reveals_nothing_sensitive(served):
    class Starting(FakePool):
        states = {"STARTING": 2}

        async def fleet_states(self) -> FleetStates:
            return FleetStates(app_status="DEPLOYING", replica_status="UPDATING", replicas=dict(self.states))

    pool = Starting(["a"], answers)
    client, router, _ = served(pool)
    starting = client.get("/readyz")
    assert starting.status_code == 503 and starting.headers["retry-after"] == "5"
    body = starting.json()
    assert body["ready"] is False and body["replicas"] == {"STARTING": 2} and body["app_status"] == "DEPLOYING"
    assert "starting" in body["reason"]
    assert set(body) == {"ready", "app_status", "replica_status", "replicas", "serving", "queued", "checked_s_ago", "reason"}
    assert client.get("/healthz").status_code == 200  # alive all along: liveness is not readiness
    Starting.states = {"STARTING": 1, "RUNNING": 1}
    router._readiness._cached = None  # skip the one-second cache
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["serving"] == 1 and ready.json()["ready"] is True
    assert "retry-after" not in ready.headers


def test_a_bad_format_is_refused_before_the_body_is_read_or_a_replica_runs(served, monkeypatch):
    client, _, pool = served()
    reads: list[int] = []
    real = http.read_body

    async def spy(request, limit):
        reads.append(limit)
        return await real(request, limit)

    monkeypatch.setattr(http, "read_body", spy)
    response = client.post("/v1/capture?format=npz", headers=AUTH, json={"prompt": "x", "capture": {"hooks": ["0:resid_post"]}})
    assert response.status_code == 400 and "format='npz'; allowed: json, safetensors" in response.json()["error"]["message"]
    assert reads == [] and pool.calls == []
    assert client.post("/v1/capture?format=safetensors", headers=AUTH, json={"prompt": "x", "capture": {"hooks": ["0:resid_post"]}}).status_code == 200
    assert len(reads) == 1


def test_a_full_queue_is_a_503_before_the_body_is_read(served, monkeypatch):
    client, router, pool = served(max_queued_requests=1)
    reads: list[int] = []
    monkeypatch.setattr(http, "read_body", lambda request, limit: reads.append(limit))
    router._queue.waiting = 1  # one request already waits for a replica
    response = client.post("/v1/generate", headers=AUTH, content=b"x" * 1000)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "max_queued_requests=1" in response.json()["error"]["message"]
    assert reads == [] and pool.calls == []
    too_big = client.post("/v1/generate", headers={**AUTH, "Content-Length": str(128 << 20)}, content=b"{}")
    assert too_big.status_code == 413  # the declared size is checked before the queue, too


def test_a_small_request_is_answered_while_a_large_result_is_being_encoded(served, monkeypatch):
    """The large result's encoder waits until the small request has its answer. On the event loop
    it would hold everything up, so the small request could not finish and it would time out."""
    import asyncio
    import threading

    import httpx

    large = np.zeros((1024, 512), np.float32)  # 2 MiB: encoded on a codec thread
    encoding, small_answered, waited = threading.Event(), threading.Event(), []
    encode_result = http.encode_result

    def encode(result: GenerateResult, safetensors: bool) -> Any:
        if result.activation_bytes >= large.nbytes:
            encoding.set()
            waited.append(small_answered.wait(timeout=10))
        return encode_result(result, safetensors)

    async def by_prompt(replica: str, request: GenerateRequest) -> GenerateResult:
        if request.prompt == "large":
            return result().model_copy(update={"activations": {"blocks.0.hook_resid_post": large}})
        return result()

    monkeypatch.setattr(http, "encode_result", encode)
    served(FakePool(["a", "b"], by_prompt))

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://capserve", headers=AUTH) as client:
            big = asyncio.ensure_future(client.post("/v1/generate", json={"prompt": "large"}))
            assert await asyncio.to_thread(encoding.wait, 10)
            small = await client.post("/v1/generate", json={"prompt": "small"})
            small_answered.set()
            assert small.status_code == 200 and small.json()["text"] == "hi"
            answer = await big
            assert answer.status_code == 200 and answer.json()["activations"]["blocks.0.hook_resid_post"]["shape"] == [1024, 512]

    asyncio.run(main())
    assert waited == [True]  # the small request finished while the large one was being encoded


def test_a_request_past_its_deadline_is_a_504_naming_the_setting(served):
    async def hangs(replica: str, request: GenerateRequest) -> str:
        import asyncio

        await asyncio.Event().wait()
        return replica

    client, router, _ = served(FakePool(["a"], hangs), routing={"request_timeout_s": 0.2})
    response = client.post("/v1/generate", headers=AUTH, json={"prompt": "x"})
    assert response.status_code == 504 and response.json()["error"]["type"] == "deadline_exceeded"
    assert "routing.request_timeout_s=0.2" in response.json()["error"]["message"]
    assert router._queue.waiting == 0


def test_the_openai_routes_share_the_app_and_its_one_auth_dependency(served):
    client, _, pool = served()
    routes = {r.path: r for r in api.routes if hasattr(r, "methods")}
    openai_paths = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/v1/captures/{capture_id}"}
    assert openai_paths <= set(routes)
    for path in openai_paths:  # the app-wide dependency, not one of their own
        assert [d.call for d in routes[path].dependant.dependencies if d.call is http.require_key], path
    unauthorized = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert unauthorized.status_code == 401 and unauthorized.headers["www-authenticate"] == "Bearer"
    assert unauthorized.json()["error"]["code"] == "invalid_api_key"  # OpenAI's error shape on OpenAI's routes
    assert client.post("/v1/generate", json={"prompt": "x"}).json()["error"].keys() == {"type", "message"}  # native shape
    assert pool.calls == []
