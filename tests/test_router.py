"""The Router's logic with a fake replica pool: validation, retries, queue bound, batches, cost.

No Ray here: `ReplicaPool` is the seam the Serve handle sits behind (STYLE #8)."""

from __future__ import annotations

import asyncio
import logging
import random
from contextlib import asynccontextmanager
from typing import Any, Callable

import numpy as np
import pytest

from deploy.balance import RouteHint
from deploy.readiness import FleetStates
from deploy.handle_args import capture_request
from deploy.router import ReplicaPool, ReplicaSlot, Router
from replicas.api import GenerateRequest, GenerateResult, ModelInfo
from replicas.api.errors import BackPressureError, InvalidRequestError, ReplicaUnavailableError

ANSI_RED = "\x1b[31m"


def remote(cause: BaseException, ip: str = "10.4.5.6", pid: int = 4242) -> BaseException:
    """What Ray raises in the caller for an exception a replica raised: a RayTaskError that is also
    an instance of the cause's type, whose text holds the remote traceback, pid and node IP."""
    from ray.exceptions import RayTaskError

    traceback = f"Traceback (most recent call last):\n  File \"replica.py\", line 1\n{ANSI_RED}{type(cause).__name__}: {cause}"
    return RayTaskError("generate", traceback, cause, proctitle="ray::ServeReplica", pid=pid, ip=ip).as_instanceof_cause()

INFO = ModelInfo(
    model="fake", architecture="Fake", n_layers=4, d_model=8, d_vocab=50, max_model_len=512,
    dtype="float32", hook_names=[], armed_kinds=[],
)
CAPTURE = {"hooks": ["blocks.0.hook_resid_post"]}


class FakeSlot(ReplicaSlot):
    def __init__(self, pool: "FakePool", replica: str) -> None:
        self.pool, self.replica = pool, replica

    async def run(self, method: str, *args: Any) -> tuple[Any, Any]:
        request: GenerateRequest = args[0]
        self.pool.calls.append((self.replica, request))
        value = await self.pool.behaviour(self.replica, request)
        return value, f"ref:{value}"


class FakePool(ReplicaPool):
    """Picks replicas with the hint's ledger, like CostAwareRequestRouter does inside Serve."""

    def __init__(self, replicas: list[str], behaviour: Callable[[str, GenerateRequest], Any], capacity: int | None = None) -> None:
        self.replicas = replicas
        self.capacity = {r: capacity for r in replicas} if capacity else None
        self.behaviour = behaviour
        self.calls: list[tuple[str, GenerateRequest]] = []
        self.open = asyncio.Event()
        self.open.set()
        self.reserved = 0

    @asynccontextmanager
    async def reserve(self, method: str, hint: RouteHint):
        await self.open.wait()  # closed = every replica is full
        ranked = hint.ledger.rank(self.replicas, hint.avoid, self.capacity)
        assert ranked, "the router asked for a replica while none had room"
        self.reserved += 1
        yield FakeSlot(self, ranked[0])

    async def call_any(self, method: str, *args: Any) -> Any:
        assert method == "info"
        return INFO

    async def fleet_states(self) -> FleetStates:
        return FleetStates(app_status="RUNNING", replica_status="HEALTHY", replicas={"RUNNING": len(self.replicas)})


async def echo(replica: str, request: GenerateRequest) -> str:
    return f"{replica}:{request.prompt}"


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- validation


def test_bad_requests_fail_before_any_replica_is_called():
    async def main():
        pool = FakePool(["a"], echo)
        router = Router(pool, {})
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            await router.generate({"prompt": "x", "max_tokens": 0})
        with pytest.raises(InvalidRequestError, match="capture.hooks"):
            await router.generate({"prompt": "x", "capture": {"hooks": ["blocks.0.hook_nope"]}})
        with pytest.raises(InvalidRequestError, match="temprature"):
            await router.generate({"prompt": "x", "temprature": 0})
        with pytest.raises(InvalidRequestError, match="expected a JSON object"):
            await router.generate(["not", "a", "dict"])
        with pytest.raises(InvalidRequestError, match=r"max_tokens: 512 .* max_model_len=512; allowed: 1..511"):
            await router.generate({"prompt": "x", "max_tokens": 512})  # no prompt fits beside it
        assert pool.calls == []
        assert (await router.stats())["queued"] == 0

    run(main())


