"""`EngineReplica`: the Serve deployment that owns one `CaptureEngine` (one GPU, or CPU cores).

A plain class: its collaborators (the EngineConfig, the engine class, the options) come in
through the constructor, so tests run it with a fake engine and no Ray. `deploy.app` wraps it in
`serve.deployment` with `num_gpus: 1` on GPU hosts and `num_gpus: 0` on CPU hosts.

- `check_health` asks the engine (an RPC into its worker); a dead engine raises, and after
  Serve's consecutive-failure threshold the replica is replaced.
- Requests that fail because the engine died raise `ReplicaUnavailableError`, which the router
  retries on another replica; a bad request raises `InvalidRequestError`, which it does not.
- Shutdown (`__del__`, called by Serve after its own drain) refuses new requests, waits for the
  in-flight ones up to `drain_timeout_s`, then shuts the engine down.
- Metrics (`ray.serve.metrics`, tagged with deployment and replica by Serve): requests by method
  and outcome, captured bytes, latency, requests in flight, starts (docs/serving.md names them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from replicas.api import GenerateRequest, GenerateResult, ModelInfo
from replicas.plans.cost import request_cost
from replicas.api.error_messages import quiet_client_errors
from replicas.api.errors import (
    CaptureFailedError,
    InvalidRequestError,
    ReplicaUnavailableError,
)
from replicas.arena.lifeline import engine_processes
from replicas.shards.sink import ShardJob, ShardSink, SinkOptions, run_shard, shard_job
from replicas.api.validation import validated

logger = logging.getLogger("capserve.replica")

LATENCY_BUCKETS_MS = [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000]
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's own switch; written here, before the engine starts
TINY_PREFIX = "tiny:"
MAX_STALL_S = 600.0  # a stalled replica wakes by itself after this, even if nobody replaces it
"""A model named "tiny:<arch>" is the built-in random-weight model, built at replica start."""


class ReplicaOptions(BaseModel):
    """What EngineReplica receives besides its EngineConfig (set by `deploy.app`)."""

    model_config = ConfigDict(extra="forbid")

    device: Literal["cpu", "gpu"] = Field("cpu", description="Where the engine runs (decided by the app builder).")
    cpu_bind: Literal["rank", "none", "inherit"] = Field(
        "rank",
        description="CPU engines: 'rank' pins replica r's OpenMP threads to allowed core r mod n; "
        "'none' leaves them to the OS scheduler; 'inherit' keeps VLLM_CPU_OMP_THREADS_BIND as set.",
    )
    drain_timeout_s: float = Field(60.0, ge=0, description="Shutdown waits this long for in-flight requests.")
    health_timeout_s: float = Field(20.0, gt=0, description="check_health fails when the engine takes longer.")
    fault_injection: bool = Field(
        False,
        description="Tests only: allow `stall()`, which wedges this replica. Off unless AppArgs.fault_injection; "
        "no HTTP route reaches it.",
    )
    sink: SinkOptions = Field(default_factory=SinkOptions, description="capture_shard's writers (replicas.shards.sink).")

def is_tiny(model: str | None) -> bool:
    return model is None or model.startswith(TINY_PREFIX)


class _Metrics:
    """Ray Serve metrics; Serve adds deployment, replica and application tags itself."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.requests = metrics.Counter(
            "capserve_replica_requests",
            description="Requests finished by this replica, by method and outcome.",
            tag_keys=("method", "outcome"),
        )
        self.captured_bytes = metrics.Counter(
            "capserve_replica_captured_bytes",
            description="Bytes of activations and logits returned by this replica.",
        )
        self.latency_ms = metrics.Histogram(
            "capserve_replica_latency_ms",
            description="Time from a request's arrival at the replica to its result.",
            boundaries=LATENCY_BUCKETS_MS,
            tag_keys=("method",),
        )
        self.in_flight = metrics.Gauge(
            "capserve_replica_in_flight",
            description="Requests this replica holds (its engine's queue and batch), at its last health check.",
        )
        self.kv_cache_tokens = metrics.Gauge(
            "capserve_replica_kv_cache_tokens",
            description="Tokens the replica's KV cache holds, as vLLM sized it at start (replicas sharing a GPU "
            "each hold their share); set at each health check.",
        )
        self.starts = metrics.Counter(
            "capserve_replica_starts",
            description="Replicas whose engine started; summed over a deployment, starts beyond its replica count "
            "are restarts (Serve replaces a replica whose engine died).",
        )

    def record(self, method: str, outcome: str, started: float, result: GenerateResult | None) -> None:
        self.requests.inc(tags={"method": method, "outcome": outcome})
        self.latency_ms.observe((time.monotonic() - started) * 1000, tags={"method": method})
        if result is not None:
            payload = result.activation_bytes + (result.logits.nbytes if result.logits is not None else 0)
            if payload:
                self.captured_bytes.inc(payload)


