"""Replica-side sinks: an EngineReplica captures a batch of input lines and writes their shard.

`capserve capture --sink replica` sends each shard's lines to the Router's `capture_shard`; one
replica runs them (concurrently, so the engine batches them), turns each result into rows, and
publishes the shard itself (`replicas.shards.files`: safetensors, atomic publish). Only the
`ShardIndex` (counts, no arrays) goes back. The bulk bytes never cross Ray's object store.

- Folder: a `ShardJob.folder` is an absolute local path, a `file://` URL (both the local fast
  path) or any fsspec URL whose backend is installed on the replica (`replicas.shards.store`). A
  scheme fsspec does not know, a missing backend or a folder that does not exist is refused with
  `InvalidRequestError` naming `folder`: the job fails, the replica goes on.
- Bounded writers: shards go to disk on `ShardSink`'s own threads (`threads`), never on the
  replica's event loop, so requests keep flowing while a shard is written.
- Backpressure: a job holds one of `max_unwritten` slots from its first request until its shard
  is on disk, so a replica never holds rows of more than `max_unwritten` shards. When all are
  taken, policy "wait" queues the job (the Router's ledger still counts it, so new work goes to
  other replicas); policy "refuse" answers `BackPressureError` at once (the driver retries later).
- Room in the arena: a line's rows view the worker's arena in place until its shard is written.
  Jobs whose lines together outgrow the arena would each wait for the others' blocks forever, so
  when a request has to wait for room (`ShardSink.watch`), the lines of jobs still capturing are
  copied into this process's memory and their blocks go back (`relieved_bytes` in the totals).
"""

from __future__ import annotations

import asyncio
import resource
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from replicas.api import GenerateResult
from replicas.arena.client import ArenaBudget
from replicas.api.arrays import DTYPES
from replicas.api.errors import BackPressureError, CaptureFailedError, InvalidRequestError
from replicas.shards.files import LineRows, write_shard
from replicas.shards.store import LocalStore, Store, open_store

Generate = Callable[[dict[str, Any]], Awaitable[GenerateResult]]
SinkPolicy = Literal["wait", "refuse"]


class RowSpec(BaseModel):
    """How a result becomes rows: what was asked for (checked against what came back)."""

    model_config = ConfigDict(extra="forbid")

    hooks: list[str] = Field(min_length=1)
    reduce: Literal["none", "mean"] = "none"
    dtype: str = "float32"
    generated: bool = False  # max_tokens > 0: keep token_ids and text in the index record


class JobLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    line: int = Field(ge=0)  # 0-based input line
    id: Any = None
    request: dict[str, Any]  # a GenerateRequest as a dict: what the replica runs


class ShardJob(BaseModel):
    """One shard's lines, sent to `Router.capture_shard` / `EngineReplica.capture_shard`."""

    model_config = ConfigDict(extra="forbid")

    folder: str = Field(description="Where the shard goes: an absolute local path, a file:// URL or an fsspec URL (s3://...).")
    shard: int = Field(ge=0)
    spec: RowSpec
    d_model: int = Field(gt=0)
    lines: list[JobLine]
    concurrency: int = Field(64, ge=1, description="Lines of this job running on the engine at once.")
    skip_invalid: bool = False


