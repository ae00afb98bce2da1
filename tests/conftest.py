"""Shared fixtures: tiny models and real vLLM CPU engines, started once per session.

Engines are bound to the event loop they start on, so the session owns one loop in a background
thread and tests submit coroutines to it with `run(...)`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
ARCHS = ("llama", "qwen2", "gpt2")
MAX_NUM_BATCHED_TOKENS = 128  # small, so prompts past it exercise chunked prefill


def _on_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# fp32 against HF fp32. On the GPU host vLLM's attention kernels multiply in TF32 (~1e-3
# relative), so the GPU suite compares at TF32 precision.
ON_GPU = _on_gpu()
ACTIVATION_TOL = 5e-3 if ON_GPU else 1e-4
LOGIT_TOL = 2e-2 if ON_GPU else 1e-3


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 600) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from replicas.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(arch, root / arch, seed=1) for arch in ARCHS}


@pytest.fixture(scope="session")
def engines(loop: LoopThread, tiny_models: dict[str, str]) -> Iterator[dict[str, Any]]:
    """One real engine per tiny architecture, started concurrently."""
    from replicas.engine import CaptureEngine, EngineConfig

    async def start_all() -> list[Any]:
        configs = [
            EngineConfig(
                model=tiny_models[arch],
                dtype="float32",
                max_model_len=512,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                max_num_seqs=64,
                max_capture_bytes=2 << 20,
                edit_stages=2,
                kv_cache_memory_bytes=256 << 20,
                gpu_memory_utilization=0.25,  # three engines share one GPU on the GPU host
            )
            for arch in ARCHS
        ]
        return await asyncio.gather(*(CaptureEngine.start(c, name=f"engine-{a}") for c, a in zip(configs, ARCHS)))

    started = dict(zip(ARCHS, loop.run(start_all())))
    yield started
    for engine in started.values():
        loop.run(engine.shutdown())


@pytest.fixture(autouse=True, scope="session")
def _quiet_vllm() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
