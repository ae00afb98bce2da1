"""What an armed site's staging copy costs a CUDA-graph decode step, and whether a side stream or a
write in place takes it off the step's critical path. Torch alone (no vLLM), so it runs before the bundle is installed:

    python3 bench/gpu/staging_copies.py --out DIR      # writes DIR/staging_copies_<gpu>.json

A Llama-3.1-8B-shaped stack (32 layers of qkv, a stand-in for attention that writes a fresh
[tokens, 4096] output as vLLM's op does, o_proj, gated MLP; bf16, random weights) is captured as one
CUDA graph per variant and batch size, and the graphs replay in turns for several rounds:
  plain     no copies;
  sync      each layer's attention output copied into a static staging buffer of its own, on the
            step's stream (hook_z with `attention_in_place: false`, as every z site before it);
  side      the same copies on a side stream, forked after the attention and joined at the layer's
            end, so the copy runs beside o_proj and the MLP;
  in_place  no copies: the attention writes into the staging buffer and o_proj reads it from there
            (`attention_in_place`, replicas/worker/sites.py).
Reported per batch size: each variant's median replay time in microseconds and its excess over plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

D, QKV, FF, LAYERS = 4096, 6144, 14336, 32


class Stack:
    def __init__(self, x: torch.Tensor, variant: str):
        self.variant = variant
        self.x = x
        self.staging = [torch.zeros_like(x) for _ in range(LAYERS)]
        self.side = torch.cuda.Stream()

    def forward(self, weights: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        x = self.x
        for i, w in enumerate(weights):
            qkv = x @ w["qkv"]
            # the attention op writes its own fresh output, or in place the site's staging buffer
            z = self.staging[i] if self.variant == "in_place" else torch.empty(x.shape[0], D, dtype=x.dtype, device=x.device)
            torch.mul(qkv[:, :D], 0.5, out=z)
            if self.variant == "sync":
                self.staging[i].copy_(z)
            elif self.variant == "side":
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    self.staging[i].copy_(z)
            x = x + z @ w["o"]
            gate_up = x @ w["gate_up"]
            x = x + (torch.nn.functional.silu(gate_up[:, :FF]) * gate_up[:, FF:]) @ w["down"]
            if self.variant == "side":
                torch.cuda.current_stream().wait_stream(self.side)
        return x


def capture(stack: Stack, weights: list[dict[str, torch.Tensor]]) -> torch.cuda.CUDAGraph:
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(3):
            stack.forward(weights)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stack.forward(weights)
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 512])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--replays", type=int, default=100)
    args = parser.parse_args()

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda") * 0.01

    weights = [{"qkv": weight(D, QKV), "o": weight(D, D), "gate_up": weight(D, 2 * FF), "down": weight(FF, D)} for _ in range(LAYERS)]
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": LAYERS, "rounds": args.rounds,
                    "replays": args.replays, "by_tokens": {}}
    variants = ("plain", "sync", "side", "in_place")
    for tokens in args.tokens:
        x = torch.randn(tokens, D, dtype=torch.bfloat16, device="cuda")
        stacks = {v: Stack(x, v) for v in variants}
        graphs = {v: capture(stacks[v], weights) for v in variants}
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                times[v].append(replay_us(graphs[v], args.replays))
        medians = {v: statistics.median(t) for v, t in times.items()}
        result["by_tokens"][str(tokens)] = {
            "replay_us_median": medians, "replay_us_rounds": times,
            "excess_over_plain_us": {v: medians[v] - medians["plain"] for v in variants},
        }
        print(tokens, json.dumps(result["by_tokens"][str(tokens)]["excess_over_plain_us"]), medians, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = result["gpu"].split()[-1].lower()
    (args.out / f"staging_copies_{name}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
