"""Where `capserve capture` sends its requests: the Serve app's handle, or its HTTP API.

Both give the pipeline the same three things: `info()`, `run(request, prompt_only)` (the
Router's `capture` when prompt_only, else `generate`), and `retry_delay(exc)`, which says
whether a failure is worth another try (a dead replica, a full queue, a dropped connection) and
how long to wait at least, or None for a failure retrying cannot fix (a bad request).

The handle backend is also a `ShardBackend`: it can hand whole shards to the replicas, which
write them themselves (`--sink replica`, provider.dataset.remote). HTTP has no such route.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol, runtime_checkable

from replicas.api import GenerateResult, ModelInfo
from replicas.api.errors import CaptureFailedError, InvalidRequestError
from replicas.shards.store import Store


class Backend(Protocol):
    description: str

    def connect(self) -> None:
        """Blocking setup, run before the event loop starts (Ray prefers the main thread)."""

    async def info(self) -> ModelInfo: ...

    async def run(self, request: dict[str, Any], prompt_only: bool) -> GenerateResult: ...

    def retry_delay(self, exc: BaseException) -> float | None: ...

    async def close(self) -> None: ...


@runtime_checkable
class ShardBackend(Backend, Protocol):
    """A backend whose replicas can write shards themselves (replicas.shards.sink)."""

    def shares_folder(self, out: Store) -> bool:
        """Whether the replicas can write the folder `out`."""

    async def replicas(self) -> int: ...

    async def run_shard(self, job: dict[str, Any]) -> dict[str, Any]: ...


class HandleBackend:
    """Through `CaptureClient` (the Serve handle). The client's own retries are off: the
    pipeline retries, so that each retry is counted and bounded in one place."""

    def __init__(self, app: str = "capserve", address: str | None = None, handle: Any = None) -> None:
        from provider.client import CaptureClient

        # by_reference "auto": a large result comes straight from the replica's object in Ray's
        # object store, so the Router never re-serializes activation payloads
        self._client = CaptureClient(app, address, retries=0, by_reference="auto", handle=handle)
        self.description = f"serve app {app!r}" + (f" at {address}" if address else "")
        self._app = app

    def connect(self) -> None:
        self._client.info()  # connects in this (the main) thread
        self._client.close()  # its background loop is not needed: the pipeline awaits the async API

    async def info(self) -> ModelInfo:
        return await self._client.ainfo()

    async def run(self, request: dict[str, Any], prompt_only: bool) -> GenerateResult:
        if prompt_only:
            return await self._client.acapture(request)
        return await self._client.agenerate(request)

    # ------------------------------------------------------------ replica-side sinks (provider.dataset.remote)

    def shares_folder(self, out: Store) -> bool:
        """Whether the replicas can write `out`: a cluster filesystem (s3://...: the same URL
        names the same storage on every node), or a node-local one (a folder, `local://`) when
        every live node of the cluster is this process's node. Never `memory://` (per process)."""
        import ray

        if out.reach != "node":
            return out.reach == "cluster"
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        return nodes == [ray.get_runtime_context().get_node_id()]

    async def replicas(self) -> int:
        """How many EngineReplicas the app has running (at least 1)."""
        from ray import serve

        def count() -> int:
            app = serve.status().applications.get(self._app)
            deployment = app.deployments.get("EngineReplica") if app is not None else None
            states = deployment.replica_states if deployment is not None else {}
            return sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")

        return max(1, await asyncio.to_thread(count))

    async def run_shard(self, job: dict[str, Any]) -> dict[str, Any]:
        """`Router.capture_shard`: a replica captures the job's lines and writes their shard."""
        handle = await self._client._ahandle()
        response = handle.capture_shard.remote(job)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise

    def retry_delay(self, exc: BaseException) -> float | None:
        from provider._serve import classify

        advice = classify(exc)
        return None if advice.kind == "no" else (advice.retry_after or 0.0)

    async def close(self) -> None:
        self._client.close()


class HttpRetryable(RuntimeError):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class HttpBackend:
    """`POST /v1/capture` or `/v1/generate` with `?format=safetensors` (binary arrays, no
    base64); `GET /v1/info`. `api_key` is sent as a bearer token."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0, connections: int = 64) -> None:
        self.url = url.rstrip("/")
        self.description = f"HTTP {self.url}"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout_s = timeout_s
        self._connections = connections
        self._client: Any = None

    def connect(self) -> None:
        pass  # the async client is made inside the event loop it will run on

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            limits = httpx.Limits(max_connections=self._connections, max_keepalive_connections=self._connections)
            self._client = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=self._timeout_s, limits=limits)
        return self._client

    async def info(self) -> ModelInfo:
        response = await self._http().get("/v1/info")
        _raise_for_status(response)
        return ModelInfo.model_validate(response.json())

    async def run(self, request: dict[str, Any], prompt_only: bool) -> GenerateResult:
        path = "/v1/capture" if prompt_only else "/v1/generate"
        response = await self._http().post(path, json=request, params={"format": "safetensors"})
        _raise_for_status(response)
        return result_from_safetensors(response.content)

    def retry_delay(self, exc: BaseException) -> float | None:
        import httpx

        if isinstance(exc, HttpRetryable):
            return exc.retry_after
        if isinstance(exc, httpx.TransportError):  # refused, reset, timed out: the proxy or its node
            return 1.0
        return None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def result_from_safetensors(body: bytes) -> GenerateResult:
    """A GenerateResult from deploy/http.py's safetensors response (fields in the metadata)."""
    from provider.dataset.shards import tensors_from_buffer

    tensors, metadata = tensors_from_buffer(body)
    fields = json.loads(metadata["capserve"])
    logits = tensors.pop("logits", None)
    return GenerateResult.model_validate({**fields, "activations": tensors, "logits": logits})


def _raise_for_status(response: Any) -> None:
    if response.status_code < 400:
        return
    try:
        error = response.json()["error"]
        kind, message = error["type"], error["message"]
    except (ValueError, KeyError, TypeError):  # not capserve's JSON error body (a proxy's page)
        kind, message = "unknown", response.text[:500]
    status = response.status_code
    if status == 422:
        raise InvalidRequestError(message)
    if status == 401:
        raise PermissionError(f"HTTP 401: {message}; pass --api-key (or set CAPSERVE_API_KEY)")
    if status in (502, 503, 504):
        retry_after = response.headers.get("retry-after", "1")
        raise HttpRetryable(f"HTTP {status} {kind}: {message}", float(retry_after) if retry_after.isdigit() else 1.0)
    if kind == "capture_failed":
        raise CaptureFailedError(message)
    raise RuntimeError(f"HTTP {status} {kind}: {message}")
