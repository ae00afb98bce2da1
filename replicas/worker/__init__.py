"""Code that runs inside vLLM's worker process: hook sites installed before compilation, the
per-step request and edit tables, row collection, and the hand-over of captured rows to the arena.
`replicas.worker.CaptureWorker` (vLLM's `worker_cls`) is built on first use from the platform's
worker class; `diagnostics/` holds the step profiler and forward timing."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name != "CaptureWorker":
        raise AttributeError(name)
    from replicas.worker import worker

    return worker.CaptureWorker
