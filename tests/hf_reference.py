"""HuggingFace transformers reference for captures and interventions (a test helper).

DESIGN.md makes HF transformers on the same weights the correctness oracle: every capture the
server returns, and every intervened logit, must match what this module computes to ~1e-4 (fp32,
the default; `dtype` gives an fp16/bf16 reference for reduced-precision engines). The values come
from forward hooks on HF's own modules, so the definitions are the HF computation, per block shape
as TransformerLens defines them (module tables in tests/hf_shapes.py):

  resid_pre[i]  = input of decoder block i
  attn_out[i]   = what attention adds to the residual stream: the sublayer output before the add,
                  after post_attention_layernorm in post-norm ("sandwich") blocks
  resid_mid[i]  = resid_pre[i] + attn_out[i] = the residual the MLP branch reads
                  (absent in parallel blocks, whose MLP reads resid_pre)
  mlp_out[i]    = what the MLP adds to the residual stream (likewise after its post-norm)
  resid_post[i] = block output = resid_mid[i] + mlp_out[i]
                  (parallel: resid_pre[i] + attn_out[i] + mlp_out[i])
  ln_final      = final norm output *including* its weight (HF's last hidden state)
  attn_unnormed[i], mlp_unnormed[i] = (sandwich blocks) the attention and MLP modules' own
                  outputs, which the post-norms read (TransformerBridge's attn.hook_out, mlp.hook_out)
  router_logits[i] = a sparse (mixture-of-experts) layer's router logits, before the softmax
  expert_ids[i]    = the experts its router chose; an edit of the logits re-routes
                     (tests/hf_shapes.route)

Edits replace the value at a site with `fn(value)`; captures taken in the same pass see the edited
values, as the server's would. resid_mid has no module of its own, so an edit there adds
`fn(mid) - mid` to the attention output, which makes the residual after attention `fn(mid)`;
editing it on a parallel model raises. Each `fn` gets and returns a [seq, d_model] tensor (in the
model's dtype) for the whole sequence; in `hf_greedy` that is prompt + tokens so far, re-run every
step, so position-independent edits (add a vector, zero a direction) compare directly with a
server that edits only the new token during decode.

Run `python tests/hf_reference.py [arch ...]` for a self-check against plain HF outputs.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

if __name__ == "__main__":  # run as a script: make `tests` and `replicas` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hf_shapes import LAYER_KINDS, PARALLEL, ROUTER_KINDS, SANDWICH, UNNORMED_KINDS, layout, route, router_of  # noqa: E402

__all__ = ["LAYER_KINDS", "hf_activations", "hf_greedy", "hf_lens", "hf_logits", "layer_kinds", "load_model"]

Key = tuple[Union[int, None], str]
EditFn = Callable[[torch.Tensor], torch.Tensor]
GlobalEditFn = Callable[[Union[int, None], str, torch.Tensor], Any]
# (layer, kind, fn) edits one site; a bare fn(layer, kind, value) -> new value | None (= unchanged)
# is offered every site, for edits that depend on where they are.
EditSpec = Union[tuple[Union[int, None], str, EditFn], GlobalEditFn]
DType = Union[torch.dtype, str]


def _dtype(dtype: DType) -> torch.dtype:
    """torch.float16 or "float16" (vLLM's spelling) alike."""
    resolved = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"not a floating dtype: {dtype!r}")
    return resolved


