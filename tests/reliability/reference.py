"""What each request of the load mix (bench.load.Mix) must return, from HuggingFace fp32 on the
same weights: the suite's and the soak's `verify`."""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import torch

from bench.load import CAPTURE_HOOKS, STEER_CHECK_HOOK, STEER_HOOK, STEER_SCALE, steer_vector
from replicas.api.hooks import resolve_hook
from tests.hf_reference import hf_activations, hf_greedy

TOL = 1e-4


class Reference:
    """What each request of the mix must return, from HuggingFace fp32 on the same weights;
    cached per prompt, since the mix repeats a few prompts."""

    def __init__(self, model: str, d_model: int = 128) -> None:
        self.model = model
        vector = torch.as_tensor(steer_vector(d_model))
        layer, kind = resolve_hook(STEER_HOOK)
        self.edits = [(layer, kind, lambda h: h + STEER_SCALE * vector)]
        self._lock = threading.Lock()

    @functools.lru_cache(maxsize=64)
    def activations(self, ids: tuple[int, ...], steered: bool) -> dict[Any, np.ndarray]:
        with self._lock:
            return hf_activations(self.model, ids, self.edits if steered else None)

    @functools.lru_cache(maxsize=64)
    def greedy(self, ids: tuple[int, ...], n: int, steered: bool) -> list[int]:
        with self._lock:
            return hf_greedy(self.model, ids, n, self.edits if steered else None)

    def verify(self, kind: str, request: dict[str, Any], result: Any) -> str | None:
        ids = tuple(result.prompt_token_ids)
        steered = kind == "steer"
        if kind != "capture" and result.token_ids != self.greedy(ids, request["max_tokens"], steered):
            return f"tokens {result.token_ids} differ from HF greedy"
        hooks = CAPTURE_HOOKS if kind == "capture" else (STEER_CHECK_HOOK,) if steered else ()
        if hooks and result.positions != list(range(len(ids))):
            return f"positions {result.positions}"
        reference = self.activations(ids, steered) if hooks else {}
        for hook in hooks:
            want = reference[tuple(resolve_hook(hook))]
            if not np.allclose(result.activations[hook], want, atol=TOL, rtol=TOL):
                return f"{hook} differs from HF by {np.abs(result.activations[hook] - want).max():.2e}"
        return None
