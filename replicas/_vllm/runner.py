"""vLLM's model runner as capserve's step loop reads it: the step's batch layout, the seam around
the model call, and per-request state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from replicas._vllm.errors import VllmInternalsError


@dataclass(frozen=True)
class StepLayout:
    """Rows of the flattened batch: request k owns rows offsets[k]:offsets[k+1], whose absolute
    token positions start at start_positions[k] (tokens computed before this step)."""

    req_ids: list[str]
    offsets: np.ndarray
    start_positions: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1]) if len(self.offsets) else 0

    @property
    def one_token_each(self) -> bool:
        """Whether every request of the step runs exactly one token, as in a decode step."""
        return self.num_tokens == len(self.req_ids)

    def chunk(self, k: int) -> tuple[int, int, int]:
        """Request k's (first row, absolute position of that row, number of rows) in this step."""
        first = int(self.offsets[k])
        return first, int(self.start_positions[k]), int(self.offsets[k + 1]) - first


def step_layout(runner: Any) -> StepLayout:
    """Read once the runner has prepared the step's inputs (inside `_model_forward`)."""
    try:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        offsets = runner.query_start_loc.np[: num_reqs + 1].copy()
        start = batch.num_computed_tokens_cpu[:num_reqs].copy()
    except AttributeError as exc:
        raise VllmInternalsError("step_layout", f"runner {type(runner).__name__}: {exc}") from None
    return StepLayout(req_ids, offsets, start)


def wrap_model_forward(runner: Any, before: Callable[[], None], after: Callable[[], None]) -> None:
    """Run `before` once the step's layout is known and `after` once its forward has been issued.

    `_model_forward` is the runner's own seam around the model call (its docstring invites
    overriding); wrapping it on the instance keeps vLLM's class untouched. Warm-up and CUDA-graph
    capture call the model without it, so they see the idle buffers.
    """
    original = getattr(runner, "_model_forward", None)
    if original is None:
        raise VllmInternalsError("wrap_model_forward", f"{type(runner).__name__} has no _model_forward")

    def model_forward(*args: Any, **kwargs: Any) -> Any:
        before()
        output = original(*args, **kwargs)
        after()
        return output

    runner._model_forward = model_forward


def max_num_tokens(runner: Any) -> int:
    return int(runner.max_num_tokens)


def runner_device(runner: Any) -> torch.device:
    return torch.device(runner.device)


def worker_runner(worker: Any) -> Any:
    return worker.model_runner


def count_with_weights(runner: Any, nbytes: int) -> None:
    """Count device memory allocated after the weights loaded (capserve's sites, edit tables,
    SAEs, probes) as model memory. vLLM sizes the KV cache as its memory budget less the weights
    (`model_memory_usage`, measured around the load alone) and the peak of a profile run measured
    from that run's start: memory allocated in between is in neither, so the KV cache would take
    it a second time and the first large step would run out (a 70B fp8 engine at 0.9 of an H200,
    2026-12-06: 13 GiB of sites)."""
    if not hasattr(runner, "model_memory_usage"):
        raise VllmInternalsError("count_with_weights", "the model runner has no model_memory_usage")
    runner.model_memory_usage += nbytes


def engine_core_pids(llm: Any) -> list[int]:
    """The pids of an AsyncLLM's engine-core processes (its workers are their children)."""
    try:
        processes = llm.engine_core.resources.engine_manager.processes
    except AttributeError as exc:
        raise VllmInternalsError("engine_core_pids", f"no engine-core process list ({exc})") from None
    return [p.pid for p in processes if p.pid is not None]


def kv_cache_tokens(llm: Any) -> int:
    """Tokens an AsyncLLM's KV cache holds, as its engine core sized it at start."""
    cache = getattr(getattr(llm, "vllm_config", None), "cache_config", None)
    if cache is None or not cache.num_gpu_blocks:
        raise VllmInternalsError("kv_cache_tokens", "the engine's cache_config has no num_gpu_blocks")
    return int(cache.num_gpu_blocks) * int(cache.block_size)


def capserve_options(vllm_config: Any) -> dict[str, Any]:
    """capserve's worker options ride in `additional_config["capserve"]`."""
    return dict((vllm_config.additional_config or {}).get("capserve", {}))


def requests_gone(runner: Any, req_ids: Any) -> set[str]:
    """Those of req_ids (a set or dict keys) the runner no longer holds: one set difference."""
    return req_ids - runner.requests.keys()


def request_extra_args(runner: Any, req_id: str) -> dict[str, Any]:
    state = runner.requests.get(req_id)
    if state is None:
        raise VllmInternalsError("request_extra_args", f"request {req_id!r} is not in runner.requests")
    params = state.sampling_params
    return (params.extra_args or {}) if params is not None else {}


