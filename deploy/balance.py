"""Least-outstanding-cost load balancing, plugged into Ray Serve's request-router extension point.

Why this route. Serve 2.60 offers two public hooks: a custom `RequestRouter` class on the
EngineReplica deployment (`request_router_config`), and `DeploymentHandle.choose_replica()` /
`dispatch()`, which runs that request router, reserves a slot on the replica it picked and tells
the caller which replica that is. The Router deployment uses both:

- `CostLedger` (owned by the Router) holds each replica's outstanding cost: the summed
  token-equivalents (`replicas.plans.cost`) of requests sent to it and not yet finished.
- The Router calls `choose_replica(RouteHint(...))`; the hint is a routing-only argument (it
  never leaves the Router's process: `dispatch` sends the request itself). Serve calls
  `CostAwareRequestRouter.choose_replicas`, which asks the ledger for the live replica with the
  least outstanding cost that has room and is not suspect. "Room" is the Router's per-replica
  limit, set below Serve's max_ongoing_requests so Serve never sees a replica as full (it would
  then probe queue lengths with RPCs and back off). Serve keeps the replica set current (new,
  dead, replaced replicas) and reserves the slot; the ledger keeps the policy.
- The Router charges a request to the replica Serve actually reserved for it (with several
  requests waiting, Serve's FIFO matching may hand a replica ranked for one request to an older
  one) and releases it on completion. It lets at most a few requests be placed at once and no
  more than the replicas have room for (`deploy.router`), so rankings made on the same counts
  cannot pile onto one replica.
- FIFOMixin is needed: calls a Router makes while serving one request (a batch's items, a
  retry) share Serve's internal request id, and exact-id matching would leave all but one
  unmatched.

Why not the alternatives: Ray's default power-of-two router looks at queue lengths only; with
its queue-length cache and rejection/backoff the measured fleet split 54/46 and collapsed under
overload. Per-replica handles would need Serve internals (`ray.serve._private`), which capserve
does not import. A call without a hint (a plain handle on EngineReplica) gets the power-of-two
choice, as Serve's default router would make it on one node.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Collection, Mapping, Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


@dataclass
class _Tally:
    cost: float = 0.0
    requests: int = 0


class CostLedger:
    """Outstanding cost per replica, charged per ticket (one request holding a slot). Thread-safe:
    the Router writes it on its event loop, Serve's request router reads it on the router thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._rng = rng or random.Random()
        self._tally: dict[str, _Tally] = {}
        self._charges: dict[str, tuple[str, float]] = {}  # ticket -> (replica, cost)
        self._suspect_until: dict[str, float] = {}
        self._seen: list[str] = []  # the replica set Serve offered last
        self._capacity: dict[str, int] = {}  # and how many requests each may hold
        self.rankings = 0  # how often Serve's request router asked (stats; proves the plug-in is live)

    def rank(
        self, replicas: Sequence[str], avoid: Collection[str] = (), capacity: Mapping[str, int] | None = None
    ) -> list[str]:
        """Replicas with room (fewer requests than `capacity`), least outstanding cost first, then
        fewest requests, ties at random (so equal replicas share evenly). Replicas to avoid (this
        request failed there) or suspect (a request failed there lately) are left out while any
        other remains: a replica whose engine died fails fast, so it would otherwise look the
        least loaded.

        The ranking charges nothing: Serve's FIFO matching may hand the chosen replica to an
        older waiting request, so a request is charged where it actually got a slot (`confirm`)."""
        with self._lock:
            self.rankings += 1
            self._seen = list(replicas)
            self._capacity = dict(capacity or {})
            now = self._clock()
            trusted = [r for r in replicas if r not in avoid and self._suspect_until.get(r, 0.0) <= now]

            def key(replica: str) -> tuple[float, int, float]:
                tally = self._tally.get(replica, _Tally())
                return (tally.cost, tally.requests, self._rng.random())

            return sorted((r for r in trusted or replicas if self._free(r) > 0), key=key)

    def free_slots(self) -> int | None:
        """Requests the replicas seen last can still take; None before the first ranking."""
        with self._lock:
            return sum(self._free(r) for r in self._seen) if self._seen else None

    def has_alternative(self, avoid: Collection[str]) -> bool:
        """Whether a replica seen in the last ranking is neither avoided nor suspect."""
        with self._lock:
            now = self._clock()
            return any(r not in avoid and self._suspect_until.get(r, 0.0) <= now for r in self._seen)

    def _free(self, replica: str) -> int:
        limit = self._capacity.get(replica, 1 << 30)
        return max(0, limit - self._tally.get(replica, _Tally()).requests)

    def confirm(self, ticket: str, replica: str, cost: float) -> None:
        """The request holds a slot on `replica`: move its charge there."""
        with self._lock:
            self._uncharge(ticket)
            self._charge(ticket, replica, cost)

    def release(self, ticket: str) -> None:
        with self._lock:
            self._uncharge(ticket)

    def suspect(self, replica: str, seconds: float) -> None:
        """Rank `replica` last for a while (it just failed a request; its engine may be dead)."""
        with self._lock:
            self._suspect_until[replica] = self._clock() + seconds

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {r: {"cost": t.cost, "requests": t.requests} for r, t in self._tally.items()}

    def _charge(self, ticket: str, replica: str, cost: float) -> None:
        tally = self._tally.setdefault(replica, _Tally())
        tally.cost += cost
        tally.requests += 1
        self._charges[ticket] = (replica, cost)

    def _uncharge(self, ticket: str) -> None:
        charge = self._charges.pop(ticket, None)
        if charge is None:
            return
        replica, cost = charge
        tally = self._tally[replica]
        tally.requests -= 1
        tally.cost = tally.cost - cost if tally.requests else 0.0  # no float drift when idle
        if not tally.requests:
            del self._tally[replica]  # replicas come and go; keep only those with work


@dataclass(frozen=True)
class RouteHint:
    """The routing-only argument of `choose_replica`: the Router's ledger and whom to avoid."""

    ledger: CostLedger = field(repr=False)
    avoid: frozenset[str] = frozenset()
    slots: int | None = None  # the Router's per-replica limit, below Serve's max_ongoing_requests
    is_capserve_route_hint: ClassVar[bool] = True


def route_hint(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    # Not isinstance: Serve ships the request-router class to the caller by value (cloudpickle),
    # so the class it sees is a copy of this module's, distinct from the one the Router builds.
    return first if getattr(first, "is_capserve_route_hint", False) else None  # type: ignore[return-value]


class CostAwareRequestRouter(FIFOMixin, RequestRouter):
    """Ranks replicas by the Router's ledger; see the module docstring."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # After every rank was tried and all were full, wait (Serve's backoff, configured by
            # request_router_config) instead of re-probing in a tight loop.
            pending_request.routing_context.should_backoff = True
        hint = route_hint(pending_request)
        if hint is None:
            return _power_of_two(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        capacity = {replica: min(hint.slots or r.max_ongoing_requests, r.max_ongoing_requests) for replica, r in by_id.items()}
        ranked = hint.ledger.rank(list(by_id), hint.avoid, capacity)
        # Only the best: every assignment comes from a fresh ranking, never from a stale
        # runner-up. None has room: [] makes Serve wait (its backoff) and ask again.
        return [[by_id[ranked[0]]]] if ranked else []


def _power_of_two(candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
    """Serve's default choice: two at random, the shorter queue wins (Serve compares them)."""
    return [random.sample(candidates, min(2, len(candidates)))] if candidates else []


def router_class_path() -> str:
    return f"{__name__}:{CostAwareRequestRouter.__name__}"
