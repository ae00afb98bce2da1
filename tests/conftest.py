"""Shared fixtures: tiny models and real vLLM CPU engines, started once per session.

Engines are bound to the event loop they start on, so the session owns one loop in a background
thread and tests submit coroutines to it with `run(...)`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

T = TypeVar("T")
ARCHS = ("llama", "qwen2", "gpt2")
MAX_NUM_BATCHED_TOKENS = 128  # small, so prompts past it exercise chunked prefill


def _on_gpu() -> bool:
    # Not torch.cuda.is_available(): initializing CUDA here would break vLLM's forked engine process.
    return os.path.exists("/dev/nvidiactl")


# fp32 against HF fp32 to 1e-4 on CPU. On the GPU host vLLM picks kernels by batch size and sums
# in their order, so the GPU suite compares by relative error (GPU_RELATIVE_TOL) and cannot ask a
# request batched with others to be bit-identical to the same request alone.
ON_GPU = _on_gpu()
if ON_GPU:
    # vLLM's Triton kernels (a mixture of experts' fused experts among them) take float32 dot inputs
    # as TF32, dropping 13 mantissa bits. A router whose second and third logits are within
    # that error then sends a token to another expert than HF does, and the row differs whole: the
    # H200 run of 2026-12-07 missed HF by 9.4e-2 on Mixtral's per-head edits, which HF itself gives
    # with its experts' inputs truncated the same way (bench/moe_tf32.py). IEEE dots keep the
    # matrix about capserve's hooks. Set before any engine process starts, which inherits it.
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
# bench/gpu/suite.sh ... quick: the shared engines compile without Inductor too (CUDA graphs still
# on), so a check of the capture path fits a short device call
QUICK_GPU_ENGINES = os.environ.get("CAPSERVE_QUICK_GPU_ENGINES") == "1"
ACTIVATION_TOL = 1e-4
LOGIT_TOL = 1e-3
GPU_RELATIVE_TOL = 3e-3


def assert_close(actual, desired, atol: float, rtol: float = 0.0, err_msg: str = "") -> None:
    actual, desired = np.asarray(actual, dtype=np.float32), np.asarray(desired, dtype=np.float32)
    if not ON_GPU:
        np.testing.assert_allclose(actual, desired, atol=atol, rtol=rtol, err_msg=err_msg)
        return
    assert actual.shape == desired.shape, (actual.shape, desired.shape, err_msg)
    error = np.linalg.norm(actual - desired) / max(np.linalg.norm(desired), 1e-12)
    assert error <= max(GPU_RELATIVE_TOL, rtol), f"relative error {error:.2e} {err_msg}"


def assert_same(actual, desired) -> None:
    """Bit-identical on CPU; at TF32 precision on the GPU (kernels depend on the batch)."""
    if ON_GPU:
        assert_close(actual, desired, atol=0.0)
    else:
        np.testing.assert_array_equal(actual, desired)


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
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_models(model_root: Path) -> dict[str, str]:
    from replicas.tiny import make_tiny_model

    return {arch: make_tiny_model(arch, model_root / arch, seed=1) for arch in ARCHS}


def engine_config(path: str, **overrides: Any) -> Any:
    """The test engines' settings: small enough that several share this machine (or one GPU)."""
    from replicas.engine import EngineConfig

    settings: dict[str, Any] = dict(
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=64,
        max_capture_bytes=2 << 20,
        edit_stages=2,
        kv_cache_memory_bytes=256 << 20,
        gpu_memory_utilization=0.2,  # four engines share one GPU on the GPU host
    )
    return EngineConfig(model=path, **(settings | overrides))


def armed_with_attention(path: str) -> list[str]:
    """Every kind the model's blocks have (a router's too; a sandwich block's unnormed sublayer
    outputs), and the attention kinds (armed only when asked)."""
    from transformers import AutoConfig

    from replicas.api.hooks import HEAD_KINDS, PATTERN_KINDS, UNNORMED_KINDS
    from replicas.engine.architectures import block_shape, layer_kinds, moe_shape

    config = AutoConfig.from_pretrained(path)
    architecture = config.architectures[0]
    shape = block_shape(architecture, config)
    unnormed = list(UNNORMED_KINDS) if shape == "sandwich" else []
    return [*layer_kinds(shape, moe_shape(architecture, config)), *unnormed, *HEAD_KINDS, *PATTERN_KINDS]


