"""What armed and steerable sites cost a compiled step, per kind of deployment, without vLLM:

    python3 bench/gpu/site_costs.py --out DIR      # writes DIR/site_costs_<gpu>.json (needs the bundle's numpy, pydantic)

A Llama-3.1-8B-shaped stack (32 layers of qkv, a stand-in for attention, o_proj, gated MLP; bf16,
random weights) with capserve's own `replicas.worker.sites.Site` modules at the five residual-stream
points of each layer (resid_pre, attn_out, resid_mid, mlp_out, resid_post), each layer compiled by
inductor as vLLM compiles the model. Decode-sized steps (32 and 512 rows) replay as CUDA graphs, a
prefill-sized step (2048 rows, vLLM's default max_num_batched_tokens) runs compiled without graphs.
No request edits anything: every row takes slot 0, as in an armed engine nobody steers. Deployments:
  plain          no sites
  lean           resid_post armed at every layer, steerable at the middle one (`steer_layers`)
  capture_all    the five kinds armed at every layer, none steerable (`steer_kinds: []`)
  steer_resid    the five kinds armed, resid_post steerable at every layer
  default        capserve's defaults: the five kinds armed and steerable at every layer (160 edit passes)
Reported per step size: each deployment's median time in microseconds and its ratio to plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from torch import nn

from replicas.api.hooks import HookPoint
from replicas.worker.sites import Site

D, QKV, FF, LAYERS = 4096, 6144, 14336, 32
KINDS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
DEPLOYMENTS = {  # (armed kinds, steerable kinds, steerable layers: None for all)
    "plain": ((), (), None),
    "lean": (("resid_post",), ("resid_post",), (LAYERS // 2,)),
    "capture_all": (KINDS, (), None),
    "steer_resid": (KINDS, ("resid_post",), None),
    "default": (KINDS, KINDS, None),
}


class Layer(nn.Module):
    def __init__(self, layer: int, deployment: str, max_tokens: int, values: torch.Tensor):
        super().__init__()
        armed, steered, layers = DEPLOYMENTS[deployment]

        def weight(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, dtype=torch.bfloat16, device="cuda") * 0.01, requires_grad=False)

        self.qkv, self.o, self.gate_up, self.down = weight(D, QKV), weight(D, D), weight(D, 2 * FF), weight(FF, D)
        self.sites = nn.ModuleDict()
        for kind in armed:
            stages = 1 if kind in steered and (layers is None or layer in layers) else 0
            self.sites[kind] = Site(HookPoint(layer, kind), d_model=D, max_tokens=max_tokens, edit_stages=stages,
                                    edit_slots=65, capture=True, dtype=torch.bfloat16, device=torch.device("cuda"),
                                    values=values)

    def site(self, kind: str, h: torch.Tensor) -> torch.Tensor:
        return self.sites[kind](h) if kind in self.sites else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.site("resid_pre", x)
        z = (x @ self.qkv)[:, :D] * 0.5
        attn = self.site("attn_out", z @ self.o)
        x = self.site("resid_mid", x + attn)
        gate_up = x @ self.gate_up
        mlp = self.site("mlp_out", (nn.functional.silu(gate_up[:, :FF]) * gate_up[:, FF:]) @ self.down)
        return self.site("resid_post", x + mlp)


def stack(deployment: str, max_tokens: int) -> list[nn.Module]:
    values = torch.zeros(max_tokens, D, dtype=torch.bfloat16, device="cuda")
    return [torch.compile(Layer(i, deployment, max_tokens, values), dynamic=False) for i in range(LAYERS)]


def forward(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def graphed(layers: list[nn.Module], x: torch.Tensor) -> torch.cuda.CUDAGraph:
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(3):
            forward(layers, x)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(layers, x)
    return graph


def timed_us(run, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--graph-tokens", type=int, nargs="+", default=[32, 512])
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS), choices=list(DEPLOYMENTS))
    args = parser.parse_args()
    torch.manual_seed(0)
    # one Layer.forward serves every layer and deployment: the default limit of 8 graphs per code
    # object would send the rest to eager mode
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.accumulated_cache_size_limit = 4096
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": LAYERS,
                    "rounds": args.rounds, "repeats": args.repeats, "by_tokens": {}}
    max_tokens = max([*args.graph_tokens, args.prefill_tokens])
    stacks = {name: stack(name, max_tokens) for name in args.deployments}
    for tokens in [*args.graph_tokens, args.prefill_tokens]:
        x = torch.randn(tokens, D, dtype=torch.bfloat16, device="cuda")
        if tokens == args.prefill_tokens:
            runs = {name: (lambda layers=layers: forward(layers, x)) for name, layers in stacks.items()}
            for run in runs.values():
                run()
        else:
            runs = {name: graphed(layers, x).replay for name, layers in stacks.items()}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                times[name].append(timed_us(run, args.repeats))
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians.get("plain")
        result["by_tokens"][str(tokens)] = {
            "graphed": tokens != args.prefill_tokens, "step_us_median": medians, "step_us_rounds": times,
            "ratio_to_plain": {name: base / m for name, m in medians.items()} if base else None,
        }
        print(tokens, {name: round(m, 1) for name, m in medians.items()},
              {name: round(base / m, 3) for name, m in medians.items()} if base else "", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    # "NVIDIA H100 80GB HBM3" -> h100
    name = next((w.lower() for w in result["gpu"].split() if w[:1].isalpha() and w[1:].isdigit()), "gpu")
    (args.out / f"site_costs_{name}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
