"""`Router`: the app's ingress. Validates, balances by cost, retries, scatters batches, queues.

Handle methods (Python callers, the provider and the client):

    await handle.generate.remote(request)            -> GenerateResult
    await handle.capture.remote(request)             -> GenerateResult (prompt activations)
    await handle.capture_batch.remote([req, ...])    -> [GenerateResult, ...] in input order
    await handle.capture_shard.remote(job)           -> ShardIndex dict: a replica wrote the shard (replicas.shards.sink)
    await handle.info.remote()                       -> ModelInfo
    await handle.stats.remote()                      -> queue depth and per-replica outstanding cost
    await handle.ready.remote()                      -> ReadyStatus: can an engine serve now (deploy.readiness)
    await handle.register_vector.remote(name, vector, hook=None, replace=False)   # named vectors (deploy.vectors);
    await handle.list_vectors.remote(); await handle.delete_vector.remote(name)   # requests name them in place of arrays
    async for item in handle.options(stream=True).generate_stream.remote(request):   # StreamDelta..., StreamEnd

`by_reference=True` on generate/capture/capture_batch returns `ray.ObjectRef`s to the replica's
own result object instead of values: the payload then never passes through the router (`await
ref` in the caller reads it from the object store, zero-copy for the arrays on one node). By
value, the router still copies no array itself; Ray serializes the result once more on return.
`by_reference="auto"` (what `CaptureClient` and the inspect provider ask for) returns a reference
for a result carrying at least `deploy.handle_args.AUTO_REFERENCE_BYTES` of arrays and the value
otherwise: a small result by value saves the caller a second round trip to fetch it.

What the router guarantees:
- validation before any replica is chosen: `InvalidRequestError` naming the field; named vectors
  are replaced by their arrays here, so replicas never see a name;
- least outstanding cost balancing (`deploy.balance`);
- a request whose replica or engine dies before answering is retried on another replica, up to
  `routing.max_attempts`; when all fail, `ReplicaUnavailableError` lists each attempt's cause;
- a bounded queue: at most `max_queued_requests` requests wait for a replica slot; the next one
  gets `BackPressureError` at once (HTTP 503), never an unbounded wait; a batch larger than the
  queue can never fit, so it is refused as a client error (`InvalidRequestError` on `requests`);
- a deadline: a request (a batch: all of it) finishes within `routing.request_timeout_s` from its
  arrival, or it is cancelled wherever it is (queue, placing, replica: the engine aborts it) and
  fails with `DeadlineExceededError` (HTTP 504). One attempt on one replica runs at most
  `routing.attempt_timeout_s`; then it is cancelled there and retried elsewhere (a hung replica);
- errors a caller sees carry the message and the field, never a remote traceback, pid or address
  (`replicas.api.error_messages`); client errors are logged as one WARNING line.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from abc import ABC, abstractmethod
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from replicas.api import GenerateRequest, ModelInfo
from replicas.plans.cost import request_cost
from replicas.api.errors import (
    BackPressureError,
    CaptureFailedError,
    InvalidRequestError,
    ReplicaUnavailableError,
)
from replicas.shards.sink import ShardJob, shard_job
from replicas.api.validation import validated

from deploy.admission import AdmissionQueue, AttemptFailed, AttemptTimedOut, Deadline, Gate, within
from deploy.balance import CostLedger, RouteHint
from deploy.handle_args import ByReference, capture_request, check_by_reference, wants_reference
from deploy.config import RouterConfig
from replicas.api.error_messages import describe, public_message, quiet_client_errors, remote_cause
from deploy.readiness import FleetStates, ReadinessProbe, ReadyStatus, serve_fleet_states
from deploy.streams import RouterStream, stream_attempt
from deploy.vectors import VectorMethods, VectorRegistry


MAX_REPICKS = 16  # slots given back because they landed on a replica this request failed on
MAX_PLACING = 4  # requests asking Serve for a slot at once (Serve routes 2 per replica at a time)
STREAM_METHODS = frozenset({"generate_stream"})  # EngineReplica methods that are async generators


def _retryable_errors() -> tuple[type[BaseException], ...]:
    """Failures that mean "this replica is gone", not "this request is bad"."""
    from ray.exceptions import RayActorError  # ActorDiedError, ActorUnavailableError
    from ray.serve.exceptions import ReplicaUnavailableError as ServeReplicaGone

    return (ReplicaUnavailableError, RayActorError, ServeReplicaGone)


# ---------------------------------------------------------------- replica pool


class ReplicaSlot(ABC):
    """A slot reserved on one replica; `run` sends the request there."""

    replica: str

    @abstractmethod
    async def run(self, method: str, *args: Any) -> tuple[Any, Any]:
        """(result value, reference to it); the value may be a zero-copy view of the reference."""

    def stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        """The items of a streaming method (reserved with `stream=True`); closing it cancels the work."""
        raise NotImplementedError(f"{type(self).__name__} cannot stream")


class ReplicaPool(ABC):
    """How the router reaches replicas. `HandlePool` is the Serve one; tests pass fakes."""

    retryable: tuple[type[BaseException], ...] = (ReplicaUnavailableError,)

    @abstractmethod
    def reserve(self, method: str, hint: RouteHint) -> Any:
        """Async context manager yielding a `ReplicaSlot` picked by the hint's ledger."""

    @abstractmethod
    async def call_any(self, method: str, *args: Any) -> Any:
        """Call `method` on some replica (info)."""

    @abstractmethod
    async def fleet_states(self) -> FleetStates:
        """What Serve says about the replicas (readiness)."""


