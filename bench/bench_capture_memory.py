"""Peak memory of `capserve capture`'s pipeline against input size: it must stay flat.

    python -m bench.bench_capture_memory                       # 10k and 100k lines
    python -m bench.bench_capture_memory --lines 10000 100000 1000000

Each size runs in a fresh process: the real pipeline (input streaming, bounded in-flight
requests, shard writer, manifest) against `tests.cli_fakes.FakeBackend`, which answers at once
with activations of the requested shape, so the pipeline itself is measured, not an engine.
Reports peak RSS (ru_maxrss) and RSS right before the run (imports), rows, GB written, time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_input(path: Path, lines: int) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": f"prompt number {i} about topic {i % 97}", "id": i}) + "\n" for i in range(lines))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(source: Path, out: Path, args: argparse.Namespace) -> dict:
    from provider.dataset.cli import parse_positions
    from provider.dataset.options import CaptureOptions
    from provider.dataset.run import run_capture
    from tests.cli_fakes import FakeBackend

    options = CaptureOptions(
        hooks=("blocks.0.hook_resid_post", "blocks.2.hook_resid_post"), positions=parse_positions(args.positions),
        shard_lines=args.shard_lines, concurrency=args.concurrency, input_format="jsonl",
    )
    before = rss_mb()
    started = time.monotonic()
    summary = asyncio.run(run_capture(source, out, options, FakeBackend(d_model=args.d_model), progress=False))
    return {
        "lines": summary.lines, "rows": summary.rows, "gb_written": round(summary.bytes_written / 1e9, 3),
        "seconds": round(time.monotonic() - started, 1), "rss_before_run_mb": round(before, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "complete": summary.complete,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--positions", default="-4,-3,-2,-1", help="4 rows per line by default")
    parser.add_argument("--shard-lines", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--child", nargs=2, metavar=("INPUT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), Path(args.child[1]), args)))
        return
    passthrough = ["--d-model", str(args.d_model), f"--positions={args.positions}",
                   "--shard-lines", str(args.shard_lines), "--concurrency", str(args.concurrency)]
    with tempfile.TemporaryDirectory(prefix="capserve-mem-") as tmp:
        for lines in args.lines:
            source, out = Path(tmp) / f"in-{lines}.jsonl", Path(tmp) / f"out-{lines}"
            make_input(source, lines)
            run = subprocess.run([sys.executable, "-m", "bench.bench_capture_memory", *passthrough, "--child", str(source), str(out)],
                                 capture_output=True, text=True, check=True)
            print(json.dumps({"input_lines": lines, **json.loads(run.stdout.strip().splitlines()[-1])}))
            subprocess.run(["rm", "-rf", str(out)], check=True)  # disk: each run writes GBs


if __name__ == "__main__":
    main()
