"""Deadlines in the router, with fake replica pools that hang or crash-loop (no Ray).

Every scenario also checks that the request gave back what it held: its admission-queue slot,
its gate turn and its ledger charge. On the old router (no deadline) each of these requests
waited forever; the `bounded` guard turns that into a failure instead of a hung test run.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any

import pytest

from deploy.router import Router
from replicas.api import GenerateRequest
from replicas.api.errors import DeadlineExceededError
from tests.test_router import CAPTURE, FakePool, FakeSlot, echo

GUARD_S = 10.0  # a test that takes longer than this has hung: the deadline did not act


def bounded(coro: Any) -> Any:
    async def guarded() -> Any:
        return await asyncio.wait_for(coro, GUARD_S)

    return asyncio.run(guarded())


class Hangs:
    """Replicas in `hung` never answer; a cancelled call is recorded (Serve would abort it)."""

    def __init__(self, *hung: str) -> None:
        self.hung = set(hung)
        self.cancelled: list[str] = []

    async def __call__(self, replica: str, request: GenerateRequest) -> str:
        if replica not in self.hung:
            return await echo(replica, request)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(replica)
            raise
        raise AssertionError("unreachable")


async def assert_nothing_held(router: Router) -> None:
    stats = await router.stats()
    assert (stats["queued"], stats["replicas"]) == (0, {})
    assert router._gate.placing == 0  # no placing turn left behind either


def routing(request_s: float, attempt_s: float | None = None) -> dict[str, Any]:
    return {"routing": {"request_timeout_s": request_s, "attempt_timeout_s": attempt_s}}


def test_a_hung_replica_is_cancelled_there_and_its_requests_retried_on_another():
    hangs = Hangs("a")

    async def main() -> None:
        pool = FakePool(["a", "b"], hangs)
        router = Router(pool, routing(5.0, 0.2))
        started = time.monotonic()
        results = await asyncio.gather(*(router.generate({"prompt": f"p{i}"}) for i in range(10)))
        assert results == [f"b:p{i}" for i in range(10)]
        assert time.monotonic() - started < 2.0  # one attempt timeout, not the request deadline
        sent_to_a = [r for r, _ in pool.calls if r == "a"]
        assert sent_to_a and hangs.cancelled == sent_to_a  # every call on the hung replica was cancelled
        await assert_nothing_held(router)

    bounded(main())


def test_past_the_deadline_a_request_fails_clearly_and_is_cancelled_on_its_replica():
    hangs = Hangs("a", "b")

    async def main() -> None:
        pool = FakePool(["a", "b"], hangs)
        router = Router(pool, routing(0.3))  # attempt timeout = half: one retry, then the deadline
        with pytest.raises(DeadlineExceededError) as info:
            await router.generate({"prompt": "x"})
        message = str(info.value)
        assert "no result within routing.request_timeout_s=0.3 s" in message
        assert "running on replica" in message and "attempt 2" in message and "cancelled" in message
        assert sorted(hangs.cancelled) == ["a", "b"]  # both attempts were aborted where they ran
        await assert_nothing_held(router)

    bounded(main())


def test_waiting_for_a_replica_while_replicas_crash_loop_ends_at_the_deadline():
    async def main() -> None:
        pool = FakePool(["a"], echo)
        pool.open.clear()  # choose_replica never finds a replica: they keep dying and restarting
        router = Router(pool, {**routing(0.3), "max_queued_requests": 4})
        outcomes = await asyncio.gather(
            router.generate({"prompt": "first"}),  # inside choose_replica
            router.capture({"prompt": "second", "capture": CAPTURE}),  # behind it, at the gate
            return_exceptions=True,
        )
        for outcome in outcomes:
            assert isinstance(outcome, DeadlineExceededError), outcome
            assert "waiting for a replica slot" in str(outcome)
        assert pool.calls == []
        await assert_nothing_held(router)
        pool.open.set()  # replicas are back: the router serves again, nothing leaked
        assert await router.generate({"prompt": "after"}) == "a:after"

    bounded(main())


def test_a_batch_shares_one_deadline_and_gives_back_every_slot():
    hangs = Hangs("a", "b")

    async def main() -> None:
        pool = FakePool(["a", "b"], hangs)
        router = Router(pool, {**routing(0.3, 0.3), "max_queued_requests": 8})
        with pytest.raises(DeadlineExceededError, match="routing.request_timeout_s=0.3"):
            await router.capture_batch([{"prompt": f"p{i}", "capture": CAPTURE} for i in range(8)])
        assert len(hangs.cancelled) == len(pool.calls) > 0
        await assert_nothing_held(router)

    bounded(main())


def test_a_router_whose_replicas_never_report_info_fails_at_the_deadline():
    class NoInfo(FakePool):
        async def call_any(self, method: str, *args: Any) -> Any:
            await asyncio.Event().wait()  # no replica ever came up

    async def main() -> None:
        router = Router(NoInfo(["a"], echo), routing(0.2))
        with pytest.raises(DeadlineExceededError, match="report the model's info"):
            await router.info()
        with pytest.raises(DeadlineExceededError):
            await router.generate({"prompt": "x"})
        await assert_nothing_held(router)

    bounded(main())


def test_an_attempt_that_ends_in_time_is_not_cut_short():
    async def slow(replica: str, request: GenerateRequest) -> str:
        await asyncio.sleep(0.15)
        return replica

    async def main() -> None:
        pool = FakePool(["a"], slow)
        router = Router(pool, routing(2.0, 0.5))
        assert await router.generate({"prompt": "x"}) == "a"
        assert len(pool.calls) == 1

    bounded(main())


def test_a_timed_out_attempt_is_retried_on_the_replica_that_did_not_hang():
    """Serve's FIFO may hand the retry the hung replica again; the router gives that slot back."""

    class FirstOnA(FakePool):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.reservations = 0

        @asynccontextmanager
        async def reserve(self, method: str, hint: Any):
            self.reservations += 1
            ranked = hint.ledger.rank(self.replicas, hint.avoid)
            yield FakeSlot(self, "a" if self.reservations <= 2 else ranked[0])

    hangs = Hangs("a")

    async def main() -> None:
        pool = FirstOnA(["a", "b"], hangs)
        router = Router(pool, routing(5.0, 0.1))
        assert await router.generate({"prompt": "x"}) == "b:x"
        assert [r for r, _ in pool.calls] == ["a", "b"] and hangs.cancelled == ["a"]
        await assert_nothing_held(router)

    bounded(main())