class EngineReplica:
    """One engine behind Serve. Build with `await EngineReplica.open(...)` outside Serve."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        engine_config: Any,
        engine_cls: Any = None,
        options: Any = None,
    ) -> None:
        from replicas.engine import EngineConfig

        quiet_client_errors()  # Serve would log each bad request as an ERROR with a traceback
        self._options = options if isinstance(options, ReplicaOptions) else ReplicaOptions.model_validate(options or {})
        config = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig.model_validate(engine_config)
        self._identity = _serve_identity()
        self.name: str = self._identity["replica"]
        self._in_flight: dict[int, float] = {}  # id(task) -> cost, for load() and the drain
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._metrics = _Metrics()
        self._sink = ShardSink(**self._options.sink.model_dump())
        if self._options.device == "cpu" and self._options.cpu_bind != "inherit":
            _bind_cpu(self._options.cpu_bind, self._identity["local_rank"])
        config = config.model_copy(update={"model": _resolve_model(config.model)})
        if engine_cls is None:
            from replicas.engine import CaptureEngine as engine_cls
        self._engine = await engine_cls.start(config, name=self.name)
        # results leave this process by Ray's serialization, which copies them: they can view
        # the worker's arena in place until then (replicas.arena.host.HeldArena), however many
        self._engine.view_share = 1.0
        self._sink.watch(self._engine.arena_budget)
        self._info: ModelInfo = await self._engine.info()
        self._metrics.starts.inc()
        logger.info("replica %s serving %s, KV cache %d tokens", self.name, self._info.model, self._engine.kv_cache_tokens)

    @classmethod
    async def open(cls, engine_config: Any, engine_cls: Any = None, options: Any = None) -> "EngineReplica":
        """Construct outside Serve (tests, scripts): Python cannot `await` a constructor call."""
        replica = cls.__new__(cls)
        await replica.__init__(engine_config, engine_cls, options)  # type: ignore[misc]
        return replica

    # ------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest | dict[str, Any], options: Any = None) -> GenerateResult:
        async with self._serving("generate", request, options) as (request, run):
            run.result = await self._engine.generate(request)
            return run.result

    async def generate_stream(self, request: GenerateRequest | dict[str, Any], options: Any = None) -> AsyncIterator[Any]:
        """Serve streaming (`handle.options(stream=True)`): `StreamDelta`s as the engine produces
        tokens, then `StreamEnd` with the whole result (replicas.api.streaming). Closing the stream
        early cancels the request in the engine."""
        from replicas.api.streaming import StreamEnd, stream_generate
        from replicas.engine import tokens

        async with self._serving("generate_stream", request, options) as (request, run):
            texts = partial(tokens.token_strings, self._engine, vocab=self._info.d_vocab) if run.options.token_strs else None
            stream = stream_generate(self._engine, request, token_texts=texts)
            try:
                async for item in stream:
                    if isinstance(item, StreamEnd):
                        run.result = item.result
                    yield item
            finally:
                await stream.aclose()

    async def capture_shard(self, job: ShardJob | dict[str, Any]) -> dict[str, Any]:
        """`capserve capture --sink replica`: run a shard's lines here (each through generate(),
        so drain, load and metrics see them), write the shard into the job's folder from this
        process, and return only its `ShardIndex` (replicas.shards.sink)."""
        if self._draining:
            raise ReplicaUnavailableError(f"replica {self.name} is shutting down; retry on another replica")
        index = await run_shard(shard_job(job), self.generate, self._sink)
        return index.model_dump()

    async def tokenize(self, request: GenerateRequest | dict[str, Any], add_special_tokens: bool = True,
                       token_strs: bool = False) -> dict[str, Any]:
        """/tokenize: the prompt's token ids as generate() would run them (chat template and tools applied)."""
        from replicas.engine import tokens

        return {**tokens.tokenize(self._engine, validated(request), add_special_tokens, token_strs),
                "max_model_len": self._info.max_model_len}

    async def detokenize(self, ids: list[int]) -> str:
        from replicas.engine import tokens

        return tokens.detokenize(self._engine, ids, self._info.d_vocab)

    async def token_strings(self, ids: list[int]) -> list[str]:
        """Each token's text (logprobs and echo on the OpenAI routes)."""
        from replicas.engine import tokens

        return tokens.token_strings(self._engine, ids, self._info.d_vocab)

    async def info(self) -> ModelInfo:
        return self._info

    async def load(self) -> dict[str, Any]:
        """Outstanding work: requests in flight and their summed cost (token-equivalents)."""
        return {
            "replica": self.name,
            "in_flight": len(self._in_flight),
            "outstanding_cost": sum(self._in_flight.values()),
            "draining": self._draining,
        }

    async def stats(self) -> dict[str, Any]:
        """Where this replica's time goes: its worker's step-loop timers (`CaptureEngine.stats`),
        what its results took from the arena (`CaptureEngine.arena_reads`) and its shard sink's
        totals (shards, bytes, seconds waiting for a slot and writing); and its KV cache's tokens."""
        return {"replica": self.name, "engine": await self._engine.stats(), "reads": self._engine.arena_reads,
                "sink": dict(self._sink.totals), "kv_cache_tokens": self._engine.kv_cache_tokens}

    async def identity(self) -> dict[str, Any]:
        """Who this replica is, with its engine's process ids (tests kill them and check they die)."""
        return {
            **self._identity,
            "pid": os.getpid(),
            "engine_pids": engine_processes(self._engine.engine_pids()),
            "spill_dir": getattr(self._engine, "spill_dir", None),
        }

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising marks the replica unhealthy. It
        sets the gauges (requests in flight, KV cache tokens): Ray exports only what was set since its
        last export."""
        self._metrics.in_flight.set(len(self._in_flight))
        self._metrics.kv_cache_tokens.set(self._engine.kv_cache_tokens)
        try:
            await asyncio.wait_for(self._engine.check_health(), self._options.health_timeout_s)
        except Exception as exc:
            raise RuntimeError(f"replica {self.name}: engine failed its health check: {exc!r}") from exc

    async def stall(self, replica: str, seconds: float) -> bool:
        """Fault injection for the reliability suite: if this is `replica`, block its event loop for
        `seconds` (at most MAX_STALL_S), as a wedged process would: requests, results and health
        checks all hang, so Serve's health check times out and the replica is replaced. Broadcast
        it (`handle.broadcast("stall", name, s)`) to reach one replica; the others return False.
        Refused unless the deployment was built with `fault_injection=True`."""
        if not self._options.fault_injection:
            raise PermissionError("stall() is a test hook; this deployment was built with fault_injection=False")
        if replica != self.name:
            return False
        logger.warning("replica %s: stalling for %.0f s (fault injection)", self.name, seconds)
        time.sleep(min(max(seconds, 0.0), MAX_STALL_S))  # blocking on purpose: nothing else here may run
        return True

    @asynccontextmanager
    async def _serving(self, method: str, request: GenerateRequest | dict[str, Any], options: Any) -> AsyncIterator[tuple[GenerateRequest, "_Run"]]:
        """One request's bookkeeping: refused while draining, counted in flight (load, drain),
        metrics, and an engine failure turned into ReplicaUnavailableError (the router retries)."""
        from replicas.api.streaming import CallOptions

        if self._draining:
            raise ReplicaUnavailableError(f"replica {self.name} is shutting down; retry on another replica")
        started = time.monotonic()
        request = validated(request)
        run = _Run(options if isinstance(options, CallOptions) else CallOptions.model_validate(options or {}))
        key = object()
        self._idle.clear()
        outcome = "error"
        try:
            if run.options.fill_max_tokens:
                from replicas.engine.tokens import fill_max_tokens

                request = fill_max_tokens(self._engine, request, self._info.max_model_len)
            # charged with the max_tokens it runs with (a filled one: what its prompt leaves room for)
            self._in_flight[id(key)] = request_cost(request, self._info.d_model, self._info.d_vocab,
                                                    probe_widths=self._info.probe_widths)
            yield request, run
            outcome = "ok"
        except (InvalidRequestError, CaptureFailedError):
            outcome = "invalid"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except Exception as exc:
            raise await self._classify(exc) from exc
        finally:
            self._in_flight.pop(id(key), None)
            if not self._in_flight:
                self._idle.set()
            self._metrics.record(method, outcome, started, run.result)

    async def _classify(self, exc: Exception) -> Exception:
        """An engine that no longer answers makes the failure the replica's, so the router retries."""
        try:
            await asyncio.wait_for(self._engine.check_health(), self._options.health_timeout_s)
        except Exception as health:
            return ReplicaUnavailableError(f"replica {self.name}: engine is dead ({health!r}) after {exc!r}")
        return exc

    # ------------------------------------------------------------ shutdown

    async def shutdown(self) -> None:
        """Refuse new requests, wait for in-flight ones (bounded), then stop the engine."""
        if self._draining:
            return
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), self._options.drain_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("replica %s: %d requests still running after the drain timeout", self.name, len(self._in_flight))
        await self._engine.shutdown()
        self._sink.close()

    def __del__(self) -> Any:
        """Serve awaits what this returns on graceful shutdown. A replica that already shut down
        (or never started) returns None, so a plain garbage collection creates no coroutine."""
        if getattr(self, "_draining", True) or not hasattr(self, "_engine"):
            return None
        return self.shutdown()


