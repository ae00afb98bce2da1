"""`run_capture`: one `capserve capture` run, with the driver-side writer or replica-side sinks.

Both writers share the folder's lock, its manifest (created, checked on a rerun, marked complete)
and the shard layout, so a folder begun by one resumes with the other. `options.sink` chooses
(`provider.dataset.remote.choose_sink`): "replica" has the replicas write their own shards,
"driver" has this process write them (`provider.dataset.harvest`); "auto" takes replica-side
sinks when the app's replicas can reach `out`. `out` is a local folder or any fsspec URL
(`replicas.shards.store`).
"""

from __future__ import annotations

import os
from pathlib import Path

from provider.dataset.backends import Backend, ShardBackend
from provider.dataset.harvest import Harvester, Progress, Summary
from provider.dataset.input import count_lines, fingerprint, read_input
from provider.dataset.manifest import finish_manifest, lock_folder, open_folder
from provider.dataset.options import CaptureOptions
from provider.dataset.remote import ShardSender, choose_sink
from replicas.api import ModelInfo
from replicas.api.hooks import resolve_hook
from replicas.shards.store import Store, open_store


def check_hooks(options: CaptureOptions, info: ModelInfo) -> None:
    for hook in options.hooks:
        resolve_hook(hook, info.n_layers)  # a layer past the model fails before any request


async def run_capture(
    source: Path, out: str | os.PathLike[str], options: CaptureOptions, backend: Backend, progress: bool = True
) -> Summary:
    """Capture every line of `source` into `out` (resuming what is there); the CLI's core.
    An `out` no filesystem here can open raises InvalidRequestError naming --out."""
    folder = open_store(out, "--out")
    info = await backend.info()
    check_hooks(options, info)
    n_lines = count_lines(source)
    sink = choose_sink(options, folder, backend)
    lock = lock_folder(folder)
    try:
        manifest = open_folder(folder, options, info, fingerprint(source), n_lines, f"{backend.description}, {sink}-side writer")
        bar = Progress(n_lines, progress)
        harvester = await _writer(sink, folder, options, info, backend, bar)
        try:
            lines = read_input(source, options.input_format, skip=harvester.already_done)  # type: ignore[arg-type]
            summary = await harvester.run(lines)
        finally:
            bar.close()
        summary.complete = finish_manifest(folder, manifest, summary.lines)
    finally:
        lock.close()
    return summary


async def _writer(sink: str, out: Store, options: CaptureOptions, info: ModelInfo, backend: Backend, bar: Progress) -> Harvester | ShardSender:
    if sink == "driver" or not isinstance(backend, ShardBackend):
        return Harvester(out, options, info, backend, bar)
    return ShardSender(out, options, info, backend, bar, await backend.replicas())
