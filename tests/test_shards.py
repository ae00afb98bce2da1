"""`capserve capture` without Ray: shard files, resume, the manifest check, the loader, the CLI's
argument handling. The app is `tests.cli_fakes.FakeBackend`; tests/test_cli.py runs the real one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from provider.dataset.cli import (
    build_parser,
    parse_positions,
    serve_command,
    serve_config,
)
from provider.dataset.harvest import Harvester, Progress
from provider.dataset.input import InputError, count_lines, read_input
from provider.dataset.manifest import ManifestMismatch, lock_folder
from provider.dataset.options import CaptureOptions, LineFailed
from provider.dataset.run import run_capture
from provider.dataset.shards import (
    LineRows,
    finished_shards,
    load_capture,
    map_shard,
    write_shard,
)
from tests.cli_fakes import FakeBackend, FakeSinkBackend, expected_rows

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ("blocks.0.hook_resid_post", "blocks.2.hook_attn_out")


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def prompts(n: int) -> list[str]:
    return [f"prompt {i} {'x' * (i % 7)}" for i in range(n)]


def options(**overrides) -> CaptureOptions:
    base = {"hooks": HOOKS, "positions": "all", "shard_lines": 10, "concurrency": 8, "input_format": "text"}
    return CaptureOptions(**{**base, **overrides})


def capture(source: Path, out: Path, opts: CaptureOptions, backend: FakeBackend | None = None):
    return asyncio.run(run_capture(source, out, opts, backend or FakeBackend(delay_s=0.002), progress=False))


def check_folder(out: Path, texts: list[str], opts: CaptureOptions) -> None:
    """Every non-blank line's rows, once, in input order, equal to what the app computed."""
    cap = load_capture(out)
    kept = [(i, t) for i, t in enumerate(texts) if t.strip()]
    expected = {h: [expected_rows(t, k, opts.positions, 8, opts.reduce).reshape(-1, 8) for _, t in kept] for k, h in enumerate(HOOKS)}
    for hook in HOOKS:
        np.testing.assert_array_equal(np.asarray(cap[hook]), np.concatenate(expected[hook]))
    lines = [i for (i, _), rows in zip(kept, expected[HOOKS[0]]) for _ in range(len(rows))]
    np.testing.assert_array_equal(np.asarray(cap.line), lines)
    records = list(cap.records())
    assert [r["line"] for r in records] == [i for i, _ in kept]
    assert sum(r["rows"] for r in records) == cap.rows == len(lines)
    for record in records[:: max(1, len(records) // 10)]:
        assert cap.line[record["row"]] == record["line"]


# ---------------------------------------------------------------- files


def test_shard_files_are_valid_safetensors_in_every_dtype(tmp_path):
    from safetensors import safe_open

    for dtype in ("float32", "float16", "bfloat16"):
        rows = [LineRows(line, {"h": np.full((n, 4), line, np.float32).astype(dtype if dtype != "bfloat16" else ml_dtypes.bfloat16)},
                         list(range(n)), [7] * n, {"note": line}) for line, n in ((3, 2), (1, 0), (2, 3))]
        folder = tmp_path / dtype
        folder.mkdir()
        write_shard(folder, 0, rows, ["h"], dtype, 4)
        tensors = map_shard(folder / "shard-000000.safetensors")
        np.testing.assert_array_equal(tensors["h"].astype(np.float32)[:, 0], [2, 2, 2, 3, 3])  # line order
        np.testing.assert_array_equal(tensors["capserve.line"], [2, 2, 2, 3, 3])
        np.testing.assert_array_equal(tensors["capserve.position"], [0, 1, 2, 0, 1])
        framework = "pt" if dtype == "bfloat16" else "numpy"  # safetensors' numpy API has no bf16
        with safe_open(str(folder / "shard-000000.safetensors"), framework=framework) as f:
            assert np.asarray(f.get_tensor("h").float() if framework == "pt" else f.get_tensor("h")).shape == (5, 4)
        index = [json.loads(x) for x in (folder / "shard-000000.jsonl").read_text().splitlines()]
        assert [(r["line"], r["row"], r["rows"]) for r in index] == [(1, 0, 0), (2, 0, 3), (3, 3, 2)]
        assert not [p for p in folder.iterdir() if ".tmp-" in p.name]


def test_input_formats_blank_lines_and_errors_name_the_line(tmp_path):
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"text": "hi", "id": "a"}\n\n{"prompt_token_ids": [1, 2]}\n'
                     '{"messages": [{"role": "user", "content": "yo"}], "label": 3}')
    got = list(read_input(jsonl, "jsonl"))
    assert [(x.line, x.prompt, x.id) for x in got] == [
        (0, "hi", "a"), (1, None, None), (2, [1, 2], None), (3, [{"role": "user", "content": "yo"}], None)]
    assert count_lines(jsonl) == 4
    for bad, message in (('{"txt": "x"}', "exactly one prompt key"), ("{nope", "not valid JSON"),
                         ('{"text": "a", "messages": []}', "found text, messages"), ('{"prompt_token_ids": ["a"]}', "list of ints")):
        jsonl.write_text('{"text": "ok"}\n' + bad + "\n")
        with pytest.raises(InputError, match=rf"in.jsonl:2: .*{message}"):
            list(read_input(jsonl, "jsonl"))


