"""Named steering vectors without a cluster: the config entries and their files, the checks against
the model, the Router putting arrays in place of names (on a fake replica pool), the /v1/vectors
routes (FastAPI app in front of an HttpRouter, as tests/test_http.py), and the engine refusing a
name that reached it. The real app is tests/test_serve_app.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from deploy.config import AppArgs, RouterConfig, VectorSpec
from deploy.router import Router
from deploy.vectors import MAX_UPLOAD_BYTES, VectorConflict, VectorNotFound, VectorRegistry, fit_problem
from replicas.api import AttentionInfo, GenerateRequest, ModelInfo, arrays
from replicas.api.errors import InvalidRequestError
from replicas.plans.request import PlanError, build_wire_plan
from replicas.shards.sink import ShardJob
from tests.test_http import AUTH, answers, served  # noqa: F401  (served: the HTTP app fixture)
from tests.test_router import INFO, FakePool

D = INFO.d_model  # 8


def npy(folder: Path, name: str, array: np.ndarray) -> str:
    path = folder / f"{name}.npy"
    np.save(path, array)
    return str(path)


def steer(seed: int = 0, width: int = D) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(width).astype(np.float32)


def router(tmp_path: Path, **vectors: dict) -> tuple[Router, FakePool]:
    pool = FakePool(["a"], answers)
    return Router(pool, RouterConfig(vectors={k: VectorSpec(**v) for k, v in vectors.items()})), pool


# ---------------------------------------------------------------- config


def test_config_vectors_load_from_npy_and_safetensors_files(tmp_path):
    from safetensors.numpy import save_file

    save_file({"layer1": steer(1), "layer2": steer(2)}, str(tmp_path / "many.safetensors"))
    save_file({"only": steer(3).astype(np.float16)}, str(tmp_path / "one.safetensors"))
    registry = VectorRegistry({
        "a": VectorSpec(path=npy(tmp_path, "a", steer(0).astype(np.float64)), hook="blocks.1.hook_resid_post"),
        "b": VectorSpec(path=str(tmp_path / "many.safetensors"), tensor="layer2"),
        "c": VectorSpec(path=str(tmp_path / "one.safetensors")),
    }, max_vectors=8)
    listed = {entry["name"]: entry for entry in registry.listing()}
    assert listed["a"] == {"name": "a", "shape": [D], "hook": "blocks.1.hook_resid_post", "source": "config",
                           "norm": pytest.approx(float(np.linalg.norm(steer(0)))), "problem": None}
    request = GenerateRequest.model_validate({"prompt": "x", "interventions": [
        {"op": "add", "vector": "a"}, {"hook": "0:resid_pre", "op": "project_out", "vector": "b"},
        {"hook": "0:mlp_out", "op": "clamp", "vector": "c", "max": 1.0}]})
    a, b, c = registry.resolve(request).interventions
    assert a.hook == "blocks.1.hook_resid_post" and a.vector.dtype == np.float32
    np.testing.assert_array_equal(a.vector, steer(0))
    np.testing.assert_array_equal(b.vector, steer(2))
    np.testing.assert_array_equal(c.vector, steer(3).astype(np.float16).astype(np.float32))
    assert not a.vector.flags.writeable  # one array, shared by every request naming it


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it on the Router's node"),
    (np.array([1.0, np.nan]), "the array holds NaN or infinite"),
    (np.zeros(4), "the vector is zero"),
    (np.ones((2, 2, 2)), r"expected a non-empty \[width\] or \[n_heads, d_head\] array, got shape \[2, 2, 2\]"),
    (np.array(["a", "b"]), "expected an array of real numbers"),
    (np.array([1e39, 0.0]), "the array holds NaN or infinite values \\(in float32\\)"),
])
def test_a_config_vector_that_cannot_be_used_fails_the_router_s_start_naming_the_entry(tmp_path, content, message):
    path = str(tmp_path / "v.npy") if content is None else npy(tmp_path, "v", content)
    with pytest.raises(ValueError, match=rf"vectors\.refusal\.path='.*v\.npy': {message}"):
        router(tmp_path, refusal={"path": path})


def test_a_safetensors_file_needs_its_tensor_named_when_it_holds_several(tmp_path):
    from safetensors.numpy import save_file

    path = str(tmp_path / "many.safetensors")
    save_file({"x": steer(1), "y": steer(2)}, path)
    with pytest.raises(ValueError, match=r"holds 2 tensors \['x', 'y'\]; name one with `tensor`"):
        router(tmp_path, v={"path": path})
    with pytest.raises(ValueError, match=r"no tensor 'z' in the file; it holds \['x', 'y'\]"):
        router(tmp_path, v={"path": path, "tensor": "z"})
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable .safetensors file"):
        router(tmp_path, v={"path": str(tmp_path / "junk.safetensors")})


@pytest.mark.parametrize("vectors, message", [
    ({"9lives": {"path": "v.npy"}}, "vector name '9lives' is not allowed"),
    ({"v": {"path": "v.pt"}}, "expected a .npy or .safetensors file"),
    ({"v": {"path": "v.npy", "tensor": "x"}}, "tensor: applies to .safetensors files only"),
    ({"v": {"path": "v.npy", "hook": "ln_final.hook_normalized"}}, "cannot be edited"),
    ({"v": {"path": "v.npy", "hook": "blocks.0.hook_nothing"}}, "blocks.<i>.hook_<kind>"),
    ({"v": {"path": "v.npy", "layer": 3}}, "Extra inputs are not permitted"),
])
def test_app_args_refuse_bad_vector_entries_before_anything_starts(vectors, message):
    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate({"vectors": vectors})
    with pytest.raises(ValidationError, match="2 entries exceed max_vectors=1"):
        AppArgs.model_validate({"vectors": {"a": {"path": "a.npy"}, "b": {"path": "b.npy"}}, "max_vectors": 1})


# ---------------------------------------------------------------- fit to the model


def test_a_vector_fits_its_default_hook_or_any_of_the_model_s_widths():
    info = INFO.model_copy(update={"attention": AttentionInfo(
        n_heads=4, n_kv_heads=2, d_head=2, d_head_v=3, scale=[1.0] * 4, soft_cap=[0.0] * 4, sliding_window=[None] * 4)})
    assert fit_problem(np.ones(8), None, info) is None
    assert fit_problem(np.ones(12), "blocks.1.attn.hook_z", info) is None  # 4 heads x 3
    assert fit_problem(np.ones(3), "blocks.1.attn.hook_z", info) is None  # one head's width
    assert fit_problem(np.ones((4, 3)), "blocks.1.attn.hook_z", info) is None
    assert fit_problem(np.ones(6), None, info) is None  # v: 2 kv heads x 3
    assert fit_problem(np.ones(8), "blocks.1.attn.hook_z", info) == (
        "shape [8] fits no row at its hook 'blocks.1.attn.hook_z'; allowed: [12], [3], [4, 3]")
    assert fit_problem(np.ones(5), None, info).startswith("shape [5] fits no row at any of this model's hooks")
    assert "layers 0..3" in fit_problem(np.ones(8), "blocks.4.hook_resid_post", info)
    assert fit_problem(np.ones(12), "blocks.1.attn.hook_z", INFO) == "hook 'blocks.1.attn.hook_z': this model reported no attention heads"


# ---------------------------------------------------------------- the Router


def test_the_router_puts_the_array_and_its_default_hook_in_place_of_the_name(tmp_path):
    async def main():
        hooked, plain = steer(1), steer(2)
        r, pool = router(tmp_path, hooked={"path": npy(tmp_path, "h", hooked), "hook": "blocks.2.hook_resid_pre"},
                         plain={"path": npy(tmp_path, "p", plain)})
        await r.generate({"prompt": "x", "interventions": [
            {"op": "add", "vector": "hooked", "scale": 3.0, "positions": "prompt"},
            {"hook": "blocks.0.hook_mlp_out", "op": "add", "vector": "hooked"},  # the request's hook wins
            {"hook": "0:resid_post", "op": "clamp", "vector": "plain", "min": -1.0},
            {"hook": "0:resid_post", "op": "scale", "factor": 0.5}]})
        sent = pool.calls[-1][1].interventions
        assert [e.hook for e in sent] == ["blocks.2.hook_resid_pre", "blocks.0.hook_mlp_out", "0:resid_post", "0:resid_post"]
        assert sent[0].scale == 3.0 and sent[0].positions == "prompt" and sent[2].min == -1.0
        for edit, array in zip(sent, (hooked, hooked, plain)):
            np.testing.assert_array_equal(edit.vector, array)
        assert all(e.vector_name is None for e in sent)
        await r.capture({"prompt": "x", "capture": {"hooks": ["0:resid_post"]}, "interventions": [{"op": "add", "vector": "hooked"}]})
        np.testing.assert_array_equal(pool.calls[-1][1].interventions[0].vector, hooked)
        batch = [{"prompt": "y", "capture": {"hooks": ["0:resid_post"]}, "interventions": [{"op": "add", "vector": v}]}
                 for v in ("hooked", "hooked")]
        await r.capture_batch(batch)
        assert all(req.interventions[0].hook == "blocks.2.hook_resid_pre" for _, req in pool.calls[-2:])

    asyncio.run(main())


def test_a_name_the_router_cannot_use_fails_the_request_before_any_replica_is_called(tmp_path):
    async def main():
        r, pool = router(tmp_path, plain={"path": npy(tmp_path, "p", steer(2))},
                         wide={"path": npy(tmp_path, "w", steer(3, width=D + 1))})
        cases = [
            ({"op": "add", "vector": "nope", "hook": "0:resid_post"},
             r"interventions\.0\.vector: no vector named 'nope' is registered; registered: \['plain', 'wide'\]"),
            ({"op": "add", "vector": "plain"}, r"interventions\.0\.hook: required; vector 'plain' has no default hook"),
            ({"op": "add", "vector": "plain", "hook": "0:resid_post", "heads": [0]}, r"interventions\.0: .*heads applies to the attention hooks"),
            ({"op": "add", "vector": "wide", "hook": "0:resid_post"},
             r"vector 'wide' \(serve_config vectors.wide\) shape \[9\] fits no row at any of this model's hooks"),
        ]
        for edit, message in cases:
            with pytest.raises(InvalidRequestError, match=message):
                await r.generate({"prompt": "x", "interventions": [edit]})
        with pytest.raises(InvalidRequestError, match=r"requests\[1\]\.interventions\.0\.vector: no vector named 'nope'"):
            await r.capture_batch([{"prompt": "x", "capture": {"hooks": ["0:resid_post"]}},
                                   {"prompt": "y", "capture": {"hooks": ["0:resid_post"]}, "interventions": [cases[0][0]]}])
        assert pool.calls == []
        assert {e["name"]: e["problem"] for e in await r.list_vectors()} == {
            "plain": None, "wide": "shape [9] fits no row at any of this model's hooks (give a default hook for another); allowed: [8]"}

    asyncio.run(main())


def test_uploads_are_checked_replaced_only_when_asked_and_deleted(tmp_path):
    async def main():
        r, pool = router(tmp_path, fixed={"path": npy(tmp_path, "f", steer(1))})
        entry = await r.register_vector("mine", steer(4).tolist(), hook="0:resid_post")
        assert entry | {"norm": 0} == {"name": "mine", "shape": [D], "hook": "0:resid_post", "source": "upload", "norm": 0, "problem": None}
        with pytest.raises(VectorConflict, match="'mine' is already registered; pass replace: true"):
            await r.register_vector("mine", steer(5))
        await r.register_vector("mine", arrays.to_base64(steer(5)), replace=True)  # the array wire format too
        await r.generate({"prompt": "x", "interventions": [{"op": "add", "vector": "mine", "hook": "1:resid_post"}]})
        np.testing.assert_array_equal(pool.calls[-1][1].interventions[0].vector, steer(5))
        assert pool.calls[-1][1].interventions[0].hook == "1:resid_post"
        with pytest.raises(VectorConflict, match=r"'fixed' comes from serve_config \(vectors.fixed\); it cannot be replaced"):
            await r.register_vector("fixed", steer(6), replace=True)
        with pytest.raises(VectorConflict, match="comes from serve_config"):
            await r.delete_vector("fixed")
        bad = [
            (("x", steer(1, width=5)), "vector: shape \\[5\\] fits no row at any of this model's hooks"),
            (("x", steer(1), "blocks.9.hook_resid_post"), "vector: hook 'blocks.9.hook_resid_post': .*layers 0..3"),
            (("x", [0.0] * D), "vector: the vector is zero"),
            (("x", np.ones((2, 2, 2))), r"vector: expected a non-empty \[width\] or \[n_heads, d_head\] array"),
            (("x", [1.0, float("inf")]), "NaN or infinite"),
            (("x y", steer(1)), r"name: Value error, vector name 'x y' is not allowed"),
            (("x", steer(1), "ln_final.hook_normalized"), "hook: Value error, hook 'ln_final.hook_normalized' cannot be edited"),
        ]
        for args, message in bad:
            with pytest.raises(InvalidRequestError, match=message):
                await r.register_vector(*args)
        assert await r.delete_vector("mine") == {"deleted": "mine"}
        with pytest.raises(VectorNotFound, match=r"no vector named 'mine'; registered: \['fixed'\]"):
            await r.delete_vector("mine")
        with pytest.raises(InvalidRequestError, match="no vector named 'mine'"):
            await r.generate({"prompt": "x", "interventions": [{"op": "add", "vector": "mine", "hook": "1:resid_post"}]})

    asyncio.run(main())


def test_the_registry_holds_at_most_max_vectors(tmp_path):
    async def main():
        r = Router(FakePool(["a"], answers), RouterConfig(max_vectors=2))
        await r.register_vector("a", steer(1))
        await r.register_vector("b", steer(2))
        with pytest.raises(VectorConflict, match="holds max_vectors=2 vectors; delete some first"):
            await r.register_vector("c", steer(3))
        await r.register_vector("b", steer(4), replace=True)  # replacing takes no room

    asyncio.run(main())


def test_a_shard_job_s_lines_carry_arrays_in_place_of_names(tmp_path):
    registry = VectorRegistry({"v": VectorSpec(path=npy(tmp_path, "v", steer(1)), hook="0:resid_post")}, 4)
    lines = [{"line": 0, "request": {"prompt": "a", "capture": {"hooks": ["0:resid_post"]}}},
             {"line": 1, "request": {"prompt": "b", "capture": {"hooks": ["0:resid_post"]}, "interventions": [{"op": "add", "vector": "v"}]}}]
    job = ShardJob.model_validate({"folder": str(tmp_path), "shard": 0, "spec": {"hooks": ["0:resid_post"]}, "d_model": D, "lines": lines})
    resolved = registry.resolve_job(job, [GenerateRequest.model_validate(line["request"]) for line in lines])
    assert resolved.lines[0] is job.lines[0]
    edit = GenerateRequest.model_validate(resolved.lines[1].request).interventions[0]
    assert edit.hook == "0:resid_post" and edit.vector_name is None
    np.testing.assert_array_equal(edit.vector, steer(1))


def test_an_engine_refuses_a_name_the_router_did_not_resolve():
    request = GenerateRequest.model_validate({"prompt": [1, 2], "interventions": [{"op": "add", "vector": "refusal"}]})
    with pytest.raises(PlanError, match=r"interventions\[0\].vector: 'refusal' names a registered vector; the capserve app's Router"):
        build_wire_plan("k", request, prompt_len=2, n_layers=2, d_model=D, armed_kinds={"resid_post"},
                        steer_kinds={"resid_post"}, edit_stages=1, max_capture_bytes=1 << 20)


# ---------------------------------------------------------------- HTTP


def test_the_vector_routes_answer_with_their_own_status_codes(served, tmp_path):  # noqa: F811
    client, r, pool = served(vectors={"fixed": VectorSpec(path=npy(tmp_path, "f", steer(1)), hook="0:resid_post")})
    up = client.post("/v1/vectors", headers=AUTH, json={"name": "mine", "vector": steer(2).tolist()})
    assert up.status_code == 201 and up.json()["source"] == "upload" and up.json()["hook"] is None
    assert client.post("/v1/vectors", headers=AUTH, json={"name": "mine", "vector": steer(3).tolist()}).status_code == 409
    again = client.post("/v1/vectors", headers=AUTH, json={"name": "mine", "vector": arrays.to_base64(steer(3)), "replace": True})
    assert again.status_code == 201
    listed = client.get("/v1/vectors", headers=AUTH).json()["vectors"]
    assert [(v["name"], v["source"]) for v in listed] == [("fixed", "config"), ("mine", "upload")]
    ok = client.post("/v1/generate", headers=AUTH, json={"prompt": "x", "interventions": [
        {"op": "add", "vector": "fixed"}, {"hook": "1:resid_post", "op": "add", "vector": "mine"}]})
    assert ok.status_code == 200
    sent = pool.calls[-1][1].interventions
    np.testing.assert_array_equal(sent[1].vector, steer(3))
    assert sent[0].hook == "0:resid_post"
    cases = [
        ({"name": "x", "vector": steer(1, width=3).tolist()}, 422, "shape [3] fits no row"),
        ({"name": "x", "vector": [1.0, "a"]}, 422, "vector"),
        ({"name": "bad name", "vector": steer(1).tolist()}, 422, "is not allowed"),
        ({"name": "x", "vector": steer(1).tolist(), "scale": 2}, 422, "scale: Extra inputs are not permitted"),
        ({"name": "fixed", "vector": steer(1).tolist(), "replace": True}, 409, "comes from serve_config"),
    ]
    for body, status, message in cases:
        answer = client.post("/v1/vectors", headers=AUTH, json=body)
        assert answer.status_code == status and message in answer.json()["error"]["message"], (body, answer.text)
    assert client.post("/v1/vectors", headers=AUTH, content=b"[1, 2]").status_code == 400
    too_big = client.post("/v1/vectors", headers=AUTH, content=b"{" + b" " * MAX_UPLOAD_BYTES + b"}")
    assert too_big.status_code == 413
    assert client.delete("/v1/vectors/mine", headers=AUTH).json() == {"deleted": "mine"}
    gone = client.delete("/v1/vectors/mine", headers=AUTH)
    assert gone.status_code == 404 and "no vector named 'mine'" in gone.json()["error"]["message"]
    assert client.delete("/v1/vectors/fixed", headers=AUTH).status_code == 409
    named = client.post("/v1/generate", headers=AUTH, json={"prompt": "x", "interventions": [
        {"hook": "1:resid_post", "op": "add", "vector": "mine"}]})
    assert named.status_code == 422 and "interventions.0.vector: no vector named 'mine'" in named.json()["error"]["message"]
    for method, path in (("POST", "/v1/vectors"), ("GET", "/v1/vectors"), ("DELETE", "/v1/vectors/fixed")):
        assert client.request(method, path, json={"name": "y", "vector": [1.0] * D}).status_code == 401


def test_the_inspect_provider_and_the_openai_routes_pass_names_on_to_the_router():
    from inspect_ai.model import ChatMessageUser, GenerateConfig

    from deploy.openai_translate import translate_chat
    from provider.inspect_provider import build_request

    named = [{"op": "add", "vector": "refusal", "scale": -2.0},
             {"hook": "blocks.1.hook_resid_post", "op": "clamp", "vector": "refusal", "max": 0.0}]
    request = build_request([ChatMessageUser(content="Hi")], GenerateConfig(extra_body={"interventions": named}), None)
    assert request["interventions"] == named
    translated = translate_chat({"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "interventions": named},
                                ["tiny-llama"], 512)
    assert [e.vector_name for e in translated.request.interventions] == ["refusal", "refusal"]
    with pytest.raises(InvalidRequestError, match="vector name 'no way' is not allowed"):
        build_request([ChatMessageUser(content="Hi")], GenerateConfig(extra_body={"interventions": [{"op": "add", "vector": "no way"}]}), None)
