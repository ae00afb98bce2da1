"""App arguments and serve_config.yaml, checked without starting Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from deploy.app import build_app, replica_scaling, router_capacity, serve_replica_limit
from deploy.config import API_KEY_ENV, AppArgs, resolve_api_key, router_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "engine, named",
    [
        ({"tensor_parallel_size": 2}, "engine.tensor_parallel_size cannot be set"),
        ({"pipeline_parallel_size": 2}, "engine.pipeline_parallel_size cannot be set"),
        ({"engine_kwargs": {"enable_prefix_caching": True}}, "engine.engine_kwargs.enable_prefix_caching cannot be set"),
        ({"max_model_len": 0}, "engine.max_model_len"),
        ({"not_a_setting": 1}, "engine.not_a_setting"),
        ({"model": "x"}, "top-level `model`"),
    ],
)
def test_wrong_or_locked_engine_settings_fail_at_build_time_naming_the_key(engine, named):
    with pytest.raises(ValidationError, match=named.replace(".", r"\.").replace("`", ".")):
        build_app({"engine": engine})


@pytest.mark.parametrize("bad", [{"num_replicas": 0}, {"max_queued_requests": -1}, {"bogus": 1},
                                 {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}])
def test_app_args_refuse_bad_values(bad):
    with pytest.raises(ValidationError):
        AppArgs.model_validate(bad)


def test_defaults_serve_the_tiny_model_on_two_cpu_replicas():
    args = AppArgs()
    assert args.model is None and args.http_host == "127.0.0.1"
    config = args.engine_config("tiny:llama")
    assert config.dtype == "float32" and config.max_capture_bytes == 256 << 20
    assert replica_scaling(args, "cpu") == {"num_replicas": 2}
    assert replica_scaling(AppArgs(num_replicas=3), "cpu") == {"num_replicas": 3}
    auto = replica_scaling(AppArgs(autoscaling={"max_replicas": 4}), "gpu")
    assert auto["autoscaling_config"]["max_replicas"] == 4
    assert router_capacity(args, "cpu") == 2 * 512 + 1024 + 64
    assert serve_replica_limit(args) == 640 and serve_replica_limit(AppArgs(replica_max_ongoing_requests=8)) == 16
    assert router_config(args).replica_slots == 512
    assert AppArgs(max_capture_bytes=1000).engine_config("m").max_capture_bytes == 1000
    assert isinstance(build_app({"num_replicas": 1}), Application)


def test_api_key_comes_from_args_or_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(AppArgs()) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(AppArgs()).get_secret_value() == "from-env"
    assert router_config(AppArgs(api_key="from-args")).api_key.get_secret_value() == "from-args"
    assert "from-args" not in repr(AppArgs(api_key="from-args"))  # never printed in logs


def test_serve_config_yaml_is_valid_for_serve_and_for_build_app():
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "deploy.app:build_app"
    args = AppArgs.model_validate(app.args)
    assert args.model is None and args.num_replicas == "auto"
    by_name = {d["name"]: d for d in config["applications"][0]["deployments"]}
    assert set(by_name) == {"EngineReplica", "Router"}
    assert by_name["EngineReplica"]["max_ongoing_requests"] >= serve_replica_limit(args)
