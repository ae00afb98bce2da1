"""Read-outs on the replica's device: logit lens and tuned lens equal HuggingFace (its final norm and
output embedding on the hook's value), probes equal rows @ W.T + b, and bad input fails one request.

Three real CPU engines serve the module: tiny Llama in float32 and in bfloat16, tiny Gemma 2 in
float32 (sandwich blocks, a (1 + w) norm, tied embeddings, final logit softcapping), each with a
tuned lens made here in tuned-lens's layout; the Llama ones also load two probes.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from replicas.api import GenerateRequest, GenerateResult, ProbeInfo, ReadoutResult
from replicas.api.errors import InvalidRequestError
from replicas.api.hooks import resolve_hook
from replicas.engine.config import EngineConfig
from replicas.plans.readouts import ReadoutPlan
from replicas.readouts.device import DeviceReadouts, Unembed
from replicas.readouts.specs import ReadoutRows, read_tuned_lens, unpacked
from tests.conftest import ON_GPU, assert_close, assert_same
from tests.hf_reference import hf_activations, hf_lens
from tests.test_engine_capture import prompt_ids

pytestmark = pytest.mark.engine
D_MODEL, N_LAYERS = 128, 4
PROBE_HOOK = "blocks.2.hook_resid_post"
TOL = 1e-4  # float32 against HF float32
LOW_TOL = 0.02  # bfloat16 against HF's head in bfloat16 on the same rows (a few ulps of logprobs near -4)


def tuned_lens_folder(folder: Path, seed: int, d_model: int = D_MODEL, n_layers: int = N_LAYERS) -> dict[int, tuple]:
    """A tuned lens in tuned-lens's saved layout (params.pt's keys, in safetensors); its translators."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    translators = {i: ((rng.standard_normal((d_model, d_model)) * 0.5 / np.sqrt(d_model)).astype(np.float32),
                       (rng.standard_normal(d_model) * 0.02).astype(np.float32)) for i in range(n_layers)}
    save_file({f"{i}.{name}": array for i, pair in translators.items() for name, array in zip(("weight", "bias"), pair)},
              str(folder / "params.safetensors"))
    config = {"base_model_name_or_path": "tiny", "d_model": d_model, "num_hidden_layers": n_layers, "bias": True,
              "base_model_revision": None, "unembed_hash": None, "lens_type": "linear_tuned_lens"}
    (folder / "config.json").write_text(json.dumps(config))
    return translators


