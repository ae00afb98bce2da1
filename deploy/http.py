"""HTTP on the Router (FastAPI ingress): JSON in, JSON or safetensors out, no pickle anywhere.

    POST /v1/generate   GenerateRequest JSON -> result
    POST /v1/capture    GenerateRequest JSON (capture required) -> result, prompt activations
    GET  /v1/info       ModelInfo
    GET  /healthz       liveness: the router process answers; never authenticated
    GET  /readyz        readiness: 200 when an engine can serve now, else 503 (Retry-After); never
                        authenticated, and it shows states and counts only (no address, pid, message)
    GET  /docs, /openapi.json   behind the bearer token when auth is on, like every route but the probes
    OpenAI-compatible routes (/v1/chat/completions, /v1/completions, /v1/models, /tokenize,
    /detokenize, /v1/captures/{id}): `deploy.openai_routes`, docs/openai.md
    POST/GET /v1/vectors, DELETE /v1/vectors/{name}: named steering vectors, `deploy.vectors`

Auth is one FastAPI dependency on the whole app (`require_key`), not a check per route: a route
added later is guarded by default; only the paths in OPEN_PATHS are exempt. The key is the
Router's (`deploy.config.read_api_key`: `api_key_file` or $CAPSERVE_API_KEY).

Order of checks on POST (cheapest first, nothing read that a refusal does not need): bearer key,
`?format=`, Content-Length against max_request_bytes, a full queue (503 before the body is read),
then the body is read (bounded), parsed and validated, and only then does a replica see it. Bodies
and results of 1 MiB or more are parsed and encoded on the Router's codec threads
(`deploy.http_parts.Codec`), so a large one does not hold up the small ones on the event loop.

Arrays in requests are lists of numbers or `{"dtype", "shape", "data": base64}` objects
(`replicas.api.arrays`). Results are JSON with each activation (and logits) in that base64 form, or,
with `Accept: application/octet-stream` or `?format=safetensors`, a safetensors file whose
tensors are the activations by hook name (plus "logits") and whose `__metadata__["capserve"]`
holds the other result fields as JSON. bfloat16 tensors are stored as BF16 (read them with
`safetensors.torch`; `safetensors.numpy` has no bfloat16).

Errors: `{"error": {"type", "message"}}` with 400 (not JSON, bad format), 401 (auth), 413 (body
over max_request_bytes), 422 (invalid request, the field named), 503 (queue full or no replica
could answer; Retry-After), 504 (past routing.request_timeout_s), 500 (capture failed, or an
internal error: logged on the router, the body names only its type). Messages never carry a
remote traceback, pid, address or ANSI code (`replicas.api.error_messages.public_message`).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from replicas.api import GenerateRequest, ModelInfo
from replicas.api.validation import validated

from deploy.config import RouterConfig, read_api_key
from deploy.http_parts import (  # re-exported: tests and callers import them from here
    SAFETENSORS_MEDIA,
    Codec,
    HttpError,
    check_bearer,
    check_declared_size,
    encode_result,
    error_response,
    logger,
    parse_json_object,
    payload_bytes,
    read_body,
    result_fields,
    to_safetensors,
    wants_safetensors,
)
from deploy.openai_routes import OPENAI_PATHS, OpenAIRoutes, openai_api, openai_error_response
from deploy.readiness import ReadyStatus
from deploy.router import Router
from deploy.vectors import VectorRoutes, vectors_api

__all__ = [
    "OPEN_PATHS", "HttpError", "HttpResult", "HttpRouter", "RouterIngress", "api", "check_bearer", "check_declared_size",
    "encode_result", "error_response", "parse_json_object", "read_body", "result_fields", "to_safetensors",
    "wants_safetensors", "logger",
]

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
api.include_router(openai_api)  # the OpenAI-compatible routes (deploy.openai_routes), behind the same key
api.include_router(vectors_api)  # named steering vectors (deploy.vectors), behind the same key


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
    tool_calls: list[dict[str, Any]] | None = None
    replica: str | None
    sae: dict[str, dict[str, Any]] = {}  # by sae_id: hook, positions, ids, values, error (arrays encoded)
    readouts: list[dict[str, Any]] = []  # in the request's order: kind, hook, probe, positions, ids, logprobs, tokens, values


_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/GenerateRequest"}}}}}
_RESULT = {
    200: {
        "description": "The result; safetensors when asked for.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HttpResult"}}, SAFETENSORS_MEDIA: {}},
    }
}


class HttpRouter(VectorRoutes, OpenAIRoutes, Router):
    """The Router plus its HTTP endpoints, native and OpenAI-compatible (wrapped by `serve.ingress`
    in `deploy.app`)."""

    def __init__(self, replicas: Any, config: RouterConfig | dict[str, Any] | None = None) -> None:
        super().__init__(replicas, config)
        self._api_key = read_api_key(self._config)  # on the Router's node: api_key_file lives there
        self._codec = Codec()  # large bodies and results are parsed and encoded off the event loop
        self._start_openai()

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
            result = await method(await self._codec.run(len(body), parse_request, body))
            return await self._codec.run(payload_bytes(result), encode_result, result, safetensors)
        except Exception as exc:
            return error_response(exc)

    def authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        check_bearer(request.headers.get("authorization"), self._api_key.get_secret_value())


def parse_request(body: bytes) -> GenerateRequest:
    """A body as a validated request (the Router's own validation then has nothing left to do)."""
    return validated(parse_json_object(body))


@api.exception_handler(HttpError)
async def _http_error(request: Request, exc: HttpError) -> JSONResponse:
    # raised by require_key, before any route runs; OpenAI clients get OpenAI's error shape
    if request.url.path in OPENAI_PATHS or request.url.path.startswith("/v1/captures/"):
        return openai_error_response(exc)
    return error_response(exc)


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
