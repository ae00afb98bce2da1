"""Named steering vectors: registered once with the app, then named in requests
(`{"hook": ..., "op": "add", "vector": "refusal"}`; `hook` may be left out when the vector has a
default one).

Where they live: in the Router, the app's single ingress (always one replica). It puts each named
vector's array, and its default hook where the request gives none, into the request before it
picks a replica, so EngineReplicas hold no vector state: a replica that restarts, or one that
autoscaling adds, serves every name at once, and a request keeps the array it was admitted with
when the name is replaced or deleted while it runs.

Two sources:
- serve_config.yaml `vectors: {name: {path, hook?, tensor?}}` (`deploy.config.VectorSpec`): read
  by the Router when it starts, on its node; a file that is missing, unreadable or holds no usable
  array fails the app's start, naming the entry. They are checked against the model's widths as
  soon as a replica reports them (the Router asks at start); one that does not fit is logged as an
  error, listed with the problem, and a request naming it gets a 422 saying why. These cannot be
  replaced or deleted over HTTP, and come back with every start.
- `POST /v1/vectors` (or the handle's `register_vector`): checked against the model before it is
  kept. Uploads live in the Router's memory only: an app (or Router) restart forgets them.

HTTP, behind the app's bearer key like every route (`deploy.http`):

    POST   /v1/vectors          {"name", "vector", "hook"?, "replace"?}  -> 201 {entry}
    GET    /v1/vectors          -> {"vectors": [entry, ...]}
    DELETE /v1/vectors/{name}   -> {"deleted": name}

An entry is `{"name", "shape", "hook", "source": "config" | "upload", "norm", "problem"}`. Errors:
400 (not JSON), 401, 404 (no such name), 409 (a name taken without `replace`, a config vector, or
`max_vectors` reached), 413 (a body over 8 MiB or max_request_bytes), 422 (a bad name, shape,
NaN/inf, a zero vector, a width the model's hooks do not take).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from replicas.api import GenerateRequest, Intervention, ModelInfo
from replicas.api.error_messages import SERVE_LOGGER
from replicas.api.errors import InvalidRequestError
from replicas.api.fields import FloatArray, check_vector_name
from replicas.api.hooks import HEAD_KINDS, editable_hook, resolve_hook
from replicas.api.validation import validation_message
from replicas.plans.heads import head_shapes, hook_width
from replicas.shards.sink import ShardJob

from deploy.config import VectorSpec
from deploy.http_parts import HttpError, error_response, parse_json_object, read_body

logger = logging.getLogger(SERVE_LOGGER)  # Serve's: its replica log is where an operator looks

MAX_UPLOAD_BYTES = 8 << 20  # a JSON body; a vector as wide as any model's row is far smaller
MAX_FILE_BYTES = 64 << 20  # a config vector's file

vectors_api = APIRouter()


class VectorNotFound(InvalidRequestError):
    """No vector of that name (HTTP 404)."""


class VectorConflict(InvalidRequestError):
    """The name is taken, belongs to serve_config, or the registry is full (HTTP 409)."""


class VectorUpload(BaseModel):
    """A vector registered over HTTP or the handle."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    name: str = Field(description="1-64 letters, digits, '_', '.' or '-', starting with a letter.")
    vector: FloatArray = Field(description="[width] (or [n_heads, d_head]): numbers, or {dtype, shape, data: base64}.")
    hook: str | None = Field(None, description="Default hook of requests that name the vector without one.")
    replace: bool = Field(False, description="Replace an uploaded vector of the same name.")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_vector_name(name)

    @field_validator("hook")
    @classmethod
    def _hook(cls, hook: str | None) -> str | None:
        return None if hook is None else editable_hook(hook)


@dataclass
class NamedVector:
    name: str
    array: np.ndarray  # float32, read-only: shared by every request that names it
    hook: str | None
    source: Literal["config", "upload"]
    problem: str | None = None  # why it does not fit the model (config vectors; found once the model is known)

    def describe(self) -> dict[str, Any]:
        norm = float(np.linalg.norm(self.array.astype(np.float64)))
        return {"name": self.name, "shape": list(self.array.shape), "hook": self.hook, "source": self.source,
                "norm": norm, "problem": self.problem}


