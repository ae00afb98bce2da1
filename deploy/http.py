"""HTTP on the Router (FastAPI ingress): JSON in, JSON or safetensors out, no pickle anywhere.

    POST /v1/generate   GenerateRequest JSON -> result
    POST /v1/capture    GenerateRequest JSON (capture required) -> result, prompt activations
    GET  /v1/info       ModelInfo
    GET  /healthz       liveness: the router process answers; never authenticated
    GET  /readyz        readiness: 200 when an engine can serve now, else 503 (Retry-After); never
                        authenticated, and it shows states and counts only (no address, pid, message)
    GET  /docs, /openapi.json   behind the bearer token when auth is on, like every route but the probes

Auth is one FastAPI dependency on the whole app (`require_key`), not a check per route: a route
added later is guarded by default; only the paths in OPEN_PATHS are exempt. The key is the
Router's (`deploy.config.read_api_key`: `api_key_file` or $CAPSERVE_API_KEY).

Order of checks on POST (cheapest first, nothing read that a refusal does not need): bearer key,
`?format=`, Content-Length against max_request_bytes, a full queue (503 before the body is read),
then the body is read (bounded), parsed and validated, and only then does a replica see it.

Arrays in requests are lists of numbers or `{"dtype", "shape", "data": base64}` objects
(`replicas.arrays`). Results are JSON with each activation (and logits) in that base64 form, or,
with `Accept: application/octet-stream` or `?format=safetensors`, a safetensors file whose
tensors are the activations by hook name (plus "logits") and whose `__metadata__["capserve"]`
holds the other result fields as JSON. bfloat16 tensors are stored as BF16 (read them with
`safetensors.torch`; `safetensors.numpy` has no bfloat16).

Errors: `{"error": {"type", "message"}}` with 400 (not JSON, bad format), 401 (auth), 413 (body
over max_request_bytes), 422 (invalid request, the field named), 503 (queue full or no replica
could answer; Retry-After), 504 (past routing.request_timeout_s), 500 (capture failed, or an
internal error: logged on the router, the body names only its type). Messages never carry a
remote traceback, pid, address or ANSI code (`replicas.error_messages.public_message`).
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from replicas import arrays
from replicas.api import GenerateRequest, GenerateResult, ModelInfo
from replicas.errors import (
    BackPressureError,
    CaptureFailedError,
    DeadlineExceededError,
    InvalidRequestError,
    ReplicaUnavailableError,
)

from deploy.config import RouterConfig, read_api_key
from replicas.error_messages import public_message, remote_cause
from deploy.readiness import ReadyStatus
from deploy.router import Router

logger = logging.getLogger("capserve.http")

SAFETENSORS_MEDIA = "application/octet-stream"
_ARRAY_FIELDS = ("activations", "logits")
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # probes: load balancers send no token
READY_RETRY_AFTER_S = "5"


def serving_router() -> "HttpRouter":
    """The Router instance of this Serve replica (how Serve itself resolves `self` for class-based
    views); tests fake that context."""
    from ray import serve

    return serve.get_replica_context().servable_object


async def require_key(request: Request, router: "HttpRouter" = Depends(serving_router)) -> None:
    """The one auth dependency, on every route of the app; the probes in OPEN_PATHS are exempt."""
    route = request.scope.get("route")
    if getattr(route, "path", None) in OPEN_PATHS:
        return
    router.authorize(request)


# FastAPI's own /docs, /redoc and /openapi.json would be open to anyone; HttpRouter serves the
# schema and the docs page itself, behind the same dependency as every other route.
api = FastAPI(
    title="capserve",
    version="0.1.0",
    description="Activation capture and interventions on vLLM replicas behind Ray Serve.",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
    dependencies=[Depends(require_key)],
)


class EncodedArray(BaseModel):
    dtype: str
    shape: list[int]
    data: str


class HttpResult(BaseModel):
    """A GenerateResult as JSON: arrays in the base64 wire format."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    choices: list[dict[str, Any]]
    activations: dict[str, EncodedArray]
    positions: list[int]
    capture_token_ids: list[int]
    logits: EncodedArray | None
    logits_positions: list[int]
    logprobs: list[dict[str, float]] | None
    prompt_logprobs: list[dict[str, float] | None] | None
    replica: str | None


class HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers or {}


_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/GenerateRequest"}}}}}
_RESULT = {
    200: {
        "description": "The result; safetensors when asked for.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HttpResult"}}, SAFETENSORS_MEDIA: {}},
    }
}


class HttpRouter(Router):
    """The Router plus its HTTP endpoints (wrapped by `serve.ingress` in `deploy.app`)."""

    def __init__(self, replicas: Any, config: RouterConfig | dict[str, Any] | None = None) -> None:
        super().__init__(replicas, config)
        self._api_key = read_api_key(self._config)  # on the Router's node: api_key_file lives there

    @api.post("/v1/generate", openapi_extra=_BODY, responses=_RESULT)
    async def http_generate(self, request: Request) -> Response:
        return await self._http_call(request, self.generate)

    @api.post("/v1/capture", openapi_extra=_BODY, responses=_RESULT)
    async def http_capture(self, request: Request) -> Response:
        return await self._http_call(request, self.capture)

    @api.get("/v1/info", response_model=ModelInfo)
    async def http_info(self) -> Response:
        try:
            info = await self.info()
        except Exception as exc:
            return error_response(exc)
        return JSONResponse(info.model_dump())

    @api.get("/openapi.json", include_in_schema=False)
    async def http_openapi(self) -> Response:
        return JSONResponse(api.openapi())

    @api.get("/docs", include_in_schema=False)
    async def http_docs(self) -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="capserve")

    @api.get("/healthz")
    async def http_healthz(self) -> dict[str, Any]:
        """Liveness: the router answers. Says nothing about the engines (see /readyz)."""
        return {"status": "ok", "queued": self._queue.waiting}

    @api.get("/readyz", response_model=ReadyStatus, responses={503: {"model": ReadyStatus}})
    async def http_readyz(self) -> Response:
        """Readiness: 200 when at least one engine can serve now, else 503 with Retry-After."""
        status = await self.ready()
        headers = {} if status.ready else {"Retry-After": READY_RETRY_AFTER_S}
        return JSONResponse(status.model_dump(), status_code=200 if status.ready else 503, headers=headers)

    async def _http_call(self, request: Request, method: Callable[[Any], Awaitable[Any]]) -> Response:
        try:
            safetensors = wants_safetensors(request)  # before anything runs: a bad format costs nothing
            check_declared_size(request, self._config.max_request_bytes)
            self._queue.check()  # full: 503 now, without reading a body that would only wait
            body = await read_body(request, self._config.max_request_bytes)
            result = await method(parse_json_object(body))
            return encode_result(result, safetensors)
        except Exception as exc:
            return error_response(exc)

    def authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        check_bearer(request.headers.get("authorization"), self._api_key.get_secret_value())


@api.exception_handler(HttpError)
async def _http_error(request: Request, exc: HttpError) -> JSONResponse:
    return error_response(exc)  # raised by require_key, before any route runs


# ---------------------------------------------------------------- pieces (unit-tested)


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
    status, kind, headers = _classify(exc)
    if kind == "internal":
        logger.error("HTTP 500: %s", public_message(exc), exc_info=exc)
        message = f"internal error ({type(remote_cause(exc)).__name__}); the router's log has the details"
    else:
        message = exc.message if isinstance(exc, HttpError) else public_message(exc)
        if 400 <= status < 500 and status != 401:  # 401s are a scanner's noise; the others help a user
            logger.warning("HTTP %d %s: %s", status, kind, message)
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status, headers=headers)


def _classify(exc: BaseException) -> tuple[int, str, dict[str, str]]:
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


def _openapi() -> dict[str, Any]:
    """FastAPI's schema plus the request/result models the raw-body endpoints read and write."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (GenerateRequest, HttpResult):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        api.openapi_schema = schema
    return api.openapi_schema


api.openapi = _openapi  # type: ignore[method-assign]


def _ingress() -> type:
    from ray import serve

    return serve.ingress(api)(HttpRouter)


# Wrapped once, at import: serve.ingress rewrites the app's routes into class-based views.
RouterIngress = _ingress()