class _HandleSlot(ReplicaSlot):
    def __init__(self, handle: Any, selection: Any) -> None:
        self._handle = handle
        self._selection = selection
        self.replica = selection.replica_id

    async def run(self, method: str, *args: Any) -> tuple[Any, Any]:
        response = self._handle.dispatch(self._selection, *args)
        # The ObjectRef of the replica's return value (Serve's documented way to get it): awaiting
        # it maps the object read-only, and returning it hands the caller the same object.
        try:
            ref = await response._to_object_ref()
            return await ref, ref
        except asyncio.CancelledError:
            response.cancel()  # the caller went away: abort the request in the engine too
            raise

    async def stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        response = self._handle.dispatch(self._selection, *args)  # a DeploymentResponseGenerator
        done = False
        try:
            async for item in response:
                yield item
            done = True
        finally:
            if not done:
                response.cancel()  # cancelled or closed early: abort the request in the engine too


class HandlePool(ReplicaPool):
    """Replicas behind a DeploymentHandle whose deployment uses `CostAwareRequestRouter`."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._by_method: dict[str, Any] = {}
        self.retryable = _retryable_errors()

    @asynccontextmanager
    async def reserve(self, method: str, hint: RouteHint) -> AsyncIterator[ReplicaSlot]:
        handle = self._by_method.get(method)
        if handle is None:  # one options() copy per method, not per request
            handle = self._by_method[method] = self._handle.options(method_name=method, stream=method in STREAM_METHODS)
        async with handle.choose_replica(hint) as selection:
            yield _HandleSlot(handle, selection)

    async def call_any(self, method: str, *args: Any) -> Any:
        response = getattr(self._handle, method).remote(*args)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()  # a deadline passed: Serve stops waiting for a replica too
            raise

    async def fleet_states(self) -> FleetStates:
        return await asyncio.to_thread(
            serve_fleet_states, self._handle.app_name, self._handle.deployment_name, _own_deployment()
        )


def _own_deployment() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().deployment
    except Exception:  # not inside a Serve replica
        return None


class _Attempts:
    """Where one request stands: queued, being placed, the replicas it failed on."""

    def __init__(self) -> None:
        self.ticket = uuid.uuid4().hex
        self.waiting = True  # counted in the admission queue
        self.placing = False  # holds one of the gate's placing turns
        self.failures: list[str] = []
        self.avoid: set[str] = set()
        self.repicks = 0


class _RouterMetrics:
    """Rare events, and the queue sampled at each health check: the per-request path stays free of
    metric calls. Serve adds the deployment, replica and application tags."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.retries = metrics.Counter(
            "capserve_router_retries", description="Requests re-sent after their replica or engine died."
        )
        self.rejected = metrics.Counter(
            "capserve_router_backpressure", description="Requests refused because the router's queue was full."
        )
        self.deadline_misses = metrics.Counter(
            "capserve_router_deadline_exceeded",
            description="Requests (or batches) cancelled at routing.request_timeout_s, wherever they were (HTTP 504).",
        )
        self.queued = metrics.Gauge(
            "capserve_router_queued",
            description="Requests the router holds that no replica has accepted yet, at its last health check.",
        )


