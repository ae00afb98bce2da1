"""`CaptureEngine`: one vLLM `AsyncLLM` with the capture worker and capserve's locked settings.

    engine = await CaptureEngine.start(EngineConfig(model=path, dtype="float32"))
    result = await engine.generate({"prompt": "Hello", "max_tokens": 4,
                                    "capture": {"hooks": ["blocks.1.hook_resid_post"]}})

Requests are validated and tokenized here, before anything reaches vLLM; what depends on the
model (layers, width, armed kinds, byte cap, prompt length) fails the one request with an
`InvalidRequestError` that names the field. The request's capture plan rides on
`SamplingParams.extra_args`, so no RPC precedes it; one RPC after it finishes takes its rows.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import shutil
import tempfile
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from replicas import arrays
from replicas.api import CaptureSpec, Choice, GenerateRequest, GenerateResult, ModelInfo, as_request
from replicas.architectures import BlockShape, absent_kinds, block_shape, layer_kinds
from replicas.arena import ArenaReader, arena_path, delete_files, stored_in
from replicas.errors import CaptureFailedError, InvalidRequestError
from replicas.hooks import LAYER_KINDS, LayerKind, served_hook_names
from replicas.plans import PLAN_KEY, build_wire_plan, reduced_on_replica

MIN_SHARED_MEMORY_BYTES = 2 << 30
logger = logging.getLogger("capserve.engine")

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


class EngineConfig(BaseModel):
    """Settings of one replica's engine. `engine_kwargs` passes any other vLLM `AsyncEngineArgs`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="HF model folder or name.")
    tokenizer: str | None = None
    dtype: str = Field("auto", description="Model dtype: auto, float32, bfloat16, float16.")
    max_model_len: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="KV cache size; CPU default 1 GiB.")
    enforce_eager: bool | None = Field(None, description="None: eager on CPU, CUDA graphs on GPU.")
    load_format: str = "auto"
    seed: int = 0
    armed_kinds: list[LayerKind] | None = Field(
        None,
        description="Hook kinds capturable on every layer (default: every kind the architecture's blocks have); "
        "each costs one row copy per step inside the graph.",
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
    edit_stages: int = Field(1, ge=0, le=8, description="Edits one request may stack at one hook; each costs a pass over the rows of every armed site.")
    edit_slots: int = Field(
        64, ge=1, description="Distinct interventions (op and vector) per hook running at once; requests with the same one share it."
    )
    max_capture_bytes: int = Field(256 << 20, gt=0, description="Largest capture one request may ask for.")
    allow_unverified_vllm: bool = Field(
        False, description="Run on a vLLM release capserve's internals were not verified on (replicas/_vllm.py)."
    )
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)

    def for_checkpoint(self, shape: BlockShape, checkpoint_dtype: str | None) -> "EngineConfig":
        """This config with what the checkpoint decides filled in: the kinds its blocks have
        (a kind they lack, asked for by name, is an error) and, for dtype auto, its own dtype."""
        kinds, absent = layer_kinds(shape), absent_kinds(shape)
        for name in ("armed_kinds", "steer_kinds"):
            lacking = [k for k in getattr(self, name) or () if k in absent]
            if lacking:
                raise ValueError(f"{name}: {lacking[0]!r} does not exist in this model: {absent[lacking[0]]}")
        update: dict[str, Any] = {"armed_kinds": list(self.armed_kinds or kinds)}
        if self.dtype == "auto" and checkpoint_dtype is not None:
            update["dtype"] = checkpoint_dtype
        return self.model_copy(update=update)

    def engine_args(self, spill_dir: str | None = None, shape: BlockShape = "pre_norm") -> dict[str, Any]:
        for key in LOCKED_SETTINGS:
            if key in self.engine_kwargs:
                raise ValueError(
                    f"engine_kwargs.{key} cannot be set: capserve locks {key}={LOCKED_SETTINGS[key]!r} "
                    f"({LOCKED_REASON})"
                )
        from replicas import _vllm

        on_cpu = _vllm.is_cpu_platform()
        eager = self.enforce_eager if self.enforce_eager is not None else on_cpu
        args: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "seed": self.seed,
            "enforce_eager": eager,
            "load_format": self.load_format,
            **{k: v for k, v in self._optional().items() if v is not None},
            **self.engine_kwargs,
            **LOCKED_SETTINGS,
        }
        if on_cpu and self.kv_cache_memory_bytes is None:
            args["kv_cache_memory_bytes"] = 1 << 30
        args["additional_config"] = {
            "capserve": {
                "block_shape": shape,
                "armed_kinds": list(self.armed_kinds or LAYER_KINDS),
                "steer_kinds": self.steerable_kinds(),
                "steer_layers": self.steer_layers,
                "edit_stages": self.edit_stages,
                "edit_slots": self.edit_slots,
                "eager": eager,
                "spill_dir": spill_dir,
            }
        }
        return args

    def steerable_kinds(self) -> list[str]:
        armed = self.armed_kinds or LAYER_KINDS
        if self.steer_kinds is None:
            return list(armed)
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


