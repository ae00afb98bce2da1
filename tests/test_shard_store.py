"""Capture folders on fsspec filesystems (`replicas.shards.store`), without Ray: atomic publish on
`memory://`, both writers, resume and `load_capture` on a URL, and the errors for a URL nothing
here can open. tests/test_cli.py writes a `local://` URL from real replicas (other processes)."""

from __future__ import annotations

import asyncio
import importlib
import json
import re

import fsspec
import numpy as np
import pytest

from provider.dataset.cli import main as cli_main
from provider.dataset.options import LineFailed, SinkUnreachable
from provider.dataset.run import run_capture
from provider.dataset.shards import finished_shards, load_capture, write_shard
from replicas.api.errors import InvalidRequestError
from replicas.shards.store import FsspecStore, LocalStore, open_store
from replicas.shards.sink import ShardJob, ShardSink, run_shard, sink_folder
from tests.cli_fakes import FakeBackend, FakeSinkBackend
from tests.test_shards import HOOKS, check_folder, options, prompts, write_lines


@pytest.fixture
def memory_url(request: pytest.FixtureRequest):
    """A fresh memory:// folder (the memory filesystem is one per process: clear it after)."""
    url = "memory://capserve-" + re.sub(r"\W", "-", request.node.name)
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def capture(source, out, opts, backend):
    return asyncio.run(run_capture(source, out, opts, backend, progress=False))


def test_local_paths_keep_the_fast_path_and_other_urls_go_through_fsspec(tmp_path):
    assert isinstance(open_store(tmp_path), LocalStore) and isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert open_store(f"file://{tmp_path}").path == tmp_path
    store = open_store(f"local://{tmp_path}")
    assert isinstance(store, FsspecStore) and store.reach == "node"
    assert open_store("memory://x").reach == "process"


def test_publish_on_memory_is_atomic_and_a_failed_write_leaves_nothing(memory_url):
    store = open_store(memory_url)
    store.mkdir()
    assert store.write_atomic("a.bin", lambda f: f.write(b"12345")) == 5
    assert store.names() == ["a.bin"] and store.read_bytes("a.bin") == b"12345"

    def half_then_fail(f):
        f.write(b"half")
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        store.write_atomic("b.bin", half_then_fail)
    assert store.names() == ["a.bin"]  # neither the final name nor a temporary
    store.write_atomic("a.bin", lambda f: f.write(b"new"))  # a retried shard replaces the old one whole
    assert store.read_bytes("a.bin") == b"new" and store.names() == ["a.bin"]


def test_a_shard_written_to_memory_reads_back_equal_to_a_local_one(memory_url, tmp_path):
    from provider.dataset.shards import LineRows

    rows = [LineRows(line, {"h": np.full((3, 4), line, np.float32)}, [0, 1, 2], [7, 8, 9], {"replica": "r"}) for line in (2, 0, 1)]
    store = open_store(memory_url)
    store.mkdir()
    assert write_shard(memory_url, 0, rows, ["h"], "float32", 4) == write_shard(tmp_path, 0, rows, ["h"], "float32", 4)
    assert finished_shards(memory_url) == {0}
    for name in ("shard-000000.safetensors", "shard-000000.jsonl"):
        assert store.read_bytes(name) == (tmp_path / name).read_bytes()


@pytest.mark.parametrize("most_per_call", [None, 1000])
def test_pieces_reach_a_local_file_whole_and_in_order_through_short_writes(tmp_path, monkeypatch, most_per_call):
    import os

    from replicas.shards import files as shard_files

    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 255, int(n), np.uint8) for n in rng.integers(0, 700, shard_files.IOV_MAX + 300)]
    if most_per_call is not None:  # a regular file's writev may stop early (a signal, a full disk)
        real = os.writev

        def short(fd, buffers):
            kept, room = [], most_per_call
            for buffer in buffers:
                kept.append(buffer[:room])
                room -= len(kept[-1])
                if not room:
                    break
            return real(fd, kept)

        monkeypatch.setattr(shard_files.os, "writev", short)
    store = LocalStore(tmp_path)

    def write(f):
        f.write(b"head")  # through the file's buffer, as the safetensors header is
        shard_files.write_pieces(f, [piece.data for piece in pieces])

    size = store.write_atomic("a.bin", write)
    expected = b"head" + b"".join(piece.tobytes() for piece in pieces)
    assert size == len(expected) and (tmp_path / "a.bin").read_bytes() == expected


@pytest.mark.parametrize("sink", ["driver", "replica"])
def test_capture_into_a_url_resumes_and_loads_like_a_folder(memory_url, tmp_path, sink):
    texts = prompts(23) + [""] + prompts(3)
    texts[14] = "BOOM"  # a failure retrying cannot fix: the run stops inside shard 1
    source = write_lines(tmp_path / "in.txt", texts)
    opts = options(sink=sink, concurrency=2, shard_lines=10)
    with pytest.raises(LineFailed, match="input line 15|shard 1"):
        capture(source, memory_url, opts, FakeSinkBackend())
    assert 1 not in finished_shards(memory_url) and 0 in finished_shards(memory_url)
    open_store(memory_url).write_atomic(".shard-000001.safetensors.tmp-999", lambda f: f.write(b"half"))  # a crash's leftover
    summary = capture(source, memory_url, opts, FakeSinkBackend(boom=False))
    assert summary.complete and summary.lines_done_before == 10 * summary.shards_done_before >= 10
    check_folder(memory_url, texts, opts)  # load_capture on the URL: every row once, in order
    cap = load_capture(memory_url)
    assert cap.folder == memory_url and cap.manifest["complete"] and cap.manifest["n_shards"] == 3
    assert f"{sink}-side writer" in cap.manifest["backend"]
    names = open_store(memory_url).names()
    assert not [n for n in names if ".tmp-" in n] and ".lock" not in names


