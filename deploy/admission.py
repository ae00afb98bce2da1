"""The Router's waiting room: the bounded admission queue, the placing gate, and deadlines.

- `AdmissionQueue` counts requests the router accepted that no replica has accepted yet; past
  `max_queued_requests` the next one is refused at once (`BackPressureError`, HTTP 503).
- `Gate` lets waiting requests ask Serve for a replica slot a few at a time, first come first
  served, and never more than the replicas have room for.
- `Deadline` is one request's (or one batch's) time budget; `within(deadline)` cancels what
  runs inside it when the budget is spent and raises `DeadlineExceededError` (HTTP 504), saying
  where the request stood.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from replicas.api.errors import BackPressureError, DeadlineExceededError


class AdmissionQueue:
    """Counts requests the router accepted that no replica has accepted yet."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting = 0

    def check(self, n: int = 1) -> None:
        """Raise BackPressureError if `n` more requests would not fit; admits nothing (HTTP uses
        it to refuse before reading a body)."""
        if self.waiting + n > self.limit:
            raise BackPressureError(
                f"the router's queue is full: {self.waiting} requests wait for a replica "
                f"(max_queued_requests={self.limit}); retry later, or add replicas"
            )

    def admit(self, n: int = 1) -> None:
        self.check(n)
        self.waiting += n

    def leave(self) -> None:
        self.waiting -= 1


class Gate:
    """Requests wait here, first come first served, for a free replica slot.

    At most `max_placing` requests are being placed (asking Serve for a slot) at once, and never
    more than the replicas have room for. So Serve's routing loop never holds requests that
    cannot be placed (it would re-poll the full replicas, and notice a freed slot only after its
    next backoff), and rankings made on the same counts cannot pile onto one replica. A finished
    request and a placed one each wake the next waiter."""

    def __init__(self, free_slots: Callable[[], int | None], max_placing: int) -> None:
        self._free_slots = free_slots
        self._max_placing = max_placing
        self.placing = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def _may_place(self) -> bool:
        if self.placing >= self._max_placing:
            return False
        free = self._free_slots()
        return self.placing == 0 if free is None else self.placing < free  # None: nothing known yet

    async def enter(self) -> None:
        """Return when this request may ask Serve for a slot; call `placed()` once it has one."""
        if not self._waiters and self._may_place():
            self.placing += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.placed()  # it was our turn; hand it on
            raise

    def placed(self) -> None:
        self.placing -= 1
        self.wake()

    def wake(self) -> None:
        while self._waiters and self._may_place():
            turn = self._waiters.popleft()
            if not turn.done():
                self.placing += 1
                turn.set_result(None)


class Deadline:
    """A time budget on the running loop's clock; `stage` says where the request stands (for
    the error message)."""

    def __init__(self, seconds: float, setting: str = "routing.request_timeout_s",
                 missed: Callable[[], None] | None = None) -> None:
        self.seconds = seconds
        self.setting = setting
        self.at = asyncio.get_running_loop().time() + seconds
        self.stage = "starting"
        self.missed = missed  # called when `within` gives up on it (the Router counts misses)

    def left(self) -> float:
        return self.at - asyncio.get_running_loop().time()

    def cap(self, seconds: float) -> float | None:
        """The loop time `seconds` from now, or None when the deadline comes first (then the
        deadline's own timer cancels, and the caller need not set a second one)."""
        end = asyncio.get_running_loop().time() + seconds
        return end if end < self.at else None


@asynccontextmanager
async def within(deadline: Deadline) -> AsyncIterator[Deadline]:
    """Run the block under `deadline`: when it passes, the block is cancelled (its `finally`s and
    cancellation handlers give back queue slots and abort replica work) and DeadlineExceededError
    is raised instead of a bare TimeoutError."""
    timer = asyncio.timeout_at(deadline.at)
    try:
        async with timer:
            yield deadline
    except TimeoutError:
        if not timer.expired():
            raise  # some other timeout inside the block: not ours to rename
        if deadline.missed is not None:
            deadline.missed()
        raise DeadlineExceededError(
            f"no result within {deadline.setting}={deadline.seconds:g} s; the request was {deadline.stage} "
            "and has been cancelled. Ask for less (max_tokens, capture size), or raise the deadline"
        ) from None


class AttemptTimedOut(Exception):
    """An attempt ran past routing.attempt_timeout_s; it was cancelled on its replica."""


class AttemptFailed(Exception):
    """One attempt failed in a way another replica may not (the replica died, hung or went away):
    the Router retries the request elsewhere."""

    def __init__(self, replica: str, cause: BaseException) -> None:
        super().__init__(replica)
        self.replica = replica
        self.cause = cause