# ---------------------------------------------------------------- helpers


@dataclass
class _Run:
    options: Any  # replicas.api.streaming.CallOptions
    result: GenerateResult | None = None


def _serve_identity() -> dict[str, Any]:
    """Serve's replica id (what GenerateResult.replica and the router's ledger use) and actor name."""
    try:
        from ray import serve

        context = serve.get_replica_context()
    except Exception:  # outside Serve: a plain object in a test
        return {"replica": f"local-{os.getpid()}", "actor_name": None, "local_rank": 0, "node_id": None, "gpu_ids": []}
    import ray

    rank = getattr(context, "rank", None)
    runtime = ray.get_runtime_context()
    return {
        "replica": context.replica_id.unique_id,
        "actor_name": runtime.get_actor_name(),
        "local_rank": getattr(rank, "local_rank", 0) or 0,
        "node_id": runtime.get_node_id(),
        "gpu_ids": runtime.get_accelerator_ids().get("GPU", []),
    }


def _bind_cpu(mode: str, local_rank: int) -> None:
    """vLLM's 'auto' binding would put every CPU replica's threads on the same cores, where they
    fight; 'rank' gives replica r its own core, 'none' lets the OS place them. A user's explicit
    VLLM_CPU_OMP_THREADS_BIND wins."""
    if os.environ.get(CPU_BIND_ENV, "auto") != "auto":
        return
    if mode == "none":
        os.environ[CPU_BIND_ENV] = "nobind"
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ[CPU_BIND_ENV] = str(cores[local_rank % len(cores)])


def _resolve_model(model: str) -> str:
    if not is_tiny(model):
        return model
    from replicas.tiny import make_tiny_model

    return make_tiny_model(model.removeprefix(TINY_PREFIX) or "llama")
