"""Mixed load against the Serve app, with every outcome counted: the reliability suite's and the
soak's engine (`tests/test_reliability.py`, `python -m bench.soak`).

A request ends in exactly one outcome:
- `ok`: a result that the caller's `verify` accepted (the suite checks it against HuggingFace);
- `backpressure`: `BackPressureError` — refused at the door, never accepted;
- `invalid`: `InvalidRequestError` — the mix sends only valid requests, so this is a failure;
- `wrong`: a result that `verify` rejected;
- `lost`: any other error, or no answer before the deadline: the router accepted the request and
  no result came back.
Everything is bounded: a burst is a fixed count, a stream stops at a request count or a deadline,
and every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

KINDS = ("generate", "capture", "steer")
PROMPTS = (
    "The river ran past the old mill",
    "A quiet morning in the harbour town",
    "Seven ships sailed north at dawn",
    "She opened the letter and smiled",
    "Rain fell on the copper roofs",
    "The engine hummed under the floor",
)
CAPTURE_HOOKS = ("blocks.1.hook_resid_post", "blocks.3.hook_attn_out")
STEER_HOOK = "blocks.1.hook_resid_post"  # edited
STEER_CHECK_HOOK = "blocks.3.hook_resid_post"  # captured downstream of the edit
STEER_SCALE = 4.0
OUTCOMES = ("ok", "backpressure", "invalid", "wrong", "lost")

Verify = Callable[[str, dict[str, Any], Any], "str | None"]
"""verify(kind, request, result) -> None when the result is right, else what is wrong."""


def steer_vector(d_model: int) -> np.ndarray:
    """A fixed unit direction, so every steer request (and its reference) edits the same way."""
    v = np.random.default_rng(7).standard_normal(d_model).astype(np.float32)
    return v / np.linalg.norm(v)


@dataclass(frozen=True)
class Mix:
    """Request i of the mix: generate, capture and steer in turn, over a few fixed prompts."""

    d_model: int = 128
    max_tokens: int = 4

    def request(self, i: int) -> tuple[str, dict[str, Any]]:
        kind = KINDS[i % len(KINDS)]
        prompt = PROMPTS[(i // len(KINDS)) % len(PROMPTS)]
        if kind == "capture":
            return kind, {"prompt": prompt, "capture": {"hooks": list(CAPTURE_HOOKS), "positions": "prompt"}}
        request: dict[str, Any] = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True}
        if kind == "steer":
            vector = steer_vector(self.d_model).tolist()
            request["interventions"] = [{"hook": STEER_HOOK, "op": "add", "vector": vector, "scale": STEER_SCALE}]
            request["capture"] = {"hooks": [STEER_CHECK_HOOK], "positions": "prompt"}
        return kind, request


@dataclass
class Tally:
    """Outcomes of one run, the first few reasons for each failure, and completion times."""

    counts: Counter[str] = field(default_factory=Counter)
    reasons: dict[str, list[str]] = field(default_factory=dict)
    done_at: list[float] = field(default_factory=list)  # monotonic times of ok results
    latencies: list[float] = field(default_factory=list)
    replicas: Counter[str] = field(default_factory=Counter)

    def record(self, outcome: str, started: float, reason: str = "", replica: str | None = None) -> None:
        self.counts[outcome] += 1
        now = time.monotonic()
        if outcome == "ok":
            self.done_at.append(now)
            self.latencies.append(now - started)
            self.replicas[str(replica)] += 1
        elif reason and len(self.reasons.setdefault(outcome, [])) < (1 if outcome == "backpressure" else 5):
            self.reasons[outcome].append(reason[:300])

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def accepted_failures(self) -> int:
        """Requests the router accepted that brought back no correct result."""
        return self.counts["lost"] + self.counts["wrong"] + self.counts["invalid"]

    def longest_gap_s(self, start: float, end: float) -> float:
        """Longest stretch within [start, end] in which no request completed."""
        times = [start, *sorted(t for t in self.done_at if start <= t <= end), end]
        return max(b - a for a, b in zip(times, times[1:]))

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "requests": self.total,
            **{name: self.counts[name] for name in OUTCOMES},
            "lost_accepted": self.accepted_failures,
            "per_replica_ok": dict(sorted(self.replicas.items())),
            "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
            "latency_max_s": round(lat[-1], 3) if lat else None,
            "failure_examples": self.reasons,
        }


def classify(exc: BaseException) -> str:
    """Ray re-raises a replica's error as a type that also subclasses the original, so isinstance
    works across the hop. Serve's own BackPressureError (a handle queue) counts as refused too."""
    from ray.serve.exceptions import BackPressureError as ServeBackPressure

    from replicas.api.errors import BackPressureError, InvalidRequestError

    if isinstance(exc, (BackPressureError, ServeBackPressure)):
        return "backpressure"
    if isinstance(exc, InvalidRequestError):
        return "invalid"
    return "lost"


