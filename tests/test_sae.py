"""SAE features on the replica: equal to SAELens's own `encode` on the same SAE and activations.

SAEs are made and encoded by SAELens itself, in the side venv `.venv-saelens`
(scripts/install_saelens.sh; tests/saelens_reference.py). One real CPU engine serves them all.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from replicas.api import GenerateRequest, GenerateResult, SaeFeatures
from replicas.engine.config import EngineConfig
from replicas.api.errors import InvalidRequestError
from replicas.plans.request import SaePlan
from replicas.sae.device import DeviceSae, encode_packed, top_features
from replicas.sae.specs import SaeRows, read_facts, unpacked
from tests.conftest import assert_close, assert_same

REPO = Path(__file__).resolve().parents[1]
SIDE_PYTHON = REPO / ".venv-saelens" / "bin" / "python"
REFERENCE = REPO / "tests" / "saelens_reference.py"
HOOK = "blocks.1.hook_resid_post"
D_MODEL, D_SAE = 128, 256
KINDS = ("relu", "jumprelu", "topk")
PRE_6 = ("topk_pre6", "topk_pre6_fn")  # TopK in SAELens < 6's format: activation_fn_str / activation_fn "topk"
PROMPT = "The cat sat on the mat and looked at the door"


def side_venv(*args: str) -> None:
    subprocess.run([str(SIDE_PYTHON), str(REFERENCE), *args], check=True, capture_output=True, timeout=300)


def saelens_encode(jobs: list[tuple[str, np.ndarray, str | None]], tmp: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each (SAE folder, rows x, dtype or None): SAELens's dense encode and x - decode(encode(x)),
    in one run of the side venv."""
    wire = []
    for i, (sae_dir, x, dtype) in enumerate(jobs):
        np.save(tmp / f"x{i}.npy", np.ascontiguousarray(x, dtype=np.float32))
        wire.append({"sae_dir": sae_dir, "acts": str(tmp / f"x{i}.npy"), "out": str(tmp / f"out{i}.npz"), "dtype": dtype})
    (tmp / "jobs.json").write_text(json.dumps(wire))
    side_venv("encode", str(tmp / "jobs.json"))
    return [(out["acts"], out["error"]) for out in (np.load(tmp / f"out{i}.npz") for i in range(len(jobs)))]


def assert_top_features(ids: np.ndarray, values: np.ndarray, dense: np.ndarray, atol: float, rtol: float = 0.0) -> None:
    """ids/values are the top-k of the reference's dense activations: the values equal its k
    largest (active ones; 0 past them, with id -1), and each id's reference activation is its value."""
    k = ids.shape[1]
    expected = -np.sort(-dense, axis=1)[:, :k]
    expected = np.where(expected > 0, expected, 0.0)
    np.testing.assert_allclose(values, expected, atol=atol, rtol=rtol)
    active = ids >= 0
    np.testing.assert_array_equal(active, values > 0)
    gathered = np.take_along_axis(dense, np.where(active, ids, 0), axis=1)
    np.testing.assert_allclose(np.where(active, gathered, 0.0), values, atol=atol, rtol=rtol)
    for row in ids:  # distinct ids per position
        assert len(set(row[row >= 0].tolist())) == int((row >= 0).sum())


@pytest.fixture(scope="module")
def sae_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if not SIDE_PYTHON.exists():
        pytest.skip(f"SAELens side venv missing: {SIDE_PYTHON} (make it with scripts/install_saelens.sh)")
    root = tmp_path_factory.mktemp("saes")
    side_venv("make", str(root), str(D_MODEL), HOOK)
    return {kind: str(root / kind) for kind in KINDS + PRE_6}


