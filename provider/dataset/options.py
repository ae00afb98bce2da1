"""What one `capserve capture` run asks for (CaptureOptions), and the error that stops it (LineFailed).

Its own module so that the manifest and the harvester read the options without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from replicas.api import CaptureSpec


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

    def __post_init__(self) -> None:
        # The same checks the Router makes, before any request: a typo fails here, not per line.
        CaptureSpec(hooks=list(self.hooks), positions=self._positions(), reduce=self.reduce, dtype=self.dtype)
        if self.max_tokens == 0 and self.positions == "generated":
            raise ValueError("--positions generated needs --max-tokens > 0 (with 0 only the prompt runs)")
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

    @property
    def window(self) -> int:
        """Open shards: enough that `concurrency` requests fit in them, plus one being written."""
        return max(2, math.ceil(self.concurrency / self.shard_lines) + 1)
