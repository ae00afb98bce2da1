"""Pydantic field types the schema modules share (`replicas.api.schemas`, `replicas.api.readouts`):
token positions; arrays of numbers (lists, numpy arrays or the `{"dtype", "shape", "data"}` encoding
of `replicas.api.arrays`); result arrays; and a vector given by the name it was registered under
with the app (serve_config `vectors`, POST /v1/vectors)."""

from __future__ import annotations

import re
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



def _to_float_array(value: Any) -> np.ndarray:
    if arrays.is_encoded_array(value):
        value = arrays.from_raw(value)
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"expected an array of numbers: {exc}") from None
    if array.ndim not in (1, 2, 3) or array.size == 0:
        raise ValueError(f"expected a non-empty 1-D, 2-D or (per head) 3-D array, got shape {list(array.shape)}")
    if not np.isfinite(array).all():
        raise ValueError("array contains NaN or infinite values; only finite numbers are allowed")
    return array


FloatArray = Annotated[
    np.ndarray,
    BeforeValidator(_to_float_array),
    PlainSerializer(lambda a: a.tolist(), when_used="json"),
    WithJsonSchema({"type": "array", "items": {}, "description": "numbers, [d_model] or [rows, d_model]"}),
]

VECTOR_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


def check_vector_name(name: str) -> str:
    """A name a steering vector is registered under (serve_config `vectors`, POST /v1/vectors)."""
    if not VECTOR_NAME.fullmatch(name):
        raise ValueError(
            f"vector name {name[:80]!r} is not allowed: use 1-64 letters, digits, '_', '.' or '-', starting with a letter"
        )
    return name


def _to_vector(value: Any) -> np.ndarray | str:
    return check_vector_name(value) if isinstance(value, str) else _to_float_array(value)


VectorOrName = Annotated[
    Union[np.ndarray, str],
    BeforeValidator(_to_vector),
    PlainSerializer(lambda v: v if isinstance(v, str) else v.tolist(), when_used="json"),
    WithJsonSchema({
        "anyOf": [{"type": "array", "items": {}}, {"type": "string"}],
        "description": "numbers, [d_model] (or [n_heads, d_head] on q, k, v, z), or a registered vector's name",
    }),
]
