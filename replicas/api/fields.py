"""Field types several schema modules share: token positions and result arrays
(`replicas.api.schemas`, `replicas.api.readouts`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

from replicas.api import arrays

PositionMode = Literal["all", "prompt", "generated", "last_prompt"]
Positions = Union[PositionMode, list[int]]
"""Which token positions: a mode, or absolute indices (negative count back from the prompt's end)."""


def _to_array(value: Any) -> np.ndarray:
    return arrays.from_raw(value) if arrays.is_encoded_array(value) else np.asarray(value)


ResultArray = Annotated[
    np.ndarray,
    BeforeValidator(_to_array),
    PlainSerializer(lambda a: dict(arrays.to_base64(a)), when_used="json"),
    WithJsonSchema({"type": "object", "description": "{dtype, shape, data: base64}"}),
]
