"""The HTTP pieces every route shares (unit-tested on their own): the bearer check, body limits,
JSON parsing, result encodings, and the mapping of errors to status codes.

Kept apart from `deploy.http` (the native routes) so `deploy.openai_routes` can use them without
an import cycle; `deploy.http` re-exports them under the same names.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from replicas.api import arrays
from replicas.api import GenerateResult
from replicas.api.error_messages import public_message, remote_cause
from replicas.api.errors import (
    BackPressureError,
    CaptureFailedError,
    DeadlineExceededError,
    InvalidRequestError,
    ReplicaUnavailableError,
)

logger = logging.getLogger("capserve.http")

SAFETENSORS_MEDIA = "application/octet-stream"
_ARRAY_FIELDS = ("activations", "logits")


class HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers or {}


def check_bearer(header: str | None, key: str) -> None:
    scheme, _, token = (header or "").partition(" ")
    # compare_digest on bytes of equal or different length runs in time independent of content
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise HttpError(401, "unauthorized", "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})


def check_declared_size(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, "too_large", f"request body of {declared} bytes exceeds max_request_bytes={limit}")


async def read_body(request: Request, limit: int) -> bytes:
    check_declared_size(request, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # a chunked body has no Content-Length; stop reading at the limit
            raise HttpError(413, "too_large", f"request body exceeds max_request_bytes={limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HttpError(400, "bad_json", f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # json.loads recurses per nesting level; a deep body would be a 500
        raise HttpError(400, "bad_json", "request body is nested too deeply; GenerateRequest needs at most a few levels") from None
    if not isinstance(value, dict):
        raise HttpError(400, "bad_json", f"request body must be a JSON object of GenerateRequest fields, got {type(value).__name__}")
    return value


def wants_safetensors(request: Request) -> bool:
    fmt = request.query_params.get("format", "json")
    if fmt not in ("json", "safetensors"):
        raise HttpError(400, "bad_format", f"format={fmt!r}; allowed: json, safetensors")
    return fmt == "safetensors" or SAFETENSORS_MEDIA in request.headers.get("accept", "")


def result_fields(result: GenerateResult) -> dict[str, Any]:
    """Every field but the arrays, JSON-ready."""
    return json.loads(result.model_dump_json(exclude=set(_ARRAY_FIELDS)))


def encode_result(result: GenerateResult, safetensors: bool) -> Response:
    if safetensors:
        return Response(to_safetensors(result), media_type=SAFETENSORS_MEDIA)
    body = result_fields(result)
    body["activations"] = {name: arrays.to_base64(a) for name, a in result.activations.items()}
    body["logits"] = arrays.to_base64(result.logits) if result.logits is not None else None
    return JSONResponse(body)


def to_safetensors(result: GenerateResult) -> bytes:
    from safetensors.numpy import save

    tensors = dict(result.activations)
    if result.logits is not None:
        tensors["logits"] = result.logits
    return save(tensors, metadata={"capserve": json.dumps(result_fields(result))})


def error_response(exc: BaseException) -> JSONResponse:
    """The JSON error for `exc`: the message and the field, never a remote traceback. Client errors
    are logged as one WARNING line; an internal error is logged with its traceback here, on the
    router, and the caller learns only its type."""
    status, kind, headers = classify(exc)
    if kind == "internal":
        logger.error("HTTP 500: %s", public_message(exc), exc_info=exc)
        message = f"internal error ({type(remote_cause(exc)).__name__}); the router's log has the details"
    else:
        message = exc.message if isinstance(exc, HttpError) else public_message(exc)
        if 400 <= status < 500 and status != 401:  # 401s are a scanner's noise; the others help a user
            logger.warning("HTTP %d %s: %s", status, kind, message)
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status, headers=headers)


def classify(exc: BaseException) -> tuple[int, str, dict[str, str]]:
    if isinstance(exc, HttpError):
        return exc.status, exc.kind, exc.headers
    exc = remote_cause(exc)
    if isinstance(exc, InvalidRequestError):
        return 422, "invalid_request", {}
    if isinstance(exc, BackPressureError):
        return 503, "backpressure", {"Retry-After": "1"}
    if isinstance(exc, ReplicaUnavailableError):
        return 503, "replica_unavailable", {"Retry-After": "1"}
    if isinstance(exc, DeadlineExceededError):
        return 504, "deadline_exceeded", {}
    if isinstance(exc, CaptureFailedError):
        return 500, "capture_failed", {}
    return 500, "internal", {}