# ---------------------------------------------------------------- runs


def test_capture_writes_every_line_once_in_order(tmp_path):
    texts = prompts(95)
    texts[13] = "   "  # blank: skipped, numbering kept
    source = write_lines(tmp_path / "in.txt", texts)
    opts = options()
    summary = capture(source, tmp_path / "out", opts)
    assert summary.complete and summary.shards_written == 10 and summary.blank == 1 and summary.captured == 94
    check_folder(tmp_path / "out", texts, opts)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["model"]["model"] == "fake-model" and manifest["hooks"] == list(HOOKS)
    assert manifest["options"]["shard_lines"] == 10 and manifest["n_shards"] == 10 and "python" in manifest["versions"]


def test_reduced_bf16_and_index_positions(tmp_path):
    texts = prompts(23)
    source = write_lines(tmp_path / "in.txt", texts)
    opts = options(reduce="mean", dtype="bfloat16", positions=(0, -1))
    capture(source, tmp_path / "out", opts)
    cap = load_capture(tmp_path / "out")
    assert cap[HOOKS[1]].shape == (23, 8) and cap[HOOKS[1]].dtype == ml_dtypes.bfloat16
    want = expected_rows(texts[5], 1, (0, -1), 8, "mean").astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(cap[HOOKS[1]][5], want)
    assert cap.position[5] == -1 and list(cap.records())[5]["positions"] == [0, len(texts[5]) - 1]


