"""HTTP pieces without Serve: bearer check, body limit, JSON parsing, result encodings, errors."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from safetensors.numpy import load as load_safetensors

from deploy.http import (
    HttpError,
    api,
    check_bearer,
    encode_result,
    error_response,
    parse_json_object,
    read_body,
    to_safetensors,
)
from replicas import arrays
from replicas.api import GenerateResult
from replicas.errors import BackPressureError, CaptureFailedError, InvalidRequestError, ReplicaUnavailableError


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
        (CaptureFailedError("worker"), 500),
        (RuntimeError("boom"), 500),
    ],
)
def test_errors_map_to_status_codes_and_keep_the_message(exc, status):
    response = error_response(exc)
    assert response.status_code == status
    assert json.loads(response.body)["error"]["message"] == str(exc)
    if status == 503:
        assert response.headers["retry-after"] == "1"


def test_openapi_documents_the_endpoints_and_the_request_schema():
    schema = api.openapi()
    assert {"/v1/generate", "/v1/capture", "/v1/info", "/healthz"} <= set(schema["paths"])
    body = schema["paths"]["/v1/capture"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/GenerateRequest"}
    components = schema["components"]["schemas"]
    assert "capture" in components["GenerateRequest"]["properties"] and "CaptureSpec" in components
    assert "self" not in json.dumps(schema["paths"]["/v1/generate"])  # the class-based view took self
