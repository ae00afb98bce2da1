"""What the Router's handle methods take besides a request: capture()'s defaults, `by_reference`."""

from __future__ import annotations

from typing import Any, Literal, Union

from replicas.api import CaptureSpec, GenerateRequest, GenerateResult
from replicas.api.errors import InvalidRequestError
from replicas.api.validation import validated

AUTO_REFERENCE_BYTES = 1 << 20  # by_reference="auto": results with this many array bytes come by reference
ByReference = Union[bool, Literal["auto"]]


def check_by_reference(by_reference: Any) -> None:
    if by_reference not in (True, False, "auto") or not isinstance(by_reference, (bool, str)):
        raise InvalidRequestError(f"by_reference: expected true, false or 'auto', got {by_reference!r}")


def wants_reference(by_reference: ByReference, value: Any) -> bool:
    if by_reference != "auto":
        return bool(by_reference)
    if not isinstance(value, GenerateResult):
        return False
    logits = 0 if value.logits is None else value.logits.nbytes
    return value.activation_bytes + logits >= AUTO_REFERENCE_BYTES


def capture_request(request: GenerateRequest | dict[str, Any], where: str = "") -> GenerateRequest:
    """A capture() request: capture required, max_tokens 1, greedy, positions default "prompt"."""
    if isinstance(request, GenerateRequest):
        given = request.model_fields_set
        max_tokens = request.max_tokens if "max_tokens" in given else None
        capture = request.capture
        positions_given = capture is not None and "positions" in capture.model_fields_set
    elif isinstance(request, dict):
        max_tokens = request.get("max_tokens")
        capture = request.get("capture")
        positions_given = isinstance(capture, dict) and "positions" in capture
    else:
        return validated(request, where)  # raises, naming the type
    if capture is None:
        raise InvalidRequestError(
            f"{where}capture: capture() needs a capture spec, e.g. {{'hooks': ['blocks.0.hook_resid_post']}}; "
            "use generate() for text only"
        )
    if max_tokens not in (None, 1):
        raise InvalidRequestError(
            f"{where}max_tokens: capture() runs the prompt only (max_tokens=1), got {max_tokens}; use generate() to sample"
        )
    request = validated(request, where)
    spec: CaptureSpec = request.capture  # type: ignore[assignment]
    if not positions_given:
        spec = spec.model_copy(update={"positions": "prompt"})
    return request.model_copy(update={"max_tokens": 1, "temperature": 0.0, "capture": spec})
