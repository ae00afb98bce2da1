"""Why the mixture-of-experts rows of the architecture matrix missed HF on the H200 (2026-12-07).

    python -m bench.moe_tf32 --out bench/results/moe_tf32_cpu.json

On the GPU, vLLM runs a float32 model's experts in its Triton fused-MoE kernel, whose `tl.dot` takes
float32 inputs as TF32 (10 mantissa bits, the rest dropped). This reruns HF on the CPU twice on the
inputs of the tests that failed there: once in float32, once with every expert product's inputs
truncated to TF32 the same way. It reports, per case, the relative error that truncation alone leaves
in `mlp_out` and in the logits, and the smallest gap between a token's last chosen and first unchosen
router logit (top 2 of 8): a gap below the error puts the token with another expert, and its row,
and every later row that attends to it, then differ from HF as a whole.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from replicas.tiny import make_tiny_model
from tests.hf_attention import hf_attention
from tests.hf_reference import hf_activations, hf_greedy, hf_logits, load_model
from tests.test_architectures import edit_of
from tests.test_engine_capture import prompt_ids
from tests.test_engine_interventions import hf_edits

ARCHS = ("mixtral", "qwen3_moe")


def truncated_to_tf32(x: torch.Tensor) -> torch.Tensor:
    bits = x.contiguous().view(torch.int32) & ~0x1FFF  # drop the 13 mantissa bits TF32 has not
    return bits.view(torch.float32)


@contextmanager
def experts_in_tf32(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """The experts' products take TF32-truncated inputs while this is open (HF's eager experts
    call `nn.functional.linear`, which is swapped for the duration of each experts call)."""
    linear = torch.nn.functional.linear

    def tf32_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return linear(truncated_to_tf32(x), truncated_to_tf32(w), b)

    def swap(module: torch.nn.Module, args: tuple) -> None:
        torch.nn.functional.linear = tf32_linear

    def restore(module: torch.nn.Module, args: tuple, output: object) -> None:
        torch.nn.functional.linear = linear

    experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel")]
    handles = []
    for module in experts:
        module.config._experts_implementation = "eager"
        if on:
            handles += [module.register_forward_pre_hook(swap), module.register_forward_hook(restore)]
    try:
        yield
    finally:
        torch.nn.functional.linear = linear
        for handle in handles:
            handle.remove()


@contextmanager
def router_logits(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    seen: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda mod, a, out: seen.append((out[0] if isinstance(out, tuple) else out).detach()))
               for name, m in model.named_modules() if name.endswith("mlp.gate")]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def cases(path: str) -> dict[str, Callable[[], np.ndarray]]:
    """Each failed test's HF computation (its logits), on that test's inputs."""
    config = json.loads(Path(path, "config.json").read_text())
    heads = config["num_attention_heads"]
    d_head = config.get("head_dim") or config["hidden_size"] // heads
    patch = torch.from_numpy(np.random.default_rng(3).standard_normal(d_head).astype(np.float32))
    head_prompt = prompt_ids(14, seed=24)

    def z_edits() -> dict:
        def ablate(z: torch.Tensor) -> torch.Tensor:
            z = z.clone()
            z[:, heads - 1] = 0
            return z

        def patched(z: torch.Tensor) -> torch.Tensor:
            z = z.clone()
            z[: len(head_prompt), 0] = patch
            return z

        return {1: ablate, 2: patched}

    def per_head() -> np.ndarray:
        tokens = list(head_prompt)
        for _ in range(4):
            tokens.append(int(hf_attention(path, tokens, z_edits())[(-1, "logits")][-1].argmax()))
        return hf_attention(path, tokens[:-1], z_edits())[(-1, "logits")]

    def add_at_resid_mid() -> np.ndarray:
        prompt = prompt_ids(12, seed=21)
        edits = hf_edits([edit_of("add", "blocks.1.hook_resid_mid")], len(prompt))
        return hf_logits(path, prompt + hf_greedy(path, prompt, 4, edits=edits)[:-1], edits=edits)

    def every_hook() -> np.ndarray:
        prompt = prompt_ids(40, seed=3)
        return hf_logits(path, prompt + hf_greedy(path, prompt, 5)[:-1])

    return {"every hook, unedited (40 + 5 tokens)": every_hook, "add at blocks.1.hook_resid_mid": add_at_resid_mid,
            "per-head edits of z": per_head}


def measure(arch: str, root: Path) -> dict:
    path = make_tiny_model(arch, root / arch, seed=1)  # the matrix's own model (tests/test_architectures.py)
    model = load_model(path)
    found = {}
    for case, run in cases(path).items():
        with experts_in_tf32(model, on=False), router_logits(model) as logits:
            exact = run()
        gaps = [torch.sort(x, -1, descending=True).values for x in logits]
        with experts_in_tf32(model, on=True):
            tf32 = run()
        found[case] = {"logits_relative_error": relative(tf32, exact),
                       "smallest_router_gap": min(float((top[:, 1] - top[:, 2]).min()) for top in gaps)}
    prompt = prompt_ids(40, seed=3)
    fed = prompt + hf_greedy(path, prompt, 5)[:-1]
    with experts_in_tf32(model, on=False):
        exact = hf_activations(path, fed)
    with experts_in_tf32(model, on=True):
        tf32 = hf_activations(path, fed)
    found["mlp_out relative error by layer"] = [relative(tf32[(i, "mlp_out")], exact[(i, "mlp_out")])
                                                for i in range(model.config.num_hidden_layers)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", type=Path, default=Path("/tmp/capserve-moe-tf32"))
    args = parser.parse_args()
    result = {"torch": torch.__version__, "archs": {arch: measure(arch, args.models) for arch in ARCHS}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
