"""What one `capserve capture` run asks for (CaptureOptions), and the error that stops it (LineFailed).

Its own module so that the manifest, the harvester and the replica-side sink all read the
options without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from replicas.api import CaptureSpec
from replicas.shards.sink import RowSpec

SINKS = ("auto", "replica", "driver")


class SinkUnreachable(ValueError):
    """`--sink replica` where the replicas cannot write the output folder."""


class LineFailed(RuntimeError):
    """A line that could not be captured; the message names the input line."""


@dataclass(frozen=True)
class CaptureOptions:
    hooks: tuple[str, ...]
    positions: str | tuple[int, ...] = "all"
    reduce: str = "none"
    dtype: str = "float32"
    max_tokens: int = 0  # 0: prompt only, through the Router's capture()
    temperature: float = 0.0
    shard_lines: int = 1024
    input_format: str = "jsonl"
    concurrency: int = 64
    retries: int = 8
    skip_invalid: bool = False
    sink: str = "auto"  # who writes shards: replica | driver | auto (provider.dataset.remote.choose_sink)
    shards_in_flight: int = 0  # replica sink: shards being captured at once; 0: auto

    def __post_init__(self) -> None:
        # The same checks the Router makes, before any request: a typo fails here, not per line.
        CaptureSpec(hooks=list(self.hooks), positions=self._positions(), reduce=self.reduce, dtype=self.dtype)
        if self.max_tokens == 0 and self.positions == "generated":
            raise ValueError("--positions generated needs --max-tokens > 0 (with 0 only the prompt runs)")
        if self.sink not in SINKS:
            raise ValueError(f"--sink {self.sink!r}: use one of {', '.join(SINKS)}")
        if self.shards_in_flight < 0:
            raise ValueError(f"shards_in_flight must be 0 (auto) or more, got {self.shards_in_flight}")
        for name in ("shard_lines", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def _positions(self) -> str | list[int]:
        return self.positions if isinstance(self.positions, str) else list(self.positions)

    def pinned(self) -> dict[str, Any]:
        """What decides a shard's content; must match on resume."""
        keys = ("hooks", "positions", "reduce", "dtype", "max_tokens", "temperature", "shard_lines", "input_format")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if k in keys}

    def request(self, prompt: Any) -> dict[str, Any]:
        capture = {"hooks": list(self.hooks), "positions": self._positions(), "reduce": self.reduce, "dtype": self.dtype}
        request: dict[str, Any] = {"prompt": prompt, "capture": capture}
        if self.max_tokens > 0:
            request.update(max_tokens=self.max_tokens, temperature=self.temperature)
        return request

    def engine_request(self, prompt: Any) -> dict[str, Any]:
        """`request(prompt)` as a replica runs it: prompt only is one greedy forward
        (what the Router's capture() makes of it)."""
        request = self.request(prompt)
        return request if self.max_tokens > 0 else {**request, "max_tokens": 1, "temperature": 0.0}

    def row_spec(self) -> RowSpec:
        return RowSpec(hooks=list(self.hooks), reduce=self.reduce, dtype=self.dtype, generated=self.max_tokens > 0)  # type: ignore[arg-type]

    @property
    def window(self) -> int:
        """Open shards: enough that `concurrency` requests fit in them, plus one being written."""
        return max(2, math.ceil(self.concurrency / self.shard_lines) + 1)