def test_capture_request_runs_the_prompt_only():
    request = capture_request({"prompt": "x", "capture": CAPTURE})
    assert (request.max_tokens, request.temperature, request.capture.positions) == (1, 0.0, "prompt")
    kept = capture_request({"prompt": "x", "max_tokens": 1, "capture": {**CAPTURE, "positions": "last_prompt"}})
    assert kept.capture.positions == "last_prompt"
    model = GenerateRequest.model_validate({"prompt": "x", "capture": CAPTURE})
    assert capture_request(model).capture.positions == "prompt"
    with pytest.raises(InvalidRequestError, match="max_tokens: capture"):
        capture_request({"prompt": "x", "max_tokens": 5, "capture": CAPTURE})
    with pytest.raises(InvalidRequestError, match="capture: capture"):
        capture_request({"prompt": "x"})
    with pytest.raises(InvalidRequestError, match=r"requests\[3\]\.capture"):
        capture_request({"prompt": "x"}, where="requests[3].")


def test_by_reference_auto_sends_large_results_by_reference_and_small_ones_by_value():
    def result(activations: dict[str, np.ndarray], logits: np.ndarray | None = None) -> GenerateResult:
        return GenerateResult(request_id="r", text="", token_ids=[], prompt_token_ids=[],
                              finish_reason="length", choices=[], activations=activations, logits=logits)

    async def sized(replica: str, request: GenerateRequest) -> GenerateResult:
        rows = int(request.prompt)  # 1 MiB at 256 rows x 1024 float32
        if request.logits is not None:
            return result({}, np.zeros((rows, 1024), np.float32))
        return result({"blocks.0.hook_resid_post": np.zeros((rows, 1024), np.float32)})

    async def main():
        router = Router(FakePool(["a"], sized), {})
        small = await router.capture({"prompt": "255", "capture": CAPTURE}, by_reference="auto")
        assert isinstance(small, GenerateResult) and small.activation_bytes == (1 << 20) - 4096
        large = await router.capture({"prompt": "256", "capture": CAPTURE}, by_reference="auto")
        assert isinstance(large, str) and large.startswith("ref:")
        logits = await router.generate({"prompt": "256", "logits": {"positions": "all"}}, by_reference="auto")
        assert isinstance(logits, str) and logits.startswith("ref:")
        batch = await router.capture_batch([{"prompt": n, "capture": CAPTURE} for n in ("1", "300")], by_reference="auto")
        assert isinstance(batch[0], GenerateResult) and isinstance(batch[1], str)
        assert isinstance(await router.capture({"prompt": "300", "capture": CAPTURE}), GenerateResult)  # default: by value
        for wrong in ("yes", 1, None):
            with pytest.raises(InvalidRequestError, match=r"by_reference: expected true, false or 'auto'"):
                await router.capture({"prompt": "1", "capture": CAPTURE}, by_reference=wrong)

    run(main())


# ---------------------------------------------------------------- retries


def test_a_request_whose_replica_dies_is_retried_elsewhere():
    async def dies_on_a(replica: str, request: GenerateRequest) -> str:
        if replica == "a":
            raise ReplicaUnavailableError("engine of a is dead")
        return await echo(replica, request)

    async def main():
        pool = FakePool(["a", "b"], dies_on_a)
        router = Router(pool, {})
        results = await asyncio.gather(*(router.generate({"prompt": f"p{i}"}) for i in range(20)))
        assert results == [f"b:p{i}" for i in range(20)]
        assert any(replica == "a" for replica, _ in pool.calls)  # some were sent there first
        assert await router.generate({"prompt": "q"}, by_reference=True) == "ref:b:q"
        stats = await router.stats()
        assert (stats["queued"], stats["max_queued_requests"], stats["replicas"]) == (0, 1024, {})
        assert stats["rankings"] >= 21

    run(main())


def test_when_every_attempt_fails_the_error_lists_each_cause():
    async def always_dies(replica: str, request: GenerateRequest) -> str:
        raise ReplicaUnavailableError(f"{replica} lost its engine")

    async def main():
        pool = FakePool(["a", "b", "c", "d"], always_dies)
        router = Router(pool, {"routing": {"max_attempts": 3}})
        with pytest.raises(ReplicaUnavailableError, match="failed on 3 replicas") as info:
            await router.generate({"prompt": "x"})
        tried = [replica for replica, _ in pool.calls]
        assert len(tried) == 3 and len(set(tried)) == 3  # a different replica each time
        for replica in tried:
            assert f"{replica} lost its engine" in str(info.value)

    run(main())