def probe_file(path: Path, seed: int, n_out: int, hook: str | None, bias: bool = True, dtype=torch.float32) -> tuple:
    """A probe: weight [n_out, d_model] (and bias) in `dtype`, the hook in the file's metadata;
    its (W, b) as float32 numpy."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n_out, D_MODEL, generator=generator).to(dtype)
    tensors = {"weight": weight}
    if bias:
        tensors["bias"] = torch.randn(n_out, generator=generator).to(dtype)
    save_file(tensors, str(path), metadata={"hook": hook} if hook else None)
    return weight.float().numpy(), (tensors["bias"].float().numpy() if bias else np.zeros(n_out, np.float32))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("readouts")
    return SimpleNamespace(
        root=root,
        llama_lens=tuned_lens_folder(root / "llama-lens", seed=1),
        gemma_lens=tuned_lens_folder(root / "gemma-lens", seed=2),
        sentiment=probe_file(root / "sentiment.safetensors", 3, n_out=3, hook=PROBE_HOOK),
        final=probe_file(root / "final.safetensors", 4, n_out=5, hook=None, bias=False, dtype=torch.bfloat16),
    )


@pytest.fixture(scope="module")
def engines(loop, files: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory):
    from replicas.tiny import make_tiny_model
    from tests.conftest import start_engine

    models = tmp_path_factory.mktemp("readout-models")
    llama, gemma = make_tiny_model("llama", models / "llama", seed=1), make_tiny_model("gemma2", models / "gemma2", seed=1)
    probes = {"sentiment": {"path": str(files.root / "sentiment.safetensors")},
              "final": {"path": str(files.root / "final.safetensors"), "hook": "ln_final.hook_normalized"}}
    lens = str(files.root / "llama-lens")

    async def start_all() -> list:
        return await asyncio.gather(
            start_engine(llama, name="engine-readouts", quick_compile=True, tuned_lens=lens, probes=probes),
            start_engine(llama, name="engine-readouts-bf16", quick_compile=True, dtype="bfloat16", tuned_lens=lens,
                         probes=probes, armed_kinds=["resid_pre", "resid_post"]),
            start_engine(gemma, name="engine-readouts-gemma2", quick_compile=True, tuned_lens=str(files.root / "gemma-lens")),
        )

    fp32, bf16, gemma2 = loop.run(start_all())
    yield SimpleNamespace(fp32=fp32, bf16=bf16, gemma2=gemma2, llama=llama, gemma=gemma)
    for engine in (fp32, bf16, gemma2):
        loop.run(engine.shutdown())


# ---------------------------------------------------------------- schema, start-up checks, device math (no engine)


def test_request_schema_names_the_field() -> None:
    one = GenerateRequest.model_validate({"prompt": "hi", "readouts": {"kind": "logit_lens", "hook": "1:resid_post"}})
    assert one.readouts[0].top_k == 10 and one.readouts[0].positions == "all"
    bad = [
        ({"kind": "tuned_lens", "hook": "blocks.1.hook_attn_out"}, "tuned_lens reads the kinds resid_pre, resid_post"),
        ({"kind": "logit_lens", "hook": "blocks.1.attn.hook_q"}, r"readouts.0.logit_lens\n.*hook: 'blocks.1.attn.hook_q' is of kind 'q'"),
        ({"kind": "logit_lens", "hook": "blocks.1.hook_nothing"}, "hook_nothing"),
        ({"kind": "logit_lens", "hook": "blocks.1.hook_resid_post", "top_k": 0}, r"readouts.0.logit_lens.top_k"),
        ({"kind": "probe", "probe": "p", "top_k": 3}, r"readouts.0.probe.top_k\n  Extra inputs are not permitted"),
        ({"kind": "probe"}, r"readouts.0.probe.probe\n  Field required"),
        ({"kind": "lens", "hook": "blocks.1.hook_resid_post"}, "expected tags: 'logit_lens', 'tuned_lens', 'probe'"),
    ]
    for spec, message in bad:
        with pytest.raises(ValueError, match=message):
            GenerateRequest.model_validate({"prompt": "hi", "readouts": [spec]})


def test_start_up_checks_name_the_field(files: SimpleNamespace, tmp_path: Path) -> None:
    text = SimpleNamespace(hidden_size=D_MODEL, num_hidden_layers=N_LAYERS)
    lens, probe = str(files.root / "llama-lens"), str(files.root / "sentiment.safetensors")
    assert EngineConfig(model="m", tuned_lens=lens, probes={"p": {"path": probe}}).for_checkpoint("pre_norm", None, text)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((files.root / "llama-lens" / "config.json").read_text())
    (pickled / "params.pt").write_bytes(b"\x80\x04")
    small = tuned_lens_folder(tmp_path / "small", seed=0, d_model=64)
    assert small
    lacking = tmp_path / "lacking"
    tuned_lens_folder(lacking, seed=0, n_layers=3)
    (lacking / "config.json").write_text(json.dumps({"d_model": D_MODEL, "num_hidden_layers": N_LAYERS}))
    wide = probe_file(tmp_path / "wide.safetensors", 0, 2, PROBE_HOOK)
    assert wide
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    cases = [
        ({"tuned_lens": str(pickled)}, "tuned_lens: '" + str(pickled) + "' has no params.safetensors"),
        ({"tuned_lens": str(tmp_path / "small")}, "tuned_lens: d_model=64, num_hidden_layers=4 (config.json) do not match the model's d_model=128"),
        ({"tuned_lens": str(lacking)}, "tuned_lens: params.safetensors has no tensor '3.weight' (expected shape [128, 128])"),
        ({"probes": {"p": {"path": probe, "hook": "blocks.9.hook_resid_post"}}}, "probes.p.hook: hook 'blocks.9.hook_resid_post': layer 9 is out of range"),
        ({"probes": {"p": {"path": probe, "hook": "blocks.1.attn.hook_z"}}}, "probes.p.hook: hook: 'blocks.1.attn.hook_z' is of kind 'z'"),
        ({"probes": {"p": {"path": probe}}, "armed_kinds": ["resid_pre"]}, "probes.p.hook: 'blocks.2.hook_resid_post' is of kind 'resid_post', which this deployment does not serve"),
        ({"probes": {"p": {"path": str(files.root / "final.safetensors")}}}, "probes.p.hook: the file's metadata names no `hook`; set hook"),
        ({"probes": {"p": {"path": str(tmp_path / "garbage.safetensors")}}}, "probes.p.path: '" + str(tmp_path / "garbage.safetensors") + "' is not a readable safetensors file"),
        ({"probes": {"p": {"path": str(tmp_path / "nope.safetensors")}}}, "probes.p.path:"),
        ({"probes": {"p": {"path": probe, "dtype": "bf16"}}}, "probes.p.dtype"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineConfig(model="m", **options).for_checkpoint("pre_norm", None, text)
    with pytest.raises(ValueError, match=re.escape("probes.p.path: weight is [3, 128]; its width must be the model's d_model=64")):
        EngineConfig(model="m", probes={"p": {"path": probe}}).for_checkpoint("pre_norm", None, SimpleNamespace(hidden_size=64, num_hidden_layers=4))
    assert read_tuned_lens(lens).bias


def test_device_math_and_packing_round_trip(files: SimpleNamespace) -> None:
    """The device module against numpy with a stand-in head: translator, norm, head, log_softmax,
    top-k; a block packed for k_max=7 read back by a request that asked 3; a probe."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(D_MODEL)
    head = torch.randn(40, D_MODEL)
    options = {"tuned_lens": str(files.root / "llama-lens"), "probes": {"p": {"path": str(files.root / "sentiment.safetensors")}}}
    unembed = Unembed(norm=norm, logits=lambda x: (x @ head.T).float())
    device = DeviceReadouts.load(options, unembed, "cpu", torch.float32)
    x = torch.randn(6, D_MODEL)
    with torch.no_grad():
        packed = device.lens(x, 2, False, 7).numpy()
        weight, bias = (torch.from_numpy(a) for a in files.llama_lens[2])
        expected = torch.log_softmax(norm(x + x @ weight.T + bias) @ head.T, -1).numpy()
    rows = ReadoutRows.for_plan(ReadoutPlan("tuned_lens", (2, "resid_pre"), "blocks.2.hook_resid_pre", "all", 5, 3, 2))
    rows.add(unpacked(packed, 7), 1, 4, 0)
    rows.plan.taken = 4
    want = np.argsort(-expected, axis=1)[1:5, :3]
    np.testing.assert_array_equal(rows.ids[:4], want)
    np.testing.assert_allclose(rows.logprobs[:4], np.take_along_axis(expected[1:5], want, 1), atol=1e-5)
    result = rows.result(prompt_len=3)
    assert result["positions"] == [0, 1, 2, 3] and result["values"] is None
    w, b = files.sentiment
    np.testing.assert_allclose(device.probe_set(("p",), x).numpy(), x.numpy() @ w.T + b, atol=1e-5)


