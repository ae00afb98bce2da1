"""Shared pieces of the benchmark scripts: workloads, dummy-weight model folders, result files."""

from __future__ import annotations

import json
import platform
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int
    prompt_len: int
    max_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompts * (self.prompt_len + self.max_tokens)

    def prompt_ids(self, vocab: int = 32000, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(10, vocab) for _ in range(self.prompt_len)] for _ in range(self.prompts)]


WORKLOADS = {
    "512x512+128": Workload("512x512+128", 512, 512, 128),
    "32x512+256": Workload("32x512+256", 32, 512, 256),
}


def dummy_model_folder(config_name: str) -> str:
    """A folder with only config.json, for vLLM's load_format="dummy" (random weights)."""
    folder = Path(tempfile.mkdtemp(prefix=f"capserve-{config_name}-"))
    shutil.copy(BENCH_DIR / "configs" / f"{config_name}.json", folder / "config.json")
    return str(folder)


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "python": platform.python_version()}
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        pass
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True
        ).stdout.strip().splitlines()
    except (OSError, subprocess.CalledProcessError):
        info["gpu"] = []
    return info


def write_result(name: str, payload: dict[str, Any], out_dir: str | None = None) -> Path:
    target = Path(out_dir) if out_dir else RESULTS_DIR
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    return path
