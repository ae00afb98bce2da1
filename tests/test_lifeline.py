"""Engine processes die with their replica, however it dies; stale shared memory is swept.

The end-to-end case runs a real engine in a child process standing in for the replica actor and
SIGKILLs it: nothing of the engine may survive. The Serve fault tests (test_reliability,
test_cli) check the same after `ray.kill`, an engine-core kill and a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from bench.load import left_behind, wait_engine_gone
from replicas.api import ModelInfo
from replicas.engine import CaptureEngine
from replicas.engine.config import EngineConfig
from replicas.arena.lifeline import OWNER_FILE, SPILL_PREFIX, Owner, Sweeper, engine_lineage, sweep_stale_spill_dirs

# The stand-in replica: start an engine, print its identity, then wait to be killed.
REPLICA = """
import asyncio, json, os, sys
from replicas.engine import CaptureEngine
from replicas.arena.lifeline import engine_processes

async def main():
    engine = await CaptureEngine.start({"model": sys.argv[1], "dtype": "float32", "max_model_len": 256}, name="doomed")
    result = await engine.generate({"prompt": [1, 2, 3], "max_tokens": 2, "capture": {"hooks": ["blocks.0.hook_resid_post"], "positions": "prompt"}})
    print(json.dumps({"replica": "doomed", "pid": os.getpid(), "spill_dir": engine.spill_dir,
                      "engine_pids": engine_processes(engine.engine_pids()), "rows": len(result.positions)}), flush=True)
    await asyncio.sleep(3600)

if __name__ == "__main__":
    asyncio.run(main())