def test_results_travel_as_json_in_every_format() -> None:
    """The native result's JSON, the HTTP body, inspect metadata and the OpenAI `capserve` field."""
    lens = ReadoutResult(kind="logit_lens", hook=PROBE_HOOK, positions=[0, 1], ids=np.array([[3, 1], [2, 0]], np.int32),
                         logprobs=np.array([[-0.5, -1.5], [-0.25, -2.0]], np.float32), tokens=[["c", "a"], ["b", " x"]])
    probe = ReadoutResult(kind="probe", hook=PROBE_HOOK, probe="p", positions=[4], values=np.array([[1.5, -2.0, 0.0]], np.float32))
    result = GenerateResult(request_id="r", text="", token_ids=[], prompt_token_ids=[1], finish_reason=None, choices=[],
                            readouts=[lens, probe])
    back = GenerateResult.model_validate_json(result.model_dump_json())
    for got, want in zip(back.readouts, result.readouts):
        assert (got.kind, got.hook, got.probe, got.positions, got.tokens) == (want.kind, want.hook, want.probe, want.positions, want.tokens)
        for name in ("ids", "logprobs", "values"):
            if getattr(want, name) is None:
                assert getattr(got, name) is None
            else:
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
                assert getattr(got, name).dtype == getattr(want, name).dtype
    from deploy.http_parts import result_fields
    from deploy.openai_responses import capserve_field
    from provider.activations import result_metadata

    encoded = json.loads(result.model_dump_json())["readouts"]
    meta, written = result_metadata(result, [])
    assert written is None and json.loads(json.dumps(meta))["readouts"] == encoded
    assert result_fields(result)["readouts"] == encoded
    assert json.loads(json.dumps(capserve_field(result)))["readouts"] == encoded