def test_a_crash_mid_run_then_a_rerun_completes_without_duplicates(tmp_path):
    texts = prompts(80)
    texts[47] = "BOOM"  # a failure retrying cannot fix: the run stops inside shard 4
    source = write_lines(tmp_path / "in.txt", texts)
    out, opts = tmp_path / "out", options()
    with pytest.raises(LineFailed, match="input line 48"):
        capture(source, out, opts, FakeBackend(delay_s=0.002))
    done = finished_shards(out)
    assert 4 not in done and len(done) >= 2
    before = {k: (out / f"shard-{k:06d}.safetensors").stat().st_ino for k in done}
    (out / ".shard-000004.safetensors.tmp-999").write_bytes(b"half a shard")  # what a SIGKILL leaves
    seen: list[str] = []
    fixed = FakeBackend(boom=False, on_request=lambda r: seen.append(r["prompt"]))
    summary = capture(source, out, opts, fixed)
    assert summary.complete and summary.shards_done_before == len(done)
    assert not {texts.index(p) // 10 for p in seen} & done  # finished shards were not redone
    assert {k: (out / f"shard-{k:06d}.safetensors").stat().st_ino for k in done} == before
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    check_folder(out, texts, opts)


def test_transient_failures_are_retried_and_invalid_lines_fail_or_are_recorded(tmp_path):
    texts = prompts(30)
    source = write_lines(tmp_path / "in.txt", texts)
    summary = capture(source, tmp_path / "retry", options(), FakeBackend(fail_first=2))
    assert summary.complete and summary.retries == 60
    check_folder(tmp_path / "retry", texts, options())
    with pytest.raises(LineFailed, match="failed 2 times"):
        capture(source, tmp_path / "exhausted", options(retries=1), FakeBackend(fail_first=5))
    texts[12] = "INVALID prompt"
    source = write_lines(tmp_path / "in2.txt", texts)
    with pytest.raises(LineFailed, match="input line 13: .*--skip-invalid"):
        capture(source, tmp_path / "strict", options())
    summary = capture(source, tmp_path / "lenient", options(skip_invalid=True))
    assert summary.complete and summary.invalid == 1
    record = next(r for r in load_capture(tmp_path / "lenient").records() if r["line"] == 12)
    assert record["rows"] == 0 and "too long" in record["error"]


def test_a_rerun_with_other_options_or_another_input_fails_clearly(tmp_path):
    source = write_lines(tmp_path / "in.txt", prompts(25))
    out = tmp_path / "out"
    capture(source, out, options())
    with pytest.raises(ManifestMismatch, match=r"options.hooks: folder has \['blocks.0.hook_resid_post'"):
        capture(source, out, options(hooks=("blocks.1.hook_resid_post",)))
    with pytest.raises(ManifestMismatch, match="options.shard_lines"):
        capture(source, out, options(shard_lines=5))
    write_lines(source, prompts(26))
    with pytest.raises(ManifestMismatch, match="input.size"):
        capture(source, out, options())
    held = lock_folder(out)  # a second run on the same folder at the same time
    with pytest.raises(ManifestMismatch, match="another `capserve capture` is writing"):
        capture(source, out, options())
    held.close()
    with pytest.raises(ValueError, match="layer 9 is out of range"):
        capture(source, tmp_path / "deep", options(hooks=("blocks.9.hook_resid_post",)))


def test_open_shards_stay_within_the_window_while_a_slow_line_holds_the_oldest(tmp_path):
    texts = prompts(200)
    source = write_lines(tmp_path / "in.txt", texts)
    opts = options(shard_lines=4, concurrency=6)
    peak = {"open": 0}

    async def run() -> None:
        backend = FakeBackend()
        slow_run = backend.run

        async def run_slowly(request, prompt_only):  # line 0 finishes last
            await asyncio.sleep(0.5 if request["prompt"] == texts[0] else 0.001)
            peak["open"] = max(peak["open"], len(harvester._open))
            return await slow_run(request, prompt_only)

        backend.run = run_slowly  # type: ignore[method-assign]
        harvester = Harvester(tmp_path / "out", opts, await backend.info(), backend, Progress(None, False))
        (tmp_path / "out").mkdir()
        await harvester.run(read_input(source, "text"))

    asyncio.run(run())
    assert peak["open"] <= opts.window == 3
    assert finished_shards(tmp_path / "out") == set(range(50))


def test_loader_partial_folders_and_random_row_access(tmp_path):
    texts = prompts(40)
    source = write_lines(tmp_path / "in.txt", texts)
    out = tmp_path / "out"
    capture(source, out, options(positions="last_prompt"))
    cap = load_capture(out)
    rows = cap[HOOKS[0]]
    assert rows.shape == (40, 8) and len(rows.parts) == 4
    pick = np.array([39, 0, 17, -1, 10])
    np.testing.assert_array_equal(rows[pick][:, 0], [expected_rows(texts[i], 0, "last_prompt", 8)[0, 0] for i in pick])
    np.testing.assert_array_equal(rows[5:25:5], np.asarray(rows)[5:25:5])
    with pytest.raises(KeyError, match="was not captured"):
        cap["blocks.3.hook_mlp_out"]
    (out / "shard-000002.safetensors").unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(ValueError, match=r"missing: \[2\]"):
        load_capture(out)
    assert load_capture(out, allow_partial=True).rows == 30


def test_the_loader_imports_no_ray(tmp_path):
    source = write_lines(tmp_path / "in.txt", prompts(12))
    capture(source, tmp_path / "out", options())
    code = (f"import sys; sys.modules['ray'] = None\n"  # an `import ray` anywhere would now fail
            f"from provider.dataset.shards import load_capture\n"
            f"cap = load_capture({str(tmp_path / 'out')!r}); print(cap.rows, cap['{HOOKS[0]}'][0][0])")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == str(sum(len(t) for t in prompts(12)))


# ---------------------------------------------------------------- the command line


def test_cli_arguments_the_console_script_and_serve_overrides(tmp_path):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"capserve": "provider.dataset.cli:main"}
    assert parse_positions("last_prompt") == "last_prompt" and parse_positions("0,-1") == (0, -1)
    with pytest.raises(ValueError, match="comma-separated ints"):
        parse_positions("first")
    args = build_parser().parse_args(["serve", "--config", str(ROOT / "serve_config.yaml"), "--model", "/m",
                                      "--num-replicas", "4", "--port", "9001"])
    config = serve_config(args)
    app = config["applications"][0]
    assert app["args"]["model"] == "/m" and app["args"]["num_replicas"] == 4 and config["http_options"]["port"] == 9001
    assert app["args"]["engine"]["max_model_len"] == 512 and app["deployments"]  # the rest of the file is kept
    assert serve_command(tmp_path / "c.yaml", "auto")[1:] == ["run", str(tmp_path / "c.yaml"), "--address", "auto"]
    bare = serve_config(build_parser().parse_args(["serve", "--config", str(tmp_path / "none.yaml")]))
    assert bare["applications"][0]["import_path"] == "deploy.app:build_app"
    source = write_lines(tmp_path / "in.txt", prompts(3))
    bad = subprocess.run([sys.executable, "-m", "provider.dataset.cli", "capture", str(source), "--out", str(tmp_path / "o"),
                          "--hooks", "blocks.0.hook_nonsense"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "hook_nonsense" in bad.stderr


# ---------------------------------------------------------------- replica-side sinks (fake replicas)


def test_replica_side_sinks_write_what_the_driver_writes(tmp_path):
    texts = prompts(35) + [""] + prompts(4)
    source = write_lines(tmp_path / "in.txt", texts)
    opts = options()
    driver = capture(source, tmp_path / "driver", options(sink="driver"), FakeSinkBackend())
    replica = capture(source, tmp_path / "replica", opts, FakeSinkBackend())
    assert driver.complete and replica.complete and replica.captured == driver.captured == 39 and replica.blank == 1
    check_folder(tmp_path / "replica", texts, opts)
    for k in range(4):  # byte for byte the same shards, whoever wrote them
        for suffix in (".safetensors", ".jsonl"):
            name = f"shard-{k:06d}{suffix}"
            assert (tmp_path / "replica" / name).read_bytes() == (tmp_path / "driver" / name).read_bytes(), name
    manifest = json.loads((tmp_path / "replica" / "manifest.json").read_text())
    assert "replica-side writer" in manifest["backend"]


def test_replica_side_sinks_retry_a_lost_shard_and_resume_a_driver_folder(tmp_path):
    texts = prompts(50)
    source = write_lines(tmp_path / "in.txt", texts)
    out = tmp_path / "out"
    backend = FakeSinkBackend(on_request=lambda r: (_ for _ in ()).throw(KeyboardInterrupt) if "prompt 27 " in r["prompt"] else None)
    with pytest.raises(KeyboardInterrupt):
        capture(source, out, options(sink="driver", concurrency=1), backend)
    done_before = finished_shards(out)
    assert done_before and len(done_before) < 5
    summary = capture(source, out, options(), FakeSinkBackend(fail_shards=2))
    assert summary.complete and summary.retries == 2 and summary.shards_done_before == len(done_before)
    check_folder(out, texts, options())


def slow_shard_writes(monkeypatch, shard: int, delay_s: float) -> threading.Event:
    """Shard `shard` takes `delay_s` longer to publish, whichever writer writes it (the delay sits
    in front of its commit, the .safetensors file); the event is set when its write has begun."""
    from replicas.shards.store import LocalStore

    began, atomic_write = threading.Event(), LocalStore.write_atomic

    def slowly(store: LocalStore, name: str, write):
        if name == f"shard-{shard:06d}.safetensors":
            began.set()
            time.sleep(delay_s)
        return atomic_write(store, name, write)

    monkeypatch.setattr(LocalStore, "write_atomic", slowly)
    return began


def test_an_interrupted_run_ends_only_after_the_shard_it_was_writing(tmp_path, monkeypatch):
    # Shard 1's write begins after line 19 and is still running when line 27 interrupts the run;
    # a write left on its thread would publish it after capture() raised (the old flake).
    slow_shard_writes(monkeypatch, 1, 0.3)
    source = write_lines(tmp_path / "in.txt", prompts(50))
    backend = FakeBackend(on_request=lambda r: (_ for _ in ()).throw(KeyboardInterrupt) if "prompt 27 " in r["prompt"] else None)
    with pytest.raises(KeyboardInterrupt):
        capture(source, tmp_path / "out", options(sink="driver", concurrency=1), backend)
    assert finished_shards(tmp_path / "out") == {0, 1}
    assert not [p for p in (tmp_path / "out").iterdir() if ".tmp-" in p.name]


def test_a_cancelled_shard_job_ends_only_after_its_write_and_frees_its_slot(tmp_path, monkeypatch):
    from replicas.api.errors import BackPressureError
    from replicas.shards.sink import JobLine, ShardJob, ShardSink, run_shard

    began = slow_shard_writes(monkeypatch, 0, 0.3)
    opts, backend = options(), FakeBackend()
    lines = [JobLine(line=i, request=opts.engine_request(text)) for i, text in enumerate(prompts(4))]
    job = ShardJob(folder=str(tmp_path), shard=0, spec=opts.row_spec(), d_model=8, lines=lines)

    async def cancel_mid_write() -> None:
        sink = ShardSink(threads=1, max_unwritten=1, policy="refuse")
        task = asyncio.create_task(run_shard(job, lambda request: backend.run(request, False), sink))
        assert await asyncio.to_thread(began.wait, 10)
        with pytest.raises(BackPressureError):  # the writing job still holds the only slot
            async with sink.slot():
                pass
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished_shards(tmp_path) == {0}  # published before the cancelled job ended
        async with sink.slot():  # and its slot is free again
            pass
        sink.close()

    asyncio.run(cancel_mid_write())


def test_the_auto_window_widens_to_the_shards_the_replicas_hold(tmp_path):
    """The CLI starts with enough shard jobs for --concurrency (2 here), then keeps as many in
    flight as the replica's answers say it holds (sink.max_unwritten 5): jobs being written count
    until their shard is on disk, so the engine gets more lines meanwhile; never more than that."""
    from replicas.shards.sink import ShardSink

    class Holding(FakeSinkBackend):
        def __init__(self) -> None:
            super().__init__(delay_s=0.002)
            self.sink = ShardSink(threads=1, max_unwritten=5)
            self.running = self.most_running = 0
            self.most_before_an_answer = 0
            self.answered = False

        async def replicas(self) -> int:
            return 1

        async def run_shard(self, job):
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            if not self.answered:
                self.most_before_an_answer = self.most_running
            try:
                await asyncio.sleep(0.05)
                return await super().run_shard(job)
            finally:
                self.running -= 1
                self.answered = True

    texts = prompts(60)
    source = write_lines(tmp_path / "in.txt", texts)
    opts = options(sink="replica", concurrency=2, shard_lines=4)
    backend = Holding()
    summary = capture(source, tmp_path / "out", opts, backend)
    assert summary.complete and summary.shards_written == 15 and summary.notes == []  # 5 slots keep 2 lines capturing
    assert backend.most_before_an_answer == 2 and backend.most_running == 5
    check_folder(tmp_path / "out", texts, opts)
    # an explicit --shards-in-flight is kept as given
    pinned = Holding()
    capture(source, tmp_path / "pinned", options(sink="replica", concurrency=2, shard_lines=4, shards_in_flight=3), pinned)
    assert pinned.most_running == 3
    # the formula the benchmark sizes its plain baseline with: two per replica, --concurrency's lines, the replicas' slots
    from provider.dataset.remote import auto_window

    assert [auto_window(opts, 3), auto_window(options(concurrency=64, shard_lines=4), 1), auto_window(opts, 2, 5)] == [6, 16, 10]


def test_slots_too_few_for_the_concurrency_are_said_once_with_the_setting_to_change(tmp_path):
    """A job holds its slot from its first line until its shard is written: 2 slots of 2-line
    shards hold 4 lines, what --concurrency 8 over 2 replicas needs capturing on each with no slot
    left for a shard being written, so the run says (once) what to raise; it still completes."""
    texts = prompts(24)
    opts = options(sink="replica", concurrency=8, shard_lines=2)
    summary = capture(write_lines(tmp_path / "in.txt", texts), tmp_path / "out", opts, FakeSinkBackend())
    assert summary.complete and summary.shards_written == 12
    assert len(summary.notes) == 1 and "at most 2 shard jobs" in summary.notes[0]
    assert "sink.max_unwritten to sink.threads + 2" in summary.notes[0]
    assert f"note       {summary.notes[0]}" in summary.text(tmp_path / "out")
    check_folder(tmp_path / "out", texts, opts)


def test_sink_choice():
    from provider.dataset.options import SinkUnreachable
    from provider.dataset.remote import choose_sink

    out = Path("/tmp/x")
    assert choose_sink(options(), out, FakeBackend()) == "driver"  # no replica-side method: the fallback
    assert choose_sink(options(), out, FakeSinkBackend()) == "replica"
    assert choose_sink(options(sink="driver"), out, FakeSinkBackend()) == "driver"
    with pytest.raises(SinkUnreachable):
        choose_sink(options(sink="replica"), out, FakeBackend())
    with pytest.raises(ValueError, match="--sink"):
        options(sink="somewhere")