async def start_engine(path: str, name: str, quick_compile: bool = False, **overrides: Any) -> Any:
    """quick_compile: on the GPU host, CUDA graphs over Dynamo's graph without Inductor, whose
    build makes a tiny engine take minutes to start; the CPU engines run eagerly anyway."""
    from replicas.engine import CaptureEngine

    if quick_compile and ON_GPU:
        overrides["engine_kwargs"] = {"compilation_config": {"backend": "eager"}}
    return await CaptureEngine.start(engine_config(path, **overrides), name=name)


@pytest.fixture(scope="session")
def engines(loop: LoopThread, tiny_models: dict[str, str]) -> Iterator[dict[str, Any]]:
    """One real engine per tiny architecture, started concurrently. GPT-2's runs dtype auto, which
    must keep its float32 checkpoint in float32 (vLLM's own auto would run it in bfloat16)."""

    async def start_all() -> list[Any]:
        dtypes = {arch: "auto" if arch == "gpt2" else "float32" for arch in ARCHS}
        return await asyncio.gather(*(
            start_engine(tiny_models[a], name=f"engine-{a}", quick_compile=QUICK_GPU_ENGINES, dtype=dtypes[a],
                         armed_kinds=armed_with_attention(tiny_models[a]), forward_timing=True)
            for a in ARCHS
        ))

    started = dict(zip(ARCHS, loop.run(start_all())))
    yield started
    for engine in started.values():
        loop.run(engine.shutdown())


@pytest.fixture(autouse=True, scope="module")
def _ray_ends_with_its_module() -> Iterator[None]:
    """Each module starts its own Ray cluster; one whose start failed leaves Ray up in this worker,
    and every later module's ray.init would fail with it (and code asking the running Serve for its
    settings would read the dead module's). Shut down after the module's own fixtures."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(autouse=True, scope="session")
def _quiet_vllm() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


# ---------------------------------------------------------------- reliability figures

FIGURES = pytest.StashKey[dict[str, Any]]()


@pytest.fixture(scope="session")
def figures(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Measurements a test records by name; printed at the end of the run and written to
    bench/results/reliability_cpu.json (merged into what an earlier run wrote)."""
    return request.config.stash.setdefault(FIGURES, {})


# The slowest modules, slowest first (seconds of a serial run on the 2-core CI machine,
# 2026-12-06): scripts/test.sh hands whole modules to two pytest-xdist workers (--dist loadfile)
# in this order, so the long ones start at once and the short ones fill in around them.
SLOW_MODULES = {
    "test_architectures": 338, "test_cli": 144, "test_provider_serve": 124, "test_multinode": 121,
    "test_openai_serve": 101, "test_serve_cli": 89, "test_reliability": 74, "test_quantized": 71,
    "test_serve_app": 69, "test_engine_compiled": 64, "test_saelens_dataset": 60, "test_readouts": 58,
    "test_engine_precision": 37, "test_tl_bridge": 37, "test_lifeline": 24, "test_engine_memory_bounds": 22,
}


# A soak test (a load ramp or a fault under load) runs about a minute on that machine.
SOAK_TEST_SECONDS = 60


@pytest.hookimpl(trylast=True)  # after pytest's grouping by fixture and the -m deselection
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    seconds: dict[str, float] = {}
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        seconds.setdefault(module, SLOW_MODULES.get(module, 0))
        if item.get_closest_marker("soak"):
            seconds[module] += SOAK_TEST_SECONDS
    items.sort(key=lambda item: -seconds[item.module.__name__.rpartition(".")[2]])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its figures to the controller, which prints and saves them."""
    figures = session.config.stash.get(FIGURES, None)
    if figures and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["capserve_figures"] = json.dumps(figures, default=str)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    sent = getattr(node, "workeroutput", {}).get("capserve_figures")
    if sent:
        node.config.stash.setdefault(FIGURES, {}).update(json.loads(sent))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    figures = config.stash.get(FIGURES, None)
    if not figures:
        return
    from tests.reliability.report import print_figures, save_figures

    print_figures(terminalreporter, figures)
    terminalreporter.write_line(f"figures written to {save_figures(figures)}")
