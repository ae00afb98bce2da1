"""The request contract, torch- and vLLM-free: what the router, the provider, the replica and the
worker all read. The schemas (`replicas.api.schemas`, `replicas.api.model_info`) are re-exported
here; hook names, errors and the array wire format have their own modules in this package."""

from replicas.api.fields import FloatArray, PositionMode, Positions, ResultArray
from replicas.api.hooks import HookPoint, resolve_hook
from replicas.api.model_info import AttentionInfo, ModelInfo, MoeInfo, ProbeInfo, SaeInfo
from replicas.api.readouts import LensSpec, ProbeSpec, ReadoutResult, ReadoutSpec
from replicas.api.schemas import (
    CaptureSpec,
    ChatMessage,
    Choice,
    GenerateRequest,
    GenerateResult,
    Intervention,
    LogitsSpec,
    NamedToolChoice,
    NamedToolChoiceFunction,
    SaeFeatures,
    SaeSpec,
    Tool,
    ToolCall,
    ToolCallFunction,
    ToolFunction,
)

__all__ = [
    "HookPoint", "resolve_hook",
    "AttentionInfo", "CaptureSpec", "ChatMessage", "Choice", "FloatArray", "GenerateRequest", "GenerateResult",
    "Intervention", "LogitsSpec", "ModelInfo", "MoeInfo", "NamedToolChoice", "NamedToolChoiceFunction", "PositionMode",
    "Positions", "ProbeInfo", "ResultArray", "SaeFeatures", "SaeInfo", "SaeSpec", "LensSpec", "ProbeSpec", "ReadoutResult", "ReadoutSpec",
    "Tool", "ToolCall", "ToolCallFunction", "ToolFunction",
]