async def call(handle: Any, kind: str, request: dict[str, Any]) -> Any:
    method = handle.capture if kind == "capture" else handle.generate
    return await method.remote(request)


async def one(handle: Any, mix: Mix, i: int, verify: Verify, tally: Tally, timeout_s: float) -> None:
    kind, request = mix.request(i)
    started = time.monotonic()
    try:
        result = await asyncio.wait_for(call(handle, kind, request), timeout_s)
    except asyncio.TimeoutError:
        tally.record("lost", started, f"{kind} #{i}: no answer within {timeout_s:.0f} s")
        return
    except Exception as exc:  # every failure is counted, none is swallowed silently
        tally.record(classify(exc), started, f"{kind} #{i}: {exc!r}")
        return
    problem = verify(kind, request, result)
    tally.record("wrong" if problem else "ok", started, f"{kind} #{i}: {problem}", result.replica)


async def burst(handle: Any, mix: Mix, n: int, verify: Verify, timeout_s: float = 600) -> Tally:
    """n requests sent at once; returns when each has its outcome."""
    tally = Tally()
    await asyncio.gather(*(one(handle, mix, i, verify, tally, timeout_s) for i in range(n)))
    return tally


class Stream:
    """Keeps `concurrency` requests in flight until `stop()`, `max_requests` or `deadline_s`;
    `finish()` then waits (bounded) for the ones in flight."""

    def __init__(self, handle: Any, mix: Mix, verify: Verify, concurrency: int, max_requests: int,
                 deadline_s: float, timeout_s: float = 300) -> None:
        self.tally = Tally()
        self._args = (handle, mix, verify, concurrency, max_requests, deadline_s, timeout_s)
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.started = time.monotonic()

    async def start(self) -> "Stream":
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())
        return self

    def stop(self) -> None:
        assert self._stop is not None
        self._stop.set()

    async def finish(self) -> Tally:
        self.stop()
        assert self._task is not None
        await self._task
        return self.tally

    async def _run(self) -> None:
        handle, mix, verify, concurrency, max_requests, deadline_s, timeout_s = self._args
        assert self._stop is not None
        slots = asyncio.Semaphore(concurrency)
        pending: set[asyncio.Task[None]] = set()
        end = self.started + deadline_s
        for i in range(max_requests):
            if self._stop.is_set() or time.monotonic() > end:
                break
            await slots.acquire()
            task = asyncio.ensure_future(one(handle, mix, i, verify, self.tally, timeout_s))
            task.add_done_callback(lambda _t: slots.release())
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending)  # each one() is bounded by timeout_s


# ---------------------------------------------------------------- memory