def test_a_steps_lenses_are_grouped_computed_in_bounded_chunks_and_a_failure_fails_only_its_requests() -> None:
    """The collector alone: two requests' lenses at one hook take one computation (at the larger
    top_k) in row chunks of max_step_temp_bytes, equal to the whole; a computation that fails on
    the device fails its requests, and the others get their rows."""
    from replicas.readouts.device import lens_row_bytes
    from replicas.readouts.specs import ReadoutCatalog
    from replicas.worker.collector import Collector
    from replicas.worker.outbox import RequestBuffers
    from replicas.worker.request_table import RequestTable
    from tests.test_engine_memory import CPU, D, LmHead, Outbox, sites_of, step_of, wire_plan

    sites = sites_of(kinds=("resid_post",), edit_stages=0, max_tokens=80)
    generator = torch.Generator().manual_seed(3)
    for s in sites.values():
        s.staging.copy_(torch.randn(s.staging.shape, generator=generator))
    head, vocab, computed = LmHead(50), 50, []

    def logits(x: torch.Tensor) -> torch.Tensor:
        computed.append(x.shape[0])
        if torch.equal(x, 2 * sites[(2, "resid_post")].staging[60:70]):  # the third request's lens (layer 2) fails
            raise RuntimeError("out of device memory (a stand-in)")
        return (x @ head.weight[:vocab].T).float()

    readouts = DeviceReadouts(Unembed(norm=lambda x: 2 * x, logits=logits))
    collector = Collector(None, sites, vocab, CPU, Outbox(), max_step_bytes=10 * lens_row_bytes(D, vocab, 4), readouts=readouts)
    table, catalog = RequestTable(), ReadoutCatalog(None, {})
    specs = [[{"kind": "logit_lens", "hook": "0:resid_post", "top_k": 5}],
             [{"kind": "logit_lens", "hook": "blocks.0.hook_resid_post", "top_k": 3, "positions": "prompt"}],
             [{"kind": "logit_lens", "hook": "2:resid_post", "top_k": 2}]]
    plans = [wire_plan({"readouts": spec}, n, readouts=catalog) for spec, n in zip(specs, (40, 20, 10))]
    buffers = [RequestBuffers.for_plan(plan, D, vocab, None) for plan in plans]
    for i, (plan, buffer) in enumerate(zip(plans, buffers)):
        table.admit(f"r{i}", plan, buffer, -1)
    collector.collect(step_of(table, [40, 20, 10]), table)
    for step in collector.outbox.steps:
        step.file()
    assert computed == [10] * 6 + [10]  # layer 0's 60 rows in chunks of 10; layer 2's 10 rows, which failed
    staging = sites[(0, "resid_post")].staging
    whole = torch.log_softmax(2 * staging[:60] @ head.weight[:vocab].T, -1)
    want_logprobs, want_ids = torch.topk(whole, 5, -1)
    for rows, (lo, hi), k in ((buffers[0].readouts[0], (0, 40), 5), (buffers[1].readouts[0], (40, 60), 3)):
        np.testing.assert_array_equal(rows.ids[: hi - lo], want_ids[lo:hi, :k].numpy())
        np.testing.assert_allclose(rows.logprobs[: hi - lo], want_logprobs[lo:hi, :k].numpy(), atol=1e-5)
    assert buffers[0].error is None and buffers[1].error is None
    assert buffers[2].error == "read-out failed on the device: out of device memory (a stand-in)"


# ---------------------------------------------------------------- the engines


def lens_ids(result: ReadoutResult) -> np.ndarray:
    assert result.ids.dtype == np.int32 and result.logprobs.dtype == np.float32
    return result.ids


def assert_lens_equals(result: ReadoutResult, reference: np.ndarray, atol: float, exact_ids: bool = True) -> None:
    """The result's top-k are the reference's: ids (most likely first; on the GPU, whose TF32
    matmuls may swap near-ties, not checked) and logprobs at them."""
    rows = reference[result.positions]
    k = result.ids.shape[1]
    at_ids = np.take_along_axis(rows, lens_ids(result).astype(np.int64), axis=1)
    assert_close(result.logprobs, at_ids, atol=atol, err_msg=result.hook)
    assert_close(result.logprobs, -np.sort(-rows, axis=1)[:, :k], atol=atol, err_msg=result.hook)
    if exact_ids and not ON_GPU:
        np.testing.assert_array_equal(result.ids, np.argsort(-rows, axis=1, kind="stable")[:, :k], err_msg=result.hook)
    assert (np.diff(result.logprobs, axis=1) <= 0).all()