class CaptureEngine:
    def __init__(self, llm: Any, config: EngineConfig, info: ModelInfo, name: str | None = None, shape: BlockShape = "pre_norm"):
        self.llm = llm
        self.config = config
        self._info = info
        self.shape = shape
        self.name = name
        # skip_tokenizer_init (benchmarks on dummy weights): prompts must then be token ids
        self.tokenizer = None if config.engine_kwargs.get("skip_tokenizer_init") else llm.get_tokenizer()
        self._edit_slots = _EditSlots(config.edit_slots)
        self._taker = _BatchedTake(llm)
        self._arena = ArenaReader()
        self.spill_dir: str | None = None  # shared-memory folder for large worker results

    @classmethod
    async def start(cls, config: EngineConfig | dict[str, Any], name: str | None = None) -> "CaptureEngine":
        config = config if isinstance(config, EngineConfig) else EngineConfig.model_validate(config)
        # The GPU default runner (V2) lays out the batch differently; capserve reads V1's layout.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from replicas import _vllm

        version = _vllm.check_version(config.allow_unverified_vllm)
        architecture, hf_config, checkpoint_dtype = _checkpoint(config)
        shape = block_shape(architecture, hf_config)  # refuses an undeclared architecture before vLLM starts
        config = config.for_checkpoint(shape, checkpoint_dtype)
        logger.info(
            "engine %s: %s (%s blocks), dtype %s%s, vLLM %s", name, architecture, shape, config.dtype,
            " (the checkpoint's own)" if checkpoint_dtype and config.dtype == checkpoint_dtype else "", version,
        )
        spill_dir = tempfile.mkdtemp(prefix="capserve-", dir=_spill_parent())
        try:
            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**config.engine_args(spill_dir, shape)))
        except BaseException:
            shutil.rmtree(spill_dir, ignore_errors=True)
            raise
        engine = cls(llm, config, _model_info(llm, config), name, shape)
        outside = sorted(set(config.steer_layers or ()) - set(range(engine._info.n_layers)))
        if outside:
            llm.shutdown()
            shutil.rmtree(spill_dir, ignore_errors=True)
            raise ValueError(f"steer_layers: {outside} outside the model's layers 0..{engine._info.n_layers - 1}")
        engine.spill_dir = spill_dir
        # map the worker's arena, then delete its name: its memory goes back with the last process
        # that maps it, also when the engine is killed rather than shut down
        engine._arena.attach(arena_path(spill_dir))
        return engine

    async def info(self) -> ModelInfo:
        return self._info

    async def check_health(self) -> dict[str, Any]:
        """Raise if the engine is dead or does not answer; otherwise the worker's counters."""
        await self.llm.check_health()
        stats = await self.llm.collective_rpc("capserve_stats", timeout=30)
        return stats[0]

    async def shutdown(self) -> None:
        self.llm.shutdown()
        if self.spill_dir:
            shutil.rmtree(self.spill_dir, ignore_errors=True)

    # ------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest | dict[str, Any]) -> GenerateResult:
        request = _validated(request)
        prompt_ids = self._prompt_token_ids(request)
        key = uuid.uuid4().hex
        plan = self._plan(key, request, prompt_ids)
        params = self._sampling_params(request, plan)
        # an edit-only request is taken too: an edit the worker could not install fails it there
        finish = _Finish(plan is not None, request.capture, len(prompt_ids))
        if request.interventions:
            async with self._edit_slots.hold(plan["edits"]):
                return await self._run(key, prompt_ids, params, finish)
        return await self._run(key, prompt_ids, params, finish)

    async def _run(self, key: str, prompt_ids: list[int], params: Any, finish: "_Finish") -> GenerateResult:
        from vllm.inputs import TokensPrompt

        final, completions, captured = None, {}, []
        try:
            try:
                async for output in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, request_id=key):
                    final = output
                    # with n > 1 a step's output carries only the completions that advanced in it
                    completions.update((c.index, c) for c in output.outputs)
            finally:
                # also on cancellation, so the worker forgets the request's rows
                captured = await asyncio.shield(self._taker.take(key)) if finish.takes else []
            args = (key, final, [completions[i] for i in sorted(completions)], captured, finish)
            if captured and any("blocks" in raw for raw in captured[0].get("activations", {}).values()):
                # copying a large capture out of the arena must not hold up the event loop
                return await asyncio.to_thread(self._result, *args)
            return self._result(*args)
        finally:
            self._free(captured)  # read or not, the worker's storage of them goes back

    def _worker_array(self, raw: dict[str, Any]) -> np.ndarray:
        if "blocks" in raw:
            return self._arena.read(raw)
        return arrays.from_file(raw) if "path" in raw else arrays.from_raw(raw)

    def _free(self, captured: list[dict[str, Any]]) -> None:
        for result in captured:
            blocks, paths = stored_in(result)
            self._taker.release(blocks)
            delete_files(paths)

    def _prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        prompt = request.prompt
        if self.tokenizer is None and not isinstance(prompt[0], int):
            raise InvalidRequestError("prompt: this replica runs without a tokenizer (skip_tokenizer_init); send token ids")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt[0], int):
            ids = list(prompt)  # type: ignore[arg-type]
            if max(ids) >= self._info.d_vocab:
                raise InvalidRequestError(f"prompt: token id {max(ids)} is outside the vocabulary (0..{self._info.d_vocab - 1})")
        else:
            messages = [m.model_dump() for m in prompt]  # type: ignore[union-attr]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        limit = self._info.max_model_len
        if len(ids) + request.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt: {len(ids)} prompt tokens + max_tokens {request.max_tokens} exceed the model's "
                f"max_model_len={limit}; shorten the prompt or lower max_tokens"
            )
        return ids

    def _plan(self, key: str, request: GenerateRequest, prompt_ids: list[int]) -> dict[str, Any] | None:
        try:
            return build_wire_plan(
                key,
                request,
                prompt_len=len(prompt_ids),
                n_layers=self._info.n_layers,
                d_model=self._info.d_model,
                armed_kinds=set(self.config.armed_kinds),
                steer_kinds=set(self.config.steerable_kinds()),
                steer_layers=None if self.config.steer_layers is None else set(self.config.steer_layers),
                edit_stages=self.config.edit_stages,
                max_capture_bytes=self.config.max_capture_bytes,
                absent_kinds=absent_kinds(self.shape),
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None

    def _sampling_params(self, request: GenerateRequest, plan: dict[str, Any] | None) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=request.n,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop=request.stop,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            ignore_eos=request.ignore_eos,
            extra_args={PLAN_KEY: plan} if plan else None,
        )

    def _result(
        self, key: str, final: Any, completions: list[Any], captured: list[dict[str, Any]], finish: "_Finish"
    ) -> GenerateResult:
        choices = [
            Choice(text=c.text, token_ids=list(c.token_ids), finish_reason=c.finish_reason, logprobs=_logprobs(c.logprobs))
            for c in completions
        ]
        prompt_ids = list(final.prompt_token_ids)
        result = GenerateResult(
            request_id=key,
            text=choices[0].text,
            token_ids=choices[0].token_ids,
            prompt_token_ids=prompt_ids,
            finish_reason=choices[0].finish_reason,
            choices=choices,
            logprobs=choices[0].logprobs,
            prompt_logprobs=[_logprob_row(row) for row in final.prompt_logprobs] if final.prompt_logprobs else None,
            replica=self.name,
        )
        if not captured:
            return result
        first = captured[0]
        if first["error"]:
            raise CaptureFailedError(first["error"])
        sequence = prompt_ids + choices[0].token_ids
        # The engine core may have run steps past what the caller gets back (a stop string is
        # matched in the front end after the core ran on): keep the rows of fed tokens only.
        fed = len(sequence) - 1
        kept = bisect.bisect_left(first["positions"], fed)
        result.positions = first["positions"][:kept]
        result.capture_token_ids = [sequence[p] for p in result.positions]
        result.activations = {name: finish.rows(self._worker_array(raw), kept) for name, raw in first["activations"].items()}
        if first["logits"] is not None:
            kept_logits = bisect.bisect_left(first["logits_positions"], fed)
            result.logits = self._worker_array(first["logits"])[:kept_logits]
            result.logits_positions = first["logits_positions"][:kept_logits]
        return result