class RssSampler:
    """Samples the resident memory of the app's processes every `period_s` in a thread and keeps
    each role's peak. `pids()` returns {role: [pid, ...]}; it is re-read every `refresh_s`, so
    replacement replicas are followed."""

    def __init__(self, pids: Callable[[], dict[str, list[int]]], period_s: float = 0.5, refresh_s: float = 5.0) -> None:
        self._pids = pids
        self._period, self._refresh = period_s, refresh_s
        self.peak_mib: dict[str, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        roles: dict[str, list[int]] = {}
        next_refresh = 0.0
        while not self._done.is_set():
            if time.monotonic() >= next_refresh:
                try:
                    roles = self._pids()
                except Exception:  # a replica mid-replacement; keep the last known pids
                    pass
                next_refresh = time.monotonic() + self._refresh
            for role, mib in rss_mib(roles).items():
                self.peak_mib[role] = max(self.peak_mib.get(role, 0.0), mib)
            self._done.wait(self._period)


def rss_mib(roles: dict[str, list[int]]) -> dict[str, float]:
    """The largest RSS (MiB) among each role's live processes."""
    import psutil

    out: dict[str, float] = {}
    for role, pids in roles.items():
        sizes = []
        for pid in pids:
            try:
                sizes.append(psutil.Process(pid).memory_info().rss / 2**20)
            except psutil.Error:
                continue
        if sizes:
            out[role] = round(max(sizes), 1)
    return out


# ---------------------------------------------------------------- the fleet


class Fleet:
    """The running app as the tests and the soak see it: replica identities, process ids, health."""

    def __init__(self, router: Any, replicas: Any, app_name: str = "capserve") -> None:
        self.router = router  # the Router deployment's handle
        self.replicas = replicas  # a handle on EngineReplica, for broadcasts
        self.app_name = app_name

    def identities(self) -> list[dict[str, Any]]:
        results = self.replicas.broadcast("identity").results(timeout_s=30, return_exceptions=True)
        return [r for r in results if isinstance(r, dict)]

    def running(self) -> int:
        from ray import serve

        status = serve.status().applications[self.app_name].deployments["EngineReplica"]
        return status.replica_states.get("RUNNING", 0)

    def pids(self) -> dict[str, list[int]]:
        idents = self.identities()
        router = self.router.stats.remote().result(timeout_s=30)
        return {
            "router": [router["pid"]],
            "replica": [i["pid"] for i in idents],
            "engine": [p["pid"] for i in idents for p in i["engine_pids"]],
        }

    def replica_names(self) -> set[str]:
        return {i["replica"] for i in self.identities()}


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float, poll_s: float = 1.0) -> float:
    """Poll until `condition()`; returns the seconds it took. Errors while polling count as no."""
    start = time.monotonic()
    while True:
        try:
            if condition():
                return time.monotonic() - start
        except Exception:
            pass
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"gave up after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def engine_core(identity: dict[str, Any]) -> int:
    """A replica's engine-core pid (from its identity())."""
    (core,) = [p["pid"] for p in identity["engine_pids"] if p["role"] == "engine_core"]
    return core


def left_behind(identity: dict[str, Any]) -> list[str]:
    """What a replica that is gone left running or on disk: engine processes (matched by pid and
    start time, so a reused pid does not count) and its shared-memory folder."""
    from replicas.arena.lifeline import Owner

    remains = [
        f"{p['role']} pid {p['pid']} ({p['name']})"
        for p in identity["engine_pids"]
        if Owner(p["pid"], p["start_ticks"]).alive()
    ]
    spill_dir = identity.get("spill_dir")
    if spill_dir and os.path.exists(spill_dir):
        remains.append(f"shared-memory folder {spill_dir}")
    return remains


def wait_engine_gone(identity: dict[str, Any], timeout_s: float = 60) -> float:
    """Seconds until nothing of the replica's engine is left; AssertionError naming what stayed."""
    try:
        return wait_until(lambda: not left_behind(identity), f"replica {identity['replica']}'s engine to end", timeout_s, 0.5)
    except TimeoutError:
        raise AssertionError(f"replica {identity['replica']} left behind: {left_behind(identity)}") from None


def kill_pids(pids: Iterable[int]) -> None:
    """SIGKILL processes (fault injection: an engine core)."""
    import os
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