def usable_array(value: Any, where: str) -> np.ndarray:
    """A read-only float32 copy of a vector: 1-D (or [n_heads, d_head]), finite, not zero."""
    array = np.asarray(value)
    if array.dtype.kind not in "fiu":
        raise ValueError(f"{where}: expected an array of real numbers, got dtype {array.dtype}")
    with np.errstate(over="ignore"):  # past float32's range becomes inf, refused below
        array = array.astype(np.float32)
    if array.ndim not in (1, 2) or array.size == 0:
        raise ValueError(f"{where}: expected a non-empty [width] or [n_heads, d_head] array, got shape {list(array.shape)}")
    if not np.isfinite(array).all():
        raise ValueError(f"{where}: the array holds NaN or infinite values (in float32); only finite numbers are allowed")
    if not np.linalg.norm(array.astype(np.float64)) > 0:
        raise ValueError(f"{where}: the vector is zero; it has no direction to steer along")
    array.flags.writeable = False
    return array


def load_vector(name: str, spec: VectorSpec) -> np.ndarray:
    """The array of a serve_config vector, read on the Router's node; raises naming the entry."""
    where = f"vectors.{name}.path={spec.path!r}"
    path = Path(spec.path).expanduser()
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ValueError(f"{where}: the file holds {size} bytes; a vector file may hold at most {MAX_FILE_BYTES}")
        array = np.load(path, allow_pickle=False) if path.suffix == ".npy" else _safetensors_array(path, where, spec)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it on the Router's node ({exc.strerror or exc})") from None
    except (EOFError, TypeError, ValueError) as exc:  # np.load on another kind of file, an object array ...
        if str(exc).startswith(where):
            raise
        raise ValueError(f"{where}: not a readable {path.suffix} file ({exc})") from None
    return usable_array(array, where)


def _safetensors_array(path: Path, where: str, spec: VectorSpec) -> np.ndarray:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, TypeError) as exc:  # not a safetensors file, truncated, or a dtype numpy lacks (bfloat16)
        raise ValueError(f"{where}: not a readable .safetensors file ({exc}); store the vector as float32 or float16") from None
    return tensors[_tensor_name(where, spec, sorted(tensors))]


def _tensor_name(where: str, spec: VectorSpec, names: list[str]) -> str:
    if spec.tensor is not None:
        if spec.tensor not in names:
            raise ValueError(f"{where}: no tensor {spec.tensor!r} in the file; it holds {names}")
        return spec.tensor
    if len(names) != 1:
        raise ValueError(f"{where}: the file holds {len(names)} tensors {names[:20]}; name one with `tensor`")
    return names[0]


def fit_problem(array: np.ndarray, hook: str | None, info: ModelInfo) -> str | None:
    """Why the vector fits no hook it may be used at (its default hook's, else any of the model's
    editable widths); None when it fits."""
    shapes = head_shapes(info.attention) or {}
    if hook is not None:
        try:
            kind = resolve_hook(hook, info.n_layers).kind
        except ValueError as exc:
            return f"hook {hook!r}: {exc}"
        if kind in HEAD_KINDS and kind not in shapes:
            return f"hook {hook!r}: this model reported no attention heads"
        if kind in HEAD_KINDS:
            heads, d_head = shapes[kind]
            allowed = [(heads * d_head,), (d_head,), (heads, d_head)]
        else:
            allowed = [(hook_width(kind, info.d_model, shapes, info.moe),)]
        where = f"at its hook {hook!r}"
    else:
        allowed = [(info.d_model,)] + [s for heads, d in shapes.values() for s in ((heads * d,), (d,), (heads, d))]
        allowed += [(info.moe.n_experts,)] if info.moe is not None else []
        where = "at any of this model's hooks (give a default hook for another)"
    if array.shape in allowed:
        return None
    shown = ", ".join(str(list(s)) for s in dict.fromkeys(allowed))
    return f"shape {list(array.shape)} fits no row {where}; allowed: {shown}"