def site(hook: str) -> tuple:
    point = resolve_hook(hook)
    return point.layer, point.kind


LENS_HOOKS = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_mid", "blocks.2.hook_attn_out", "blocks.1.hook_mlp_out",
              "blocks.3.hook_resid_post", "ln_final.hook_normalized", "3:resid_pre"]
TUNED = [("blocks.2.hook_resid_pre", 2), ("blocks.0.hook_resid_post", 1), ("blocks.0.hook_in", 0)]


def test_model_info_lists_the_probes_and_the_tuned_lens(loop, engines) -> None:
    info, gemma = loop.run(engines.fp32.info()), loop.run(engines.gemma2.info())
    assert info.probes == {"sentiment": ProbeInfo(hook=PROBE_HOOK, n_out=3), "final": ProbeInfo(hook="ln_final.hook_normalized", n_out=5)}
    assert info.tuned_lens and gemma.tuned_lens and gemma.probes == {} and info.saes == {}


def test_lenses_and_probes_equal_hf_in_a_mixed_batch(loop, engines, files: SimpleNamespace) -> None:
    """float32: every lens equals HF's final norm and lm_head on the hook's value within 1e-4 (the
    tuned lens after its translator), on prompt and generated rows, a prompt past one chunk; the
    probes equal the captured rows @ W.T + b and HF's value; requests beside them are unchanged."""
    engine, path = engines.fp32, engines.llama
    prompt = prompt_ids(150, seed=5)  # past max_num_batched_tokens: a chunked prefill
    readouts = ([{"kind": "logit_lens", "hook": hook, "top_k": 8} for hook in LENS_HOOKS]
                + [{"kind": "tuned_lens", "hook": hook, "top_k": 5} for hook, _ in TUNED]
                + [{"kind": "probe", "probe": "sentiment"}, {"kind": "probe", "probe": "final", "positions": "generated"},
                   {"kind": "logit_lens", "hook": "blocks.3.hook_resid_post", "top_k": 3, "positions": [2, -1, 151]}])
    asking = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "readouts": readouts,
              "capture": {"hooks": [PROBE_HOOK, "ln_final.hook_normalized"]}, "logits": {"positions": "all"}}
    others = [{"prompt": prompt_ids(30, seed=s), "max_tokens": 4, "temperature": 0, "ignore_eos": True} for s in (6, 7)]

    async def batch() -> list[GenerateResult]:
        return await asyncio.gather(*(engine.generate(r) for r in [asking, *others]))

    res, *beside = loop.run(batch())
    for got, request in zip(beside, others):
        alone = loop.run(engine.generate(request))
        assert got.token_ids == alone.token_ids and not got.readouts
    fed = prompt + res.token_ids[:-1]
    assert len(res.readouts) == len(readouts)
    for spec, result in zip(readouts, res.readouts):
        assert (result.kind, result.hook) == (spec["kind"], spec.get("hook", PROBE_HOOK if spec.get("probe") == "sentiment"
                                                                        else "ln_final.hook_normalized"))
    for result in res.readouts[: len(LENS_HOOKS)]:
        assert result.positions == list(range(len(fed)))
        assert_lens_equals(result, hf_lens(path, fed, site(result.hook)), TOL)
    for (hook, index), result in zip(TUNED, res.readouts[len(LENS_HOOKS) :]):
        reference = hf_lens(path, fed, site(hook), translator=files.llama_lens[index])
        assert_lens_equals(result, reference, TOL)
        assert np.abs(reference - hf_lens(path, fed, site(hook))).max() > 0.1  # the translator matters
    # the tokens are the ids' texts; the final norm's lens is the model's own output distribution
    from replicas import _vllm

    lens = res.readouts[0]
    assert lens.tokens == [_vllm.token_texts(engine.tokenizer, row) for row in lens.ids.tolist()]
    final = res.readouts[LENS_HOOKS.index("ln_final.hook_normalized")]
    logprobs = torch.log_softmax(torch.from_numpy(res.logits), -1).numpy()
    assert_close(final.logprobs, np.take_along_axis(logprobs, final.ids.astype(np.int64), 1), atol=1e-5)
    # probes: rows @ W.T + b on the captured rows, and on HF's value
    sentiment, late = res.readouts[-3], res.readouts[-2]
    w, b = files.sentiment
    assert sentiment.values.shape == (len(fed), 3) and sentiment.values.dtype == np.float32
    assert_close(sentiment.values, res.activations[PROBE_HOOK] @ w.T + b, atol=1e-5, rtol=1e-6)
    assert_close(sentiment.values, hf_activations(path, fed)[site(PROBE_HOOK)] @ w.T + b, atol=1e-3, rtol=1e-4)
    w, b = files.final
    assert late.positions == list(range(len(prompt), len(fed)))
    assert_close(late.values, res.activations["ln_final.hook_normalized"][len(prompt) :] @ w.T, atol=1e-5, rtol=1e-6)
    # explicit positions (151: the second generated token) are those rows of the full lens
    explicit = res.readouts[-1]
    assert explicit.positions == [2, 149, 151]
    full = res.readouts[LENS_HOOKS.index("blocks.3.hook_resid_post")]
    assert_same(explicit.logprobs, full.logprobs[[2, 149, 151], :3])
    if not ON_GPU:  # computed in a group of another size: the GPU's kernels may swap near-ties
        np.testing.assert_array_equal(explicit.ids, full.ids[[2, 149, 151], :3])


