"""The one format arrays travel in outside Python objects: dtype name, shape and raw bytes.

Used between the vLLM worker and the replica (msgpack carries bytes natively, never pickle), in
HTTP JSON bodies and in inspect logs (base64 of the same bytes: TransformerLens's
`{"data", "dtype", "shape"}` wire format). bfloat16 arrays are numpy arrays of `ml_dtypes.bfloat16`.
"""

from __future__ import annotations

import base64
import os
from typing import Any, TypedDict

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
}


class RawArray(TypedDict):
    dtype: str
    shape: list[int]
    data: bytes


class Base64Array(TypedDict):
    dtype: str
    shape: list[int]
    data: str


def dtype_name(array: np.ndarray) -> str:
    for name, dtype in DTYPES.items():
        if array.dtype == dtype:
            return name
    raise TypeError(f"array dtype {array.dtype} cannot travel; allowed: {', '.join(DTYPES)}")


def to_raw(array: np.ndarray) -> RawArray:
    array = np.ascontiguousarray(array)
    return {"dtype": dtype_name(array), "shape": list(array.shape), "data": array.tobytes()}


def from_raw(raw: RawArray | dict[str, Any]) -> np.ndarray:
    dtype = DTYPES.get(raw["dtype"])
    if dtype is None:
        raise ValueError(f"unknown array dtype {raw['dtype']!r}; allowed: {', '.join(DTYPES)}")
    data = raw["data"]
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    shape = tuple(int(n) for n in raw["shape"])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"array data has {len(data)} bytes but dtype {raw['dtype']} and shape {list(shape)} "
            f"need {expected}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def to_file(array: np.ndarray, path: str) -> dict[str, Any]:
    """Write the bytes to a file (shared memory) and describe them; for the worker-to-replica hop
    only, where a large capture would otherwise stall vLLM's engine core while it relays bytes."""
    array = np.ascontiguousarray(array)
    array.tofile(path)
    return {"dtype": dtype_name(array), "shape": list(array.shape), "path": path}


def from_file(described: dict[str, Any]) -> np.ndarray:
    """Read and delete what `to_file` wrote. Never call this on data from outside the replica."""
    path = described["path"]
    try:
        array = np.fromfile(path, dtype=DTYPES[described["dtype"]])
    finally:
        os.unlink(path)
    return array.reshape([int(n) for n in described["shape"]])


def to_base64(array: np.ndarray) -> Base64Array:
    raw = to_raw(array)
    return {"dtype": raw["dtype"], "shape": raw["shape"], "data": base64.b64encode(raw["data"]).decode()}


def is_encoded_array(value: Any) -> bool:
    return isinstance(value, dict) and {"dtype", "shape", "data"} <= value.keys()


class OutOfBand:
    """Pickles an array of a user-defined dtype (bfloat16) as a view of its bits, so it travels
    out-of-band. numpy pickles such dtypes in-band: Ray then copies the data into the pickle
    stream, and every process that loads the result copies it again, where a builtin dtype is a
    zero-copy view of the object store on one node."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray, str]]:
        bits = self.array.view(np.dtype(f"u{self.array.dtype.itemsize}"))
        return _viewed_as, (bits, dtype_name(self.array))


def _viewed_as(bits: np.ndarray, dtype: str) -> np.ndarray:
    return bits.view(DTYPES[dtype])


def out_of_band(array: np.ndarray) -> np.ndarray | OutOfBand:
    """What to pickle for `array`: itself when numpy pickles it out-of-band already."""
    user_defined = array.dtype.isbuiltin == 2  # ml_dtypes' bfloat16
    return OutOfBand(array) if user_defined else array


def unit(vector: np.ndarray) -> np.ndarray:
    """The float32 unit vector along `vector`, its norm taken in float64 so tiny vectors do not
    underflow to a zero norm (the request schema refuses zero vectors)."""
    wide = vector.astype(np.float64)
    return (wide / np.linalg.norm(wide)).astype(np.float32)
