"""The `capserve capture` pipeline: stream prompts, capture them concurrently, write shards.

Memory stays flat whatever the input size:
- the input is read line by line (`provider.dataset.input`);
- at most `concurrency` requests are in flight (a semaphore);
- results wait in memory only until their shard is complete, and at most `window` shards are
  open at once: the reader stops before opening a shard past the window until the oldest open
  shard is written. So memory ~ window x (one shard's captured bytes) + in-flight results.

Resume: shard k covers input lines [k*S, (k+1)*S); lines of a finished shard are skipped
without a request. The manifest pins everything that decides a shard's content (options,
model, input fingerprint); a rerun with other values fails and names them.

Faults: the Router already retries a request whose replica died. What still reaches us (the
queue full, no replica answering, a lost object, a dropped connection) is retried here with
jittered exponential backoff, at most `retries` times per line; then the run stops, finished
shards stay, and a rerun resumes. A shard already being written when the run stops (a failure,
Ctrl-C) is finished before `run()` ends, so nothing is published after the run has returned.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from provider.dataset.backends import Backend
from provider.dataset.input import InputLine
from provider.dataset.options import CaptureOptions, LineFailed
from provider.dataset.shards import LineRows, finished_shards
from replicas.api import GenerateResult, ModelInfo
from replicas.api.errors import InvalidRequestError
from replicas.shards.store import Store, open_store
from replicas.shards.sink import RowsMismatch, empty_rows, publish_shard, rows_of

MAX_BACKOFF_S = 20.0
T = TypeVar("T")


@dataclass
class Summary:
    lines: int = 0
    lines_done_before: int = 0
    captured: int = 0
    blank: int = 0
    invalid: int = 0
    rows: int = 0
    bytes_written: int = 0
    shards_written: int = 0
    shards_done_before: int = 0
    retries: int = 0
    replicas: Counter = field(default_factory=Counter)
    elapsed_s: float = 0.0
    complete: bool = False
    notes: list[str] = field(default_factory=list)  # what would make the run faster (`remote.short_of_lines`)

    def text(self, out: Path | str) -> str:
        rate = self.rows / self.elapsed_s if self.elapsed_s else 0.0
        split = ", ".join(f"{name}: {n}" for name, n in self.replicas.most_common()) or "none"
        state = "complete" if self.complete else "INCOMPLETE (rerun the same command to finish)"
        return "\n".join([
            f"capserve capture: {state} -> {out}",
            (f"  lines      {self.lines} read, {self.captured} captured now, {self.lines_done_before} already done, "
             f"{self.blank} blank, {self.invalid} invalid (skipped)"),
            f"  shards     {self.shards_written} written now, {self.shards_done_before} already done",
            f"  rows       {self.rows} in {self.elapsed_s:.1f} s ({rate:.1f} rows/s), {self.bytes_written / 1e9:.3f} GB written",
            f"  retries    {self.retries}",
            f"  replicas   {split}",
            *(f"  note       {note}" for note in self.notes),
        ])


class Progress:
    """tqdm over input lines with rows/s and GB written; silent when disabled."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, disable=not enabled, unit="line", desc="capture", dynamic_ncols=True)
        self.started = time.monotonic()

    def update(self, lines: int, summary: Summary) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{summary.rows / elapsed:.0f} rows/s, {summary.bytes_written / 1e9:.3f} GB", refresh=False)
        self.bar.update(lines)

    def close(self) -> None:
        self.bar.close()


class _Shard:
    def __init__(self, k: int) -> None:
        self.k = k
        self.lines: list[LineRows] = []
        self.pending = 0
        self.sealed = False  # the reader has moved past this shard's lines
        self.writing = False