@pytest.fixture(scope="module")
def sae_engine(loop, sae_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    from replicas.tiny import make_tiny_model
    from tests.conftest import start_engine

    model = make_tiny_model("llama", tmp_path_factory.mktemp("sae-model") / "llama", seed=1)
    saes = {kind: {"path": sae_dirs[kind]} for kind in KINDS}
    saes["relu_bf16"] = {"path": sae_dirs["relu"], "dtype": "bfloat16"}
    engine = loop.run(start_engine(model, name="engine-sae", saes=saes))
    yield engine
    loop.run(engine.shutdown())


# ---------------------------------------------------------------- device encode, no engine


def test_encode_equals_saelens(sae_dirs: dict[str, str], tmp_path: Path) -> None:
    """Each kind in float32 (TopK saved by SAELens < 6 too), and ReLU and TopK with bfloat16
    weights: bit for bit on the same rows."""
    x = (np.random.default_rng(0).standard_normal((24, D_MODEL)) * 2).astype(np.float32)
    cases = [(kind, None) for kind in KINDS + PRE_6] + [("relu", "bfloat16"), ("topk", "bfloat16")]
    references = saelens_encode([(sae_dirs[kind], x, dtype) for kind, dtype in cases], tmp_path)
    for (kind, dtype), (reference, error) in zip(cases, references):
        sae = DeviceSae.load(read_facts(kind, {"path": sae_dirs[kind], "dtype": dtype}))
        assert sae.W_enc.dtype == getattr(torch, dtype or "float32")
        acts, state = sae.encode(torch.from_numpy(x))
        np.testing.assert_array_equal(acts.float().numpy(), reference, err_msg=f"{kind} {dtype}")
        residual = torch.from_numpy(x).to(acts.dtype) - sae.decode(acts, state)
        np.testing.assert_array_equal(residual.float().numpy(), error, err_msg=f"{kind} {dtype}")


def test_a_topk_block_without_errors_takes_one_top_k(sae_dirs: dict[str, str]) -> None:
    """TopK with no error asked packs the k_max largest pre-activations directly: the same block as
    the top k_max of the dense activations, for k_max up to the SAE's k; SAELens < 6's TopK too."""
    x = torch.randn(32, D_MODEL, generator=torch.Generator().manual_seed(3)) * 2
    for kind in ("topk", "topk_pre6"):
        sae = DeviceSae.load(read_facts(kind, {"path": sae_dirs[kind]}))
        for k_max in (1, sae.facts.k // 2, sae.facts.k):
            ids, values = top_features(sae.encode(x)[0], k_max)
            packed = encode_packed(sae, x, k_max, "none")
            assert packed.shape == (32, 2 * k_max)
            np.testing.assert_array_equal(packed[:, k_max:].view(torch.float32).numpy(), values.numpy(), err_msg=f"{kind} {k_max}")
            np.testing.assert_array_equal(packed[:, :k_max].numpy(), ids.numpy(), err_msg=f"{kind} {k_max}")
            assert (ids[:, 0] >= 0).all()  # random rows: some feature of each is active


def test_top_features_and_packing_round_trip(sae_dirs: dict[str, str]) -> None:
    acts = torch.tensor([[0.0, 3.0, 0.5, 0.0], [1.0, 0.0, 0.0, 2.0]])
    ids, values = top_features(acts, 3)
    assert ids.tolist() == [[1, 2, -1], [3, 0, -1]]
    assert values.tolist() == [[3.0, 0.5, 0.0], [2.0, 1.0, 0.0]]
    # a block packed for k_max=20 with error vectors, read back by a request that asked k=5 and a norm
    sae = DeviceSae.load(read_facts("topk", {"path": sae_dirs["topk"]}))
    x = torch.randn(6, D_MODEL, generator=torch.Generator().manual_seed(0))
    packed = encode_packed(sae, x, 20, "vector").numpy()
    acts, state = sae.encode(x)
    residual = (x - sae.decode(acts, state)).numpy()
    want_ids, want_values = (t.numpy() for t in top_features(acts, 20))
    norm_rows = SaeRows.for_plan(SaePlan("topk", HOOK, 5, "all", "norm", 6), D_MODEL)
    vector_rows = SaeRows.for_plan(SaePlan("topk", HOOK, 20, "all", "vector", 8), D_MODEL)
    norm_rows.add(unpacked(packed, 20), 1, 4, 0)
    vector_rows.add(unpacked(packed, 20), 0, 6, 2)
    np.testing.assert_array_equal(norm_rows.ids[:4], want_ids[1:5, :5])
    np.testing.assert_array_equal(norm_rows.values[:4], want_values[1:5, :5])
    np.testing.assert_allclose(norm_rows.error[:4], np.linalg.norm(residual[1:5], axis=1), rtol=1e-6)
    np.testing.assert_array_equal(vector_rows.ids[2:], want_ids)
    assert (vector_rows.ids[2:, 12:] == -1).all()  # k=12: the rest inactive
    np.testing.assert_array_equal(vector_rows.error[2:], residual)


# ---------------------------------------------------------------- config and request validation, no engine


def test_start_up_checks_name_the_field(sae_dirs: dict[str, str], tmp_path: Path) -> None:
    text = SimpleNamespace(hidden_size=D_MODEL, num_hidden_layers=4)
    ok = EngineConfig(model="m", saes={"relu": {"path": sae_dirs["relu"]}})
    assert ok.for_checkpoint("pre_norm", None, text).saes["relu"].path == sae_dirs["relu"]
    cases = [
        ({"path": sae_dirs["relu"]}, SimpleNamespace(hidden_size=64, num_hidden_layers=4), {}, "saes.relu: d_in=128 (cfg.json) does not match the model's d_model=64"),
        ({"path": sae_dirs["relu"], "hook": "blocks.7.hook_resid_post"}, text, {}, "saes.relu.hook: hook 'blocks.7.hook_resid_post': layer 7 is out of range"),
        ({"path": sae_dirs["relu"]}, text, {"armed_kinds": ["resid_pre"]}, "saes.relu.hook: 'blocks.1.hook_resid_post' is of kind 'resid_post'"),
        ({"path": sae_dirs["relu"] + "-missing"}, text, {}, "saes.relu.path:"),
        ({"path": sae_dirs["relu"], "hook": "blocks.1.hook_nothing"}, text, {}, "saes.relu.hook:"),
    ]
    edited = [
        ({"d_sae": 300}, "saes.relu.path: sae_weights.safetensors has W_enc of shape [128, 256], cfg.json implies [128, 300]"),
        ({"architecture": "gated"}, "saes.relu: architecture 'gated' (cfg.json) is not served"),
    ]
    for edit, message in edited:
        folder = tmp_path / f"edited-{len(cases)}"
        shutil.copytree(sae_dirs["relu"], folder)
        cfg = json.loads((folder / "cfg.json").read_text())
        (folder / "cfg.json").write_text(json.dumps(cfg | edit))
        cases.append(({"path": str(folder)}, text, {}, message))
    for sae, text_config, extra, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineConfig(model="m", saes={"relu": sae}, **extra).for_checkpoint("pre_norm", None, text_config)


def test_saelens_pre_6_configs_read_as_saelens_6_reads_them(sae_dirs: dict[str, str], tmp_path: Path) -> None:
    """activation_fn_str / activation_fn "topk" with activation_fn_kwargs.k is the topk architecture
    with that k (the encode is checked against SAELens in test_encode_equals_saelens); the hook comes
    from hook_point; an activation capserve cannot run is refused, not read as ReLU."""
    for kind, k in (("topk_pre6", 9), ("topk_pre6_fn", 17)):
        facts = read_facts(kind, {"path": sae_dirs[kind]})
        assert (facts.architecture, facts.k, facts.hook, facts.normalize_activations) == ("topk", k, HOOK, "none"), kind
        assert not facts.rescale_acts_by_decoder_norm
    old = json.loads((Path(sae_dirs["topk_pre6"]) / "cfg.json").read_text())
    cases = [
        ({"activation_fn_str": "relu", "activation_fn_kwargs": {}}, None),
        ({"activation_fn_str": "topk", "activation_fn_kwargs": {}}, "saes.old: activation_fn 'topk' (cfg.json, SAELens < 6) names no activation_fn_kwargs.k"),
        ({"activation_fn_str": "tanh-relu"}, "saes.old: activation_fn 'tanh-relu' (cfg.json, SAELens < 6) is not served; served: relu, topk"),
        ({"hook_point": "blocks.1.attn.hook_z"}, "saes.old: reshape_activations='hook_z' (cfg.json) is not served"),
        ({"sae_lens_version": "6.2.0", "activation_fn_str": "tanh-relu", "hook_name": HOOK}, None),  # 6 reads no activation field
    ]
    for i, (edit, message) in enumerate(cases):
        folder = tmp_path / f"old-{i}"
        shutil.copytree(sae_dirs["topk_pre6"], folder)
        (folder / "cfg.json").write_text(json.dumps(old | edit))
        if message is None:
            assert read_facts("old", {"path": str(folder)}).architecture == "standard"
            continue
        with pytest.raises(ValueError, match=re.escape(message)):
            read_facts("old", {"path": str(folder)})


def test_request_schema() -> None:
    one = GenerateRequest.model_validate({"prompt": "hi", "sae": {"sae_id": "relu", "top_k": 3}})
    assert [s.sae_id for s in one.sae] == ["relu"] and one.sae[0].positions == "all"
    bad = [
        ({"sae": {"sae_id": "relu", "top_k": 0}}, "top_k"),
        ({"sae": [{"sae_id": "relu"}, {"sae_id": "relu"}]}, "sae_id twice"),
        ({"sae": {"sae_id": "relu", "error": "mse"}}, "error"),
        ({"interventions": [{"hook": HOOK, "op": "add", "sae_id": "relu"}]}, "needs both sae_id and feature"),
        ({"interventions": [{"hook": HOOK, "op": "scale", "factor": 0, "sae_id": "relu", "feature": 1}]}, "op 'add' only"),
        ({"interventions": [{"hook": HOOK, "op": "add", "vector": [1.0] * 4, "sae_id": "relu", "feature": 1}]}, "not both"),
    ]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            GenerateRequest.model_validate({"prompt": "hi", **extra})


def test_result_json_round_trip() -> None:
    features = SaeFeatures(hook=HOOK, positions=[0, 1], ids=np.array([[3, -1], [1, 2]], np.int32),
                           values=np.array([[1.5, 0], [2, 1]], np.float32), error=np.array([0.5, 0.25], np.float32))
    result = GenerateResult(request_id="r", text="", token_ids=[], prompt_token_ids=[1], finish_reason=None, choices=[],
                            sae={"relu": features})
    back = GenerateResult.model_validate_json(result.model_dump_json())
    for name in ("ids", "values", "error"):
        np.testing.assert_array_equal(getattr(back.sae["relu"], name), getattr(features, name))
    # HTTP JSON bodies and inspect metadata carry them JSON-safe
    from deploy.http_parts import result_fields
    from provider.activations import result_metadata

    meta, written = result_metadata(result, [])
    assert written is None and json.loads(json.dumps(meta))["sae"] == json.loads(result.model_dump_json())["sae"]
    assert SaeFeatures.model_validate(result_fields(result)["sae"]["relu"]).positions == [0, 1]


# ---------------------------------------------------------------- the engine


def plain(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 5, "temperature": 0}


def test_model_info_lists_the_loaded_saes(loop, sae_engine) -> None:
    """A client finds the SAEs it may name, with what each reads and how wide it is."""
    saes = loop.run(sae_engine.info()).saes
    assert sorted(saes) == sorted([*KINDS, "relu_bf16"])
    assert {sae.hook for sae in saes.values()} == {HOOK} and {sae.d_sae for sae in saes.values()} == {D_SAE}
    assert saes["topk"].architecture == "topk" and saes["topk"].k is not None and saes["relu"].k is None


def test_features_equal_saelens_in_a_mixed_batch(loop, sae_engine, sae_dirs: dict[str, str], tmp_path: Path) -> None:
    asking = {
        **plain(PROMPT),
        "capture": {"hooks": [HOOK], "positions": "all"},
        "sae": [
            {"sae_id": "relu", "hook": HOOK, "top_k": 16, "error": "norm"},
            {"sae_id": "jumprelu", "top_k": 24, "error": "vector"},
            {"sae_id": "topk", "top_k": 20},  # k=12: the last 8 of each row are inactive (-1)
            {"sae_id": "relu_bf16", "top_k": 8},
        ],
    }
    explicit = {**plain(PROMPT), "sae": {"sae_id": "relu", "top_k": 4, "positions": [0, -1, 12]}}
    others = [plain("A quick brown fox"), plain("Numbers: 1 2 3 4 5 6 7 8")]

    async def batch():
        return await asyncio.gather(*(sae_engine.generate(r) for r in [asking, explicit, *others]))

    res, res_explicit, *res_others = loop.run(batch())
    alone = [loop.run(sae_engine.generate(r)) for r in others]
    for got, want in zip(res_others, alone):  # requests that ask for nothing are unchanged
        assert got.token_ids == want.token_ids and not got.sae and not got.activations
    x = res.activations[HOOK]
    assert x.shape == (len(res.prompt_token_ids) + 4, D_MODEL)
    references = saelens_encode([(sae_dirs[k], x, None) for k in KINDS] + [(sae_dirs["relu"], x, "bfloat16")], tmp_path)
    for (sae_id, top_k), (dense, error) in zip((("relu", 16), ("jumprelu", 24), ("topk", 20)), references):
        features = res.sae[sae_id]
        assert features.hook == HOOK  # as given, or the SAE's own (cfg.json) when the spec names none
        assert features.positions == res.positions
        assert features.ids.dtype == np.int32 and features.values.dtype == np.float32
        assert features.ids.shape == features.values.shape == (len(res.positions), top_k)
        assert_top_features(features.ids, features.values, dense, atol=1e-5, rtol=1e-5)
        if sae_id == "relu":
            assert_close(features.error, np.linalg.norm(error, axis=1), atol=1e-4, rtol=1e-5)
        if sae_id == "jumprelu":
            assert_close(features.error, error, atol=1e-4, rtol=1e-5)
        if sae_id == "topk":
            assert (features.ids[:, 12:] == -1).all() and (features.ids[:, :12] >= 0).all()
    dense = references[3][0]
    assert_top_features(res.sae["relu_bf16"].ids, res.sae["relu_bf16"].values, dense, atol=0.05, rtol=0.02)
    # explicit positions: the rows of those positions
    prompt_len = len(res.prompt_token_ids)
    wanted = sorted({0, prompt_len - 1, 12})
    assert res_explicit.sae["relu"].positions == wanted
    np.testing.assert_array_equal(res_explicit.sae["relu"].ids, res.sae["relu"].ids[wanted, :4])


def test_feature_steering_equals_add_of_decoder_row(loop, sae_engine, sae_dirs: dict[str, str]) -> None:
    from safetensors.numpy import load_file

    row = load_file(f"{sae_dirs['relu']}/sae_weights.safetensors")["W_dec"][7]
    capture = {"hooks": [HOOK, "blocks.2.hook_resid_post"], "positions": "all"}
    by_feature = {**plain(PROMPT), "capture": capture,
                  "interventions": [{"hook": HOOK, "op": "add", "sae_id": "relu", "feature": 7, "scale": 6.0}]}
    by_vector = {**plain(PROMPT), "capture": capture, "interventions": [{"hook": HOOK, "op": "add", "vector": row, "scale": 6.0}]}

    async def both():
        return await asyncio.gather(sae_engine.generate(by_feature), sae_engine.generate(by_vector),
                                    sae_engine.generate({**plain(PROMPT), "capture": capture}))

    steered, reference, unsteered = loop.run(both())
    assert steered.token_ids == reference.token_ids
    for hook in capture["hooks"]:
        assert_same(steered.activations[hook], reference.activations[hook])
    # the edit is there: the prompt rows moved by scale x W_dec[7] against the unsteered run
    prompt_len = len(steered.prompt_token_ids)
    assert_close(steered.activations[HOOK][:prompt_len] - unsteered.activations[HOOK][:prompt_len],
                 np.tile(row * 6.0, (prompt_len, 1)), atol=1e-4)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"sae": {"sae_id": "nope"}}, r"sae\[0\].sae_id: unknown SAE 'nope'; this replica serves \['jumprelu', 'relu', 'relu_bf16', 'topk'\]"),
        ({"sae": {"sae_id": "relu", "top_k": D_SAE + 1}}, r"sae\[0\].top_k: 257 exceeds SAE 'relu''s d_sae=256"),
        ({"sae": {"sae_id": "relu", "top_k": 0}}, r"sae.0.top_k"),
        ({"sae": {"sae_id": "relu", "hook": "blocks.0.hook_resid_post"}}, r"sae\[0\].hook: 'blocks.0.hook_resid_post' is not the hook SAE 'relu' reads"),
        ({"sae": {"sae_id": "relu", "positions": [99]}}, r"sae\[0\].positions: index 99 is outside the sequence"),
        ({"interventions": [{"hook": HOOK, "op": "add", "sae_id": "relu", "feature": D_SAE}]},
         r"interventions\[0\].feature: 256 is out of range; SAE 'relu' has features 0..255"),
        ({"interventions": [{"hook": HOOK, "op": "add", "sae_id": "gone", "feature": 1}]}, r"interventions\[0\].sae_id: unknown SAE 'gone'"),
        ({"interventions": [{"hook": "blocks.0.hook_resid_post", "op": "add", "sae_id": "relu", "feature": 1}]},
         r"interventions\[0\].hook: 'blocks.0.hook_resid_post' is not the hook SAE 'relu' reads"),
    ],
)
def test_bad_input_fails_that_request_alone(loop, sae_engine, extra: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        loop.run(sae_engine.generate({**plain(PROMPT), **extra}))
    res = loop.run(sae_engine.generate({**plain(PROMPT), "sae": {"sae_id": "topk", "top_k": 2, "positions": "last_prompt"}}))
    assert res.sae["topk"].ids.shape == (1, 2) and (res.sae["topk"].ids >= 0).all()


def test_sae_module_runs_without_the_side_venv_in_this_interpreter() -> None:
    """capserve's venv never imports SAELens (it cannot: transformer-lens<4 vs 4.3)."""
    assert "sae_lens" not in sys.modules
