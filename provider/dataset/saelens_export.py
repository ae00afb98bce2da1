"""`capserve export`: a capture folder as the cached-activations dataset SAELens trains from.

SAELens (checked against sae-lens 6.54.0, `sae_lens/training/activations_store.py`
`load_cached_activation_dataset` / `_load_raw_llm_batch_from_cached`, and the writer it pairs
with, `sae_lens/cache_activations_runner.py`) reads `cached_activations_path` with
`datasets.load_from_disk` and expects:

- a Hugging Face `datasets.Dataset` saved with `save_to_disk` (arrow files, `state.json`,
  `dataset_info.json`), one row per *sequence*;
- one column per hook, named by the TransformerLens hook name (`cfg.hook_name`), of feature type
  `Array2D(shape=(context_size, d_in), dtype=...)`; the loader refuses a column whose feature shape
  is not exactly `(cfg.context_size, cfg.sae.d_in)`. Columns here carry the canonical
  TransformerLens name whatever spelling the capture used (`6:resid_post` -> `blocks.6.hook_resid_post`);
  a per-head hook's [heads, d_head] rows are flattened, as SAELens flattens them;
- optionally a `token_ids` column, `Sequence(Value("int32"), length=context_size)`, which the
  loader uses to drop special tokens (`exclude_special_tokens`).

It reads `store_batch_size_prompts` sequences at a time in row order, flattens them to
[batch * context_size, d_in] and feeds its mixing buffer; it converts to `cfg.dtype` on load.

This module writes exactly that: one `Array2D` column per exported hook, then `token_ids`
(the capture's `capserve.token_id`), dtype float32 (SAELens's default) or float16, plus a side
file `capserve_export.json` (what was exported from where, and the SAELens settings that match).
Each sequence is `context_size` consecutive rows of the capture, chosen by `layout`:

- `exact` (default): every captured line is one sequence; each must have exactly
  `context_size` rows at consecutive positions (a pretokenized input of fixed-length contexts,
  captured with `--positions all`, is this case);
- `truncate`: every line's first `context_size` rows (consecutive positions); shorter lines are
  an error;
- `pack`: all rows in input order cut into sequences of `context_size`, across line boundaries;
  the remainder (< context_size rows) is dropped. SAELens trains on tokens, not sequences, so
  packing loses nothing it uses; `token_ids` then span lines.

`datasets` is imported when an export runs: it is SAELens's dependency, so run the export in the
environment SAELens trains in (`pip install 'capserve[saelens]'`; in this repo `.venv-saelens`,
built by scripts/install_saelens.sh). Nothing here imports torch, Ray or vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from provider.dataset.shards import Capture, load_capture
from replicas.api.hooks import HookNameError, resolve_hook

LAYOUTS = ("exact", "truncate", "pack")
EXPORT_DTYPES = ("float32", "float16")  # Arrow has no bfloat16; SAELens converts to cfg.dtype on load
TOKEN_COLUMN = "token_ids"
SIDE_FILE = "capserve_export.json"
BATCH_BYTES = 64 << 20  # activation bytes gathered per write: bounds memory, not the result


class ExportError(ValueError):
    """The capture cannot be exported as asked; the message names the option and the fix."""


@dataclass(frozen=True)
class ExportPlan:
    """Which capture rows become which SAELens sequences."""

    hooks: list[str]  # as the capture names them
    columns: list[str]  # the dataset's column per hook: its canonical TransformerLens name
    context_size: int
    layout: str
    dtype: str
    d_in: dict[str, int]  # per hook: the row width (heads x d_head flattened)
    starts: np.ndarray  # global first capture row of each sequence; rows starts[i] .. +context_size
    lines_used: int
    rows_dropped: int  # capture rows in no sequence (truncated tails, pack remainder)

    @property
    def sequences(self) -> int:
        return len(self.starts)


def plan_export(
    capture: Capture,
    hooks: list[str] | None = None,
    context_size: int | None = None,
    layout: str = "exact",
    dtype: str = "float32",
) -> ExportPlan:
    """Check the capture against what SAELens needs and choose the rows; raises ExportError."""
    if layout not in LAYOUTS:
        raise ExportError(f"--layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {dtype!r}: use one of {', '.join(EXPORT_DTYPES)} (Arrow has no bfloat16; "
                          "SAELens converts to its cfg.dtype when it loads)")
    hooks = list(hooks) if hooks else capture.hooks
    unknown = [h for h in hooks if h not in capture.hooks]
    if unknown:
        raise ExportError(f"--hooks: {', '.join(unknown)} not in this capture; it has {', '.join(capture.hooks)}")
    try:
        columns = [resolve_hook(h).canonical_name for h in hooks]
    except HookNameError as exc:
        raise ExportError(f"--hooks: {exc}") from None
    if len(set(columns)) != len(columns):
        raise ExportError(f"--hooks names one hook twice (TransformerLens names {', '.join(columns)}); name each once")
    options = capture.manifest.get("options", {})
    if options.get("reduce", "none") != "none":
        raise ExportError(f"this capture was made with --reduce {options['reduce']} (one row per prompt); SAELens trains "
                          "on per-token rows: capture again with --reduce none")
    if context_size is not None and context_size < 1:
        raise ExportError(f"--context-size {context_size}: must be a positive number of rows per sequence")
    d_in = {h: int(np.prod(capture[h].shape[1:])) for h in hooks}
    records = [r for r in capture.records() if "error" not in r and r.get("rows", 0) > 0]
    if not records:
        raise ExportError(f"{capture.folder} holds no captured rows to export")
    starts = np.array([r["row"] for r in records], dtype=np.int64)
    counts = np.array([r["rows"] for r in records], dtype=np.int64)
    lines = np.array([r["line"] for r in records], dtype=np.int64)
    if context_size is None:
        if counts.min() != counts.max():
            raise ExportError(
                f"captured lines have {counts.min()} to {counts.max()} rows, so there is no one context size: pass "
                "--context-size N with --layout truncate (each line's first N rows) or --layout pack (rows cut into N)"
            )
        context_size = int(counts[0])
    if layout == "pack":
        n = capture.rows // context_size
        if n == 0:
            raise ExportError(f"--context-size {context_size}: the capture has only {capture.rows} rows, fewer than one sequence")
        seq_starts = np.arange(n, dtype=np.int64) * context_size
        return ExportPlan(hooks, columns, context_size, layout, dtype, d_in, seq_starts, len(records), capture.rows - n * context_size)
    if layout == "exact":
        bad = np.flatnonzero(counts != context_size)
        if bad.size:
            raise ExportError(
                f"--layout exact needs every line to have --context-size {context_size} rows; "
                f"{_lines(lines[bad], counts[bad])}. Use --layout truncate (each line's first {context_size} rows; "
                f"lines need at least that many) or --layout pack (rows cut into sequences across lines)"
            )
    else:
        bad = np.flatnonzero(counts < context_size)
        if bad.size:
            raise ExportError(
                f"--layout truncate needs every line to have at least --context-size {context_size} rows; "
                f"{_lines(lines[bad], counts[bad])}. Use a smaller --context-size or --layout pack"
            )
    _check_consecutive(capture, starts, lines, context_size)
    dropped = int(counts.sum()) - len(starts) * context_size
    return ExportPlan(hooks, columns, context_size, layout, dtype, d_in, starts, len(records), dropped)


def _lines(lines: np.ndarray, counts: np.ndarray, show: int = 5) -> str:
    shown = ", ".join(f"input line {line + 1} has {count}" for line, count in zip(lines[:show], counts[:show]))
    more = f" (and {len(lines) - show} more)" if len(lines) > show else ""
    return f"{len(lines)} do not: {shown}{more}"


def _check_consecutive(capture: Capture, starts: np.ndarray, lines: np.ndarray, context_size: int) -> None:
    """A sequence must be one stretch of the prompt: positions p, p+1, ..., p+context_size-1."""
    if context_size == 1:
        return
    step = max(1, (8 << 20) // context_size)  # positions read per pass: 64 MiB of int64
    offsets = np.arange(context_size, dtype=np.int64)
    broken, example = 0, None
    for first in range(0, len(starts), step):
        window = capture.position[(starts[first : first + step, None] + offsets).ravel()].reshape(-1, context_size)
        bad = np.flatnonzero((np.diff(window, axis=1) != 1).any(axis=1))
        if bad.size and example is None:
            example = (int(lines[first + bad[0]]), window[bad[0]][:8].tolist())
        broken += bad.size
    if example is not None:
        raise ExportError(
            f"a SAELens sequence is {context_size} consecutive token positions, but {broken} captured line(s) are not "
            f"consecutive (input line {example[0] + 1} has positions {example[1]}...); capture with "
            "--positions all, prompt or generated, or use --layout pack"
        )


def export_saelens(
    capture_folder: str | os.PathLike[str],
    out: str | os.PathLike[str],
    hooks: list[str] | None = None,
    context_size: int | None = None,
    layout: str = "exact",
    dtype: str = "float32",
) -> ExportPlan:
    """Write the capture in `capture_folder` to `out` as SAELens's cached-activations dataset.

    `out` must not exist (or be an empty folder); it appears whole or not at all. Returns the
    plan that was written. Raises ExportError on input SAELens could not train from."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty folder; choose a new folder")
    try:
        capture = load_capture(capture_folder)
    except (FileNotFoundError, ValueError) as exc:
        raise ExportError(str(exc)) from None
    plan = plan_export(capture, hooks, context_size, layout, dtype)
    datasets = _datasets()
    features = saelens_features(plan, datasets)
    temp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        arrow = temp / "rows.arrow"
        writer = datasets.arrow_writer.ArrowWriter(features=features, path=str(arrow))
        try:
            for batch in _batches(capture, plan):
                writer.write_batch(batch)
            writer.finalize()
        finally:
            writer.close()
        final = temp / "dataset"
        # save_to_disk lays out the folder (arrow shards, state.json, dataset_info.json) in the
        # form load_from_disk reads, whatever the installed datasets version calls it.
        datasets.Dataset.from_file(str(arrow)).save_to_disk(str(final))
        (final / SIDE_FILE).write_text(json.dumps(_side_record(capture, plan), indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(final, out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return plan


def saelens_features(plan: ExportPlan, datasets: Any) -> Any:
    """The dataset's features: Array2D per hook, then token_ids (SAELens's own cache layout)."""
    columns: dict[str, Any] = {
        column: datasets.Array2D(shape=(plan.context_size, plan.d_in[hook]), dtype=plan.dtype)
        for hook, column in zip(plan.hooks, plan.columns)
    }
    columns[TOKEN_COLUMN] = datasets.Sequence(datasets.Value("int32"), length=plan.context_size)
    return datasets.Features(columns)


def _batches(capture: Capture, plan: ExportPlan) -> Any:
    per_sequence = plan.context_size * sum(plan.d_in.values()) * np.dtype(plan.dtype).itemsize
    step = max(1, BATCH_BYTES // per_sequence)
    tokens = capture.token_id
    arrays = {column: (capture[hook], plan.d_in[hook]) for hook, column in zip(plan.hooks, plan.columns)}
    offsets = np.arange(plan.context_size, dtype=np.int64)
    for first in range(0, plan.sequences, step):
        rows = (plan.starts[first : first + step, None] + offsets).ravel()
        n = len(rows) // plan.context_size
        batch = {column: a[rows].astype(plan.dtype, copy=False).reshape(n, plan.context_size, width)
                 for column, (a, width) in arrays.items()}
        batch[TOKEN_COLUMN] = tokens[rows].astype(np.int32).reshape(n, plan.context_size)
        yield batch


def _side_record(capture: Capture, plan: ExportPlan) -> dict[str, Any]:
    manifest = capture.manifest
    record = asdict(plan)
    record.pop("starts")
    return {
        "format": "capserve-saelens/1",
        "source": str(capture.folder.resolve()) if isinstance(capture.folder, Path) else capture.folder,
        "model": manifest.get("model", {}).get("model"),
        "capture_options": manifest.get("options"),
        **record,
        "sequences": plan.sequences,
        "saelens": {  # LanguageModelSAERunnerConfig fields that must match this dataset
            "use_cached_activations": True,
            "hook_name": plan.columns[0] if len(plan.columns) == 1 else plan.columns,
            "context_size": plan.context_size,
            "d_in": plan.d_in[plan.hooks[0]] if len(plan.hooks) == 1 else dict(zip(plan.columns, plan.d_in.values())),
            "is_dataset_tokenized": True,
        },
        "exported": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _datasets() -> Any:
    try:
        import datasets
        import datasets.arrow_writer  # a submodule that `import datasets` need not load
    except ImportError:
        raise ExportError(
            "capserve export --format saelens needs the `datasets` package (SAELens reads the dataset with it): "
            "run it where SAELens is installed (pip install 'capserve[saelens]'; in this repo "
            ".venv-saelens/bin/capserve, built by scripts/install_saelens.sh)"
        ) from None
    return datasets