class Harvester:
    """One run over one input into one folder. `run(lines)` returns the Summary."""

    def __init__(self, out: Path | Store, options: CaptureOptions, info: ModelInfo, backend: Backend, progress: Progress) -> None:
        self.out, self.options, self.info, self.backend, self.progress = open_store(out), options, info, backend, progress
        self.summary = Summary()
        self.done = finished_shards(self.out)
        self.summary.shards_done_before = len(self.done)
        self._open: dict[int, _Shard] = {}
        self._changed = asyncio.Event()
        self._slots = asyncio.Semaphore(options.concurrency)
        self._tasks: asyncio.TaskGroup | None = None

    def already_done(self, line: int) -> bool:
        return line // self.options.shard_lines in self.done

    async def run(self, lines: Iterator[InputLine]) -> Summary:
        started = time.monotonic()
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                await self._feed(lines)
        except BaseExceptionGroup as group:  # the first real failure, not the group
            raise first_error(group) from None
        finally:
            self.summary.elapsed_s = time.monotonic() - started
        return self.summary

    async def _feed(self, lines: Iterator[InputLine]) -> None:
        for item in lines:
            self.summary.lines += 1
            k = item.line // self.options.shard_lines
            if k in self.done:
                self.summary.lines_done_before += 1
                self.progress.update(1, self.summary)
                continue
            shard = await self._shard(k)
            if item.prompt is None:
                self.summary.blank += 1
                self.progress.update(1, self.summary)
                continue
            await self._slots.acquire()
            shard.pending += 1
            self._tasks.create_task(self._capture(shard, item))  # type: ignore[union-attr]
        for shard in list(self._open.values()):
            self._seal(shard)

    async def _shard(self, k: int) -> _Shard:
        if k in self._open:
            return self._open[k]
        for shard in list(self._open.values()):
            if shard.k < k:
                self._seal(shard)
        while self._open and k - min(self._open) >= self.options.window:
            changed = self._changed
            await changed.wait()  # the oldest open shard is still waiting for results
        shard = self._open[k] = _Shard(k)
        return shard

    def _seal(self, shard: _Shard) -> None:
        shard.sealed = True
        self._maybe_write(shard)

    def _maybe_write(self, shard: _Shard) -> None:
        if shard.sealed and shard.pending == 0 and not shard.writing:
            shard.writing = True
            self._tasks.create_task(self._write(shard))  # type: ignore[union-attr]

    async def _write(self, shard: _Shard) -> None:
        hooks, d_model = list(self.options.hooks), self.info.d_model
        # A thread, so requests keep flowing while the shard goes to disk; awaited to its end even
        # when the run is interrupted, so no shard is published after run() has ended.
        size = await publish_shard(None, self.out, shard.k, shard.lines, hooks, self.options.dtype, d_model)
        self.summary.bytes_written += size
        self.summary.shards_written += 1
        self.done.add(shard.k)
        del self._open[shard.k]
        self._changed.set()
        self._changed = asyncio.Event()
        self.progress.update(0, self.summary)

    async def _capture(self, shard: _Shard, item: InputLine) -> None:
        try:
            rows = await self._line_rows(item)
        finally:
            self._slots.release()
            shard.pending -= 1
        shard.lines.append(rows)
        self.summary.rows += rows.rows
        self.progress.update(1, self.summary)
        self._maybe_write(shard)

    async def _line_rows(self, item: InputLine) -> LineRows:
        try:
            result = await self._with_retries(item)
        except InvalidRequestError as exc:
            if not self.options.skip_invalid:
                raise LineFailed(f"input line {item.line + 1}: {exc} (fix the line, or pass --skip-invalid)") from None
            self.summary.invalid += 1
            return empty_rows(item.line, self.options.row_spec(), self.info.d_model, str(exc))
        self.summary.captured += 1
        self.summary.replicas[result.replica or "unknown"] += 1
        return line_rows(item, result, self.options, self.info.d_model)

    async def _with_retries(self, item: InputLine) -> GenerateResult:
        request = self.options.request(item.prompt)
        prompt_only = self.options.max_tokens == 0
        return await with_retries(
            lambda: self.backend.run(request, prompt_only), f"input line {item.line + 1}", self.backend, self.options.retries,
            self.summary,
        )


async def with_retries(call: Callable[[], Awaitable[T]], what: str, backend: Backend, retries: int, summary: Summary) -> T:
    """`call()` until it returns. An error the backend calls retryable (`retry_delay`) is retried
    with jittered exponential backoff, at least the delay it names, at most `retries` times; any
    other fails as a LineFailed naming `what`. InvalidRequestError (the input itself is bad:
    retrying cannot help) goes to the caller, who decides."""
    for attempt in itertools.count():
        try:
            return await call()
        except InvalidRequestError:
            raise
        except Exception as exc:
            wait = backend.retry_delay(exc)
            if wait is None:
                raise LineFailed(f"{what}: {exc!r}") from exc
            if attempt >= retries:
                raise LineFailed(f"{what}: failed {attempt + 1} times; last error: {exc!r}") from exc
            summary.retries += 1
            backoff = min(0.25 * 2**attempt, MAX_BACKOFF_S) * random.uniform(0.5, 1.0)  # jitter: no herd
            await asyncio.sleep(max(wait, backoff))
    raise AssertionError("unreachable")



def line_rows(item: InputLine, result: GenerateResult, options: CaptureOptions, d_model: int) -> LineRows:
    """A result as rows of the shard, checked against what was asked for (the same code the
    replica-side sink runs)."""
    try:
        return rows_of(item.line, item.id, result, options.row_spec(), d_model)
    except RowsMismatch as exc:
        raise LineFailed(str(exc)) from None


def first_error(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]