def test_a_slot_on_a_replica_the_request_failed_on_is_given_back():
    class StubbornPool(FakePool):
        """Serve's FIFO may hand a request a replica ranked for another one: here, always "a"
        for the first three reservations."""

        def __init__(self, *args):
            super().__init__(*args)
            self.reservations = 0

        @asynccontextmanager
        async def reserve(self, method, hint):
            self.reservations += 1
            hint.ledger.rank(self.replicas, hint.avoid)
            yield FakeSlot(self, "a" if self.reservations <= 3 else "b")

    async def dies_on_a(replica: str, request: GenerateRequest) -> str:
        if replica == "a":
            raise ReplicaUnavailableError("dead")
        return replica

    async def main():
        pool = StubbornPool(["a", "b"], dies_on_a)
        assert await Router(pool, {"routing": {"max_attempts": 2}}).generate({"prompt": "x"}) == "b"
        assert [replica for replica, _ in pool.calls] == ["a", "b"]  # a's later slots went back unused

    run(main())


def test_a_bad_request_reported_by_a_replica_is_not_retried():
    async def rejects(replica: str, request: GenerateRequest) -> str:
        raise InvalidRequestError("capture.hooks[0]: layer 9 is out of range")

    async def main():
        pool = FakePool(["a", "b"], rejects)
        with pytest.raises(InvalidRequestError, match="layer 9"):
            await Router(pool, {}).generate({"prompt": "x"})
        assert len(pool.calls) == 1

    run(main())


def test_a_replica_error_reaches_the_caller_as_its_own_exception_without_ray_s_wrapper():
    async def rejects(replica: str, request: GenerateRequest) -> str:
        raise remote(InvalidRequestError("capture.hooks[0]: layer 9 is out of range (0..3)"))

    async def main():
        with pytest.raises(InvalidRequestError) as info:
            await Router(FakePool(["a"], rejects), {}).generate({"prompt": "x"})
        assert type(info.value) is InvalidRequestError  # not RayTaskError(InvalidRequestError)
        assert str(info.value) == "capture.hooks[0]: layer 9 is out of range (0..3)"

    run(main())


def test_retry_causes_name_each_replica_without_tracebacks_pids_or_addresses():
    async def dies(replica: str, request: GenerateRequest) -> str:
        if replica == "a":
            raise remote(ReplicaUnavailableError("replica a: engine is dead"), ip="10.9.8.7", pid=31337)
        raise RuntimeError("The actor died unexpectedly before finishing this task.\n\tpid: 31337\n\tip: 10.9.8.7")

    async def main():
        pool = FakePool(["a", "b"], dies)
        pool.retryable = (ReplicaUnavailableError, RuntimeError)  # as Ray's actor errors are for HandlePool
        with pytest.raises(ReplicaUnavailableError) as info:
            await Router(pool, {"routing": {"max_attempts": 2}}).generate({"prompt": "x"})
        message = str(info.value)
        assert "replica a: ReplicaUnavailableError: replica a: engine is dead" in message
        assert "replica b: RuntimeError: The actor died unexpectedly before finishing this task." in message
        for leak in ("Traceback", "10.9.8.7", "31337", "\x1b["):
            assert leak not in message

    run(main())


def test_client_errors_raised_to_handle_callers_are_logged_as_one_warning_line(caplog):
    Router(FakePool(["a"], echo), {})  # installs the filter on Serve's logger in this process
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(caplog.handler)  # Serve's replica logger does not propagate
    try:
        for exc in (remote(InvalidRequestError("capture.hooks[0]: layer 9 is out of range")), RuntimeError("a real bug")):
            try:
                raise exc
            except Exception:
                serve_logger.exception("Request failed.")  # what Serve's replica wrapper does
    finally:
        serve_logger.removeHandler(caplog.handler)
    client, bug = caplog.records[-2:]
    assert (client.levelname, client.exc_info) == ("WARNING", None)
    assert client.getMessage() == "client error (InvalidRequestError): capture.hooks[0]: layer 9 is out of range"
    assert "\n" not in caplog.handler.format(client)  # one line
    assert bug.levelname == "ERROR" and bug.exc_info is not None  # real failures keep their traceback


# ---------------------------------------------------------------- backpressure


def test_the_queue_is_bounded_and_drains():
    async def main():
        pool = FakePool(["a"], echo)
        pool.open.clear()  # replicas full: requests wait in the router
        router = Router(pool, {"max_queued_requests": 2})
        waiting = [asyncio.ensure_future(router.generate({"prompt": f"w{i}"})) for i in range(2)]
        await asyncio.sleep(0.01)
        assert (await router.stats())["queued"] == 2
        with pytest.raises(BackPressureError, match="max_queued_requests=2"):
            await router.generate({"prompt": "over"})
        with pytest.raises(BackPressureError):
            await router.capture_batch([{"prompt": "b", "capture": CAPTURE}])
        pool.open.set()
        assert await asyncio.gather(*waiting) == ["a:w0", "a:w1"]
        assert (await router.stats())["queued"] == 0
        assert await router.generate({"prompt": "after"}) == "a:after"  # accepted again

    run(main())


