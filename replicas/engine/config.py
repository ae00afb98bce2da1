"""`EngineConfig`: one replica's engine settings, the settings capserve locks, and what the
checkpoint decides (its architecture's block shape, and for dtype auto its own dtype)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replicas.api.hooks import LAYER_KINDS, PATTERN_KINDS, LayerKind
from replicas.engine.architectures import BlockShape, MoeShape, absent_kinds, layer_kinds, same_kinds
from replicas.readouts.specs import ProbeConfig, check_readouts
from replicas.sae.specs import SaeConfig, check_saes

LOCKED_SETTINGS: dict[str, Any] = {
    "tensor_parallel_size": 1,  # one replica = one GPU; the worker bookkeeping assumes one rank
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "enable_prefix_caching": False,  # cached prefixes skip the forward, so their rows are never seen
    "speculative_config": None,  # draft tokens would run through the hooks: captured and edited
    "kv_transfer_config": None,  # prefill computed elsewhere never runs through this replica's hooks
    "worker_cls": "replicas.worker.CaptureWorker",
    "worker_extension_cls": "",
    "additional_config": None,  # carries capserve's worker options
}


LOCKED_REASON = (
    "one GPU per replica; every token runs through the hooks exactly once, so no prefix caching, "
    "speculative decoding or KV transfer; capserve's own worker"
)


DEFAULT_ARENA_RESERVE_BYTES = {"gpu": 1 << 30, "cpu": 64 << 20}

class WorkerOptions:
    """capserve's options for its worker, riding in vLLM's `additional_config` (read back by
    `_vllm.capserve_options` as `additional_config.get("capserve")`). vLLM folds additional_config
    into the key of its compile cache (`VllmConfig.compute_hash`); as a plain dict the per-start
    fields (the arena's folder, the owning process) made every start a new key, so a restarted
    replica recompiled for minutes. Here they stay out of the hash: the same model and settings
    find the graphs compiled before."""

    PER_START = ("spill_dir", "owner")

    def __init__(self, capserve: dict[str, Any]):
        self.capserve = capserve

    def get(self, key: str, default: Any = None) -> Any:
        return self.capserve if key == "capserve" else default

    def __getitem__(self, key: str) -> Any:
        if key != "capserve":
            raise KeyError(key)
        return self.capserve

    def compute_hash(self) -> str:
        import hashlib
        import json

        lasting = {k: v for k, v in self.capserve.items() if k not in self.PER_START}
        return hashlib.sha256(json.dumps(lasting, sort_keys=True, default=str).encode()).hexdigest()


# Kinds a request can read but not edit, and what to edit instead.
READ_ONLY_KINDS: dict[str, str] = {
    **{kind: "is computed from q and k on the replica and cannot be edited; edit q or k instead" for kind in PATTERN_KINDS},
    "expert_ids": "is the router's choice and cannot be edited; to force or forbid an expert, add +1e4 or -1e4 at "
    "its index to the same layer's blocks.<i>.mlp.hook_router_logits",
}


class StepProfile(BaseModel):
    """Steps of the worker's step loop to profile (replicas/worker/diagnostics/step_profile.py), and where the table goes."""

    model_config = ConfigDict(extra="forbid")

    first_step: int = Field(ge=0, description="First step of the window (the worker counts from 0 at start).")
    steps: int = Field(gt=0, le=10_000, description="Steps the window spans.")
    folder: str = Field(description="Folder, on the engine's node, that receives step_profile-<pid>.txt "
                        "(created at the engine's start if missing).")
    python: bool = Field(False, description="Also time the step loop's Python functions (cProfile, the step "
                         "loop's thread) into python_profile-<pid>.txt; the window's steps run slower.")


class EngineConfig(BaseModel):
    """Settings of one replica's engine. `engine_kwargs` passes any other vLLM `AsyncEngineArgs`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="HF model folder or name.")
    tokenizer: str | None = None
    dtype: str = Field(
        "auto", description="Model dtype: float32, bfloat16, float16, or auto: the checkpoint's own (logged at start)."
    )
    max_model_len: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="KV cache size; CPU default 1 GiB.")
    enforce_eager: bool | None = Field(None, description="None: eager on CPU, CUDA graphs on GPU.")
    load_format: str = "auto"
    compile_cache_dir: str | None = Field(
        None, description="Folder of vLLM's torch.compile cache (default: vLLM's, under ~/.cache/vllm), also given "
        "to Serve replicas as VLLM_CACHE_ROOT, where vLLM keeps its AOT-compiled model. Replicas of the same model "
        "and settings share its entries, restarts included; a folder on a shared disk lets a replacement replica "
        "on another node skip compilation too.",
    )
    quantization: str | None = Field(
        None, description="Have vLLM quantize the float checkpoint as it loads it: fp8 on the GPU, fp8_per_block on "
        "CPU (dense models). A pre-quantized checkpoint (AWQ, GPTQ) needs none. Methods capserve has not checked "
        "on the platform are refused at start (replicas/engine/quantization.py).",
    )
    seed: int = 0
    armed_kinds: list[LayerKind] | None = Field(
        None,
        description="Hook kinds capturable on every layer (default: every residual-stream kind the architecture's "
        "blocks have); each costs one row copy per step inside the graph. The attention kinds q, k, v, z (per head) "
        "and pattern, attn_scores (computed on the replica from q and k) are armed only when listed here.",
    )
    steer_kinds: list[LayerKind] | None = Field(
        None,
        description="Armed kinds that accept interventions (default: all armed); each costs one edit pass per step.",
    )
    steer_layers: list[int] | None = Field(
        None,
        description="Layers whose steer_kinds accept interventions (default: every layer); a deployment that "
        "steers at known layers pays the edit pass only there.",
    )
    edit_stages: int = Field(
        1, ge=0, le=8,
        description="Edits one request may stack at one position of one hook (edits at disjoint explicit positions "
        "share one); each costs a pass over the rows of every armed site.",
    )
    edit_slots: int = Field(
        64, ge=1, description="Distinct interventions (op and vector) per hook running at once; requests with the same one share it."
    )
    max_capture_bytes: int = Field(
        256 << 20, gt=0,
        description="Most bytes one request may have the worker hold: its activations plus its logits (float32 rows "
        "x d_vocab), times n (each completion captures in full; the first is returned).",
    )
    arena_max_bytes: int | None = Field(
        None, gt=0,
        description="Most shared memory this replica's capture arena may take. Default: a fair share of /dev/shm "
        "(or of the temporary folder when /dev/shm is small): half of it, split evenly over the node's GPUs and "
        "at least two shares, so replicas, Ray's object store and others never find it full. A request whose "
        "capture could not fit beside those in flight waits; one that could never fit is refused.",
    )
    arena_reserve_bytes: int | None = Field(
        None, ge=0,
        description="Shared memory the capture arena reserves at start-up, pages faulted in (and on a GPU "
        "registered with CUDA, in one piece), so a first large capture runs as fast as later ones and a step's "
        "rows go into it by the fewest copies; it keeps this much when idle and grows past it as needed, up to "
        "arena_max_bytes (on a GPU registering new memory holds up the step loop a little). For N large captures "
        "at once: N x replicas.arena.host.capture_arena_bytes(hooks, rows, row bytes, d_model); for `capserve capture` "
        "with replica-side sinks, the lines of the shard jobs a replica holds (sink.max_unwritten shards, or "
        "the CLI's --concurrency lines when shards are smaller). Default: 1 GiB on a "
        "GPU, 64 MiB on the CPU engine.",
    )
    max_step_temp_bytes: int = Field(
        256 << 20, gt=0,
        description="Most device memory one step's capture gather or logits computation takes at once, outside "
        "vLLM's memory profile; larger steps are computed in row chunks of this size. Except a large step's "
        "captured rows on a GPU: gathered whole (hooks x rows x width) for the copy engines, and freed as they "
        "reach host memory.",
    )
    arena_graphs: bool = Field(
        True,
        description="On a GPU, a small decode step's captured rows go into the arena by one CUDA graph replay "
        "(replicas/worker/arena_graphs.py: a few CPU calls a step, not a dozen); off: by the side stream, as a large "
        "step's do.",
    )
    forward_timing: bool = Field(
        False,
        description="Time each decode step's model call on the host and, on a GPU, by CUDA events on the device "
        "(replicas/worker/diagnostics/forward_timing.py; `CaptureEngine.forward_times`): where a slower step's time goes, without a "
        "profiler. Costs two event records a decode step.",
    )
    attention_in_place: bool = Field(
        True,
        description="vLLM's attention kernel writes its output straight into hook_z's staging buffer, so arming "
        "z costs no copy a step (replicas/worker/sites.py); off: z is copied there after the op, one copy per layer a step "
        "(bench_side_by_side's z-copy deployment compares the two).",
    )
    switch_context_every_s: float | None = Field(
        0.05, gt=0,
        description="On a GPU, launch an empty kernel in a second CUDA context of the engine's process at most this "
        "often while steps write captured rows, and once after the last such step (replicas/worker/context_switch.py): on "
        "an H200 a capture of many rows otherwise leaves the forward ~3 % slower, during the capture and after it, "
        "until the GPU switches contexts. On by default by evidence (docs/notes/switch-context-default.md; one H200 "
        "host, 32 requests, one-layer hook_z capture): the capture ran 0.963x plain vLLM with it against 0.942x without "
        "(forward on the device 5,338 against 5,512 us a step), and the engine after a capture 0.979x against 0.949x. "
        "Cost: the context takes 260 MiB of device memory (made while the model loads, so vLLM's memory profile "
        "counts it and the KV cache is that much smaller), 0.25 s to create, a launch 6.6 us on the host. Other GPUs "
        "are unmeasured. None turns it off.",
    )
    max_set_edits: int = Field(
        4, ge=1, le=64,
        description="Most `set` interventions one request may carry. Every steered site shares one values buffer "
        "of max_set_edits x max_num_batched_tokens x d_model.",
    )
    take_timeout_s: float = Field(
        120.0, gt=0,
        description="How long the replica waits for the worker to hand over finished requests' rows (one RPC "
        "between two engine steps); past it those requests fail with ReplicaUnavailableError (retried elsewhere).",
    )
    outbox_timeout_s: float = Field(
        60.0, gt=0,
        description="How long the engine core waits for the worker's outbox thread (a finished request's rows, "
        "room in the backlog); past it the requests concerned fail with ReplicaUnavailableError instead of "
        "hanging the engine core. Must be below take_timeout_s.",
    )
    stall_timeout_s: float = Field(
        300.0, gt=0,
        description="The health check fails when requests are running and none got output for this long (a wedged "
        "engine core); above take_timeout_s, since a take holds the engine core between two steps.",
    )
    step_profile: StepProfile | None = Field(
        None,
        description="Profile these steps of the worker's step loop with torch.profiler and write the table of ops "
        "(replicas/worker/diagnostics/step_profile.py) into its folder: where a step's time goes. None: off.",
    )
    allow_unverified_vllm: bool = Field(
        False, description="Run on a vLLM release capserve's internals were not verified on (replicas/_vllm/)."
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM tool parser that finds tool calls in generated text, as `vllm serve --tool-call-parser` "
        "(e.g. hermes for Qwen2.5/Hermes-style <tool_call> JSON; the built-in tiny models use hermes). None: "
        "requests with tools are refused (tool_choice none excepted). Checked against vLLM's parsers at start.",
    )
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        "auto",
        description="How far vLLM's structural tags constrain tool calls (`vllm serve --tool-strict-level`): auto = "
        "tool_choice required / a named function force the call's envelope, and a tool's arguments follow its "
        "schema only when it says strict: true; function = the envelope on every request with tools; parameter = "
        "also every tool's arguments, as if each were strict.",
    )
    tool_call_max_whitespace: int | None = Field(
        None, ge=1,
        description="Most whitespace characters between the JSON tokens of a constrained tool call's arguments "
        "(xgrammar's max_whitespace_cnt). None: any, as vLLM. A random-weight model needs a bound (1) to end a "
        "forced call; a trained one stops by itself.",
    )
    saes: dict[str, SaeConfig] = Field(
        default_factory=dict,
        description="SAEs loaded onto the device, by sae_id: SAELens folders whose features requests ask for "
        "(`sae`) or steer by (`add` with sae_id + feature); see docs/sae.md. Checked at start: d_in = d_model, "
        "the hook served.",
    )
    tuned_lens: str | None = Field(
        None,
        description="Folder of a tuned lens for this model, for `readouts` of kind tuned_lens: tuned-lens's "
        "TunedLens.save layout with params.pt converted to params.safetensors (no pickle is ever read); see "
        "docs/readouts.md. Checked at start: d_model and num_hidden_layers match the model. Its translators take "
        "n_layers x d_model^2 of device memory in the model's dtype.",
    )
    probes: dict[str, ProbeConfig] = Field(
        default_factory=dict,
        description="Linear probes loaded onto the device, by name, for `readouts` of kind probe: .safetensors files "
        "with weight [n_out, d_model] and optional bias [n_out], the hook in the option or the file's metadata; see "
        "docs/readouts.md. Checked at start: width d_model, the hook served.",
    )
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _waits_nest(self) -> "EngineConfig":
        if self.outbox_timeout_s >= self.take_timeout_s:
            raise ValueError(
                f"outbox_timeout_s={self.outbox_timeout_s:g} must be below take_timeout_s={self.take_timeout_s:g}: "
                "a take waits for the outbox, and its requests should fail for the outbox's reason"
            )
        if self.stall_timeout_s <= self.take_timeout_s:
            raise ValueError(
                f"stall_timeout_s={self.stall_timeout_s:g} must be above take_timeout_s={self.take_timeout_s:g}: "
                "a take holds the engine core, and a busy engine must not fail its health check"
            )
        return self

    def for_checkpoint(
        self, shape: BlockShape, checkpoint_dtype: str | None, text_config: Any = None, moe: MoeShape | None = None
    ) -> "EngineConfig":
        """This config with what the checkpoint decides filled in: the kinds its blocks have
        (a kind they lack, asked for by name, is an error) and, for dtype auto, its own dtype.
        With the checkpoint's text config, its SAEs, tuned lens and probes are checked against the model."""
        kinds, absent = layer_kinds(shape, moe), absent_kinds(shape, moe)
        for name in ("armed_kinds", "steer_kinds"):
            lacking = [k for k in getattr(self, name) or () if k in absent]
            if lacking:
                raise ValueError(f"{name}: {lacking[0]!r} does not exist in this model: {absent[lacking[0]]}")
        same = same_kinds(shape)  # one site serves both names
        update: dict[str, Any] = {"armed_kinds": list(dict.fromkeys(same.get(k, k) for k in self.armed_kinds or kinds))}
        if self.steer_kinds is not None:
            update["steer_kinds"] = list(dict.fromkeys(same.get(k, k) for k in self.steer_kinds))
        if self.dtype == "auto" and checkpoint_dtype is not None:
            update["dtype"] = checkpoint_dtype
        if self.saes and text_config is not None:
            check_saes(self.saes, d_model=int(text_config.hidden_size), n_layers=int(text_config.num_hidden_layers),
                       armed_kinds=update["armed_kinds"], absent=absent)
        if (self.tuned_lens is not None or self.probes) and text_config is not None:
            check_readouts(self.tuned_lens, self.probes, d_model=int(text_config.hidden_size),
                           n_layers=int(text_config.num_hidden_layers), armed_kinds=update["armed_kinds"], absent=absent)
        return self.model_copy(update=update)

    def engine_args(
        self, spill_dir: str | None = None, shape: BlockShape = "pre_norm", owner: dict[str, Any] | None = None,
        moe: MoeShape | None = None,
    ) -> dict[str, Any]:
        """vLLM's engine arguments; `owner` (pid, start time) is the process the engine dies with."""
        for key in LOCKED_SETTINGS:
            if key in self.engine_kwargs:
                raise ValueError(
                    f"engine_kwargs.{key} cannot be set: capserve locks {key}={LOCKED_SETTINGS[key]!r} "
                    f"({LOCKED_REASON})"
                )
        if "quantization" in self.engine_kwargs:
            raise ValueError("engine_kwargs.quantization: set the engine config's own `quantization` field, which is "
                             "checked against the methods capserve serves")
        from replicas import _vllm

        if self.tool_call_parser is not None:
            _vllm.check_tool_parser(self.tool_call_parser)  # before vLLM spends a minute starting
        on_cpu = _vllm.is_cpu_platform()
        eager = self.enforce_eager if self.enforce_eager is not None else on_cpu
        args: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "seed": self.seed,
            "enforce_eager": eager,
            "load_format": self.load_format,
            "quantization": self.quantization,
            **{k: v for k, v in self._optional().items() if v is not None},
            **self.engine_kwargs,
            **LOCKED_SETTINGS,
        }
        if on_cpu and self.kv_cache_memory_bytes is None:
            args["kv_cache_memory_bytes"] = 1 << 30
        args["additional_config"] = WorkerOptions(
            {
                "block_shape": shape,
                "moe": asdict(moe) if moe is not None else None,
                "armed_kinds": list(self.armed_kinds or LAYER_KINDS),
                "steer_kinds": self.steerable_kinds(),
                "steer_layers": self.steer_layers,
                "edit_stages": self.edit_stages,
                "edit_slots": self.edit_slots,
                "max_set_edits": self.max_set_edits,
                "saes": {sae_id: sae.model_dump() for sae_id, sae in self.saes.items()},
                "tuned_lens": self.tuned_lens,
                "probes": {name: probe.model_dump() for name, probe in self.probes.items()},
                "arena_max_bytes": self.arena_max_bytes,
                "arena_reserve_bytes": self.arena_reserve_bytes if self.arena_reserve_bytes is not None
                else DEFAULT_ARENA_RESERVE_BYTES["cpu" if on_cpu else "gpu"],
                "max_step_temp_bytes": self.max_step_temp_bytes,
                "arena_graphs": self.arena_graphs,
                "forward_timing": self.forward_timing,
                "attention_in_place": self.attention_in_place,
                "switch_context_every_s": self.switch_context_every_s,
                "outbox_timeout_s": self.outbox_timeout_s,
                "step_profile": self.step_profile.model_dump() if self.step_profile is not None else None,
                "eager": eager,
                "spill_dir": spill_dir,
                "owner": owner,
            }
        )
        if self.compile_cache_dir is not None:
            args["compilation_config"] = {**(args.get("compilation_config") or {}), "cache_dir": self.compile_cache_dir}
        return args

    def steerable_kinds(self) -> list[str]:
        armed = self.armed_kinds or LAYER_KINDS
        if self.steer_kinds is None:
            return [kind for kind in armed if kind not in READ_ONLY_KINDS]
        read_only = [kind for kind in self.steer_kinds if kind in READ_ONLY_KINDS]
        if read_only:
            raise ValueError(f"steer_kinds: {read_only[0]!r} {READ_ONLY_KINDS[read_only[0]]}")
        unarmed = set(self.steer_kinds) - set(armed)
        if unarmed:
            raise ValueError(f"steer_kinds {sorted(unarmed)} are not in armed_kinds {list(armed)}")
        return list(self.steer_kinds)

    def _optional(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
        }


def checkpoint_facts(config: EngineConfig) -> tuple[str, Any, str | None]:
    """(architecture, text config, dtype the weights are stored in) of the checkpoint. vLLM's own
    `auto` downcasts float32 checkpoints (GPT-2, Pythia) to bfloat16; TransformerLens runs them in
    float32, and researchers comparing with it expect the same numbers."""
    from transformers import AutoConfig

    trust = bool(config.engine_kwargs.get("trust_remote_code", False))
    hf = AutoConfig.from_pretrained(config.model, trust_remote_code=trust)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    stored = getattr(text, "dtype", None) or getattr(hf, "dtype", None)
    name = str(stored).removeprefix("torch.") if stored is not None else None
    dtype = name if name in ("float32", "float16", "bfloat16") else None
    return (hf.architectures or ["unknown"])[0], text, dtype