class VectorRegistry:
    """The named vectors of one Router (see the module)."""

    def __init__(self, specs: Mapping[str, VectorSpec], max_vectors: int) -> None:
        self.max_vectors = max_vectors
        self._vectors = {name: NamedVector(name, load_vector(name, spec), spec.hook, "config") for name, spec in specs.items()}
        self._checked: ModelInfo | None = None  # the model the config vectors were checked against

    @property
    def unchecked(self) -> bool:
        return self._checked is None and bool(self._vectors)

    def check_model(self, info: ModelInfo) -> None:
        """Check the config vectors against the model, once; a misfit is logged and kept with its problem."""
        if self._checked is not None:
            return
        self._checked = info
        for entry in self._vectors.values():
            entry.problem = fit_problem(entry.array, entry.hook, info)
            if entry.problem is not None:
                logger.error("serve_config vectors.%s does not fit the model %s: %s; requests naming it fail",
                             entry.name, info.model, entry.problem)

    def add(self, upload: VectorUpload, info: ModelInfo) -> NamedVector:
        where = f"vector {upload.name!r}"
        old = self._vectors.get(upload.name)
        if old is not None and old.source == "config":
            raise VectorConflict(f"name: {where} comes from serve_config (vectors.{upload.name}); it cannot be replaced "
                                 "or deleted over HTTP: choose another name")
        if old is not None and not upload.replace:
            raise VectorConflict(f"name: {where} is already registered; pass replace: true to replace it, or delete it first")
        if old is None and len(self._vectors) >= self.max_vectors:
            raise VectorConflict(f"name: the Router holds max_vectors={self.max_vectors} vectors; delete some first")
        try:
            array = usable_array(upload.vector, "vector")
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        problem = fit_problem(array, upload.hook, info)
        if problem is not None:
            raise InvalidRequestError(f"vector: {problem}")
        entry = self._vectors[upload.name] = NamedVector(upload.name, array, upload.hook, "upload")
        return entry

    def remove(self, name: str) -> None:
        entry = self._vectors.get(name)
        if entry is None:
            raise VectorNotFound(f"name: no vector named {name[:80]!r}; registered: {sorted(self._vectors) or 'none'}")
        if entry.source == "config":
            raise VectorConflict(f"name: vector {name!r} comes from serve_config (vectors.{name}); remove it there")
        del self._vectors[name]

    def listing(self) -> list[dict[str, Any]]:
        return [entry.describe() for _, entry in sorted(self._vectors.items())]

    @staticmethod
    def names_any(request: GenerateRequest) -> bool:
        return any(edit.vector_name is not None for edit in request.interventions)

    def resolve(self, request: GenerateRequest, where: str = "") -> GenerateRequest:
        """The request with every named vector replaced by its array (and its default hook where the
        edit gives none), each edit validated again; unchanged when it names none."""
        if not self.names_any(request):
            return request
        return request.model_copy(update={"interventions": [self._resolved(edit, f"{where}interventions.{i}.")
                                                            for i, edit in enumerate(request.interventions)]})

    def _resolved(self, edit: Intervention, where: str) -> Intervention:
        name = edit.vector_name
        if name is None:
            return edit
        entry = self._vectors.get(name)
        if entry is None:
            raise InvalidRequestError(
                f"{where}vector: no vector named {name!r} is registered; registered: {sorted(self._vectors) or 'none'} "
                "(serve_config `vectors`, POST /v1/vectors)"
            )
        if entry.problem is not None:
            raise InvalidRequestError(f"{where}vector: vector {name!r} (serve_config vectors.{name}) {entry.problem}")
        hook = edit.hook or entry.hook
        if hook is None:
            raise InvalidRequestError(f"{where}hook: required; vector {name!r} has no default hook")
        try:
            return Intervention.model_validate(edit.model_dump(exclude_unset=True) | {"vector": entry.array, "hook": hook})
        except ValidationError as exc:
            raise InvalidRequestError(validation_message(exc, where)) from None

    def resolve_job(self, job: ShardJob, requests: list[GenerateRequest]) -> ShardJob:
        """A shard job whose lines (validated as `requests`) carry arrays in place of names."""
        lines = []
        for i, (line, request) in enumerate(zip(job.lines, requests)):
            resolved = self.resolve(request, f"lines[{i}].request.")
            lines.append(line if resolved is request else line.model_copy(update={"request": resolved.model_dump(exclude_unset=True)}))
        return job.model_copy(update={"lines": lines})