def shard_job(job: ShardJob | dict[str, Any]) -> ShardJob:
    """A job from a handle caller: a malformed one is the caller's error, named by its field."""
    if isinstance(job, ShardJob):
        return job
    try:
        return ShardJob.model_validate(job)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequestError(f"job.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


class ShardIndex(BaseModel):
    """What a replica sends back for a written shard: counts only."""

    shard: int
    captured: int = 0
    invalid: int = 0
    rows: int = 0
    bytes_written: int = 0
    replicas: dict[str, int] = Field(default_factory=dict)
    # the writing replica's sink.max_unwritten: how many shards it holds at once, captured or
    # being written (the driver's auto window follows it; 0 from a replica that did not say)
    slots: int = 0


class RowsMismatch(ValueError):
    """A result that does not have the rows its request asked for; names the input line."""


# ---------------------------------------------------------------- rows


def rows_of(line: int, line_id: Any, result: GenerateResult, spec: RowSpec, d_model: int) -> LineRows:
    """A result as rows of its shard, checked against what was asked for."""
    reduced = spec.reduce == "mean"
    arrays = {}
    for hook in spec.hooks:
        if hook not in result.activations:
            raise RowsMismatch(f"input line {line + 1}: the result has no {hook!r} (got {sorted(result.activations)})")
        array = result.activations[hook]
        array = array.reshape(1, -1) if reduced else array
        if array.dtype != DTYPES[spec.dtype] or array.ndim != 2 or array.shape[1] != d_model:
            raise RowsMismatch(f"input line {line + 1}: {hook} came back {array.dtype} {list(array.shape)}, "
                               f"expected {spec.dtype} [rows, {d_model}]")
        arrays[hook] = array
    rows = 1 if reduced else len(result.positions)
    if any(a.shape[0] != rows for a in arrays.values()):
        raise RowsMismatch(f"input line {line + 1}: {rows} positions but arrays of {[a.shape[0] for a in arrays.values()]} rows")
    record: dict[str, Any] = {"prompt_token_ids": result.prompt_token_ids, "positions": result.positions, "replica": result.replica}
    if spec.generated:
        record.update(token_ids=result.token_ids, text=result.text)
    if line_id is not None:
        record["id"] = line_id
    positions = [-1] if reduced else result.positions
    tokens = [-1] if reduced else result.capture_token_ids
    return LineRows(line, arrays, positions, tokens, record)


def empty_rows(line: int, spec: RowSpec, d_model: int, error: str) -> LineRows:
    """An invalid line skipped on request: no rows, its error in the index."""
    arrays = {h: np.empty((0, d_model), DTYPES[spec.dtype]) for h in spec.hooks}
    return LineRows(line, arrays, [], [], {"error": error})


# ---------------------------------------------------------------- the sink


def sink_folder(url: str) -> Store:
    """The folder a job's URL names, checked to exist from this replica."""
    store = open_store(url, "folder")
    if isinstance(store, LocalStore) and not store.path.is_absolute():
        raise InvalidRequestError(f"folder: {url!r} must be absolute: the replica's working directory is not the caller's")
    try:
        exists = store.is_dir()
    except Exception as exc:  # noqa: BLE001  credentials, a network: the filesystem's own error, named
        raise InvalidRequestError(f"folder: {url} cannot be reached from this replica: {exc!r}; use --sink driver") from None
    if not exists:
        raise InvalidRequestError(f"folder: {url} does not exist as seen from this replica; use --sink driver")
    return store


async def publish_shard(threads: Executor | None, folder: Store, k: int, lines: list[LineRows], hooks: list[str], dtype: str,
                        d_model: int, write: Callable[..., int] = write_shard) -> int:
    """`write` (`write_shard`, or a wrapper timing it) on one of `threads` (None: the loop's
    default executor), awaited to its end even when the awaiting task is cancelled; the
    cancellation then goes on. Both writers (this sink and the driver's
    `provider.dataset.harvest`) publish through it.

    A thread cannot be stopped: abandoning the await would let the write publish its shard after
    the run that started it has ended (`capserve capture` already out with KeyboardInterrupt,
    a rerun already counting finished shards), and would free the job's backpressure slot while
    the thread still holds the rows."""
    written = asyncio.get_running_loop().run_in_executor(threads, write, folder, k, lines, hooks, dtype, d_model)
    cancelled: asyncio.CancelledError | None = None
    while not written.done():
        try:
            await asyncio.wait([written])  # unlike `await written`, a cancelled wait leaves the write running
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        raise cancelled
    return written.result()


class SinkOptions(BaseModel):
    """A replica's shard writing (`capture_shard`): `sink:` in serve_config.yaml's args."""

    model_config = ConfigDict(extra="forbid")

    threads: int = Field(2, ge=1, description="Threads writing shards to disk on each replica.")
    max_unwritten: int = Field(
        3, ge=1, description="Shards whose rows a replica holds at once (capturing or being written). A job holds "
        "its slot from its first line, so `threads` plus enough for the replica's share of `capserve capture "
        "--concurrency` in shards of `--shard-lines` keeps every writer and the engine busy: one more than "
        "`threads` for long shards, 8 + 22 for 8 writers, 64 lines and 3-line shards (the CLI says when it is short).",
    )
    policy: SinkPolicy = Field(
        "wait", description="A job past max_unwritten: wait for a slot, or refuse it with BackPressureError (the "
        "caller retries later).",
    )


class ShardSink:
    """Bounded writer threads and the backpressure slots of one replica."""

    def __init__(self, threads: int = 2, max_unwritten: int = 3, policy: SinkPolicy = "wait") -> None:
        self._threads = ThreadPoolExecutor(max(threads, 1), thread_name_prefix="capserve-sink")
        self._max_unwritten = max(max_unwritten, 1)
        self._policy = policy
        self._slots: asyncio.Semaphore | None = None  # made on the replica's loop, at first use
        # where a replica's shards spend their time, for `EngineReplica.stats` (sums over shards);
        # write_s runs from handing a shard to the threads to its publication, a wait for a free
        # thread included; writing_s is the threads' own time in `write_shard`, minor_faults their page faults;
        # relieved_bytes what capturing jobs' lines copied out of the arena to make room (`relieve`)
        self.totals = {"shards": 0, "bytes": 0, "slot_wait_s": 0.0, "write_s": 0.0, "writing_s": 0.0, "minor_faults": 0,
                       "relieved_bytes": 0}
        self._writing = threading.Lock()
        self._arena: ArenaBudget | None = None
        self._capturing: list[list[LineRows]] = []  # the lines of each job still capturing, done so far
        self._relieving: asyncio.Task | None = None
        self._relief_wanted = False

    def watch(self, arena: ArenaBudget) -> None:
        """Give `arena`'s blocks back whenever a request has to wait for them (see the module)."""
        self._arena = arena
        arena.on_wait.append(self.relieve)

    @contextmanager
    def capturing(self, lines: list[LineRows]) -> Iterator[None]:
        """`lines` (a job's, appended as they finish) may be copied out of the arena until the
        block ends, when the job hands them to its write."""
        self._capturing.append(lines)
        try:
            yield
        finally:
            self._capturing.remove(lines)

    def line_done(self) -> None:
        """A line of a capturing job finished: while requests wait for the arena, its rows leave it too."""
        if self._arena is not None and self._arena.waiting:
            self.relieve()

    def relieve(self) -> None:
        """Copy every capturing job's lines out of the arena, on a thread (once more if asked again meanwhile)."""
        self._relief_wanted = True
        if self._relieving is None or self._relieving.done():
            self._relieving = asyncio.ensure_future(self._relieve())

    async def _relieve(self) -> None:
        while self._relief_wanted:
            self._relief_wanted = False
            lines = [rows for job in self._capturing for rows in job]
            copied = await asyncio.to_thread(lambda: sum(map(copy_out_of_arena, lines)))
            self.totals["relieved_bytes"] += copied

    @property
    def slots(self) -> int:
        return self._max_unwritten

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_unwritten)
        if self._policy == "refuse" and self._slots.locked():
            raise BackPressureError(f"this replica already holds {self._max_unwritten} unwritten shards; retry later")
        began = time.perf_counter()
        async with self._slots:
            self.totals["slot_wait_s"] += time.perf_counter() - began
            yield

    async def write(self, folder: Store, job: ShardJob, lines: list[LineRows]) -> int:
        began = time.perf_counter()
        size = await publish_shard(self._threads, folder, job.shard, lines, job.spec.hooks, job.spec.dtype, job.d_model,
                                   self._timed_write)
        self.totals["write_s"] += time.perf_counter() - began
        self.totals["shards"] += 1
        self.totals["bytes"] += size
        return size

    def _timed_write(self, *args: Any) -> int:
        began, faults = time.perf_counter(), _minor_faults()
        try:
            return write_shard(*args)
        finally:
            with self._writing:  # the threads add up concurrently
                self.totals["writing_s"] += time.perf_counter() - began
                self.totals["minor_faults"] += _minor_faults() - faults

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


