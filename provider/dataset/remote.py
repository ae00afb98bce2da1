"""Replica-side sinks, the driver's half: send each shard's lines to the app, collect its index.

With `--sink replica` the replicas write the shards (`replicas.shards.sink`, `Router.capture_shard`):
this process reads the input, groups its lines by shard (shard k: lines [k*S, (k+1)*S), as on
the driver path), sends each unfinished shard as one `ShardJob`, and keeps only the
`ShardIndex` it gets back. Rows never come here. Resume, the manifest and `load_capture` are
the driver path's: a shard is finished when its .safetensors file exists, whoever wrote it.

At most `shards_in_flight` jobs run at once (auto: enough for `concurrency` lines, at least two
per replica the app has, and once the replicas answer as many as they hold at once, their
`sink.max_unwritten` each: a job runs until its shard is written, and the engine captures the
next shards meanwhile). A job that fails on its way (the queue full, no replica, a lost
connection) is sent again with jittered backoff, at most `retries` times; a replica that dies
mid-shard is retried by the Router, and since a shard is published atomically a retry never
leaves half of one. `choose_sink` decides between this and the driver-side writer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path

from provider.dataset.backends import Backend, ShardBackend
from provider.dataset.harvest import Progress, Summary, first_error, with_retries
from provider.dataset.input import InputLine
from provider.dataset.options import CaptureOptions, LineFailed, SinkUnreachable
from provider.dataset.shards import finished_shards
from replicas.api import ModelInfo
from replicas.api.errors import InvalidRequestError
from replicas.shards.store import LocalStore, Store, open_store
from replicas.shards.sink import JobLine, ShardIndex, ShardJob

logger = logging.getLogger(__name__)


def choose_sink(options: CaptureOptions, out: Path | Store, backend: Backend) -> str:
    """"replica" or "driver". auto: replica-side when the backend can reach the replicas' method
    (the Serve handle) and the replicas see `out` as this process does (`shares_folder`)."""
    if options.sink == "driver":
        return "driver"
    reachable = isinstance(backend, ShardBackend) and backend.shares_folder(open_store(out, "--out"))
    if options.sink == "replica" and not reachable:
        raise SinkUnreachable(f"--sink replica: the replicas cannot write to {out} (they need the Serve handle and this node); "
                         "use --sink driver or auto")
    return "replica" if reachable else "driver"


def shards_of(lines: Iterator[InputLine], shard_lines: int) -> Iterator[tuple[int, list[InputLine]]]:
    """Consecutive lines grouped by shard number, in order."""
    for k, group in itertools.groupby(lines, key=lambda item: item.line // shard_lines):
        yield k, list(group)


def auto_window(options: CaptureOptions, replicas: int, replica_slots: int = 0) -> int:
    """Shard jobs in flight at once: `shards_in_flight` when set; else enough for `concurrency`
    lines, at least two per replica, and once the replicas answer, as many as they hold at once
    (`replica_slots`, their sink.max_unwritten, each): a job counts until its shard is written,
    and a window sized for the lines to capture alone would leave an engine idle meanwhile."""
    if options.shards_in_flight:
        return options.shards_in_flight
    return max(2 * replicas, math.ceil(options.concurrency / options.shard_lines), replica_slots * replicas)


def jobs_capturing(options: CaptureOptions, replicas: int) -> int:
    """Shard jobs a replica runs at once to keep its share of `concurrency` lines capturing: the
    slots (sink.max_unwritten) it needs beside those of the shards its writers hold."""
    return math.ceil(math.ceil(options.concurrency / replicas) / options.shard_lines)


def short_of_lines(options: CaptureOptions, replicas: int, replica_slots: int) -> str | None:
    """What to change when the replicas' slots cannot keep `concurrency` lines on their engines: a
    job holds its replica's slot (sink.max_unwritten) from its first line until its shard is
    written, so short shards fill the slots with few lines; None when they can, with a slot to spare
    for a shard being written."""
    per_replica = math.ceil(options.concurrency / replicas)
    capturing = jobs_capturing(options, replicas)
    if replica_slots == 0 or replica_slots > capturing:
        return None
    return (f"each replica holds at most {replica_slots} shard jobs (sink.max_unwritten), capturing or being written: "
            f"{replica_slots * options.shard_lines} lines of {options.shard_lines}-line shards, too few to keep the "
            f"{per_replica} lines of --concurrency {options.concurrency} capturing on it while shards are written, so its "
            f"engine runs short of lines. Set the app's sink.max_unwritten to sink.threads + {capturing}, "
            "or use longer shards (--shard-lines)")


class ShardSender:
    """One run over one input, each unfinished shard captured and written by a replica."""

    def __init__(self, out: Path | Store, options: CaptureOptions, info: ModelInfo, backend: ShardBackend, progress: Progress,
                 replicas: int) -> None:
        self.out, self.options, self.info, self.backend, self.progress = open_store(out), options, info, backend, progress
        # The replicas' working directory is not ours: a local folder travels as an absolute path.
        self.url = str(self.out.path.resolve()) if isinstance(self.out, LocalStore) else self.out.url
        self.summary = Summary()
        self.done = finished_shards(self.out)
        self.summary.shards_done_before = len(self.done)
        self.replicas = replicas
        self._window = auto_window(options, replicas)
        self._slots = asyncio.Semaphore(self._window)

    def already_done(self, line: int) -> bool:
        return line // self.options.shard_lines in self.done

    async def run(self, lines: Iterator[InputLine]) -> Summary:
        started = time.monotonic()
        try:
            async with asyncio.TaskGroup() as tasks:
                for k, group in shards_of(lines, self.options.shard_lines):
                    if self._count(k, group):
                        await self._slots.acquire()
                        tasks.create_task(self._shard(k, group))
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        finally:
            self.summary.elapsed_s = time.monotonic() - started
        return self.summary

    def _count(self, k: int, group: list[InputLine]) -> bool:
        """Count the group's lines; True when its shard is still to capture."""
        self.summary.lines += len(group)
        if k in self.done:
            self.summary.lines_done_before += len(group)
            self.progress.update(len(group), self.summary)
            return False
        return True

    async def _shard(self, k: int, group: list[InputLine]) -> None:
        try:
            index = await self._with_retries(self._job(k, group))
            self._widen(index.slots)
        finally:
            self._slots.release()
        blank = sum(1 for item in group if item.prompt is None)
        self.summary.blank += blank
        self.summary.captured += index.captured
        self.summary.invalid += index.invalid
        self.summary.rows += index.rows
        self.summary.bytes_written += index.bytes_written
        self.summary.shards_written += 1
        self.summary.replicas.update(index.replicas)
        self.done.add(k)
        self.progress.update(len(group), self.summary)

    def _widen(self, replica_slots: int) -> None:
        """The window once a replica said how many shards it holds (`auto_window`); it never narrows.
        Slots too few for `concurrency` are said once (log and summary)."""
        note = short_of_lines(self.options, self.replicas, replica_slots)
        if note and note not in self.summary.notes:
            logger.warning("capserve capture: %s", note)
            self.summary.notes.append(note)
        wider = auto_window(self.options, self.replicas, replica_slots)
        if wider <= self._window:
            return
        for _ in range(wider - self._window):
            self._slots.release()
        self._window = wider

    def _job(self, k: int, group: list[InputLine]) -> ShardJob:
        lines = [JobLine(line=item.line, id=item.id, request=self.options.engine_request(item.prompt))
                 for item in group if item.prompt is not None]
        return ShardJob(folder=self.url, shard=k, spec=self.options.row_spec(), d_model=self.info.d_model, lines=lines,
                        concurrency=min(self.options.concurrency, max(len(lines), 1)), skip_invalid=self.options.skip_invalid)

    async def _with_retries(self, job: ShardJob) -> ShardIndex:
        async def attempt() -> ShardIndex:
            return ShardIndex.model_validate(await self.backend.run_shard(job.model_dump()))

        try:
            return await with_retries(attempt, f"shard {job.shard}", self.backend, self.options.retries, self.summary)
        except InvalidRequestError as exc:  # a bad line (named) or a folder the replica cannot write
            raise LineFailed(f"shard {job.shard}: {exc} (fix the line, pass --skip-invalid, or use --sink driver)") from None
