"""A request's `GenerateResult`, built from vLLM's final output and the rows the worker took.

`Finish` travels with a request through `CaptureEngine.generate`: what it captures, the arena
blocks it holds, and how its rows are cut once the caller's tokens are known. `generation_result`
turns vLLM's completions into the result; `add_captured` adds the worker's rows to it, trimmed to
the tokens the caller gets back.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np

from replicas.api import arrays
from replicas.api import CaptureSpec, GenerateResult, ModelInfo
from replicas.engine.attention import finish_capture
from replicas.plans.request import reduced_on_replica
from replicas.readouts.specs import readout_results
from replicas.sae.specs import sae_results
from replicas.engine.tools import ToolTurn, choice


class Finish:
    """What the replica does with a request's rows once it knows which tokens the caller gets."""

    def __init__(self, takes: bool, capture: CaptureSpec | None, prompt_len: int, arena_blocks: int = 0):
        self.takes = takes
        self.capture = capture
        self.widened = False  # the worker captured more positions than asked, for a pattern's keys
        self.arena_blocks = arena_blocks  # of the replica's arena budget, held until freed
        self.held = False  # its result views the arena: freed when those arrays are dropped
        self.ran = False  # submitted to vLLM
        self.taking = False  # its take is under way
        # a mean over rows that may run past the returned tokens is taken here, after trimming
        self.mean_dtype = capture.dtype if capture is not None and reduced_on_replica(capture, prompt_len) else None
        self.tool_turn: ToolTurn | None = None  # parses the completions of a request with tools

    def rows(self, array: np.ndarray, kept: int) -> np.ndarray:
        """The first `kept` rows, or their mean; a mean the worker took ([d]) covers prompt rows only."""
        if array.ndim == 1:
            return array
        if self.mean_dtype is None:
            return array[:kept]
        mean = array[:kept].astype(np.float32).sum(0) / max(kept, 1)
        return mean.astype(arrays.DTYPES[self.mean_dtype])


def generation_result(key: str, final: Any, completions: list[Any], turn: ToolTurn | None, replica: str | None) -> GenerateResult:
    """The result of vLLM's completions (in index order) and its final output, without rows."""
    choices = [choice(turn, c.text, list(c.token_ids), c.finish_reason, _logprobs(c.logprobs)) for c in completions]
    return GenerateResult(
        request_id=key,
        text=choices[0].text,
        token_ids=choices[0].token_ids,
        prompt_token_ids=list(final.prompt_token_ids),
        finish_reason=choices[0].finish_reason,
        choices=choices,
        tool_calls=choices[0].tool_calls,
        logprobs=choices[0].logprobs,
        prompt_logprobs=[_logprob_row(row) for row in final.prompt_logprobs] if final.prompt_logprobs else None,
        replica=replica,
    )


def add_captured(
    result: GenerateResult, taken: dict[str, Any], finish: Finish, info: ModelInfo, read: Callable[[dict[str, Any]], np.ndarray],
    texts: Callable[[list[int]], list[str]] | None = None,
) -> None:
    """The worker's rows of the request (`taken`, without error) into `result`; `read` turns a
    stored array's description into its array, `texts` token ids into their strings."""
    sequence = result.prompt_token_ids + result.token_ids
    # The engine core may have run steps past what the caller gets back (a stop string is
    # matched in the front end after the core ran on): keep the rows of fed tokens only.
    fed = len(sequence) - 1
    kept = bisect.bisect_left(taken["positions"], fed)
    result.sae = sae_results(taken.get("sae") or [], fed)
    result.readouts = readout_results(taken.get("readouts") or [], fed, texts)
    activations = {name: finish.rows(read(raw), kept) for name, raw in taken["activations"].items()}
    if finish.capture is not None:
        result.activations, result.positions = finish_capture(
            activations, taken["positions"][:kept], finish.capture, len(result.prompt_token_ids), info.d_model,
            info.attention, finish.widened, info.moe,
        )
    result.capture_token_ids = [sequence[p] for p in result.positions]
    if taken["logits"] is not None:
        kept_logits = bisect.bisect_left(taken["logits_positions"], fed)
        result.logits = read(taken["logits"])[:kept_logits]
        result.logits_positions = taken["logits_positions"][:kept_logits]


def _logprob_row(row: dict[int, Any] | None) -> dict[int, float] | None:
    return None if row is None else {int(t): float(lp.logprob) for t, lp in row.items()}


def _logprobs(rows: Any) -> list[dict[int, float]] | None:
    return None if rows is None else [_logprob_row(row) or {} for row in rows]
