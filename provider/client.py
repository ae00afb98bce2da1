"""`CaptureClient`: a typed Python client for the capserve Serve app (its Router's handle).

    from provider import CaptureClient

    client = CaptureClient(app="capserve", address="auto")
    res = client.generate({"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    res = client.capture("The river ran", ["blocks.1.hook_resid_post"], positions="last_prompt")
    res.activations["blocks.1.hook_resid_post"]           # np.ndarray [1, d_model]
    results = client.capture_many(prompts, ["blocks.1.hook_resid_post"], concurrency=64)
    client.info()                                         # ModelInfo
    client.wait_ready(timeout_s=600)                      # block until an engine can serve (ReadyStatus)

Every method has an async twin with an `a` prefix (`agenerate`, `acapture`, `acapture_many`,
`ainfo`) for use inside an event loop; the sync forms run on a private event-loop thread, so
they also work in Jupyter (whose own loop is already running). Results are `GenerateResult`s
with numpy arrays. Backpressure and dead replicas are retried (`retries` times, exponential
backoff); a bad request raises `InvalidRequestError` at once, naming the field. Every call ends
within `timeout_s` (retries included), else it is cancelled (the router and the engine abort it
too) and raises `DeadlineExceededError`; the router has its own deadline
(`routing.request_timeout_s`), so keep `timeout_s` above it.

Waiting for the app: `wait_ready()` / `await_ready()` poll the Router's `ready()` until an engine
can serve (the app may not even exist yet: `serve run` in another terminal); over HTTP,
`wait_ready_http(url)` polls `GET /readyz`.

Connecting: `address` is a Ray cluster address; None uses `RAY_ADDRESS`, else `"auto"` (a running
local cluster; never starts one). A process already connected to Ray (`ray.init(...)`) keeps its
connection. Ray is imported on the first call, not at import.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Coroutine, Iterable
from typing import Any, Literal, TypeVar

from provider._serve import AppConnection, classify, unwrap
from provider.dataset.shards import load_capture  # noqa: F401  (re-exported: what `capserve capture` wrote)
from replicas.api import GenerateRequest, GenerateResult, ModelInfo
from replicas.api.errors import DeadlineExceededError, InvalidRequestError

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 900.0  # above the router's default deadline (600 s) plus backoff between retries
READY_POLL_S = 1.0
NOT_YET = (LookupError, ConnectionError)  # no app (yet), no cluster (yet): keep waiting
Prompt = str | list[int] | list[dict[str, str]]
Request = GenerateRequest | dict[str, Any]


class CaptureClient:
    """Sync and async access to a capserve app; see the module docstring.

    `by_reference`: "auto" (the default) fetches each result of 1 MiB of arrays or more straight
    from the replica's object in Ray's object store (the Router never passes the payload on; arrays
    are read-only zero-copy views on the same node), smaller ones by value; True does so for every
    result, False for none. `handle`: use this app handle instead of looking `app` up (e.g. the
    one `serve.run` returned). `timeout_s`: the most one call may take, retries included (None: no
    limit of its own; the router's deadline still applies).
    """

    def __init__(
        self,
        app: str = "capserve",
        address: str | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 0.5,
        by_reference: bool | Literal["auto"] = "auto",
        handle: Any = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; use a positive number of seconds, or None for no limit")
        if by_reference not in (True, False, "auto"):
            raise ValueError(f"by_reference={by_reference!r}; use True, False or 'auto'")
        self._conn = AppConnection(app, address, handle)
        self.timeout_s = timeout_s
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
        handle = await self._ahandle()
        return await _bounded(handle.info.remote(), self.timeout_s, "info")

    async def await_ready(self, timeout_s: float = 600.0, interval_s: float = READY_POLL_S) -> Any:
        """Wait until the app can serve: its Router answers `ready()` with ready=True. Tolerates an
        app that does not exist yet and a Router still starting. Returns the `ReadyStatus`;
        raises TimeoutError, with the last state seen, after `timeout_s`."""
        return await self._ready_by(time.monotonic() + timeout_s, timeout_s, interval_s)

    async def _ready_by(self, end: float, timeout_s: float, interval_s: float) -> Any:
        last = "no answer yet"
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"app {self.app!r} not ready within timeout_s={timeout_s:g}: {last}")
            try:
                handle = self._conn.connected or await asyncio.to_thread(self._conn.handle)
                status = await _bounded(handle.ready.remote(), min(left, 10.0), "ready")
                if status.ready:
                    return status
                last = status.reason or f"replicas {status.replicas}"
            except Exception as exc:  # not up yet, or a Router restarting: wait; anything else is a bug
                if not isinstance(exc, (*NOT_YET, DeadlineExceededError)) and classify(exc).kind == "no":
                    raise
                last = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            await asyncio.sleep(min(interval_s, max(0.0, end - time.monotonic())))

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

    def wait_ready(self, timeout_s: float = 600.0, interval_s: float = READY_POLL_S) -> Any:
        """Blocking `await_ready`: e.g. after `serve run serve_config.yaml &`, before the first capture."""
        end = time.monotonic() + timeout_s
        while True:  # connect in the caller's thread (ray.init prefers the main thread)
            try:
                self._conn.handle()
                break
            except NOT_YET as exc:
                if time.monotonic() + interval_s > end:
                    raise TimeoutError(f"app {self.app!r} not ready within timeout_s={timeout_s:g}: {exc}") from None
                time.sleep(interval_s)
        return self._sync(self._ready_by(end, timeout_s, interval_s))

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
        timer = asyncio.timeout(self.timeout_s)
        try:
            async with timer:
                return await self._attempts(method, request)
        except TimeoutError:
            if not timer.expired():
                raise
            raise DeadlineExceededError(
                f"{method}: no result within timeout_s={self.timeout_s:g} s (CaptureClient, retries included); "
                "the request was cancelled. Raise timeout_s, or ask for less"
            ) from None

    async def _attempts(self, method: str, request: Request) -> GenerateResult:
        handle = await self._ahandle()
        for attempt in itertools.count():
            kwargs = {"by_reference": self.by_reference} if self.by_reference else {}
            response = getattr(handle, method).remote(request, **kwargs)
            try:
                result = await response
                return result if isinstance(result, GenerateResult) else await result  # a reference
            except asyncio.CancelledError:
                response.cancel()
                raise
            except Exception as exc:
                advice = classify(exc)
                if advice.kind == "no" or attempt >= self.retries:
                    raise _clean(exc) from None
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


async def _bounded(response: Any, timeout_s: float | None, method: str) -> Any:
    """Await a Serve response for at most `timeout_s`; cancel it (on the router too) when late."""
    try:
        async with asyncio.timeout(timeout_s):
            return await response
    except TimeoutError:
        response.cancel()
        raise DeadlineExceededError(f"{method}: no answer within {timeout_s:g} s") from None
    except asyncio.CancelledError:
        response.cancel()
        raise
    except Exception as exc:
        raise _clean(exc) from None


def _clean(exc: BaseException) -> BaseException:
    """capserve's own error without Ray's wrapper (whose text carries the remote traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, DeadlineExceededError) and isinstance(cause, DeadlineExceededError):
        return cause
    return unwrap(exc)


def wait_ready_http(url: str, timeout_s: float = 600.0, interval_s: float = READY_POLL_S, *, transport: Any = None) -> dict[str, Any]:
    """Poll `GET {url}/readyz` until it answers 200; returns its JSON body (a ReadyStatus).
    Connection errors (the proxy not up yet) and 503s are waited out; TimeoutError after
    `timeout_s` names the last answer. /readyz needs no token. `transport`: an httpx transport
    (tests)."""
    import httpx

    end = time.monotonic() + timeout_s
    last = "no answer yet"
    with httpx.Client(base_url=url.rstrip("/"), timeout=min(10.0, timeout_s), transport=transport) as client:
        while True:
            try:
                response = client.get("/readyz")
                if response.status_code == 200:
                    return response.json()
                last = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + interval_s > end:
                raise TimeoutError(f"{url} not ready within timeout_s={timeout_s:g}: {last}")
            time.sleep(interval_s)


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