"""


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_an_owner_is_matched_by_pid_and_start_time():
    me = Owner.current()
    assert me.alive()
    assert not Owner(me.pid, me.start_ticks - 100).alive()  # the same pid, another process
    assert not Owner(dead_pid(), time.time()).alive()


def test_an_owner_outlives_a_step_of_the_wall_clock(tmp_path, monkeypatch):
    """NTP or an admin stepping the clock moves the boot time the kernel derives from it (btime in
    /proc/stat, which psutil adds to a process's start ticks): a live owner must still match, and a
    sweep must leave its folder alone."""
    import psutil._pslinux

    folder = tmp_path / f"{SPILL_PREFIX}live"
    folder.mkdir()
    Owner.current().write(str(folder))
    booted, now = psutil._pslinux.boot_time(), time.time
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: booted + 3600)  # the clock stepped an hour ahead
    monkeypatch.setattr(time, "time", lambda: now() + 3600)
    assert Owner.read(folder) == Owner.current() and Owner.read(folder).alive()
    assert sweep_stale_spill_dirs(str(tmp_path)) == [] and (folder / OWNER_FILE).exists()


def test_the_lineage_runs_from_this_process_up_to_the_owner():
    child = subprocess.run(
        [sys.executable, "-c", "import json, sys; from replicas.arena.lifeline import Owner, engine_lineage;"
         "print(json.dumps([o.pid for o in engine_lineage(Owner.of(int(sys.argv[1])))]))", str(os.getpid())],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1],
    )
    (only,) = json.loads(child.stdout)  # the child itself: its parent is the owner
    assert only not in (os.getpid(), 0)
    with pytest.raises(RuntimeError, match="does not descend"):
        engine_lineage(Owner(dead_pid(), 0.0))


def test_sweep_removes_the_folders_of_gone_owners_only(tmp_path):
    gone, alive, unowned = (tmp_path / f"{SPILL_PREFIX}{name}" for name in ("gone", "alive", "unowned"))
    for folder in (gone, alive, unowned):
        folder.mkdir()
        (folder / "rows.bin").write_bytes(b"x" * 1024)
    Owner(dead_pid(), time.time()).write(str(gone))
    Owner.current().write(str(alive))
    (tmp_path / "other").mkdir()
    Owner(dead_pid(), time.time()).write(str(tmp_path / "other"))  # not capserve's: left alone

    assert sweep_stale_spill_dirs(str(tmp_path)) == [str(gone)]
    assert not gone.exists() and alive.exists() and unowned.exists() and (tmp_path / "other" / OWNER_FILE).exists()


# A replica in another container: its own PID namespace, the same /dev/shm. It writes its folder's
# owner, says so, and lives until its stdin closes.
CONTAINED = """
import sys
from replicas.arena.lifeline import Owner
Owner.current().write(sys.argv[1])
print("written", flush=True)
sys.stdin.read()
"""


def unshare_pid_namespace() -> list[str]:
    """`unshare` into a new PID namespace (as its own user namespace's root), or skip."""
    command = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    try:
        subprocess.run([*command, "true"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("unshare cannot make a PID namespace here")
    return command


def test_sweep_leaves_the_folders_of_another_pid_namespace_alone(tmp_path):
    folder = tmp_path / f"{SPILL_PREFIX}contained"
    folder.mkdir()
    container = subprocess.Popen(
        [*unshare_pid_namespace(), sys.executable, "-c", CONTAINED, str(folder)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    try:
        assert container.stdout.readline().strip() == "written"
        assert sweep_stale_spill_dirs(str(tmp_path)) == [] and (folder / OWNER_FILE).exists()
        owner = Owner.read(folder)
        assert owner.pid != container.pid  # its number in its own namespace (1): here, some other process or none
        assert owner.foreign() and owner.pid_ns != Owner.current().pid_ns and owner.boot_id == Owner.current().boot_id
    finally:
        container.stdin.close()
        container.wait(timeout=30)
    assert sweep_stale_spill_dirs(str(tmp_path)) == [] and folder.exists()  # gone or not: not this namespace's to judge

    earlier = tmp_path / f"{SPILL_PREFIX}earlier-boot"
    earlier.mkdir()
    Owner(os.getpid(), Owner.current().start_ticks, boot_id="an-earlier-boot").write(str(earlier))
    assert sweep_stale_spill_dirs(str(tmp_path)) == [str(earlier)]  # every process of an earlier boot is gone


def test_owner_files_stay_readable_by_the_previous_version_on_the_same_node(tmp_path):
    """In a rolling upgrade, replicas of capserve before 2026-12-05 share /dev/shm with these: they
    judge a folder by pid and wall-clock "started" within 0.05 s (psutil), and sweep what they cannot
    read as alive. Their own folders name no namespace: this version leaves them to them."""
    import psutil

    ours, theirs = tmp_path / f"{SPILL_PREFIX}ours", tmp_path / f"{SPILL_PREFIX}theirs"
    for folder in (ours, theirs):
        folder.mkdir()
    Owner.current().write(str(ours))
    written = json.loads((ours / OWNER_FILE).read_text())
    assert abs(psutil.Process(written["pid"]).create_time() - written["started"]) < 0.05  # the previous version's test
    (theirs / OWNER_FILE).write_text(json.dumps({"pid": dead_pid(), "started": time.time()}))
    assert Owner.read(theirs) is None and sweep_stale_spill_dirs(str(tmp_path)) == [] and theirs.exists()


class FakeLLM:
    """What CaptureEngine.check_health reads of vLLM's AsyncLLM: its error state and its engine processes."""

    def __init__(self, core_pid: int) -> None:
        process = types.SimpleNamespace(pid=core_pid)
        self.engine_core = types.SimpleNamespace(resources=types.SimpleNamespace(engine_manager=types.SimpleNamespace(processes=[process])))

    async def check_health(self) -> None:
        return None


def fake_engine(core_pid: int, stall_timeout_s: float) -> CaptureEngine:
    config = EngineConfig(model="m", stall_timeout_s=stall_timeout_s, take_timeout_s=0.5, outbox_timeout_s=0.2,
                          engine_kwargs={"skip_tokenizer_init": True})
    info = ModelInfo(model="m", architecture="LlamaForCausalLM", n_layers=1, d_model=64, d_vocab=100,
                     max_model_len=64, dtype="float32", hook_names=[], armed_kinds=[])
    return CaptureEngine(FakeLLM(core_pid), config, info)


def test_the_health_check_fails_for_a_gone_engine_core_and_a_stall_but_not_for_a_busy_engine():
    busy = fake_engine(os.getpid(), stall_timeout_s=0.8)
    asyncio.run(busy.check_health())  # idle: nothing to stall
    busy.progress.started()
    time.sleep(0.5)
    busy.progress.output()
    time.sleep(0.5)
    asyncio.run(busy.check_health())  # running, with output 0.5 s ago: healthy
    time.sleep(0.5)
    with pytest.raises(RuntimeError, match="no output for 1 s with 1 requests running"):
        asyncio.run(busy.check_health())
    busy.progress.finished()
    asyncio.run(busy.check_health())  # nothing running any more

    with pytest.raises(RuntimeError, match="engine core process .* is gone"):
        asyncio.run(fake_engine(dead_pid(), stall_timeout_s=60).check_health())


@pytest.mark.engine
def test_an_engine_dies_with_a_sigkilled_replica(tiny_models):
    replica = subprocess.Popen(
        [sys.executable, "-c", REPLICA, tiny_models["llama"]],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1], start_new_session=True,
    )
    try:
        identity = next(json.loads(line) for line in replica.stdout if line.startswith('{"replica"'))
        assert identity["rows"] == 3  # the engine served a capture before its replica died
        assert [p["role"] for p in identity["engine_pids"]].count("engine_core") == 1
        assert len(left_behind(identity)) == len(identity["engine_pids"]) + 1  # all running, the folder there
        assert Owner.read(identity["spill_dir"]) == Owner.of(replica.pid)
        os.kill(replica.pid, signal.SIGKILL)
        replica.wait()
        seconds = wait_engine_gone(identity, timeout_s=30)
        print(f"engine gone {seconds:.1f} s after its replica was killed")
    finally:
        try:  # only if the test failed: the replica's session holds the engine processes too
            os.killpg(replica.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_sweeper_sweeps_at_once_then_at_most_every_period(tmp_path):
    sweeper = Sweeper(str(tmp_path), period_s=60)
    first, second = (tmp_path / f"{SPILL_PREFIX}{n}" for n in ("first", "second"))
    first.mkdir()
    Owner(dead_pid(), time.time()).write(str(first))
    assert sweeper.maybe() == [str(first)]
    second.mkdir()
    Owner(dead_pid(), time.time()).write(str(second))
    assert sweeper.maybe() == [] and second.exists()  # within the period: nothing read
    sweeper.period_s = 0
    assert sweeper.maybe() == [str(second)]
