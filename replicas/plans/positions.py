"""Which rows of a request a position spec selects: modes ("all", "prompt", "generated",
"last_prompt") as integer codes, so one step's selection is computed for every request at once with
numpy, and explicit indices (negative ones count back from the end of the prompt)."""

from __future__ import annotations

import numpy as np

from replicas.api import Positions
from replicas.api.errors import PlanError


# Position modes as integer codes, so one step's selection is computed for every request at once.
MODE_CODES = {"all": 0, "prompt": 1, "generated": 2, "last_prompt": 3}
EXPLICIT = -1  # a list of indices: selected request by request
PHASE_MODES = {"all": "all", "prefill": "prompt", "decode": "generated"}


def mode_code(spec: Positions) -> int:
    return MODE_CODES[spec] if isinstance(spec, str) else EXPLICIT


def selected_spans(
    mode: np.ndarray, start: np.ndarray, count: np.ndarray, prompt_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For chunks of `count` rows whose first row sits at absolute position `start`, the offsets
    [a, b) each position mode selects (modes are ranges, so no search). Arrays in, arrays out;
    rows of EXPLICIT mode come out as garbage for the caller to replace."""
    end = start + count
    lo = np.where(mode == 2, np.maximum(start, prompt_len), np.where(mode == 3, np.maximum(start, prompt_len - 1), start))
    # a chunk of the prompt that ends before the generated rows begin selects none of them: its
    # span stays inside the chunk (the step loop indexes rows with it)
    lo = np.minimum(lo, end)
    hi = np.where((mode == 1) | (mode == 3), np.minimum(end, prompt_len), end)
    return lo - start, np.maximum(hi, lo) - start


def concatenated_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), in one pass."""
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def selected_range(spec: Positions, start: int, count: int, prompt_len: int) -> tuple[int, int] | None:
    """`selected_spans` for one chunk; None for explicit indices."""
    code = mode_code(spec)
    if code == EXPLICIT:
        return None
    a, b = selected_spans(np.array(code), np.array(start), np.array(count), np.array(prompt_len))
    return int(a), int(b)


def selected_offsets(spec: Positions, start: int, count: int, prompt_len: int) -> np.ndarray:
    """Offsets (ascending) of the rows a spec selects in such a chunk."""
    span = selected_range(spec, start, count, prompt_len)
    if span is not None:
        return np.arange(*span)
    wanted = np.unique(absolute_indices(spec, prompt_len))  # type: ignore[arg-type]
    return wanted[(wanted >= start) & (wanted < start + count)] - start


NO_END = np.iinfo(np.int64).max  # a spec that may select rows as long as the request runs


def selection_end(specs: list[Positions], prompt_len: int) -> int:
    """The position past the last row any of these specs can select: the prompt's end for
    "prompt" and "last_prompt", past the last explicit index, NO_END for "all" and "generated"."""
    end = 0
    for spec in specs:
        if spec in ("all", "generated"):
            return int(NO_END)
        end = max(end, prompt_len if isinstance(spec, str) else int(absolute_indices(spec, prompt_len).max(initial=-1)) + 1)
    return end


def absolute_indices(indices: list[int], prompt_len: int) -> np.ndarray:
    """Explicit indices; negative ones count back from the end of the prompt."""
    return np.array([i + prompt_len if i < 0 else i for i in indices], dtype=np.int64)


def value_rows(spec: Positions, positions: np.ndarray, prompt_len: int, n_values: int) -> np.ndarray:
    """Row of a `set` intervention's values for each selected position (broadcast when 1 row)."""
    if n_values == 1:
        return np.zeros(len(positions), dtype=np.int64)
    if spec in ("all", "prompt"):
        return positions.astype(np.int64)
    if spec == "generated":
        return (positions - prompt_len).astype(np.int64)
    if spec == "last_prompt":
        return np.zeros(len(positions), dtype=np.int64)
    wanted = absolute_indices(spec, prompt_len)  # type: ignore[arg-type]
    order = {int(p): i for i, p in enumerate(wanted)}
    return np.array([order[int(p)] for p in positions], dtype=np.int64)


def count_positions(spec: Positions, prompt_len: int, max_tokens: int) -> int:
    """Most rows a spec can select: the sequence fed through the model is prompt + max_tokens - 1."""
    fed = prompt_len + max_tokens - 1
    if spec == "all":
        return fed
    if spec == "prompt":
        return prompt_len
    if spec == "generated":
        return max_tokens - 1
    if spec == "last_prompt":
        return 1
    return len(spec)


def captured_positions(spec: Positions, prompt_len: int, n_rows: int) -> list[int]:
    """The positions of the first n_rows rows a spec selects. Rows are captured in position order
    (chunks run in order, re-run rows are skipped), so the rows never need to carry them: a mode
    selects one range, explicit indices their sorted values."""
    if not isinstance(spec, str):
        return np.unique(absolute_indices(spec, prompt_len))[:n_rows].tolist()
    first = {"generated": prompt_len, "last_prompt": prompt_len - 1}.get(spec, 0)
    return list(range(first, first + n_rows))


def check_positions(field_name: str, spec: Positions, prompt_len: int, max_tokens: int, repeats: bool = False) -> None:
    """Explicit indices inside the sequence fed through the model; `repeats`: a position may be
    listed more than once (edits: it is edited once, as TransformerLens's act[:, pos] op= v)."""
    if isinstance(spec, str):
        return
    fed = prompt_len + max_tokens - 1
    for index in spec:
        absolute = index + prompt_len if index < 0 else index
        if not 0 <= absolute < fed:
            raise PlanError(
                f"{field_name}: index {index} is outside the sequence; allowed are "
                f"-{prompt_len}..{fed - 1} (prompt of {prompt_len} tokens, the last of "
                f"{max_tokens} generated tokens is never fed through the model)"
            )
    absolute = absolute_indices(spec, prompt_len).tolist()
    repeated = sorted({p for p in absolute if absolute.count(p) > 1})
    if repeated and not repeats:
        raise PlanError(
            f"{field_name}: position {repeated[0]} is listed more than once in {spec}; rows come back once per "
            f"position, in ascending order, with their positions: list each position once and pick rows from the "
            f"result (TransformerLens's act[:, {spec}] is those rows, repeated)"
        )