@functools.lru_cache(maxsize=8)
def _load(path: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()


def load_model(path: str | Path, dtype: DType = torch.float32) -> torch.nn.Module:
    """The cached HF model for (`path`, `dtype`) (eager attention, eval mode)."""
    return _load(str(Path(path).expanduser().resolve()), _dtype(dtype))


def layer_kinds(path: str | Path) -> tuple[str, ...]:
    """The per-layer kinds the model at `path` has (no resid_mid for parallel blocks)."""
    return layout(load_model(path)).block.kinds


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _replace_first(output: Any, value: torch.Tensor) -> Any:
    return (value, *output[1:]) if isinstance(output, tuple) else value


class _Run:
    """Installs capture/edit hooks for one forward pass; `values` fills in as the model runs."""

    def __init__(self, model: torch.nn.Module, edits: Sequence[EditSpec] | None, capture: bool):
        lay = layout(model)
        self.blocks, self.kinds = lay.blocks, lay.block.kinds
        self.config = model.config
        self.routers = [router_of(block) for block in lay.blocks]
        self.unnormed = lay.block.shape == SANDWICH
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
        attn = self._attn_parallel if lay.block.shape == PARALLEL else self._attn
        self.handles: list[Any] = []
        for i, block in enumerate(self.blocks):
            at = functools.partial
            self.handles += [
                block.register_forward_pre_hook(at(self._pre, i), with_kwargs=True),
                getattr(block, lay.block.attn_out).register_forward_hook(at(attn, i)),
                getattr(block, lay.block.mlp_out).register_forward_hook(at(self._mlp, i)),
                block.register_forward_hook(at(self._post, i)),
            ]
        for i, block in enumerate(self.blocks if self.unnormed else ()):
            for kind, module in zip(UNNORMED_KINDS, (block.self_attn, block.mlp)):
                self.handles.append(module.register_forward_hook(functools.partial(self._unnormed, i, kind)))
        for i, router in enumerate(self.routers):
            if router is not None:
                self.handles.append(router.register_forward_hook(functools.partial(self._router, i)))
        self.handles.append(lay.final_norm.register_forward_hook(self._final))

    def _check_site(self, layer: int | None, kind: str) -> None:
        if kind == "ln_final" and layer is None:
            return
        n = len(self.blocks)
        if kind in ROUTER_KINDS and isinstance(layer, int) and 0 <= layer < n and self.routers[layer] is not None:
            return
        if kind in UNNORMED_KINDS and self.unnormed and isinstance(layer, int) and 0 <= layer < n:
            return
        if kind not in self.kinds or not isinstance(layer, int) or not 0 <= layer < n:
            raise ValueError(
                f"no site ({layer!r}, {kind!r}); layers 0..{n - 1}, kinds {self.kinds}"
            )

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

    def _attn_parallel(self, i: int, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        return _replace_first(output, self._apply(i, "attn_out", _first(output)))

    def _mlp(self, i: int, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        return _replace_first(output, self._apply(i, "mlp_out", _first(output)))

    def _post(self, i: int, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        return _replace_first(output, self._apply(i, "resid_post", _first(output)))

    def _unnormed(self, i: int, kind: str, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        return _replace_first(output, self._apply(i, kind, _first(output)))

    def _router(self, i: int, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        logits, weights, ids = output
        edited = self._apply(i, "router_logits", logits.unsqueeze(0))[0]
        if self.site_edits.get((i, "router_logits")) or self.global_edits:
            weights, ids = route(self.config, edited)
        if self.capture:
            self.values[(i, "expert_ids")] = ids.detach().clone()
        return edited, weights, ids

    def _final(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        return _replace_first(output, self._apply(None, "ln_final", _first(output)))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _forward(
    path: str | Path,
    token_ids: Sequence[int],
    edits: Sequence[EditSpec] | None,
    capture: bool,
    dtype: DType,
) -> tuple[torch.Tensor, dict[Key, torch.Tensor]]:
    model = load_model(path, dtype)
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
    path: str | Path,
    token_ids: Sequence[int],
    edits: Sequence[EditSpec] | None = None,
    dtype: DType = torch.float32,
) -> dict[Key, np.ndarray]:
    """{(layer, kind): [seq, d_model] float32} for `layer_kinds(path)`, plus (None, "ln_final").

    With a reduced `dtype` the values are computed in it and only widened on return.
    """
    _, values = _forward(path, token_ids, edits, True, dtype)
    return {key: value.float().numpy() for key, value in values.items()}


def hf_logits(
    path: str | Path,
    token_ids: Sequence[int],
    edits: Sequence[EditSpec] | None = None,
    dtype: DType = torch.float32,
) -> np.ndarray:
    """[seq, vocab] float32 logits with the edits applied (after any final softcapping)."""
    logits, _ = _forward(path, token_ids, edits, False, dtype)
    return logits.numpy()


def hf_lens(
    path: str | Path,
    token_ids: Sequence[int],
    site: Key,
    translator: tuple[np.ndarray, np.ndarray] | None = None,
    dtype: DType = torch.float32,
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """[seq, vocab] float32 log_softmax of the logit lens at `site`: HF's final norm (not on
    ln_final, normed already) and output embedding applied to the site's value, then Gemma 2's
    final logit softcapping, as the model's own logits. `translator` (W [d, d], b [d]): the tuned
    lens's h + h @ W.T + b first, in the model's dtype (tuned-lens's TunedLens.forward). `rows`:
    decode these [seq, d_model] rows (e.g. a server's captured ones) instead of HF's own value."""
    model = load_model(path, dtype)
    if rows is None:
        h = _forward(path, token_ids, None, True, dtype)[1][site]
    else:
        h = torch.from_numpy(np.asarray(rows, dtype=np.float32)).to(_dtype(dtype))
    with torch.inference_mode():
        if translator is not None:
            weight, bias = (torch.from_numpy(np.asarray(a)).to(h.dtype) for a in translator)
            h = h + torch.nn.functional.linear(h, weight, bias)
        if site[1] != "ln_final":
            h = layout(model).final_norm(h)
        logits = model.get_output_embeddings()(h)
        cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return torch.log_softmax(logits.float(), dim=-1).numpy()


def hf_greedy(
    path: str | Path,
    token_ids: Sequence[int],
    max_new_tokens: int,
    edits: Sequence[EditSpec] | None = None,
    stop_token_ids: Iterable[int] = (),
    dtype: DType = torch.float32,
) -> list[int]:
    """Greedy continuation (new tokens only), edits applied to the whole sequence at every step.

    No EOS handling unless `stop_token_ids` is given (then the stop token is included and ends it),
    so compare against a server run with ignore_eos or the same stop set.
    """
    stops = set(stop_token_ids)
    seq, new = list(token_ids), []
    for _ in range(max_new_tokens):
        logits, _ = _forward(path, seq, edits, False, dtype)
        token = int(torch.argmax(logits[-1]).item())
        seq.append(token)
        new.append(token)
        if token in stops:
            break
    return new


def _close(a: Any, b: Any, what: str, tol: float = 1e-5) -> None:
    err = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    assert err <= tol, f"{what}: max abs err {err}"


def _inputs_of(modules: Sequence[torch.nn.Module], path: str, ids: list[int]) -> list[np.ndarray]:
    """The first input each module sees in one plain forward pass, seen by hooks of our own."""
    seen: dict[int, np.ndarray] = {}

    def record(i: int, module: torch.nn.Module, args: tuple) -> None:
        seen.setdefault(i, args[0][0].numpy().copy())

    at = functools.partial
    hooks = [m.register_forward_pre_hook(at(record, i)) for i, m in enumerate(modules)]
    try:
        hf_logits(path, ids)
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in range(len(modules))]


def _self_check(path: str) -> None:
    """Hooks must not perturb HF, and captured values must agree with HF's own outputs."""
    model = load_model(path)
    lay = layout(model)
    blocks, shape, kinds, n = lay.blocks, lay.block.shape, lay.block.kinds, len(lay.blocks)
    # ~40 tokens, so Gemma's 16-token sliding windows are crossed by the prompt itself.
    ids = [5 + (7 * k) % 400 for k in range(41)]
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    logits = ref.logits[0].numpy()
    hidden = [h[0].numpy() for h in ref.hidden_states]
    acts = hf_activations(path, ids)
    ln_final = acts[(None, "ln_final")]
    assert {k for (i, k) in acts if i is not None and k not in ROUTER_KINDS + UNNORMED_KINDS} == set(kinds), sorted(acts)
    assert layer_kinds(path) == kinds

    _close(hf_logits(path, ids), logits, "logits vs model(...).logits", 0)
    _close(ln_final, hidden[-1], "ln_final vs last hidden state", 0)
    with torch.inference_mode():
        normed = lay.final_norm(torch.from_numpy(acts[(n - 1, "resid_post")])).numpy()
        lm_logits = model.get_output_embeddings()(torch.from_numpy(ln_final))
        cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2
        lm_logits = (torch.tanh(lm_logits / cap) * cap if cap else lm_logits).numpy()
    _close(normed, ln_final, "norm(resid_post[last]) vs ln_final")
    _close(lm_logits, logits, "lm_head(ln_final) vs logits")
    for i in range(n):
        pre, post = acts[(i, "resid_pre")], acts[(i, "resid_post")]
        attn, mlp = acts[(i, "attn_out")], acts[(i, "mlp_out")]
        _close(pre, hidden[i], f"resid_pre[{i}] vs hidden_states[{i}]", 0)
        if shape == PARALLEL:
            _close(post, pre + attn + mlp, f"resid_post[{i}] = pre + attn + mlp")
        else:
            _close(acts[(i, "resid_mid")], pre + attn, f"resid_mid[{i}]")
            _close(post, acts[(i, "resid_mid")] + mlp, f"resid_post[{i}]")
        if i + 1 < n:
            _close(post, acts[(i + 1, "resid_pre")], f"resid_post[{i}] vs resid_pre[{i + 1}]", 0)

    # The MLP branch really reads resid_mid (resid_pre when parallel), seen by independent hooks:
    # this pins attn_out to what is added to the stream, post-norm included for sandwich blocks.
    branch = "resid_pre" if shape == PARALLEL else "resid_mid"
    reads = _inputs_of([getattr(b, lay.block.mlp_reads) for b in blocks], path, ids)
    for i in range(n):
        _close(reads[i], acts[(i, branch)], f"{branch}[{i}] vs MLP branch input")
    if shape == SANDWICH:  # and attn_out is the normed attention output, not the raw one
        raw = _inputs_of([b.post_attention_layernorm for b in blocks], path, ids)
        assert all(np.abs(r - acts[(i, "attn_out")]).max() > 1e-3 for i, r in enumerate(raw))
        for i, r in enumerate(raw):
            _close(acts[(i, "attn_unnormed")], r, f"attn_unnormed[{i}] vs the post-norm's input", 0)

    # Identity edits change nothing; equivalent edits at equivalent sites agree.
    same = lambda x: x  # noqa: E731
    ident = [(i, k, same) for i in range(n) for k in kinds] + [(None, "ln_final", same)]
    _close(hf_logits(path, ids, ident), logits, "identity edits", 0)
    v = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    add = lambda x: x + v  # noqa: E731
    edited = hf_logits(path, ids, [(0, "resid_post", add)])
    assert np.abs(edited - logits).max() > 1e-2, "edit had no effect"
    _close(edited, hf_logits(path, ids, [(1, "resid_pre", add)]), "post[0] vs pre[1] edit")
    # mlp_out is the last thing added to the stream, so adding there is adding to resid_post.
    _close(
        hf_logits(path, ids, [(1, "mlp_out", add)]),
        hf_logits(path, ids, [(1, "resid_post", add)]),
        "additive mlp_out edit vs resid_post edit",
    )
    if shape == PARALLEL:
        # Both branches read resid_pre, so an addition to either output lands in the same place.
        _close(
            hf_logits(path, ids, [(1, "attn_out", add)]),
            hf_logits(path, ids, [(1, "mlp_out", add)]),
            "additive attn_out edit vs mlp_out edit",
        )
        try:
            hf_logits(path, ids, [(1, "resid_mid", add)])
        except ValueError:
            pass
        else:
            raise AssertionError("a resid_mid edit on a parallel model must raise")
    else:
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

    routed = [i for i, block in enumerate(blocks) if router_of(block) is not None]
    if routed:  # the router hooks are HF's own router logits, and re-routing unedited logits changes nothing
        with torch.inference_mode():
            own = model(input_ids=torch.tensor([ids]), output_router_logits=True, use_cache=False).router_logits
        for j, i in enumerate(routed):
            _close(acts[(i, "router_logits")], own[j].float().numpy(), f"router_logits[{i}] vs output_router_logits", 0)
            expected_ids = route(model.config, own[j])[1].numpy()
            np.testing.assert_array_equal(acts[(i, "expert_ids")], expected_ids)
        _close(hf_logits(path, ids, [(routed[0], "router_logits", same)]), logits, "identity router edit", 0)

    out = hf_greedy(path, ids, 4)
    with torch.inference_mode():
        gen = model.generate(
            torch.tensor([ids]), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0
        )
    assert out == gen[0, len(ids) :].tolist(), (out, gen[0, len(ids) :].tolist())

    # A reduced-precision reference is its own model, close to fp32 but not equal to it (further
    # with routers: rounding flips some tokens' choice of experts).
    half = hf_logits(path, ids, dtype="bfloat16")
    assert load_model(path, "bfloat16") is not model and 0 < np.abs(half - logits).max() < (3.0 if routed else 0.5)
    print(f"ok {path}: {type(model).__name__}, {shape}, {n} layers, kinds {kinds}, greedy {out}")


if __name__ == "__main__":
    from replicas.tiny import ARCHS, make_tiny_model

    for arch in sys.argv[1:] or ARCHS:
        _self_check(make_tiny_model(arch))
