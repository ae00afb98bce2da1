"""Readiness (is an engine up?) apart from liveness (is the router up?), without a cluster:
the probe's cache, the mapping of Serve's status, `Router.ready()`, and the client's waits."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from deploy.readiness import FleetStates, ReadinessProbe, ReadyStatus, build_status, serve_fleet_states
from deploy.router import Router
from provider.client import CaptureClient, wait_ready_http
from tests.test_router import FakePool, echo


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def states(**replicas: int) -> FleetStates:
    return FleetStates(app_status="RUNNING" if replicas.get("RUNNING") else "DEPLOYING", replica_status="HEALTHY", replicas=replicas)


def test_the_probe_asks_serve_at_most_once_per_ttl_however_many_callers():
    clock = Clock()
    answers = [states(STARTING=2), states(RUNNING=1, STARTING=1)]

    async def fetch() -> FleetStates:
        await asyncio.sleep(0.01)
        return answers[0]

    async def main() -> None:
        probe = ReadinessProbe(fetch, ttl_s=1.0, clock=clock)
        first = await asyncio.gather(*(probe.status() for _ in range(20)))
        assert probe.fetches == 1 and all(s == first[0] for s in first)  # one fetch shared by all
        assert first[0].ready is False and first[0].replicas == {"STARTING": 2}
        clock.now += 0.5
        assert (await probe.status()).ready is False and probe.fetches == 1  # cached
        answers.pop(0)
        clock.now += 0.6
        fresh = await probe.status(queued=3)
        assert probe.fetches == 2 and fresh.ready is True and fresh.serving == 1 and fresh.queued == 3

    asyncio.run(main())


def test_a_controller_that_does_not_answer_means_not_ready_and_says_no_more():
    async def fails() -> FleetStates:
        raise ConnectionError("GCS at 10.0.0.7:6379 (pid=991) unreachable")

    async def hangs() -> FleetStates:
        await asyncio.Event().wait()
        raise AssertionError

    async def main() -> None:
        for fetch in (fails, hangs):
            status = await ReadinessProbe(fetch, timeout_s=0.05).status()
            assert status.ready is False and status.app_status == "UNKNOWN"
            assert "controller did not answer" in status.reason
            assert "10.0.0.7" not in status.model_dump_json() and "991" not in status.model_dump_json()

    asyncio.run(main())


def test_status_reasons_and_the_several_routers_warning():
    starting = build_status(states(STARTING=2), "", 0, 0.0)
    assert (starting.ready, starting.serving, starting.reason) == (False, 0, "engines are starting; no EngineReplica is RUNNING yet")
    failed = build_status(FleetStates(app_status="DEPLOY_FAILED", replica_status="DEPLOY_FAILED", replicas={}), "", 0, 0.0)
    assert failed.ready is False and "DEPLOY_FAILED" in failed.reason
    two = build_status(FleetStates(app_status="RUNNING", replica_status="HEALTHY", replicas={"RUNNING": 2}, routers=2), "", 0, 0.0)
    assert two.ready is True and "2 Router replicas" in two.reason


def test_serve_status_is_read_into_counts_by_state(monkeypatch):
    from ray import serve
    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
    from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    def deployment(**counts: int) -> DeploymentStatusOverview:
        return DeploymentStatusOverview(
            status=DeploymentStatus.UPDATING, status_trigger=DeploymentStatusTrigger.CONFIG_UPDATE_STARTED,
            replica_states={ReplicaState(k): v for k, v in counts.items()}, message="Traceback ... pid=1 ip=10.0.0.1",
        )

    app = ApplicationStatusOverview(
        status=ApplicationStatus.DEPLOYING, message="", last_deployed_time_s=0.0,
        deployments={"EngineReplica": deployment(RUNNING=1, STARTING=1, STOPPING=0), "Router": deployment(RUNNING=1)},
    )
    monkeypatch.setattr(serve, "status", lambda: ServeStatus(applications={"capserve": app}))
    got = serve_fleet_states("capserve", "EngineReplica", "Router")
    assert got == FleetStates(app_status="DEPLOYING", replica_status="UPDATING", replicas={"RUNNING": 1, "STARTING": 1}, routers=1)
    assert "Traceback" not in got.model_dump_json()  # Serve's messages are never passed on
    assert serve_fleet_states("other", "EngineReplica", None).app_status == "NOT_STARTED"


def test_router_ready_reports_the_pool_and_its_queue():
    async def main() -> None:
        router = Router(FakePool(["a", "b"], echo), {})
        status = await router.ready()
        assert isinstance(status, ReadyStatus) and status.ready and status.serving == 2 and status.queued == 0

    asyncio.run(main())


# ---------------------------------------------------------------- the client waits


class FakeReadyApp:
    """A Router handle whose `ready()` answers from a script."""

    def __init__(self, script: list[ReadyStatus]) -> None:
        self.script = script
        self.asked = 0
        self.ready = SimpleNamespace(remote=self._remote)

    def _remote(self) -> Any:
        async def answer() -> ReadyStatus:
            self.asked += 1
            return self.script[min(self.asked, len(self.script)) - 1]

        return _Response(answer())


class _Response:
    def __init__(self, coro: Any) -> None:
        self._coro = coro

    def __await__(self) -> Any:
        return self._coro.__await__()

    def cancel(self) -> None:
        pass


class LateApp:
    """An AppConnection whose app does not exist for the first `misses` lookups."""

    def __init__(self, handle: Any, misses: int) -> None:
        self.app, self._handle, self.misses, self.connected = "capserve", handle, misses, None

    def handle(self) -> Any:
        if self.misses:
            self.misses -= 1
            raise LookupError("no Serve application named 'capserve'")
        self.connected = self._handle
        return self._handle


def test_wait_ready_waits_for_the_app_to_exist_and_an_engine_to_run():
    starting = build_status(states(STARTING=2), "", 0, 0.0)
    running = build_status(states(RUNNING=1, STARTING=1), "", 0, 0.0)
    app = FakeReadyApp([starting, starting, running])
    client = CaptureClient()
    client._conn = LateApp(app, misses=2)
    status = client.wait_ready(timeout_s=10, interval_s=0.01)
    assert status.ready and status.serving == 1 and app.asked == 3
    client.close()


def test_wait_ready_gives_up_at_its_timeout_naming_the_last_state():
    app = FakeReadyApp([build_status(states(STARTING=2), "", 0, 0.0)])
    client = CaptureClient(handle=app)
    with pytest.raises(TimeoutError, match=r"not ready within timeout_s=0.2: engines are starting"):
        client.wait_ready(timeout_s=0.2, interval_s=0.02)
    client.close()


def test_wait_ready_http_polls_readyz_until_200():
    answers = iter([httpx.ConnectError("refused"), 503, 503, 200])

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/readyz" and "authorization" not in request.headers
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer, json={"ready": answer == 200})

    assert wait_ready_http("http://capserve:8000/", 10, 0.01, transport=httpx.MockTransport(handler)) == {"ready": True}
    never = httpx.MockTransport(lambda request: httpx.Response(503, json={"ready": False, "reason": "engines are starting"}))
    with pytest.raises(TimeoutError, match="HTTP 503.*engines are starting"):
        wait_ready_http("http://capserve:8000", 0.1, 0.02, transport=never)
