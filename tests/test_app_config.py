"""App arguments and serve_config.yaml, checked without starting Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from deploy.app import build_app, replica_scaling, router_capacity, serve_replica_limit, warn_if_open
from deploy.config import API_KEY_ENV, AppArgs, read_api_key, resolve_api_key, router_config
from replicas.shards.sink import ShardSink, SinkOptions

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
    assert config.tool_call_parser == "hermes" and config.tool_call_max_whitespace == 1  # its chat template's format
    assert args.engine_config("/models/real").tool_call_parser is None  # a real model: the user names its parser


def test_placement_resources_and_autoscaling_delays_reach_the_deployments():
    app = build_app({"device": "cpu", "replica_resources": {"engine_node": 1}, "router_resources": {"head": 0.5},
                     "autoscaling": {"max_replicas": 3, "upscale_delay_s": 2, "downscale_delay_s": 7, "look_back_period_s": 3}})
    router = app._bound_deployment
    replicas = router.init_args[0]._bound_deployment
    assert router.ray_actor_options == {"num_cpus": 0, "resources": {"head": 0.5}}
    assert replicas.ray_actor_options["resources"] == {"engine_node": 1.0}
    scaling = replicas._deployment_config.autoscaling_config
    assert (scaling.max_replicas, scaling.upscale_delay_s, scaling.downscale_delay_s, scaling.look_back_period_s) == (3, 2, 7, 3)


def test_sink_options_reach_each_replica_and_bad_ones_name_their_field():
    app = build_app({"device": "cpu", "sink": {"threads": 4, "max_unwritten": 6, "policy": "refuse"}})
    options = app._bound_deployment.init_args[0]._bound_deployment.init_args[2]
    assert options.sink == SinkOptions(threads=4, max_unwritten=6, policy="refuse")
    sink = ShardSink(**options.sink.model_dump())  # as the replica makes it
    assert (sink._threads._max_workers, sink._max_unwritten, sink._policy) == (4, 6, "refuse")
    sink.close()
    assert AppArgs().sink == SinkOptions(threads=2, max_unwritten=3, policy="wait")
    for bad, field in [({"threads": 0}, "sink.threads"), ({"policy": "drop"}, "sink.policy"), ({"writers": 2}, "sink.writers")]:
        with pytest.raises(ValidationError, match=field):
            AppArgs(sink=bad)


def test_api_key_comes_from_the_environment_or_a_file_never_from_args(monkeypatch, tmp_path):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(AppArgs()) is None and read_api_key(router_config(AppArgs())) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert read_api_key(router_config(AppArgs())).get_secret_value() == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    config = router_config(AppArgs(api_key_file=str(key_file)))
    assert read_api_key(config).get_secret_value() == "from-file"  # the file wins; whitespace stripped
    assert "from-env" not in repr(config)


def test_an_api_key_argument_is_refused_and_the_error_says_where_it_goes():
    with pytest.raises(ValidationError) as info:
        AppArgs.model_validate({"api_key": "tok-77777777"})
    message = str(info.value)
    assert "api_key cannot be an app argument" in message and API_KEY_ENV in message and "api_key_file" in message
    assert "tok-77777777" not in message
    with pytest.raises(ValidationError, match="api_key cannot be an app argument"):
        build_app({"api_key": None})  # even empty: the key has no place in args


def test_an_unreadable_or_empty_key_file_fails_the_router_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"api_key_file='.*missing'.*cannot read it on the Router's node"):
        read_api_key(router_config(AppArgs(api_key_file=str(tmp_path / "missing"))))
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        read_api_key(router_config(AppArgs(api_key_file=str(tmp_path / "empty"))))


def test_more_than_one_router_replica_is_refused():
    with pytest.raises(ValidationError, match=r"router_replicas=2: only 1 is supported.*own cost ledger"):
        AppArgs(router_replicas=2)
    assert AppArgs(router_replicas=1).router_replicas == 1


def test_a_public_bind_without_a_key_is_warned_about(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    caplog.set_level("WARNING", logger="capserve.app")
    assert warn_if_open(AppArgs(http_host="0.0.0.0")) is True
    assert "http_host=0.0.0.0 listens beyond this machine and no API key is set" in caplog.text
    assert warn_if_open(AppArgs(http_host="127.0.0.1")) is False
    assert warn_if_open(AppArgs(http_host="::1")) is False and warn_if_open(AppArgs(http_host="localhost")) is False
    assert warn_if_open(AppArgs(http_host="0.0.0.0", api_key_file=str(tmp_path / "k"))) is False
    monkeypatch.setenv(API_KEY_ENV, "k")
    assert warn_if_open(AppArgs(http_host="10.1.2.3")) is False


def test_deadlines_default_and_an_attempt_cannot_outlive_its_request():
    routing = AppArgs().routing
    assert (routing.request_timeout_s, routing.attempt_timeout_s, routing.attempt_limit_s) == (600.0, None, 300.0)
    assert AppArgs(routing={"request_timeout_s": 10, "attempt_timeout_s": 4}).routing.attempt_limit_s == 4
    with pytest.raises(ValidationError, match=r"routing.attempt_timeout_s=20.0 exceeds routing.request_timeout_s=10.0"):
        AppArgs(routing={"request_timeout_s": 10, "attempt_timeout_s": 20})
    with pytest.raises(ValidationError, match="request_timeout_s"):
        AppArgs(routing={"request_timeout_s": 0})


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
    assert by_name["Router"]["num_replicas"] == 1
    # the proxy must not cut an HTTP request before the router's own deadline answers it with a 504
    assert config["http_options"]["request_timeout_s"] > args.routing.request_timeout_s


def test_compile_cache_dir_also_holds_vllms_aot_compiled_model():
    """vLLM 0.26 on an H100 saved the AOT-compiled model under ~/.cache/vllm although compile_cache_dir
    was set (bench/results/readiness_h100_llama8b.json's log): replicas given the folder get it as
    VLLM_CACHE_ROOT too, and replicas without one keep vLLM's default and no runtime_env of their own."""
    cached = build_app({"device": "cpu", "engine": {"compile_cache_dir": "/cache/capserve"}})
    replicas = cached._bound_deployment.init_args[0]._bound_deployment
    assert replicas.ray_actor_options["runtime_env"] == {"env_vars": {"VLLM_CACHE_ROOT": "/cache/capserve"}}
    assert replicas.init_args[0].engine_args()["compilation_config"]["cache_dir"] == "/cache/capserve"
    plain = build_app({"device": "cpu"})._bound_deployment.init_args[0]._bound_deployment
    assert "runtime_env" not in plain.ray_actor_options


def test_replicas_share_a_gpu_with_an_equal_part_of_its_memory(monkeypatch):
    """replicas_per_gpu: 2 places two replicas on each GPU, each with half a GPU and under half its
    memory; a share that would not fit beside the others is refused naming both fields."""
    import deploy.app

    monkeypatch.setattr(deploy.app, "gpu_count", lambda: 1)
    app = build_app({"device": "gpu", "replicas_per_gpu": 2})
    replicas = app._bound_deployment.init_args[0]._bound_deployment
    assert replicas.ray_actor_options["num_gpus"] == 0.5 and replicas._deployment_config.num_replicas == 2
    assert replicas.init_args[0].gpu_memory_utilization == 0.45
    own = build_app({"device": "gpu", "replicas_per_gpu": 3, "engine": {"gpu_memory_utilization": 0.3}})
    assert own._bound_deployment.init_args[0]._bound_deployment.init_args[0].gpu_memory_utilization == 0.3
    single = build_app({"device": "gpu"})._bound_deployment.init_args[0]._bound_deployment
    assert single.ray_actor_options["num_gpus"] == 1 and single.init_args[0].gpu_memory_utilization is None
    with pytest.raises(ValidationError, match=r"engine.gpu_memory_utilization=0.6 x replicas_per_gpu=2 .* at most 0.47"):
        AppArgs(replicas_per_gpu=2, engine={"gpu_memory_utilization": 0.6})