# ---------------------------------------------------------------- the router


class Router(VectorMethods):
    def __init__(self, replicas: Any, config: RouterConfig | dict[str, Any] | None = None) -> None:
        self._config = config if isinstance(config, RouterConfig) else RouterConfig.model_validate(config or {})
        self._pool: ReplicaPool = replicas if isinstance(replicas, ReplicaPool) else HandlePool(replicas)
        self._ledger = CostLedger()
        self._queue = AdmissionQueue(self._config.max_queued_requests)
        self._gate = Gate(self._ledger.free_slots, MAX_PLACING)
        self._info: ModelInfo | None = None
        self._metrics = _RouterMetrics()
        self._readiness = ReadinessProbe(self._pool.fleet_states)
        self._vectors = VectorRegistry(self._config.vectors, self._config.max_vectors)  # named vectors (deploy.vectors)
        self._check_vectors_at_start()
        quiet_client_errors()  # a bad request raised to a handle caller: one WARNING line, no traceback

    # ------------------------------------------------------------ handle methods

    async def generate(self, request: GenerateRequest | dict[str, Any], by_reference: ByReference = False, options: Any = None) -> Any:
        """`options`: `replicas.api.streaming.CallOptions` for the replica (the OpenAI routes set them)."""
        check_by_reference(by_reference)
        request = await self._resolved(validated(request))
        async with within(self._deadline()) as deadline:
            await self._check_model_limits(request)
            self._admit(1)
            return await self._submit("generate", request, by_reference, deadline, options=options)

    async def generate_stream(self, request: GenerateRequest | dict[str, Any], options: Any = None) -> AsyncIterator[Any]:
        """generate() as a stream: `StreamDelta`s as tokens come, then `StreamEnd(result)`
        (replicas.api.streaming). Handle callers: `handle.options(stream=True).generate_stream.remote(r)`.
        Same validation, queue bound, deadline and balancing; a replica that fails before the
        first item is retried elsewhere, one that fails after it fails the stream."""
        stream = self.open_stream(request, options)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    def open_stream(self, request: GenerateRequest | dict[str, Any], options: Any = None) -> RouterStream:
        """Start streaming one request; the HTTP routes await `first()` before they answer, so an
        error before the first token still gets its status code."""
        return RouterStream(self._stream_into, validated(request), options)

    async def _stream_into(self, request: GenerateRequest, options: Any, sink: Callable[[Any], None]) -> None:
        request = await self._resolved(request)
        async with within(self._deadline()) as deadline:
            await self._check_model_limits(request)
            self._admit(1)
            limit_s, retryable = self._config.routing.attempt_limit_s, self._pool.retryable

            async def attempt(slot: ReplicaSlot) -> None:
                await stream_attempt(slot, "generate_stream", (request, options), deadline, limit_s, retryable, sink)

            await self._submit("generate_stream", request, False, deadline, attempt=attempt)

    async def capture(self, request: GenerateRequest | dict[str, Any], by_reference: ByReference = False) -> Any:
        """Prompt activations only. The request must carry `capture`; it runs with max_tokens=1
        and temperature 0 (one forward over the prompt; the sampled token is discarded), and
        `capture.positions` defaults to "prompt". A max_tokens other than 1 is refused: use
        generate() to sample."""
        check_by_reference(by_reference)
        request = await self._resolved(capture_request(request))
        async with within(self._deadline()) as deadline:
            self._admit(1)
            return await self._submit("generate", request, by_reference, deadline)

    async def capture_batch(self, requests: list[Any], by_reference: ByReference = False) -> list[Any]:
        """capture() for every request, spread over the replicas; results in input order. The
        batch is admitted whole or refused whole (BackPressureError); one larger than the queue
        could never be admitted and is refused as a client error. If one request fails, the others
        are cancelled and the error names its index. One deadline covers the whole batch."""
        check_by_reference(by_reference)
        if not isinstance(requests, list):
            raise InvalidRequestError(f"requests: expected a list of capture requests, got {type(requests).__name__}")
        if len(requests) > self._config.max_batch_size:
            raise InvalidRequestError(
                f"requests: {len(requests)} requests exceed max_batch_size={self._config.max_batch_size}; split the batch"
            )
        if len(requests) > self._queue.limit:
            # Admission takes the whole batch into the queue at once, so this one would get a
            # retryable 503 forever: the caller must split it.
            raise InvalidRequestError(
                f"requests: {len(requests)} requests exceed max_queued_requests={self._queue.limit}, the most the "
                f"router can hold at once; split the batch into batches of at most {self._queue.limit}"
            )
        batch = [await self._resolved(capture_request(r, where=f"requests[{i}]."), f"requests[{i}].") for i, r in enumerate(requests)]
        if not batch:
            return []
        async with within(self._deadline()) as deadline:
            self._admit(len(batch))
            states = [_Attempts() for _ in batch]
            tasks = [
                asyncio.ensure_future(self._submit_item(i, r, by_reference, deadline, states[i]))
                for i, r in enumerate(batch)
            ]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)  # their own cleanup first
                for state in states:  # then whatever a task cancelled before its first step left
                    self._leave(state)

    async def capture_shard(self, job: ShardJob | dict[str, Any]) -> dict[str, Any]:
        """`capserve capture --sink replica`: one replica captures a shard's lines and writes the
        shard itself (replicas.shards.sink); returns its `ShardIndex` as a dict, never the rows. Balanced
        by the summed cost of its lines, one queue slot, retried on another replica when the one
        running it dies (a shard is published atomically, so a retry never leaves half of one)."""
        job = shard_job(job)
        requests = [validated(item.request, f"lines[{i}].request.") for i, item in enumerate(job.lines)]
        job = await self._resolved_job(job, requests)
        async with within(self._deadline()) as deadline:
            self._admit(1)
            cost = sum([await self._cost(request) for request in requests])
            return await self._submit("capture_shard", job, False, deadline, cost=cost)

    async def info(self) -> ModelInfo:
        if self._info is None:
            async with within(self._deadline()) as deadline:
                deadline.stage = "waiting for a replica to report the model's info"
                self._info = await self._pool.call_any("info")
            self._vectors.check_model(self._info)
        return self._info

    async def ready(self) -> ReadyStatus:
        """Whether an engine can serve now (an EngineReplica is RUNNING), with the replicas'
        states; cached for a second. Liveness is the router answering at all."""
        return await self._readiness.status(self._queue.waiting)

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; it samples the queue for the metrics."""
        self._metrics.queued.set(self._queue.waiting)

    async def stats(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),  # for memory monitoring (the reliability suite samples its RSS)
            "node_id": _node_id(),
            "queued": self._queue.waiting,
            "max_queued_requests": self._queue.limit,
            "replicas": self._ledger.snapshot(),
            "rankings": self._ledger.rankings,
        }

    # ------------------------------------------------------------ routing

    def _deadline(self) -> Deadline:
        return Deadline(self._config.routing.request_timeout_s, missed=self._metrics.deadline_misses.inc)

    async def _check_model_limits(self, request: GenerateRequest) -> None:
        """What no replica could serve, refused before it takes a queue slot: max_tokens past the
        model's context (the replica also checks prompt + max_tokens once it has tokenized)."""
        limit = (await self.info()).max_model_len
        if request.max_tokens >= limit:
            raise InvalidRequestError(
                f"max_tokens: {request.max_tokens} leaves no room for a prompt in the model's "
                f"max_model_len={limit}; allowed: 1..{limit - 1}"
            )

    def _admit(self, n: int) -> None:
        try:
            self._queue.admit(n)
        except BackPressureError:
            self._metrics.rejected.inc(n)
            raise

    async def _submit_item(
        self, index: int, request: GenerateRequest, by_reference: ByReference, deadline: Deadline, state: "_Attempts"
    ) -> Any:
        try:
            return await self._submit("generate", request, by_reference, deadline, state)
        except (InvalidRequestError, CaptureFailedError, ReplicaUnavailableError) as exc:
            raise type(remote_cause(exc))(f"requests[{index}]: {public_message(exc)}") from None

    async def _submit(
        self, method: str, request: GenerateRequest | ShardJob, by_reference: ByReference, deadline: Deadline,
        state: "_Attempts | None" = None, *, options: Any = None, attempt: Callable[[ReplicaSlot], Awaitable[Any]] | None = None,
        cost: float | None = None,
    ) -> Any:
        """Run an admitted request to completion, on another replica each time one dies or hangs.
        Runs inside `within(deadline)`: when it passes, the CancelledError lands wherever the
        request waits, and the `finally` gives back its queue slot, gate turn and ledger charge."""
        state = state or _Attempts()
        routing = self._config.routing
        try:
            cost = await self._cost(request) if cost is None else cost  # type: ignore[arg-type]
            deadline.stage = "waiting for a replica slot (replicas full, starting or restarting)"
            await self._gate.enter()
            state.placing = True
            while len(state.failures) < routing.max_attempts:
                hint = RouteHint(self._ledger, frozenset(state.avoid), self._config.replica_slots)
                try:
                    async with self._pool.reserve(method, hint) as slot:
                        if slot.replica in state.avoid and state.repicks < MAX_REPICKS and self._ledger.has_alternative(state.avoid):
                            # Serve's FIFO matching handed this request a replica it already
                            # failed on, picked for another request; give the slot back.
                            state.repicks += 1
                            continue
                        self._ledger.confirm(state.ticket, slot.replica, cost)
                        self._placed(state)
                        deadline.stage = f"running on replica {slot.replica} (attempt {len(state.failures) + 1})"
                        if attempt is not None:  # streaming: the attempt forwards items itself
                            return await attempt(slot)
                        value, ref = await self._run(slot, method, request, deadline, options)
                        return ref if wants_reference(by_reference, value) else value
                except AttemptFailed as failed:
                    self._metrics.retries.inc()
                    state.failures.append(f"replica {failed.replica}: {describe(failed.cause)}")
                    state.avoid.add(failed.replica)
                    self._ledger.suspect(failed.replica, routing.suspect_s)
                    deadline.stage = "waiting for another replica after " + "; ".join(state.failures)
            raise ReplicaUnavailableError(
                f"request failed on {len(state.failures)} replicas, each died, lost its engine or hung before "
                f"answering: {'; '.join(state.failures)}"
            )
        finally:
            self._leave(state)

    def _leave(self, state: "_Attempts") -> None:
        """Give back everything the request holds; safe to call more than once."""
        self._ledger.release(state.ticket)
        self._placed(state)
        self._gate.wake()  # a slot may have freed

    def _placed(self, state: "_Attempts") -> None:
        """The request left the queue: it holds a slot, or it gave up."""
        if state.waiting:
            state.waiting = False
            self._queue.leave()
        if state.placing:
            state.placing = False
            self._gate.placed()

    async def _run(
        self, slot: ReplicaSlot, method: str, request: GenerateRequest | ShardJob, deadline: Deadline, options: Any = None
    ) -> tuple[Any, Any]:
        limit_s = self._config.routing.attempt_limit_s
        timer = asyncio.timeout_at(deadline.cap(limit_s))  # None: the request's deadline comes first
        args = (request,) if options is None else (request, options)
        try:
            async with timer:
                return await slot.run(method, *args)  # cancelled: the slot cancels the replica's work
        except Exception as exc:
            if isinstance(exc, TimeoutError) and timer.expired():
                cause = AttemptTimedOut(f"no answer within routing.attempt_timeout_s={limit_s:g} s; cancelled there")
                raise AttemptFailed(slot.replica, cause) from None
            original = remote_cause(exc)
            if isinstance(original, (InvalidRequestError, CaptureFailedError)):
                # Ray's error types mix in the cause's type; a bad request is never retried, and
                # the caller gets the replica's own exception, not Ray's wrapper with its traceback.
                raise original from None
            if isinstance(exc, self._pool.retryable):
                raise AttemptFailed(slot.replica, exc) from exc
            raise

    async def _cost(self, request: GenerateRequest) -> float:
        info = await self.info()
        routing = self._config.routing
        return request_cost(
            request,
            info.d_model,
            info.d_vocab,
            probe_widths=info.probe_widths,
            prompt_token_weight=routing.prompt_token_weight,
            capture_bytes_per_token=routing.capture_bytes_per_token,
        )


def _node_id() -> str | None:
    import ray

    # get_runtime_context() would start a Ray instance in a process outside Ray (unit tests)
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