def test_gemma2_lenses_equal_hf_with_its_softcapped_head(loop, engines, files: SimpleNamespace) -> None:
    """Sandwich blocks, a (1 + w) final norm, tied embeddings and final logit softcapping."""
    engine, path = engines.gemma2, engines.gemma
    prompt = prompt_ids(40, seed=8)
    hooks = ["blocks.1.hook_resid_post", "blocks.2.hook_attn_out", "blocks.3.hook_resid_post", "ln_final.hook_normalized"]
    readouts = [{"kind": "logit_lens", "hook": hook, "top_k": 6} for hook in hooks]
    readouts.append({"kind": "tuned_lens", "hook": "blocks.1.hook_resid_post", "top_k": 6})
    res = loop.run(engine.generate({"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                    "readouts": readouts}))
    fed = prompt + res.token_ids[:-1]
    for result in res.readouts[:-1]:
        assert_lens_equals(result, hf_lens(path, fed, site(result.hook)), TOL)
    assert_lens_equals(res.readouts[-1], hf_lens(path, fed, (1, "resid_post"), translator=files.gemma_lens[2]), TOL)


def test_bfloat16_lenses_and_probes(loop, engines, files: SimpleNamespace) -> None:
    """bfloat16: lenses equal HF's final norm and head in bfloat16 on the same (captured) rows to
    bfloat16's precision; the final norm's lens is the model's own logits, and probes are float32
    math on the captured bfloat16 rows."""
    engine, path = engines.bf16, engines.llama
    prompt = prompt_ids(40, seed=9)
    readouts = [{"kind": "logit_lens", "hook": "blocks.2.hook_resid_post", "top_k": 4},
                {"kind": "tuned_lens", "hook": "blocks.1.hook_resid_pre", "top_k": 4},
                {"kind": "logit_lens", "hook": "ln_final.hook_normalized", "top_k": 4},
                {"kind": "probe", "probe": "sentiment", "hook": "2:resid_post"}]
    res = loop.run(engine.generate({"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                    "readouts": readouts, "logits": {"positions": "all"},
                                    "capture": {"hooks": [PROBE_HOOK, "blocks.1.hook_resid_pre"], "dtype": "bfloat16"}}))
    lens, tuned, final, probe = res.readouts
    captured = {hook: rows.astype(np.float32) for hook, rows in res.activations.items()}
    fed = prompt + res.token_ids[:-1]
    reference = hf_lens(path, fed, (2, "resid_post"), dtype="bfloat16", rows=captured[PROBE_HOOK])
    assert_lens_equals(lens, reference, LOW_TOL, exact_ids=False)
    reference = hf_lens(path, fed, (1, "resid_pre"), translator=files.llama_lens[1], dtype="bfloat16",
                        rows=captured["blocks.1.hook_resid_pre"])
    assert_lens_equals(tuned, reference, LOW_TOL, exact_ids=False)
    logprobs = torch.log_softmax(torch.from_numpy(res.logits), -1).numpy()
    assert_same(final.logprobs, np.take_along_axis(logprobs, final.ids.astype(np.int64), 1))
    assert_same(final.logprobs[:, 0], logprobs.max(1))
    w, b = files.sentiment
    assert probe.hook == "2:resid_post"
    assert_close(probe.values, captured[PROBE_HOOK] @ w.T + b, atol=1e-5, rtol=1e-5)


BAD = [
    ({"kind": "probe", "probe": "nope"}, {},
     r"readouts\[0\].probe: unknown probe 'nope'; this replica serves \['final', 'sentiment'\] \(engine option probes\)"),
    ({"kind": "probe", "probe": "sentiment", "hook": "blocks.1.hook_resid_post"}, {},
     r"readouts\[0\].hook: 'blocks.1.hook_resid_post' is not the hook probe 'sentiment' reads \('blocks.2.hook_resid_post'\)"),
    ({"kind": "logit_lens", "hook": "blocks.1.attn.hook_z"}, {},
     r"readouts.0.logit_lens: Value error, hook: 'blocks.1.attn.hook_z' is of kind 'z'; logit_lens reads the kinds resid_pre, "),
    ({"kind": "logit_lens", "hook": "blocks.7.hook_resid_post"}, {},
     r"readouts\[0\].hook: hook 'blocks.7.hook_resid_post': layer 7 is out of range"),
    ({"kind": "logit_lens", "hook": "blocks.1.hook_resid_mid"}, {},
     r"readouts\[0\].hook: hook 'blocks.1.hook_resid_mid' is of kind 'resid_mid', which this deployment has not armed; "
     r"armed kinds: \['resid_post', 'resid_pre'\] \(engine option armed_kinds\)"),
    ({"kind": "logit_lens", "hook": "blocks.1.hook_resid_post", "positions": [40]}, {},
     r"readouts\[0\].positions: index 40 is outside the sequence; allowed are -12..13"),
    ({"kind": "logit_lens", "hook": "blocks.1.hook_resid_post", "top_k": 100_000}, {},
     r"readouts\[0\].top_k: 100000 exceeds the vocabulary; allowed 1..\d+ \(d_vocab\)"),
    ({"kind": "tuned_lens", "hook": "blocks.3.hook_resid_post"}, {},
     r"readouts\[0\].hook: 'blocks.3.hook_resid_post' is the last block's output, which a tuned lens decodes with the "
     r"model's own head \(it has no translator there\); use 'logit_lens' at that hook"),
    ({"kind": "logit_lens", "hook": "blocks.1.hook_resid_post", "top_k": 400}, {"max_tokens": 490, "n": 2},
     r"readouts\[0\]/n: \(501 positions x 400 x 8 bytes = 1603200 bytes\) x n=2 completions .* over the replica's "
     r"max_capture_bytes=2097152; ask for fewer lens positions or a smaller top_k, lower n"),
]


@pytest.mark.parametrize(("readout", "extra", "message"), BAD)
def test_bad_input_fails_that_request_alone(loop, engines, readout: dict, extra: dict, message: str) -> None:
    """A 4xx naming the field and what is allowed; a good request in the same batch is served."""
    engine = engines.bf16  # armed_kinds resid_pre, resid_post
    prompt = prompt_ids(12, seed=10)
    good = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "readouts": {"kind": "probe", "probe": "sentiment"}}
    bad = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "readouts": [readout], **extra}

    async def both() -> list:
        return await asyncio.gather(engine.generate(bad), engine.generate(good), return_exceptions=True)

    failed, served = loop.run(both())
    assert isinstance(failed, (InvalidRequestError, ValueError)), failed
    assert re.search(message, str(failed)), str(failed)
    assert isinstance(served, GenerateResult) and served.readouts[0].values.shape == (14, 3)


def test_a_tuned_lens_without_one_loaded_is_a_clear_error() -> None:
    from replicas.plans.request import build_wire_plan
    from replicas.readouts.specs import ReadoutCatalog

    request = GenerateRequest.model_validate({"prompt": [1, 2, 3], "readouts": {"kind": "tuned_lens", "hook": "blocks.1.hook_resid_pre"}})
    with pytest.raises(InvalidRequestError, match=re.escape(
            "readouts[0].kind: 'tuned_lens', but this replica loaded no tuned lens (engine option tuned_lens); use 'logit_lens'")):
        build_wire_plan("k", request, prompt_len=3, n_layers=N_LAYERS, d_model=D_MODEL, armed_kinds={"resid_pre"},
                        steer_kinds=set(), edit_stages=1, max_capture_bytes=1 << 20, d_vocab=50,
                        readouts=ReadoutCatalog(None, {}))


# ---------------------------------------------------------------- conditional steering (a probe decides)


def test_a_probe_gated_add_steers_only_where_the_probe_fires_as_hf_does(loop, engines, files: SimpleNamespace) -> None:
    """`when: {probe, output, above}`: the add lands on the rows whose probe output, taken on the
    hook's own value in the same forward, exceeds the threshold (about half the prompt here); the
    others stay bit for bit; tokens and logits equal HF with the same gated edit; a request beside
    it is unchanged; `below` gates the complement."""
    engine, path = engines.fp32, engines.llama
    prompt = prompt_ids(24, seed=31)
    w, b = files.sentiment
    plain = loop.run(engine.generate({"prompt": prompt, "max_tokens": 1, "capture": {"hooks": [PROBE_HOOK]}}))
    scores = plain.activations[PROBE_HOOK] @ w[1] + b[1]
    threshold = float(np.median(scores))
    vector = np.random.default_rng(9).standard_normal(D_MODEL).astype(np.float32)
    base = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logits": {"positions": "all"},
            "capture": {"hooks": [PROBE_HOOK]}}

    def gated(test: str) -> dict:
        return {"hook": PROBE_HOOK, "op": "add", "vector": vector, "scale": 2.0,
                "when": {"probe": "sentiment", "output": 1, test: threshold}}

    async def batch() -> list[GenerateResult]:
        return await asyncio.gather(engine.generate(base | {"interventions": [gated("above")]}),
                                    engine.generate(base | {"interventions": [gated("below")]}), engine.generate(base))

    above, below, beside = loop.run(batch())
    n = len(prompt)
    fired = scores > threshold
    assert 0 < fired.sum() < n
    for result, where in ((above, fired), (below, scores < threshold)):
        delta = result.activations[PROBE_HOOK][:n] - beside.activations[PROBE_HOOK][:n]
        np.testing.assert_array_equal(delta[~where], 0)
        assert_close(delta[where], np.broadcast_to(2.0 * vector, delta[where].shape), atol=1e-5, rtol=1e-5)
    layer, kind = site(PROBE_HOOK)
    shift = torch.from_numpy(2.0 * vector)
    probe_w, probe_b = torch.from_numpy(w[1]), float(b[1])

    def hf_gated(x: torch.Tensor) -> torch.Tensor:
        return x + ((x @ probe_w + probe_b) > threshold).unsqueeze(-1) * shift

    from tests.hf_reference import hf_greedy, hf_logits

    edits = [(layer, kind, hf_gated)]
    assert above.token_ids == hf_greedy(path, prompt, 4, edits=edits)
    assert_close(above.logits, hf_logits(path, prompt + above.token_ids[:-1], edits=edits), atol=1e-3)
    assert_close(beside.logits, hf_logits(path, prompt + beside.token_ids[:-1]), atol=1e-3)


