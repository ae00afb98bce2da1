"""A fast in-process stand-in for the Serve app, for the capture pipeline's unit tests and the
memory measurement (bench/bench_capture_memory.py). Activations are a pure function of
(prompt tokens, position, hook), so every stored row can be checked exactly."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from replicas.api import GenerateResult, ModelInfo
from replicas.api.arrays import DTYPES
from replicas.api.errors import InvalidRequestError


class FakeTransient(RuntimeError):
    """What a lost replica looks like to the pipeline: retryable."""


def tokens_of(prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return list(prompt.encode())
    if prompt and isinstance(prompt[0], dict):
        return list(" ".join(m["content"] for m in prompt).encode())
    return list(prompt)


def select_positions(n: int, positions: Any) -> list[int]:
    if positions in ("all", "prompt"):
        return list(range(n))
    if positions == "last_prompt":
        return [n - 1]
    return [p if p >= 0 else n + p for p in positions]


def expected_rows(prompt: Any, hook_index: int, positions: Any, d_model: int, reduce: str = "none") -> np.ndarray:
    ids = tokens_of(prompt)
    kept = select_positions(len(ids), positions)
    rows = np.zeros((len(kept), d_model), np.float32)
    for r, p in enumerate(kept):
        rows[r, 0] = ids[p] + 256 * p + 65536 * hook_index  # exact in float32: < 2**24
        rows[r, 1:] = np.arange(1, d_model) + hook_index
    return rows.mean(axis=0) if reduce == "mean" else rows


class FakeBackend:
    """`fail_first`: each line's first `fail_first` attempts raise FakeTransient. Prompts
    containing "INVALID" are rejected as bad requests; "BOOM" fails for good (not retryable)."""

    description = "fake"

    def __init__(
        self,
        d_model: int = 8,
        delay_s: float = 0.0,
        fail_first: int = 0,
        on_request: Callable[[dict[str, Any]], None] | None = None,
        boom: bool = True,
    ) -> None:
        self.d_model = d_model
        self.delay_s = delay_s
        self.fail_first = fail_first
        self.on_request = on_request
        self.boom = boom
        self.attempts: dict[str, int] = {}
        self.requests = 0

    def connect(self) -> None:
        pass

    async def info(self) -> ModelInfo:
        return ModelInfo(
            model="fake-model", architecture="Fake", n_layers=4, d_model=self.d_model, d_vocab=256,
            max_model_len=4096, dtype="float32", hook_names=["blocks.0.hook_resid_post"], armed_kinds=["resid_post"],
        )

    async def run(self, request: dict[str, Any], prompt_only: bool) -> GenerateResult:
        self.requests += 1
        if self.on_request is not None:
            self.on_request(request)
        if self.delay_s:
            await asyncio.sleep(random.uniform(0, self.delay_s))
        if self.fail_first:  # tracked only when asked: the memory benchmark must not grow here
            key = repr(request["prompt"])
            self.attempts[key] = self.attempts.get(key, 0) + 1
            if self.attempts[key] <= self.fail_first:
                raise FakeTransient(f"replica lost (attempt {self.attempts[key]})")
        text = request["prompt"] if isinstance(request["prompt"], str) else ""
        if "INVALID" in text:
            raise InvalidRequestError("prompt: too long for max_model_len=4096 (fake)")
        if "BOOM" in text and self.boom:
            raise ValueError("the fake backend broke for good")
        return self._result(request)

    def _result(self, request: dict[str, Any]) -> GenerateResult:
        spec = request["capture"]
        ids = tokens_of(request["prompt"])
        kept = select_positions(len(ids), spec["positions"])
        dtype = DTYPES[spec["dtype"]]
        activations = {
            hook: expected_rows(request["prompt"], i, spec["positions"], self.d_model, spec["reduce"]).astype(dtype)
            for i, hook in enumerate(spec["hooks"])
        }
        return GenerateResult(
            request_id=str(self.requests), text="", token_ids=[0], prompt_token_ids=ids, finish_reason="length",
            choices=[], activations=activations, positions=kept, capture_token_ids=[ids[p] for p in kept],
            replica=f"fake-{len(ids) % 2}",
        )

    def retry_delay(self, exc: BaseException) -> float | None:
        return 0.0 if isinstance(exc, FakeTransient) else None

    async def close(self) -> None:
        pass


class FakeSinkBackend(FakeBackend):
    """FakeBackend whose "replicas" write shards themselves: `run_shard` runs the job through
    `replicas.shards.sink.run_shard` in this process, as EngineReplica.capture_shard does."""

    description = "fake with replica-side sinks"

    def __init__(self, *args: Any, fail_shards: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from replicas.shards.sink import ShardSink

        self.sink = ShardSink(threads=2, max_unwritten=2)
        self.fail_shards = fail_shards  # the first N jobs die mid-shard, as a killed replica would
        self.jobs = 0

    def shares_folder(self, out: Any) -> bool:
        return True

    async def replicas(self) -> int:
        return 2

    async def run_shard(self, job: dict[str, Any]) -> dict[str, Any]:
        from replicas.shards.sink import run_shard, shard_job

        self.jobs += 1
        if self.jobs <= self.fail_shards:
            raise FakeTransient(f"replica died holding shard {job['shard']}")
        index = await run_shard(shard_job(job), lambda request: self.run(request, False), self.sink)
        return index.model_dump()
