"""Security properties that need no cluster: loopback by default, no pickle or code execution on
the wire path, constant-time token comparison, test hooks off by default, secrets kept out of
messages. The live checks (401 on every route, the token in no log) are in test_reliability.py."""

from __future__ import annotations

import ast
import asyncio
import base64
from pathlib import Path

import pytest
import yaml

from deploy import http, http_parts
from deploy.config import AppArgs, read_api_key, router_config
from replicas.api import arrays
from replicas.replica import EngineReplica
from tests.test_replica import OPTIONS, FakeEngine

ROOT = Path(__file__).resolve().parents[1]
# What a request from outside touches: the HTTP layer, the router, schemas and array decoding.
WIRE_MODULES = [*sorted((ROOT / "deploy").glob("*.py")), *sorted((ROOT / "replicas" / "api").glob("*.py")),
                ROOT / "replicas" / "plans" / "cost.py"]
UNSAFE_IMPORTS = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}


def test_the_default_binds_to_loopback():
    assert AppArgs().http_host == "127.0.0.1"
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"


@pytest.mark.parametrize("path", WIRE_MODULES, ids=lambda p: p.name)
def test_no_wire_module_unpickles_or_runs_code(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & UNSAFE_IMPORTS, (path.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in UNSAFE_IMPORTS, (path.name, node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in UNSAFE_CALLS, (path.name, node.lineno)
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            assert isinstance(node.value, ast.Constant) and node.value.value is False, (path.name, node.lineno)


def test_wire_arrays_refuse_object_dtypes():
    for dtype in ("object", "O", "|O", "V8"):
        with pytest.raises(ValueError, match="unknown array dtype"):
            arrays.from_raw({"dtype": dtype, "shape": [1], "data": base64.b64encode(b"\0" * 8).decode()})


def test_the_bearer_check_compares_in_constant_time(monkeypatch):
    compared = []
    real = http_parts.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(http_parts.hmac, "compare_digest", spy)
    http.check_bearer("Bearer s3cret", "s3cret")
    with pytest.raises(http.HttpError) as info:
        http.check_bearer("Bearer guess", "s3cret")
    assert compared == [(b"s3cret", b"s3cret"), (b"guess", b"s3cret")]
    assert "guess" not in str(info.value) and "s3cret" not in str(info.value)


def test_secrets_stay_out_of_reprs_and_validation_errors(monkeypatch, tmp_path):
    secret = "tok-" + "9" * 20
    with pytest.raises(ValueError) as info:
        AppArgs.model_validate({"api_key": secret, "max_queued_requests": -1})
    assert secret not in str(info.value) and "api_key_file" in str(info.value)
    key_file = tmp_path / "key"
    key_file.write_text(secret)
    args = AppArgs(api_key_file=str(key_file))
    assert secret not in repr(args) and secret not in str(args.model_dump())
    assert secret not in repr(router_config(args)) and secret not in repr(read_api_key(router_config(args)))
    monkeypatch.setenv("CAPSERVE_API_KEY", secret)
    assert secret not in repr(router_config(AppArgs()))
    assert secret not in str(router_config(AppArgs()).model_dump())


def test_deeply_nested_json_is_a_400_not_a_crash():
    with pytest.raises(http.HttpError) as info:
        http.parse_json_object(b"[" * 100_000 + b"]" * 100_000)
    assert info.value.status == 400 and "nested" in str(info.value)


def test_the_stall_hook_is_off_unless_the_app_enables_fault_injection():
    assert AppArgs().fault_injection is False

    async def scenario() -> None:
        replica = await EngineReplica.open({"model": "/models/x"}, FakeEngine, OPTIONS)
        with pytest.raises(PermissionError, match="fault_injection"):
            await replica.stall(replica.name, 0.0)
        armed = await EngineReplica.open({"model": "/models/x"}, FakeEngine, {**OPTIONS, "fault_injection": True})
        assert await armed.stall("another-replica", 5.0) is False  # only the named replica stalls
        assert await armed.stall(armed.name, 0.0) is True
        await replica.shutdown()
        await armed.shutdown()

    asyncio.run(scenario())


def test_no_http_route_reaches_the_stall_hook():
    paths = {route.path for route in http.api.routes}
    assert not any("stall" in p for p in paths)
    assert not hasattr(http.HttpRouter, "stall")
