"""The replica's side of the worker's arena (`replicas.arena.host`): admission by the blocks a capture
may take (`ArenaBudget`), and the take RPC that brings results and carries read blocks back
(`BatchedTake`), batched across requests that finish together."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from replicas.api.errors import ReplicaUnavailableError


class ArenaBudget:
    """Admits a request whose capture files into the worker's arena once the blocks it may take
    fit beside those of the requests before it (first come, first served), so the worker's arena
    never runs out under a mix of requests and never grows past its limit. A request's blocks come
    back once the worker has them back (`BatchedTake.after_release`)."""

    def __init__(self, capacity: int, block_bytes: int, limit: int):
        self.capacity = capacity
        self.geometry = (capacity, block_bytes, limit)
        self.used = 0
        self.waits = 0  # requests that had to wait
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()
        # called when a request starts to wait: whoever holds results in the arena (a replica's
        # shard sink) can give their blocks back (`replicas.shards.sink.ShardSink.relieve`)
        self.on_wait: list[Callable[[], None]] = []

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, blocks: int) -> None:
        if not blocks:
            return
        if not self._waiting and self.used + blocks <= self.capacity:
            self.used += blocks
            return
        self.waits += 1
        waiter = (blocks, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        for callback in self.on_wait:
            callback()
        try:
            await waiter[1]
        except BaseException:
            if waiter[1].done() and not waiter[1].cancelled():
                self.release(blocks)  # granted as it was cancelled
            else:
                self._waiting.remove(waiter)
                self._grant()  # the next in line may fit now
            raise

    def release(self, blocks: int) -> None:
        if blocks:
            self.used -= blocks
            self._grant()

    def _grant(self) -> None:
        while self._waiting and self.used + self._waiting[0][0] <= self.capacity:
            blocks, future = self._waiting.popleft()
            self.used += blocks
            future.set_result(None)


class BatchedTake:
    """Collects the keys of requests that finished close together into one `capserve_take` RPC
    (every RPC waits for the engine core between two steps, so one per request would stall it),
    and with them the arena blocks whose rows were read since the last one.

    Each RPC waits at most `timeout_s`; its requests then fail with ReplicaUnavailableError (the
    engine core did not answer: another replica should serve them). Calls are numbered: the next
    one tells the worker which earlier ones the replica never got an answer to, so the worker frees
    what they delivered. Blocks of a failed call are kept for the next one."""

    def __init__(self, llm: Any, timeout_s: float = 120.0):
        self.llm = llm
        self.timeout_s = timeout_s
        self.pending: dict[str, asyncio.Future] = {}
        self.released: list[int] = []
        self.callbacks: list[Callable[[], None]] = []  # to run once the worker has `released` back
        self.abandoned: list[int] = []  # calls whose answer never came
        self.calls = itertools.count()
        self.flushing: asyncio.Task | None = None

    def take(self, key: str) -> asyncio.Future:
        """A future of the key's results (it completes even if the awaiting caller is cancelled)."""
        future = asyncio.get_running_loop().create_future()
        self.pending[key] = future
        self._schedule()
        return future

    def release(self, blocks: list[int]) -> None:
        if blocks:
            self.released.extend(blocks)
            self._schedule()  # back promptly, so the arena need not grow

    def after_release(self, callback: Callable[[], None]) -> None:
        """Run callback once the worker has every block released so far back (and has freed what
        abandoned calls delivered); at once when nothing is on its way."""
        if not self.released and not self.abandoned:
            callback()
            return
        self.callbacks.append(callback)
        self._schedule()

    def _schedule(self) -> None:
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let requests finishing in the same output batch join
        while self.pending or self.released or self.callbacks:
            batch, self.pending = self.pending, {}
            released, self.released = self.released, []
            callbacks, self.callbacks = self.callbacks, []
            abandoned, call = list(self.abandoned), next(self.calls)
            try:
                taken = await self._call(list(batch), released, call, abandoned)
            except Exception as exc:
                # the worker may or may not have run it: the next call says to free what it gave
                self.abandoned.append(call)
                self.released[:0] = released
                self.callbacks[:0] = callbacks
                for future in batch.values():
                    if not future.done():
                        future.set_exception(exc)
                if not self.pending:  # blocks alone wait for the next take: a dead engine is not hammered
                    return
                continue
            self.abandoned = [c for c in self.abandoned if c not in abandoned]
            for key, future in batch.items():
                if not future.done():
                    future.set_result(taken.get(key, []))
            for callback in callbacks:
                callback()

    async def _call(self, keys: list[str], released: list[int], call: int, abandoned: list[int]) -> dict[str, Any]:
        args = (keys, released, call, abandoned)
        try:
            # vLLM's own timeout is not honoured by every executor: bound the wait here
            answer = await asyncio.wait_for(self.llm.collective_rpc("capserve_take", timeout=self.timeout_s, args=args), self.timeout_s)
        except asyncio.TimeoutError:
            raise ReplicaUnavailableError(
                f"the engine core did not answer the take RPC within {self.timeout_s:g} s (engine option take_timeout_s)"
            ) from None
        return answer[0]


def taken_results(done: asyncio.Future) -> list[dict[str, Any]]:
    """The results a finished take future holds; none when it failed."""
    return done.result() if not done.cancelled() and done.exception() is None else []
