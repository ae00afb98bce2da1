"""`CaptureClient`: a typed Python client for the capserve Serve app (its Router's handle).

    from provider import CaptureClient

    client = CaptureClient(app="capserve", address="auto")
    res = client.generate({"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    res = client.capture("The river ran", ["blocks.1.hook_resid_post"], positions="last_prompt")
    res.activations["blocks.1.hook_resid_post"]           # np.ndarray [1, d_model]
    results = client.capture_many(prompts, ["blocks.1.hook_resid_post"], concurrency=64)
    client.info()                                         # ModelInfo

Every method has an async twin with an `a` prefix (`agenerate`, `acapture`, `acapture_many`,
`ainfo`) for use inside an event loop; the sync forms run on a private event-loop thread, so
they also work in Jupyter (whose own loop is already running). Results are `GenerateResult`s
with numpy arrays. Backpressure and dead replicas are retried (`retries` times, exponential
backoff); a bad request raises `InvalidRequestError` at once, naming the field.

Connecting: `address` is a Ray cluster address; None uses `RAY_ADDRESS`, else `"auto"` (a running
local cluster; never starts one). A process already connected to Ray (`ray.init(...)`) keeps its
connection. Ray is imported on the first call, not at import.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from provider._serve import AppConnection, classify, unwrap
from provider.shards import load_capture  # noqa: F401  (re-exported: what `capserve capture` wrote)
from replicas.api import GenerateRequest, GenerateResult, ModelInfo
from replicas.errors import InvalidRequestError

T = TypeVar("T")
Prompt = str | list[int] | list[dict[str, str]]
Request = GenerateRequest | dict[str, Any]


class CaptureClient:
    """Sync and async access to a capserve app; see the module docstring.

    `by_reference=True` fetches each result straight from the replica's object in Ray's object
    store (the Router never holds the payload; arrays are read-only zero-copy views on the same
    node): worth it for large captures. `handle`: use this app handle instead of looking
    `app` up (e.g. the one `serve.run` returned).
    """

    def __init__(
        self,
        app: str = "capserve",
        address: str | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 0.5,
        by_reference: bool = False,
        handle: Any = None,
    ) -> None:
        self._conn = AppConnection(app, address, handle)
        self.retries = retries
        self.backoff_s = backoff_s
        self.by_reference = by_reference
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()

    @property
    def app(self) -> str:
        return self._conn.app

    # ------------------------------------------------------------ async API

    async def agenerate(self, request: Request | None = None, /, **fields: Any) -> GenerateResult:
        """Sample, capture and edit as the request says (`GenerateRequest` or its dict; fields
        given as keyword arguments are merged in)."""
        return await self._call("generate", _merge(request, fields))

    async def acapture(
        self,
        prompt: Prompt | Request,
        hooks: list[str] | str | None = None,
        *,
        positions: str | list[int] | None = None,
        reduce: str | None = None,
        dtype: str | None = None,
        **fields: Any,
    ) -> GenerateResult:
        """Prompt activations at `hooks` (one forward pass; positions default to "prompt").
        `prompt` may also be a whole request dict carrying its own `capture`."""
        return await self._call("capture", capture_request(prompt, hooks, positions, reduce, dtype, fields))

    async def acapture_many(
        self,
        prompts: Iterable[Prompt | Request],
        hooks: list[str] | str | None = None,
        *,
        concurrency: int = 32,
        progress: bool = True,
        positions: str | list[int] | None = None,
        reduce: str | None = None,
        dtype: str | None = None,
        **fields: Any,
    ) -> list[GenerateResult]:
        """`acapture` for every prompt, at most `concurrency` in flight (the Router spreads them
        over the replicas), with a progress bar; results in input order. The first failure
        cancels the rest and is raised with the prompt's index."""
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency}; use at least 1")
        from tqdm.auto import tqdm

        total = len(prompts) if hasattr(prompts, "__len__") else None  # type: ignore[arg-type]
        items = iter(enumerate(prompts))
        results: dict[int, GenerateResult] = {}
        bar = tqdm(total=total, disable=not progress, desc=f"capture ({self.app})", unit="prompt")

        async def worker() -> None:
            for index, prompt in items:  # one shared iterator: each prompt is taken once
                try:
                    request = capture_request(prompt, hooks, positions, reduce, dtype, fields)
                    results[index] = await self._call("capture", request)
                except Exception as exc:
                    raise _at_index(exc, index) from exc
                bar.update(1)

        await self._ahandle()
        workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            bar.close()
        return [results[i] for i in range(len(results))]

    async def ainfo(self) -> ModelInfo:
        """The served model: n_layers, d_model, d_vocab, hook names, max_model_len."""
        return await (await self._ahandle()).info.remote()

    # ------------------------------------------------------------ sync API

    def generate(self, request: Request | None = None, /, **fields: Any) -> GenerateResult:
        """Blocking `agenerate`."""
        return self._sync(self.agenerate(request, **fields))

    def capture(
        self,
        prompt: Prompt | Request,
        hooks: list[str] | str | None = None,
        *,
        positions: str | list[int] | None = None,
        reduce: str | None = None,
        dtype: str | None = None,
        **fields: Any,
    ) -> GenerateResult:
        """Blocking `acapture`."""
        return self._sync(self.acapture(prompt, hooks, positions=positions, reduce=reduce, dtype=dtype, **fields))

    def capture_many(
        self,
        prompts: Iterable[Prompt | Request],
        hooks: list[str] | str | None = None,
        *,
        concurrency: int = 32,
        progress: bool = True,
        positions: str | list[int] | None = None,
        reduce: str | None = None,
        dtype: str | None = None,
        **fields: Any,
    ) -> list[GenerateResult]:
        """Blocking `acapture_many`."""
        return self._sync(
            self.acapture_many(
                prompts,
                hooks,
                concurrency=concurrency,
                progress=progress,
                positions=positions,
                reduce=reduce,
                dtype=dtype,
                **fields,
            )
        )

    def info(self) -> ModelInfo:
        """Blocking `ainfo`."""
        return self._sync(self.ainfo())

    def close(self) -> None:
        """Stop the client's event-loop thread (the Ray connection stays up)."""
        with self._loop_lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)  # type: ignore[union-attr]
                self._loop.close()
                self._loop = self._thread = None

    def __enter__(self) -> CaptureClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    async def _ahandle(self) -> Any:
        # connecting blocks (ray.init, the app lookup): keep it off the event loop
        return self._conn.connected or await asyncio.to_thread(self._conn.handle)

    async def _call(self, method: str, request: Request) -> GenerateResult:
        handle = await self._ahandle()
        for attempt in itertools.count():
            kwargs = {"by_reference": True} if self.by_reference else {}
            response = getattr(handle, method).remote(request, **kwargs)
            try:
                result = await response
                return await result if self.by_reference else result
            except asyncio.CancelledError:
                response.cancel()
                raise
            except Exception as exc:
                advice = classify(exc)
                if advice.kind == "no" or attempt >= self.retries:
                    raise unwrap(exc) from None
                await asyncio.sleep(max(advice.retry_after or 0.0, min(self.backoff_s * 2**attempt, 30.0)))
        raise AssertionError("unreachable")

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        self._conn.handle()  # connect in the caller's thread (ray.init prefers the main thread)
        loop = self._background_loop()
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # KeyboardInterrupt: cancel the requests still in flight
            raise

    def _background_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="capserve-client", daemon=True)
                self._thread.start()
            return self._loop