class _Finish:
    """What the replica does with a request's rows once it knows which tokens the caller gets."""

    def __init__(self, takes: bool, capture: CaptureSpec | None, prompt_len: int):
        self.takes = takes
        # a mean over rows that may run past the returned tokens is taken here, after trimming
        self.mean_dtype = capture.dtype if capture is not None and reduced_on_replica(capture, prompt_len) else None

    def rows(self, array: np.ndarray, kept: int) -> np.ndarray:
        """The first `kept` rows, or their mean; a mean the worker took ([d]) covers prompt rows only."""
        if array.ndim == 1:
            return array
        if self.mean_dtype is None:
            return array[:kept]
        mean = array[:kept].astype(np.float32).sum(0) / max(kept, 1)
        return mean.astype(arrays.DTYPES[self.mean_dtype])


class _EditSlots:
    """Admits a request with interventions once each of its ops fits the worker's edit table.
    Requests with the same op at the same hook and stage share one table row (the worker keys rows
    by content), so the limit counts distinct ops per hook and stage, not requests."""

    def __init__(self, slots: int):
        self.slots = slots
        self.users: Counter[tuple] = Counter()  # op -> requests holding it
        self.per_hook: Counter[tuple] = Counter()  # (layer, kind, stage) -> distinct ops held
        self.changed = asyncio.Condition()

    @asynccontextmanager
    async def hold(self, wire_edits: list[dict[str, Any]]) -> AsyncIterator[None]:
        ops = {_op_key(edit) for edit in wire_edits}
        async with self.changed:
            await self.changed.wait_for(lambda: self._fits(ops))
            for op in ops:
                self.per_hook[op[:3]] += self.users[op] == 0
                self.users[op] += 1
        try:
            yield
        finally:
            async with self.changed:
                for op in ops:
                    self.users[op] -= 1
                    if not self.users[op]:
                        del self.users[op]
                        self.per_hook[op[:3]] -= 1
                self.changed.notify_all()

    def _fits(self, ops: set[tuple]) -> bool:
        new = Counter(op[:3] for op in ops if op not in self.users)
        return all(self.per_hook[hook] + n <= self.slots for hook, n in new.items())


