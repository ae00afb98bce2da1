"""The replica's side of vLLM: `CaptureEngine` (one `AsyncLLM` with capserve's worker and locked
settings), its `EngineConfig`, the architectures it serves, and what it needs to answer a request
(results, attention patterns, tools, tokens)."""

from replicas.engine.capture_engine import CaptureEngine
from replicas.engine.config import EngineConfig

__all__ = ["CaptureEngine", "EngineConfig"]
