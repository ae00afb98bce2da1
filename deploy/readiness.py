"""Readiness: can the app serve a request now? (Liveness is `/healthz`: the router process is up.)

Serve marks an EngineReplica RUNNING only after its async constructor returned, and that
constructor starts the engine and reads its ModelInfo; so "at least one EngineReplica RUNNING"
means an engine is up. The counts come from `ray.serve.status()` (one RPC to Serve's
controller), asked at most once per `ttl_s` however many probes arrive, so a load balancer
polling every replica of the proxy costs the controller almost nothing.

What the answer shows is safe for an unauthenticated probe: states and counts, never replica
addresses, pids or Serve's status messages (which can carry a constructor's traceback).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field

RUNNING = "RUNNING"


class FleetStates(BaseModel):
    """What Serve says about the app; `HandlePool.fleet_states` fills it."""

    model_config = ConfigDict(extra="forbid")

    app_status: str = Field(description="Serve's application status: DEPLOYING, RUNNING, UNHEALTHY, DEPLOY_FAILED, ...")
    replica_status: str = Field(description="The EngineReplica deployment's status: UPDATING, HEALTHY, UNHEALTHY, ...")
    replicas: dict[str, int] = Field(description="EngineReplica replicas by state (STARTING, RUNNING, STOPPING, ...).")
    routers: int = Field(1, description="Router replicas running; more than one would split the cost ledger.")


class ReadyStatus(BaseModel):
    """`Router.ready()` and the body of `GET /readyz`."""

    model_config = ConfigDict(extra="forbid")

    ready: bool = Field(description="True when at least one EngineReplica's engine is up.")
    app_status: str
    replica_status: str
    replicas: dict[str, int] = Field(description="EngineReplica replicas by state.")
    serving: int = Field(description="EngineReplica replicas that can take requests now (RUNNING).")
    queued: int = Field(0, description="Requests waiting in the router for a replica slot.")
    checked_s_ago: float = Field(description="Age of the fleet states this answer is built on.")
    reason: str = Field("", description="Why the app is not ready, or a warning when it is.")


Fetch = Callable[[], Awaitable[FleetStates]]


class ReadinessProbe:
    """Caches the fleet states for `ttl_s`; concurrent probes share one fetch."""

    def __init__(self, fetch: Fetch, ttl_s: float = 1.0, timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._cached: tuple[float, FleetStates | None, str] | None = None  # (when, states, error)
        self._inflight: asyncio.Future[None] | None = None
        self.fetches = 0  # how often Serve was asked (tests; proves the cache holds)

    async def status(self, queued: int = 0) -> ReadyStatus:
        if self._cached is None or self._clock() - self._cached[0] > self._ttl_s:
            await self._refresh()
        when, states, error = self._cached  # type: ignore[misc]
        return build_status(states, error, queued, self._clock() - when)

    async def _refresh(self) -> None:
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._fetch_once())
        inflight = self._inflight
        try:
            await asyncio.shield(inflight)  # a probe that gives up does not cancel the others' fetch
        finally:
            if self._inflight is inflight and inflight.done():
                self._inflight = None

    async def _fetch_once(self) -> None:
        self.fetches += 1
        try:
            states = await asyncio.wait_for(self._fetch(), self._timeout_s)
            self._cached = (self._clock(), states, "")
        except Exception as exc:  # the controller is busy or restarting: not ready, say which
            self._cached = (self._clock(), None, f"Serve's controller did not answer the status query ({type(exc).__name__})")


def build_status(states: FleetStates | None, error: str, queued: int, age_s: float) -> ReadyStatus:
    if states is None:
        return ReadyStatus(ready=False, app_status="UNKNOWN", replica_status="UNKNOWN", replicas={}, serving=0,
                           queued=queued, checked_s_ago=round(age_s, 3), reason=error)
    serving = states.replicas.get(RUNNING, 0)
    if serving:
        reason = ""
    elif states.replicas.get("STARTING") or states.replicas.get("UPDATING") or states.replicas.get("RECOVERING"):
        reason = "engines are starting; no EngineReplica is RUNNING yet"
    else:
        reason = f"no EngineReplica is RUNNING (application {states.app_status}, deployment {states.replica_status})"
    if states.routers > 1:
        reason = (reason + "; " if reason else "") + (
            f"{states.routers} Router replicas run, each with its own cost ledger: replicas can be overfilled; run one"
        )
    return ReadyStatus(
        ready=serving > 0, app_status=states.app_status, replica_status=states.replica_status,
        replicas=dict(states.replicas), serving=serving, queued=queued, checked_s_ago=round(age_s, 3), reason=reason,
    )


def serve_fleet_states(app: str, deployment: str, router_deployment: str | None) -> FleetStates:
    """Blocking (one RPC to Serve's controller): run it in a thread."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return FleetStates(app_status="NOT_STARTED", replica_status="UNKNOWN", replicas={})
    engine = status.deployments.get(deployment)
    router = status.deployments.get(router_deployment) if router_deployment else None
    return FleetStates(
        app_status=_name(status.status),
        replica_status=_name(engine.status) if engine else "UNKNOWN",
        replicas={_name(state): n for state, n in (engine.replica_states if engine else {}).items() if n},
        routers=(router.replica_states.get(RUNNING, 0) if router else 1) or 1,
    )


def _name(value: object) -> str:
    return str(getattr(value, "value", value))