def _op_key(edit: dict[str, Any]) -> tuple:
    """What decides an edit's table row (a `set` row is the identity; its values go per row)."""
    where = (edit["layer"], edit["kind"], edit["stage"])
    if edit["op"] == "set":
        return (*where, "set")
    vector = edit["vector"]["data"] if edit["vector"] is not None else None
    return (*where, edit["op"], vector, edit["scale"], edit["norm_match"], edit["factor"])


class _BatchedTake:
    """Collects the keys of requests that finished close together into one `capserve_take` RPC
    (every RPC waits for the engine core between two steps, so one per request would stall it),
    and with them the arena blocks whose rows were read since the last one."""

    def __init__(self, llm: Any):
        self.llm = llm
        self.pending: dict[str, asyncio.Future] = {}
        self.released: list[int] = []
        self.flushing: asyncio.Task | None = None

    async def take(self, key: str) -> list[dict[str, Any]]:
        future = asyncio.get_running_loop().create_future()
        self.pending[key] = future
        self._schedule()
        return await future

    def release(self, blocks: list[int]) -> None:
        if blocks:
            self.released.extend(blocks)
            self._schedule()  # back promptly, so the arena need not grow

    def _schedule(self) -> None:
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let requests finishing in the same output batch join
        while self.pending or self.released:
            batch, self.pending = self.pending, {}
            released, self.released = self.released, []
            try:
                taken = (await self.llm.collective_rpc("capserve_take", args=(list(batch), released)))[0]
                for key, future in batch.items():
                    if not future.done():
                        future.set_result(taken.get(key, []))
            except Exception as exc:
                for future in batch.values():
                    if not future.done():
                        future.set_exception(exc)


def _checkpoint(config: EngineConfig) -> tuple[str, Any, str | None]:
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


def _spill_parent() -> str | None:
    """/dev/shm, unless it is missing or small (a container's default is 64 MiB): then the
    temporary folder (None), whose page cache serves the worker's large results more slowly."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").total >= MIN_SHARED_MEMORY_BYTES:
        return "/dev/shm"
    return None


def _validated(request: GenerateRequest | dict[str, Any]) -> GenerateRequest:
    try:
        return as_request(request)
    except ValidationError as exc:
        raise InvalidRequestError(_validation_message(exc)) from None


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "request"
        parts.append(f"{where}: {error['msg']}")
    return "invalid request: " + "; ".join(parts)


def _logprob_row(row: dict[int, Any] | None) -> dict[int, float] | None:
    return None if row is None else {int(t): float(lp.logprob) for t, lp in row.items()}


def _logprobs(rows: Any) -> list[dict[int, float]] | None:
    return None if rows is None else [_logprob_row(row) or {} for row in rows]


def _model_info(llm: Any, config: EngineConfig) -> ModelInfo:
    model_config = llm.model_config
    hf = model_config.hf_config
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    n_layers = int(model_config.get_num_layers(llm.vllm_config.parallel_config))
    return ModelInfo(
        model=config.model,
        architecture=(hf.architectures or ["unknown"])[0],
        n_layers=n_layers,
        d_model=int(text.hidden_size),
        d_vocab=int(model_config.get_vocab_size()),
        max_model_len=int(model_config.max_model_len),
        dtype=str(model_config.dtype).removeprefix("torch."),
        hook_names=served_hook_names(n_layers, config.armed_kinds),
        armed_kinds=list(config.armed_kinds),
    )

