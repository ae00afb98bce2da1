"""Turn a request dict into a `GenerateRequest`, or an `InvalidRequestError` naming every bad field.

Shared by the router (which validates before any replica is picked) and the replica deployment,
so a caller sees the same message whichever one rejected the request.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from replicas.api import GenerateRequest
from replicas.api.errors import InvalidRequestError


def validated(request: GenerateRequest | dict[str, Any], where: str = "") -> GenerateRequest:
    """`where` prefixes field names, e.g. "requests[3]." for one item of a batch."""
    if isinstance(request, GenerateRequest):
        return request
    if not isinstance(request, dict):
        raise InvalidRequestError(
            f"{where or 'request'}: expected a JSON object / dict of GenerateRequest fields, "
            f"got {type(request).__name__}"
        )
    try:
        return GenerateRequest.model_validate(request)
    except ValidationError as exc:
        raise InvalidRequestError(validation_message(exc, where)) from None


def validation_message(exc: ValidationError, where: str = "") -> str:
    parts = []
    for error in exc.errors():
        loc = ".".join(str(p) for p in error["loc"]) or "request"
        parts.append(f"{where}{loc}: {error['msg']}")
    return "invalid request: " + "; ".join(parts)
