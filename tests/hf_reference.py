"""HuggingFace transformers fp32 reference for captures and interventions (a test helper).

DESIGN.md makes HF transformers on the same weights the correctness oracle: every capture the
server returns, and every intervened logit, must match what this module computes to ~1e-4. The
values come from forward hooks on HF's own modules, so the definitions are the HF computation:

  resid_pre[i]  = input of decoder block i
  attn_out[i]   = attention sublayer output (after o_proj / c_proj), before the residual add
  resid_mid[i]  = resid_pre[i] + attn_out[i]          (input of the second norm)
  mlp_out[i]    = MLP output, before the residual add
  resid_post[i] = block output = resid_mid[i] + mlp_out[i]
  ln_final      = final norm output *including* its weight (HF's last hidden state)

Edits replace the value at a site with `fn(value)`; captures taken in the same pass see the edited
values, as the server's would. resid_mid has no module of its own, so an edit there adds
`fn(mid) - mid` to the attention output, which makes the residual after attention `fn(mid)`.
Each `fn` gets and returns a [seq, d_model] tensor for the whole sequence; in `hf_greedy` that is
prompt + tokens so far, re-run every step, so position-independent edits (add a vector, zero a
direction) compare directly with a server that edits only the new token during decode.

Run `python tests/hf_reference.py` for a self-check against plain HF outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

LAYER_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
Key = tuple[Union[int, None], str]
EditFn = Callable[[torch.Tensor], torch.Tensor]
GlobalEditFn = Callable[[Union[int, None], str, torch.Tensor], Any]
# (layer, kind, fn) edits one site; a bare fn(layer, kind, value) -> new value | None (= unchanged)
# is offered every site, for edits that depend on where they are.
EditSpec = Union[tuple[Union[int, None], str, EditFn], GlobalEditFn]


@functools.lru_cache(maxsize=8)
def _load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def load_model(path: str | Path) -> torch.nn.Module:
    """The cached fp32 HF model for `path` (eager attention, eval mode)."""
    return _load(str(Path(path).expanduser().resolve()))


def _sites(model: torch.nn.Module) -> tuple[list[torch.nn.Module], str, str, torch.nn.Module]:
    """(blocks, attention attr, mlp attr, final norm) for the supported architectures."""
    if hasattr(model, "model") and hasattr(model.model, "layers"):  # llama, qwen2, mistral, ...
        return list(model.model.layers), "self_attn", "mlp", model.model.norm
    if hasattr(model, "transformer") and hasattr(model.transformer, "h"):  # gpt2
        return list(model.transformer.h), "attn", "mlp", model.transformer.ln_f
    raise TypeError(f"unsupported model class {type(model).__name__}")


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _replace_first(output: Any, value: torch.Tensor) -> Any:
    return (value, *output[1:]) if isinstance(output, tuple) else value


class _Run:
    """Installs capture/edit hooks for one forward pass; `values` fills in as the model runs."""

    def __init__(self, model: torch.nn.Module, edits: Sequence[EditSpec] | None, capture: bool):
        self.blocks, attn_attr, mlp_attr, final_norm = _sites(model)
        self.capture = capture
        self.values: dict[Key, torch.Tensor] = {}
        self.site_edits: dict[Key, list[EditFn]] = {}
        self.global_edits: list[GlobalEditFn] = []
        for spec in edits or ():
            if isinstance(spec, tuple):
                layer, kind, fn = spec
                self._check_site(layer, kind)
                self.site_edits.setdefault((layer, kind), []).append(fn)
            elif callable(spec):
                self.global_edits.append(spec)
            else:
                raise TypeError(f"edit must be (layer, kind, fn) or a callable, got {spec!r}")
        self.resid_pre: dict[int, torch.Tensor] = {}  # edited block inputs, for resid_mid
        self.handles: list[Any] = []
        for i, block in enumerate(self.blocks):
            at = functools.partial
            self.handles += [
                block.register_forward_pre_hook(at(self._pre, i), with_kwargs=True),
                getattr(block, attn_attr).register_forward_hook(at(self._attn, i)),
                getattr(block, mlp_attr).register_forward_hook(at(self._mlp, i)),
                block.register_forward_hook(at(self._post, i)),
            ]
        self.handles.append(final_norm.register_forward_hook(self._final))

    def _check_site(self, layer: int | None, kind: str) -> None:
        if kind == "ln_final" and layer is None:
            return
        n = len(self.blocks)
        if kind not in LAYER_KINDS or not isinstance(layer, int) or not 0 <= layer < n:
            raise ValueError(f"no site ({layer!r}, {kind!r}); layers 0..{len(self.blocks) - 1}")

    def _apply(self, layer: int | None, kind: str, value: torch.Tensor) -> torch.Tensor:
        """Run the edits for one site on a [1, seq, d] tensor; record the result if capturing."""
        x = value[0]
        for fn in self.site_edits.get((layer, kind), ()):
            x = fn(x)
        for fn in self.global_edits:
            out = fn(layer, kind, x)
            x = x if out is None else out
        x = x.to(value.dtype).reshape(value.shape[1:])
        if self.capture:
            self.values[(layer, kind)] = x.detach().clone()
        return x.unsqueeze(0)

    def _pre(self, i: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if args:
            hidden = self._apply(i, "resid_pre", args[0])
            self.resid_pre[i] = hidden
            return (hidden, *args[1:]), kwargs
        hidden = self._apply(i, "resid_pre", kwargs["hidden_states"])
        self.resid_pre[i] = hidden
        return args, {**kwargs, "hidden_states": hidden}

    def _attn(self, i: int, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        attn = self._apply(i, "attn_out", _first(output))
        mid = self.resid_pre[i] + attn
        new_mid = self._apply(i, "resid_mid", mid)
        return _replace_first(output, attn + (new_mid - mid))

    def _mlp(self, i: int, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        return _replace_first(output, self._apply(i, "mlp_out", _first(output)))

    def _post(self, i: int, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        return _replace_first(output, self._apply(i, "resid_post", _first(output)))

    def _final(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        return _replace_first(output, self._apply(None, "ln_final", _first(output)))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _forward(
    path: str | Path, token_ids: Sequence[int], edits: Sequence[EditSpec] | None, capture: bool
) -> tuple[torch.Tensor, dict[Key, torch.Tensor]]:
    model = load_model(path)
    if len(token_ids) == 0:
        raise ValueError("token_ids is empty")
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    run = _Run(model, edits, capture)
    try:
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits[0]
    finally:
        run.close()
    return logits.float(), run.values


def hf_activations(
    path: str | Path, token_ids: Sequence[int], edits: Sequence[EditSpec] | None = None
) -> dict[Key, np.ndarray]:
    """{(layer, kind): [seq, d_model] float32}: five kinds per layer, plus (None, "ln_final")."""
    _, values = _forward(path, token_ids, edits, capture=True)
    return {key: value.numpy().astype(np.float32) for key, value in values.items()}


def hf_logits(
    path: str | Path, token_ids: Sequence[int], edits: Sequence[EditSpec] | None = None
) -> np.ndarray:
    """[seq, vocab] float32 logits with the edits applied."""
    logits, _ = _forward(path, token_ids, edits, capture=False)
    return logits.numpy().astype(np.float32)


def hf_greedy(
    path: str | Path,
    token_ids: Sequence[int],
    max_new_tokens: int,
    edits: Sequence[EditSpec] | None = None,
    stop_token_ids: Iterable[int] = (),
) -> list[int]:
    """Greedy continuation (new tokens only), edits applied to the whole sequence at every step.

    No EOS handling unless `stop_token_ids` is given (then the stop token is included and ends it),
    so compare against a server run with ignore_eos or the same stop set.
    """
    stops = set(stop_token_ids)
    seq, new = list(token_ids), []
    for _ in range(max_new_tokens):
        logits, _ = _forward(path, seq, edits, capture=False)
        token = int(torch.argmax(logits[-1]).item())
        seq.append(token)
        new.append(token)
        if token in stops:
            break
    return new


def _close(a: Any, b: Any, what: str, tol: float = 1e-5) -> None:
    err = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    assert err <= tol, f"{what}: max abs err {err}"


def _self_check(path: str) -> None:
    """Hooks must not perturb HF, and captured values must agree with HF's own outputs."""
    model = load_model(path)
    blocks, _, _, norm = _sites(model)
    n = len(blocks)
    ids = list(range(5, 40, 3))
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    logits = ref.logits[0].numpy()
    hidden = [h[0].numpy() for h in ref.hidden_states]
    acts = hf_activations(path, ids)
    ln_final = acts[(None, "ln_final")]

    _close(hf_logits(path, ids), logits, "logits vs model(...).logits", 0)
    _close(ln_final, hidden[-1], "ln_final vs last hidden state", 0)
    with torch.inference_mode():
        normed = norm(torch.from_numpy(acts[(n - 1, "resid_post")])).numpy()
        lm_logits = model.get_output_embeddings()(torch.from_numpy(ln_final)).numpy()
    _close(normed, ln_final, "norm(resid_post[last]) vs ln_final")
    _close(lm_logits, logits, "lm_head(ln_final) vs logits")
    for i in range(n):
        pre, mid, post = (acts[(i, k)] for k in ("resid_pre", "resid_mid", "resid_post"))
        _close(pre, hidden[i], f"resid_pre[{i}] vs hidden_states[{i}]", 0)
        _close(mid, pre + acts[(i, "attn_out")], f"resid_mid[{i}]")
        _close(post, mid + acts[(i, "mlp_out")], f"resid_post[{i}]")
        if i + 1 < n:
            _close(post, acts[(i + 1, "resid_pre")], f"resid_post[{i}] vs resid_pre[{i + 1}]", 0)

    # resid_mid really is the second norm's input (seen by an independent hook).
    seen: dict[int, np.ndarray] = {}
    ln2 = [b.ln_2 if hasattr(b, "ln_2") else b.post_attention_layernorm for b in blocks]
    hooks = [
        m.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0][0].numpy().copy()))
        for i, m in enumerate(ln2)
    ]
    try:
        hf_logits(path, ids)
    finally:
        for h in hooks:
            h.remove()
    for i in range(n):
        _close(seen[i], acts[(i, "resid_mid")], f"resid_mid[{i}] vs second norm input")

    # Identity edits change nothing; equivalent edits at equivalent sites agree.
    same = lambda x: x  # noqa: E731
    ident = [(i, k, same) for i in range(n) for k in LAYER_KINDS] + [(None, "ln_final", same)]
    _close(hf_logits(path, ids, ident), logits, "identity edits", 0)
    v = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    add = lambda x: x + v  # noqa: E731
    edited = hf_logits(path, ids, [(0, "resid_post", add)])
    assert np.abs(edited - logits).max() > 1e-2, "edit had no effect"
    _close(edited, hf_logits(path, ids, [(1, "resid_pre", add)]), "post[0] vs pre[1] edit")
    _close(
        hf_logits(path, ids, [(1, "resid_mid", add)]),
        hf_logits(path, ids, [(1, "attn_out", add)]),
        "additive resid_mid edit vs attn_out edit",
    )
    eacts = hf_activations(path, ids, [(1, "resid_mid", add)])
    _close(eacts[(1, "resid_mid")], acts[(1, "resid_mid")] + v.numpy(), "edited resid_mid")
    _close(eacts[(1, "resid_pre")], acts[(1, "resid_pre")], "upstream of the edit", 0)
    at_site = lambda layer, kind, x: add(x) if (layer, kind) == (0, "resid_post") else None  # noqa
    _close(hf_logits(path, ids, [at_site]), edited, "global-callable edit vs tuple edit", 0)

    out = hf_greedy(path, ids, 4)
    with torch.inference_mode():
        gen = model.generate(
            torch.tensor([ids]), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0
        )
    assert out == gen[0, len(ids) :].tolist(), (out, gen[0, len(ids) :].tolist())
    print(f"ok {path}: {n} layers, d_model {hidden[0].shape[-1]}, greedy {out}")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from replicas.tiny import ARCHS, make_tiny_model

    for arch in sys.argv[1:] or ARCHS:
        _self_check(make_tiny_model(arch))
