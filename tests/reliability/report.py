"""Printing and saving the reliability suite's figures (called from conftest's terminal summary)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RESULT_NAME = "reliability_cpu"
RESULTS_ENV = "CAPSERVE_RESULTS_DIR"  # where the figures go; default bench/results
COLUMNS = ("requests", "ok", "backpressure", "lost_accepted", "errors", "recovery_s", "longest_gap_s")


def _row(name: str, values: dict[str, Any]) -> str:
    cells = [f"{col}={values[col]}" for col in COLUMNS if values.get(col) is not None]
    rss = values.get("peak_rss_mib")
    if rss:
        cells.append("peak_rss_mib=" + ",".join(f"{role}:{mib:.0f}" for role, mib in sorted(rss.items())))
    extra = values.get("summary")
    if extra:
        cells.append(str(extra))
    return f"{name:28s} " + "  ".join(cells)


def print_figures(reporter: Any, figures: dict[str, Any]) -> None:
    reporter.write_sep("=", "capserve reliability figures")
    for name, values in figures.items():
        reporter.write_line(_row(name, values))


def save_figures(figures: dict[str, Any]) -> Path:
    """Merge into the result file: a run of some of the tests updates only their rows."""
    from bench.common import RESULTS_DIR, environment

    folder = Path(os.environ.get(RESULTS_ENV) or RESULTS_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{RESULT_NAME}.json"
    earlier: dict[str, Any] = {}
    if path.exists():
        try:
            earlier = json.loads(path.read_text()).get("figures", {})
        except (OSError, ValueError):
            earlier = {}
    payload = {"environment": {**environment(), "load_average": [round(x, 2) for x in os.getloadavg()]},
               "figures": {**earlier, **figures}}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