def vector_upload(fields: dict[str, Any]) -> VectorUpload:
    try:
        return VectorUpload.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequestError(validation_message(exc)) from None


class VectorMethods:
    """Mixin of the Router: the named-vector handle methods."""

    _vectors: VectorRegistry

    async def register_vector(self, name: str, vector: Any, hook: str | None = None, replace: bool = False) -> dict[str, Any]:
        """Register `vector` (an array, a list, or {dtype, shape, data}) under `name`; returns its entry."""
        return await self._register(vector_upload({"name": name, "vector": vector, "hook": hook, "replace": replace}))

    async def list_vectors(self) -> list[dict[str, Any]]:
        await self.info()  # type: ignore[attr-defined]  # the Router's; it checks the config vectors
        return self._vectors.listing()

    async def delete_vector(self, name: str) -> dict[str, Any]:
        self._vectors.remove(name)
        return {"deleted": name}

    async def _resolved(self, request: GenerateRequest, where: str = "") -> GenerateRequest:
        """`request` with arrays in place of names; the config vectors are checked against the model first."""
        await self._vectors_checked([request])
        return self._vectors.resolve(request, where)

    async def _resolved_job(self, job: ShardJob, requests: list[GenerateRequest]) -> ShardJob:
        await self._vectors_checked(requests)
        return self._vectors.resolve_job(job, requests)

    async def _vectors_checked(self, requests: list[GenerateRequest]) -> None:
        if self._vectors.unchecked and any(self._vectors.names_any(r) for r in requests):
            await self.info()  # type: ignore[attr-defined]  # the Router's: it checks them once it knows the model

    async def _register(self, upload: VectorUpload) -> dict[str, Any]:
        return self._vectors.add(upload, await self.info()).describe()  # type: ignore[attr-defined]

    def _check_vectors_at_start(self) -> None:
        """Ask a replica for the model now, so a config vector that does not fit is reported at start,
        not at the first request naming it (outside an event loop, e.g. in unit tests: at that request)."""
        if not self._vectors.unchecked:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        check = asyncio.ensure_future(self.info())  # type: ignore[attr-defined]  # info() checks them; a failure leaves it to the next info()
        check.add_done_callback(lambda task: task.cancelled() or task.exception())


_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": VectorUpload.model_json_schema()}}}}


class VectorRoutes:
    """Mixin of HttpRouter: /v1/vectors over the handle methods; 404 and 409 as their own codes."""

    _config: Any
    _vectors: VectorRegistry

    @vectors_api.post("/v1/vectors", status_code=201, openapi_extra=_UPLOAD_BODY)
    async def http_register_vector(self, request: Request) -> Response:
        try:
            body = await read_body(request, min(MAX_UPLOAD_BYTES, self._config.max_request_bytes))
            entry = await self._register(vector_upload(parse_json_object(body)))  # type: ignore[attr-defined]
        except Exception as exc:
            return _error(exc)
        return JSONResponse(entry, status_code=201)

    @vectors_api.get("/v1/vectors")
    async def http_list_vectors(self) -> Response:
        try:
            return JSONResponse({"vectors": await self.list_vectors()})  # type: ignore[attr-defined]
        except Exception as exc:
            return _error(exc)

    @vectors_api.delete("/v1/vectors/{name}")
    async def http_delete_vector(self, name: str) -> Response:
        try:
            return JSONResponse(await self.delete_vector(name))  # type: ignore[attr-defined]
        except Exception as exc:
            return _error(exc)


def _error(exc: Exception) -> Response:
    if isinstance(exc, VectorNotFound):
        exc = HttpError(404, "not_found", str(exc))
    elif isinstance(exc, VectorConflict):
        exc = HttpError(409, "conflict", str(exc))
    return error_response(exc)
