"""EngineReplica with a fake engine (no Ray, no vLLM): load, health, failure classes, drain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from replicas.api import GenerateResult, ModelInfo
from replicas.arena.client import ArenaBudget
from replicas.api.errors import InvalidRequestError, ReplicaUnavailableError
from replicas.replica import EngineReplica

INFO = ModelInfo(
    model="fake", architecture="Fake", n_layers=2, d_model=8, d_vocab=50, max_model_len=64,
    dtype="float32", hook_names=[], armed_kinds=[],
)
OPTIONS = {"cpu_bind": "inherit", "drain_timeout_s": 5, "health_timeout_s": 1}


class FakeEngine:
    started: list["FakeEngine"] = []
    kv_cache_tokens = 4096

    def __init__(self, config: Any, name: str) -> None:
        self.config, self.name = config, name
        self.release = asyncio.Event()
        self.dead = False
        self.stopped = False
        self.arena_budget = ArenaBudget(0, 0, 0)  # no arena
        self.requests: list[Any] = []

    @classmethod
    async def start(cls, config: Any, name: str | None = None) -> "FakeEngine":
        engine = cls(config, name or "")
        cls.started.append(engine)
        return engine

    async def info(self) -> ModelInfo:
        return INFO

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("EngineCore died")

    def engine_pids(self) -> list[int]:
        return []

    async def shutdown(self) -> None:
        self.stopped = True

    def prompt_token_ids(self, request: Any) -> list[int]:
        return list(request.prompt) if isinstance(request.prompt, list) else [0]

    async def generate(self, request: Any) -> GenerateResult:
        self.requests.append(request)
        if request.prompt == "bad":
            raise InvalidRequestError("prompt: bad")
        await self.release.wait()
        if self.dead:
            raise RuntimeError("engine loop stopped")
        return GenerateResult(
            request_id="r", text="t", token_ids=[1], prompt_token_ids=[0], finish_reason="length",
            choices=[], replica=self.name,
        )


async def open_replica(model: str = "/models/x") -> tuple[EngineReplica, FakeEngine]:
    replica = await EngineReplica.open({"model": model}, FakeEngine, OPTIONS)
    return replica, FakeEngine.started[-1]


def test_results_name_the_replica_and_load_counts_outstanding_cost():
    async def main():
        replica, engine = await open_replica()
        assert engine.config.model == "/models/x" and engine.name == replica.name
        pending = asyncio.ensure_future(replica.generate({"prompt": [1, 2, 3], "max_tokens": 7}))
        await asyncio.sleep(0.01)
        assert await replica.load() == {"replica": replica.name, "in_flight": 1, "outstanding_cost": 10.0, "draining": False}
        engine.release.set()
        assert (await pending).replica == replica.name
        assert (await replica.load())["in_flight"] == 0
        assert (await replica.identity())["replica"] == replica.name
        await replica.shutdown()

    asyncio.run(main())


def test_a_request_that_fills_the_context_is_charged_with_the_room_its_prompt_leaves():
    """OpenAI chat without max_tokens: the replica sets max_tokens to max_model_len (64) minus the
    prompt (3 tokens), and charges that, not the Router's placeholder (63)."""
    async def main():
        replica, engine = await open_replica()
        pending = asyncio.ensure_future(replica.generate({"prompt": [1, 2, 3], "max_tokens": 63}, {"fill_max_tokens": True}))
        await asyncio.sleep(0.01)
        assert engine.requests[-1].max_tokens == 61
        assert (await replica.load())["outstanding_cost"] == 3 + 61
        engine.release.set()
        await pending
        await replica.shutdown()

    asyncio.run(main())


def test_tiny_model_name_is_built_at_start():
    async def main():
        replica, engine = await open_replica("tiny:llama")
        assert engine.config.model.endswith("tiny-llama-0")
        await replica.shutdown()

    asyncio.run(main())


def test_bad_requests_stay_bad_and_a_dead_engine_makes_the_replica_unavailable():
    async def main():
        replica, engine = await open_replica()
        with pytest.raises(InvalidRequestError):
            await replica.generate({"prompt": "bad"})
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            await replica.generate({"prompt": "x", "max_tokens": -1})
        await replica.check_health()
        pending = asyncio.ensure_future(replica.generate({"prompt": "x"}))
        await asyncio.sleep(0.01)
        engine.dead = True
        engine.release.set()
        with pytest.raises(ReplicaUnavailableError, match="engine is dead"):
            await pending
        with pytest.raises(RuntimeError, match="failed its health check"):
            await replica.check_health()
        await replica.shutdown()

    asyncio.run(main())


def test_shutdown_drains_in_flight_requests_then_stops_the_engine():
    async def main():
        replica, engine = await open_replica()
        pending = asyncio.ensure_future(replica.generate({"prompt": "x"}))
        await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(replica.shutdown())
        await asyncio.sleep(0.01)
        assert not engine.stopped and not stopping.done()  # waiting for the request
        with pytest.raises(ReplicaUnavailableError, match="shutting down"):
            await replica.generate({"prompt": "late"})
        engine.release.set()
        assert (await pending).text == "t"
        await stopping
        assert engine.stopped

    asyncio.run(main())


def test_drain_gives_up_after_its_timeout():
    async def main():
        replica = await EngineReplica.open({"model": "/m"}, FakeEngine, {**OPTIONS, "drain_timeout_s": 0.05})
        engine = FakeEngine.started[-1]
        pending = asyncio.ensure_future(replica.generate({"prompt": "x"}))
        await asyncio.sleep(0.01)
        await replica.__del__()  # what Serve awaits on graceful shutdown
        assert engine.stopped and not pending.done()
        pending.cancel()

    asyncio.run(main())


def test_cpu_bind_gives_replica_r_allowed_core_r_mod_n_and_leaves_an_explicit_setting(monkeypatch):
    import os

    from replicas.replica import CPU_BIND_ENV, _bind_cpu

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {6, 4})
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)
    _bind_cpu("rank", 3)
    assert os.environ[CPU_BIND_ENV] == "6"  # allowed cores sorted: 4, 6
    monkeypatch.setenv(CPU_BIND_ENV, "auto")
    _bind_cpu("none", 0)
    assert os.environ[CPU_BIND_ENV] == "nobind"
    monkeypatch.setenv(CPU_BIND_ENV, "1")  # the user's own choice (scripts/test.sh sets nobind)
    _bind_cpu("rank", 0)
    assert os.environ[CPU_BIND_ENV] == "1"