def capture_request(
    prompt: Prompt | Request,
    hooks: list[str] | str | None,
    positions: str | list[int] | None,
    reduce: str | None,
    dtype: str | None,
    fields: dict[str, Any],
) -> Request:
    """A capture request from a prompt and capture options, or a whole request (options fill in
    a missing `capture`)."""
    spec: dict[str, Any] = {}
    if hooks is not None:
        spec["hooks"] = [hooks] if isinstance(hooks, str) else list(hooks)
    for name, value in (("positions", positions), ("reduce", reduce), ("dtype", dtype)):
        if value is not None:
            spec[name] = value
    if isinstance(prompt, GenerateRequest):
        prompt = prompt.model_dump(exclude_unset=True)
    if isinstance(prompt, dict) and "prompt" in prompt:
        request = {**prompt, **fields}
        if "capture" not in request and spec:
            request["capture"] = spec
    else:
        request = {"prompt": prompt, **fields}
        if spec:
            request["capture"] = spec
    if "hooks" not in (request.get("capture") or {}):
        raise InvalidRequestError("capture.hooks: name the hooks to capture, e.g. ['blocks.0.hook_resid_post']")
    return request


def _merge(request: Request | None, fields: dict[str, Any]) -> Request:
    if request is None:
        return fields
    if not fields:
        return request
    base = request.model_dump(exclude_unset=True) if isinstance(request, GenerateRequest) else dict(request)
    return {**base, **fields}


def _at_index(exc: Exception, index: int) -> Exception:
    cause = unwrap(exc)
    try:
        return type(cause)(f"prompts[{index}]: {cause}")
    except Exception:  # an exception type with a different constructor
        return RuntimeError(f"prompts[{index}]: {cause!r}")