class Tally:
    """Stands in for a ray.serve.metrics Counter or Gauge (the Serve test scrapes the real ones)."""

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, value: float = 1.0) -> None:
        self.value += value

    def set(self, value: float) -> None:
        self.value = value


def test_deadline_misses_are_counted_once_per_request_or_batch_and_the_queue_is_sampled_at_health_checks():
    hangs = Hangs("a", "b")

    async def main() -> None:
        pool = FakePool(["a", "b"], hangs)
        router = Router(pool, {**routing(0.3, 0.3), "max_queued_requests": 8})
        router._metrics.deadline_misses, router._metrics.queued = misses, queued = Tally(), Tally()
        with pytest.raises(DeadlineExceededError):
            await router.generate({"prompt": "x"})
        with pytest.raises(DeadlineExceededError):
            await router.capture_batch([{"prompt": f"p{i}", "capture": CAPTURE} for i in range(3)])
        assert misses.value == 2
        pool.open.clear()  # no replica slot: requests wait in the router's queue
        waiting = [asyncio.ensure_future(router.generate({"prompt": f"w{i}"})) for i in range(3)]
        while (await router.stats())["queued"] < 3:
            await asyncio.sleep(0.01)
        await router.check_health()
        assert queued.value == 3
        await asyncio.gather(*waiting, return_exceptions=True)  # they miss their deadline too
        await router.check_health()
        assert queued.value == 0 and misses.value == 5

    bounded(main())
