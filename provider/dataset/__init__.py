"""The dataset pipeline behind `capserve capture` and `capserve export`.

    input.py      input files, streamed line by line
    options.py    CaptureOptions (what a run asks for), LineFailed, SinkUnreachable
    run.py        run_capture: one run, with either writer
    harvest.py    the driver-side writer: results come here, this process writes the shards
    remote.py     replica-side sinks: shards go to the app as jobs, replicas write them (replicas/shards/sink.py)
    manifest.py   the folder's manifest: create, check a rerun, mark complete
    shards.py     the folder format and load_capture (the writing half: replicas/shards/files.py)
    backends.py   the Serve handle and HTTP backends
    saelens_export.py, cli.py

    from provider.dataset import load_capture   # also provider.load_capture
"""

from provider.dataset.options import CaptureOptions, LineFailed, SinkUnreachable
from provider.dataset.shards import Capture, load_capture

__all__ = ["Capture", "CaptureOptions", "LineFailed", "SinkUnreachable", "load_capture"]