def test_unknown_schemes_and_missing_backends_name_the_field(tmp_path):
    with pytest.raises(InvalidRequestError, match=r"^--out: 'nosuch://x/y': Protocol not known.*use a local folder"):
        open_store("nosuch://x/y", "--out")
    with pytest.raises(InvalidRequestError, match=r"^folder: 'nosuch://x/y'"):
        sink_folder("nosuch://x/y")
    with pytest.raises(InvalidRequestError, match=r"^folder: memory://capserve-absent does not exist"):
        sink_folder("memory://capserve-absent")
    missing = _protocol_without_backend()
    with pytest.raises(InvalidRequestError, match=rf"^folder: '{missing}://b/c' needs a package that is not installed"):
        sink_folder(f"{missing}://b/c")


def test_a_replica_refuses_a_job_for_an_unknown_scheme_and_goes_on(tmp_path):
    from replicas.shards.sink import RowSpec

    job = ShardJob(folder="nosuch://bucket/acts", shard=0, spec=RowSpec(hooks=list(HOOKS)), d_model=8, lines=[])

    async def never(request):
        raise AssertionError("no line runs before the folder is checked")

    sink = ShardSink()
    with pytest.raises(InvalidRequestError, match="^folder: 'nosuch://bucket/acts'"):
        asyncio.run(run_shard(job, never, sink))
    local = job.model_copy(update={"folder": str(tmp_path)})
    assert asyncio.run(run_shard(local, never, sink)).shard == 0  # the same sink still writes
    written = (tmp_path / "shard-000000.safetensors").stat().st_size + (tmp_path / "shard-000000.jsonl").stat().st_size
    assert sink.totals["shards"] == 1 and sink.totals["bytes"] == written  # the refused job counts nothing
    sink.close()


def test_a_sink_counts_its_writing_time_and_the_faults_of_reading_a_fresh_mapping(tmp_path):
    """What `EngineReplica.stats` reports of a replica's writers: their own time in the write, and
    the page faults of reading rows that view a file mapped afresh (as rows view the arena)."""
    import mmap

    from provider.dataset.shards import LineRows
    from replicas.shards.sink import RowSpec

    d_model, rows = 1024, 16384  # 64 MiB: at least 32 faults even where the kernel maps 2 MiB pages
    source = tmp_path / "arena"
    source.write_bytes(np.arange(rows * d_model, dtype=np.float32).tobytes())
    with open(source, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0)
    array = np.frombuffer(mapping, np.float32).reshape(rows, d_model)  # no page of it touched yet
    line = LineRows(0, {"h": array}, list(range(rows)), [0] * rows)
    job = ShardJob(folder=str(tmp_path / "out"), shard=0, spec=RowSpec(hooks=["h"], dtype="float32"), d_model=d_model, lines=[])
    sink = ShardSink()
    (tmp_path / "out").mkdir()
    asyncio.run(sink.write(open_store(tmp_path / "out"), job, [line]))
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(load_file(tmp_path / "out" / "shard-000000.safetensors")["h"], array)
    assert 0 < sink.totals["writing_s"] <= sink.totals["write_s"]
    first = sink.totals["minor_faults"]
    asyncio.run(sink.write(open_store(tmp_path / "out"), job, [line]))  # the same rows, now mapped
    again = sink.totals["minor_faults"] - first  # the write's own allocations alone
    # Not fewer than the first: where the kernel maps 2 MiB pages the whole mapping is 32 faults, and
    # the write's own allocations took 0 in one run and 64 in another (2026-12-06, a loaded machine).
    assert first >= 32 and again >= 0, (first, again)
    sink.close()  # the mapping closes when collected: a write's frames may still hold views of it


def test_the_cli_exits_2_naming_out_for_an_unknown_scheme(tmp_path, capsys):
    source = write_lines(tmp_path / "in.txt", prompts(2))
    code = cli_main(["capture", str(source), "--out", "nosuch://x/acts", "--hooks", HOOKS[0], "--http", "http://127.0.0.1:9"])
    assert code == 2 and "capserve: --out: 'nosuch://x/acts': Protocol not known" in capsys.readouterr().err


class _Unshared(FakeSinkBackend):
    def shares_folder(self, out):
        from provider.dataset.backends import HandleBackend

        return HandleBackend.shares_folder(self, out)


def test_memory_urls_are_never_handed_to_replicas():
    from provider.dataset.backends import HandleBackend
    from provider.dataset.remote import choose_sink

    backend = HandleBackend.__new__(HandleBackend)  # shares_folder needs no connection for these
    assert not backend.shares_folder(open_store("memory://x"))
    with pytest.raises(SinkUnreachable, match="--sink replica"):
        choose_sink(options(sink="replica"), "memory://x", _Unshared())


def _protocol_without_backend() -> str:
    from fsspec.registry import known_implementations

    for protocol in ("gs", "abfs", "oci", "sftp", "dropbox"):
        module = known_implementations[protocol]["class"].rsplit(".", 1)[0]
        try:
            importlib.import_module(module)
        except ImportError:
            return protocol
    pytest.skip("every candidate fsspec backend is installed here")
    return ""


def test_manifest_on_a_url_is_plain_json(memory_url, tmp_path):
    source = write_lines(tmp_path / "in.txt", prompts(4))
    capture(source, memory_url, options(sink="driver"), FakeBackend())
    manifest = json.loads(open_store(memory_url).read_bytes("manifest.json"))
    assert manifest["complete"] and manifest["rows"] == load_capture(memory_url).rows > 0