def copy_out_of_arena(rows: LineRows) -> int:
    """Replace the line's arrays that view memory they do not own (the arena) by copies; returns
    the bytes copied. Dropping the views gives their arena blocks back (`HeldArena`)."""
    views = {hook: array for hook, array in rows.arrays.items() if array.base is not None}
    rows.arrays = {**rows.arrays, **{hook: array.copy() for hook, array in views.items()}}
    return sum(array.nbytes for array in views.values())


def _minor_faults() -> int:
    """This thread's minor page faults so far: a writer faulting in the arena's pages as it reads
    them (the replica maps the worker's arena file) shows here."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


async def run_shard(job: ShardJob, generate: Generate, sink: ShardSink) -> ShardIndex:
    """Capture every line of `job` with `generate`, write the shard, return its index."""
    folder = sink_folder(job.folder)
    async with sink.slot():
        limit = asyncio.Semaphore(job.concurrency)
        finished: list[LineRows] = []

        async def one(item: JobLine) -> tuple[LineRows, str | None]:
            async with limit:
                rows, replica = await _line(item, job, generate)
            finished.append(rows)
            sink.line_done()
            return rows, replica

        with sink.capturing(finished):
            done = await asyncio.gather(*(one(item) for item in job.lines))
        lines = [rows for rows, _ in done]
        size = await sink.write(folder, job, lines)
    replicas = Counter(replica for _, replica in done if replica is not None)
    invalid = sum(1 for rows, _ in done if "error" in rows.record)
    return ShardIndex(shard=job.shard, captured=len(lines) - invalid, invalid=invalid, rows=sum(r.rows for r in lines),
                      bytes_written=size, replicas=dict(replicas), slots=sink.slots)


async def _line(item: JobLine, job: ShardJob, generate: Generate) -> tuple[LineRows, str | None]:
    try:
        result = await generate(item.request)
    except InvalidRequestError as exc:
        if not job.skip_invalid:
            raise InvalidRequestError(f"input line {item.line + 1}: {exc}") from None
        return empty_rows(item.line, job.spec, job.d_model, str(exc)), None
    try:
        return rows_of(item.line, item.id, result, job.spec, job.d_model), result.replica or "unknown"
    except RowsMismatch as exc:
        raise CaptureFailedError(str(exc)) from None