def test_a_condition_names_its_field_when_it_cannot_be_decided(loop, engines) -> None:
    engine = engines.fp32
    vector = [0.0] * D_MODEL
    cases = [
        ({"hook": "blocks.1.hook_resid_post", "when": {"probe": "sentiment", "above": 0.0}},
         r"interventions\[0\].when.probe: probe 'sentiment' reads 'blocks.2.hook_resid_post', not the edited hook"),
        ({"hook": PROBE_HOOK, "when": {"probe": "nope", "above": 0.0}}, r"interventions\[0\].when.probe: unknown probe 'nope'"),
        ({"hook": PROBE_HOOK, "when": {"probe": "sentiment", "output": 3, "above": 0.0}}, r"when.output: 3 is out of range"),
        ({"hook": PROBE_HOOK, "when": {"vector": [1.0] * 5, "above": 0.0}}, r"when.vector: width 5 does not match the hook's 128"),
        ({"hook": PROBE_HOOK, "when": {"sae_id": "none", "feature": 1, "above": 0.0}}, r"when.sae_id: unknown SAE 'none'"),
    ]
    for edit, message in cases:
        request = {"prompt": prompt_ids(8, seed=1), "max_tokens": 2,
                   "interventions": [{"op": "add", "vector": vector} | edit]}
        with pytest.raises(InvalidRequestError, match=message):
            loop.run(engine.generate(request))