def test_a_batch_larger_than_the_queue_is_a_client_error_not_a_503_forever():
    async def main():
        pool = FakePool(["a"], echo)
        router = Router(pool, {"max_queued_requests": 4, "max_batch_size": 100})
        with pytest.raises(InvalidRequestError, match=r"requests: 5 requests exceed max_queued_requests=4.*batches of at most 4"):
            await router.capture_batch([{"prompt": f"p{i}", "capture": CAPTURE} for i in range(5)])
        assert pool.calls == [] and (await router.stats())["queued"] == 0
        assert len(await router.capture_batch([{"prompt": f"p{i}", "capture": CAPTURE} for i in range(4)])) == 4

    run(main())


def test_a_cancelled_request_leaves_the_queue_and_the_ledger():
    async def main():
        pool = FakePool(["a"], echo)
        pool.open.clear()
        router = Router(pool, {"max_queued_requests": 1})
        task = asyncio.ensure_future(router.generate({"prompt": "x"}))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await router.stats()
        assert (stats["queued"], stats["replicas"]) == (0, {})

    run(main())


def test_requests_wait_in_the_router_until_a_replica_has_room():
    release = asyncio.Event()

    async def held(replica: str, request: GenerateRequest) -> str:
        await release.wait()
        return replica

    async def main():
        pool = FakePool(["a", "b"], held, capacity=3)
        router = Router(pool, {"max_queued_requests": 10})
        tasks = [asyncio.ensure_future(router.generate({"prompt": f"p{i}"})) for i in range(10)]
        await asyncio.sleep(0.05)
        assert pool.reserved == 6  # 2 replicas x 3 slots; the other 4 wait in the router
        assert (await router.stats())["queued"] == 4
        assert {r: v["requests"] for r, v in (await router.stats())["replicas"].items()} == {"a": 3, "b": 3}
        release.set()
        results = await asyncio.gather(*tasks)
        assert set(results) == {"a", "b"} and len(results) == 10
        assert pool.reserved == 10 and (await router.stats())["queued"] == 0

    run(main())


# ---------------------------------------------------------------- batches and balance


def test_capture_batch_scatters_and_gathers_in_input_order():
    async def jitter(replica: str, request: GenerateRequest) -> str:
        await asyncio.sleep(random.random() / 100)
        return f"{replica}:{request.prompt}"

    async def main():
        pool = FakePool(["a", "b"], jitter)
        router = Router(pool, {})
        results = await router.capture_batch([{"prompt": f"p{i}", "capture": CAPTURE} for i in range(40)])
        assert [r.split(":")[1] for r in results] == [f"p{i}" for i in range(40)]
        assert {r.split(":")[0] for r in results} == {"a", "b"}
        assert all(req.max_tokens == 1 for _, req in pool.calls)
        assert await router.capture_batch([]) == []

    run(main())


def test_capture_batch_names_the_bad_item_and_its_size_limit():
    async def main():
        router = Router(FakePool(["a"], echo), {"max_batch_size": 3})
        with pytest.raises(InvalidRequestError, match=r"requests\[1\]\.capture\.hooks"):
            await router.capture_batch([{"prompt": "ok", "capture": CAPTURE}, {"prompt": "x", "capture": {"hooks": []}}])
        with pytest.raises(InvalidRequestError, match="max_batch_size=3"):
            await router.capture_batch([{"prompt": "x", "capture": CAPTURE}] * 4)
        with pytest.raises(InvalidRequestError, match="expected a list"):
            await router.capture_batch({"prompt": "x"})

    run(main())


def test_one_expensive_request_weighs_as_much_as_many_cheap_ones():
    release = asyncio.Event()

    async def held(replica: str, request: GenerateRequest) -> str:
        await release.wait()
        return replica

    async def main():
        pool = FakePool(["a", "b"], held)
        router = Router(pool, {})
        big = asyncio.ensure_future(router.generate({"prompt": [1] * 300, "max_tokens": 100}))
        await asyncio.sleep(0.01)
        (heavy,) = (await router.stats())["replicas"]
        small = [asyncio.ensure_future(router.generate({"prompt": [1] * 5, "max_tokens": 5})) for _ in range(20)]
        await asyncio.sleep(0.01)
        release.set()
        assert await big == heavy
        assert all(r != heavy for r in await asyncio.gather(*small))  # 20 x 10 < 400

    run(main())
