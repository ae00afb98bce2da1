"""Streaming through the Router: one producer task per streamed request, and its attempts.

`Router.open_stream(request)` returns a `RouterStream`. Its producer task runs what a plain
request runs (validation, admission to the bounded queue, the deadline, cost-aware placing,
retries), all inside that task so the deadline's cancellation never lands in the consumer's code;
the items it gets from the replica reach the consumer through a queue. The consumer (the HTTP
route, or `Router.generate_stream` for handle callers) iterates the stream and closes it when done
or gone, which cancels the producer and, through Serve, the request in the engine.

Retries: an attempt that fails before the replica's first item (a dead or hung replica,
`routing.attempt_timeout_s` waiting for it) is retried on another replica like a plain request;
after the first item has gone to the consumer, a failure ends the stream with
`ReplicaUnavailableError`: the client already holds part of the answer. The attempt timeout
covers the wait for the first item only; the request's deadline (`routing.request_timeout_s`)
covers the whole stream.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

from replicas.api.error_messages import describe, remote_cause
from replicas.api.errors import CaptureFailedError, InvalidRequestError, ReplicaUnavailableError

from deploy.admission import AttemptFailed, AttemptTimedOut, Deadline

_END = object()


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class RouterStream:
    """The consumer's side of one streamed request: `await stream.first()` (raises the request's
    error if it failed before its first item), then `async for item in stream`, then `aclose()`."""

    def __init__(self, produce: Callable[[Any, Any, Callable[[Any], None]], Awaitable[None]], request: Any, options: Any) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()  # unbounded: the engine does not wait for readers either
        self._peeked: Any = _END
        self._done = False
        self._task = asyncio.ensure_future(produce(request, options, self._queue.put_nowait))
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            self._queue.put_nowait(_Raised(asyncio.CancelledError()))
        elif task.exception() is not None:
            self._queue.put_nowait(_Raised(task.exception()))  # type: ignore[arg-type]
        else:
            self._queue.put_nowait(_END)

    async def first(self) -> Any:
        """The first item (kept: iteration starts with it)."""
        if self._peeked is _END:
            self._peeked = await self.__anext__()
        return self._peeked

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        if self._peeked is not _END:
            item, self._peeked = self._peeked, _END
            return item
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, _Raised):
            self._done = True
            raise item.exc
        return item

    async def aclose(self) -> None:
        self._done = True
        if not self._task.done():
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def attempt_error(exc: BaseException, replica: str, retryable: tuple[type[BaseException], ...]) -> BaseException:
    """What an attempt's failure becomes: the replica's own client error (never retried, and
    without Ray's wrapper and its traceback), AttemptFailed (retry elsewhere), or itself."""
    original = remote_cause(exc)
    if isinstance(original, (InvalidRequestError, CaptureFailedError)):
        return original
    if isinstance(exc, retryable):
        return AttemptFailed(replica, exc)
    return exc


async def stream_attempt(
    slot: Any,
    method: str,
    args: tuple[Any, ...],
    deadline: Deadline,
    limit_s: float,
    retryable: tuple[type[BaseException], ...],
    sink: Callable[[Any], None],
) -> None:
    """Stream `method` from the reserved replica into `sink`, until the replica's stream ends."""
    items = slot.stream(method, *args)
    try:
        timer = asyncio.timeout_at(deadline.cap(limit_s))
        try:
            async with timer:
                first = await anext(items)
        except StopAsyncIteration:
            raise AttemptFailed(slot.replica, RuntimeError("the replica's stream ended before its result")) from None
        except Exception as exc:
            if isinstance(exc, TimeoutError) and timer.expired():
                cause = AttemptTimedOut(f"no first token within routing.attempt_timeout_s={limit_s:g} s; cancelled there")
                raise AttemptFailed(slot.replica, cause) from None
            raise attempt_error(exc, slot.replica, retryable) from None
        sink(first)
        deadline.stage = f"streaming from replica {slot.replica}"
        try:
            async for item in items:
                sink(item)
        except Exception as exc:
            error = attempt_error(exc, slot.replica, retryable)
            if isinstance(error, AttemptFailed):
                raise ReplicaUnavailableError(
                    f"replica {slot.replica} failed after the stream began ({describe(exc)}); not retried, since the "
                    "client already has part of the answer: send the request again"
                ) from None
            raise error from None
    finally:
        await items.aclose()
