"""The HTTP pieces every route shares (unit-tested on their own): the bearer check, body limits,
JSON parsing, result encodings, the codec threads, and the mapping of errors to status codes.

Kept apart from `deploy.http` (the native routes) so `deploy.openai_routes` can use them without
an import cycle; `deploy.http` re-exports them under the same names.
"""

from __future__ import annotations

import asyncio
import binascii
import functools
import hmac
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import numpy as np

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
OFF_LOOP_BYTES = 1 << 20  # bodies and results from this size on are parsed and encoded on the codec threads
CODEC_THREADS = 2  # the work holds the GIL most of the time: more threads would only queue on it
BASE64_CHUNK = 3 << 20  # array bytes per base64 call; a multiple of 3, so the pieces join into one text

T = TypeVar("T")


class Codec:
    """Parsing bodies and encoding results off the Router's event loop, on a few threads of its
    own. On the loop, a 64 MiB body or a 256 MiB result held every other request (and the
    health answers) for a second or more. Small work stays on the loop: a thread hop costs more.

    json.loads holds the GIL for its whole call, so parsing a large body still pauses the loop
    for most of its length; encoding does not: `json_body` hands the GIL back between chunks."""

    def __init__(self, threads: int = CODEC_THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="capserve-codec")

    async def run(self, size: int, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)`, on a codec thread when `size` (bytes of body or arrays) is large."""
        if size < OFF_LOOP_BYTES:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(work, *args))


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


def payload_bytes(result: GenerateResult) -> int:
    """Bytes of the result's arrays (activations and logits)."""
    return result.activation_bytes + (result.logits.nbytes if result.logits is not None else 0)


def encode_result(result: GenerateResult, safetensors: bool) -> Response:
    if safetensors:
        return Response(to_safetensors(result), media_type=SAFETENSORS_MEDIA)
    return Response(json_body(result), media_type="application/json")


def json_body(result: GenerateResult) -> bytes:
    """The result as JSON, each array in the base64 wire form (`arrays.to_base64`). Built in
    pieces: the arrays' base64 is made chunk by chunk (the GIL goes back to the event loop between
    chunks) and spliced into the JSON of the other fields, which json.dumps never scans."""
    marker = uuid.uuid4().hex
    encoded: list[np.ndarray] = []

    def placeholder(array: np.ndarray) -> dict[str, Any]:
        encoded.append(np.ascontiguousarray(array))
        return {"dtype": arrays.dtype_name(array), "shape": list(array.shape), "data": f"{marker}{len(encoded) - 1}"}

    body = result_fields(result)
    body["activations"] = {name: placeholder(a) for name, a in result.activations.items()}
    body["logits"] = placeholder(result.logits) if result.logits is not None else None
    rest = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    pieces: list[bytes] = []
    for i, array in enumerate(encoded):
        head, rest = rest.split(f'"{marker}{i}"', 1)
        pieces += [head.encode(), b'"', *_base64_pieces(array), b'"']
    pieces.append(rest.encode())
    return b"".join(pieces)


def _base64_pieces(array: np.ndarray) -> list[bytes]:
    data = memoryview(array.reshape(-1).view(np.uint8))
    return [binascii.b2a_base64(data[i:i + BASE64_CHUNK], newline=False) for i in range(0, len(data), BASE64_CHUNK)]


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
