"""`CaptureEngine`: one vLLM `AsyncLLM` with the capture worker and capserve's locked settings.

    engine = await CaptureEngine.start(EngineConfig(model=path, dtype="float32"))
    result = await engine.generate({"prompt": "Hello", "max_tokens": 4,
                                    "capture": {"hooks": ["blocks.1.hook_resid_post"]}})

Requests are validated and tokenized here, before anything reaches vLLM; what depends on the
model (layers, width, armed kinds, byte cap, prompt length) fails the one request with an
`InvalidRequestError` that names the field. The request's capture plan rides on
`SamplingParams.extra_args`, so no RPC precedes it; one RPC after it finishes takes its rows.

Memory a request holds is admitted here: its activations and logits, times `n`, against
`max_capture_bytes` (replicas.plans.request); the arena blocks its capture may need against the
replica's arena (`ArenaBudget`: it waits until they fit). The take RPC has a deadline
(`take_timeout_s`); a request whose take timed out fails with ReplicaUnavailableError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import numpy as np

from replicas.api import arrays
from replicas.api import GenerateRequest, GenerateResult, ModelInfo, MoeInfo
from replicas.engine.architectures import BlockShape, MoeShape, absent_kinds, block_shape, moe_shape, same_kinds
from replicas.arena.host import (
    ArenaLayout, ArenaReader, HeldArena, arena_blocks, arena_geometry, arena_limit_bytes, arena_path, delete_files, stored_in,
)
from replicas.arena.client import ArenaBudget, BatchedTake, taken_results
from replicas.engine.attention import attention_info
from replicas.engine.edit_slots import EditSlots
from replicas.engine.config import EngineConfig, checkpoint_facts
from replicas.api.errors import OUTBOX_DEAD, CaptureFailedError, InvalidRequestError, ReplicaUnavailableError
from replicas.api.hooks import served_hook_names
from replicas.arena.lifeline import SPILL_PREFIX, Owner, Progress, Sweeper
from replicas.plans.heads import head_shapes
from replicas.plans.request import PLAN_KEY, build_wire_plan
from replicas.engine.gates import resolve_conditions
from replicas.engine.quantization import check_quantization
from replicas.engine.results import Finish, add_captured, generation_result
from replicas.engine.start_turn import gpu_start_turn
from replicas.readouts.specs import ReadoutCatalog
from replicas.sae.specs import SaeCatalog
from replicas.engine.tools import ToolCalling, ToolTurn, template_inputs
from replicas.api.validation import validated

MIN_SHARED_MEMORY_BYTES = 2 << 30
logger = logging.getLogger("capserve.engine")


class CaptureEngine:
    def __init__(
        self, llm: Any, config: EngineConfig, info: ModelInfo, name: str | None = None, shape: BlockShape = "pre_norm",
        moe: MoeShape | None = None,
    ):
        self.llm = llm
        self.config = config
        self.shape = shape
        self.moe = moe
        self.name = name
        # skip_tokenizer_init (benchmarks on dummy weights): prompts must then be token ids
        self.tokenizer = None if config.engine_kwargs.get("skip_tokenizer_init") else llm.get_tokenizer()
        self._edit_slots = EditSlots(config.edit_slots)
        self.saes = SaeCatalog.read(config.saes)  # replicas.sae.specs: checked by for_checkpoint
        self.readouts = ReadoutCatalog.read(config.tuned_lens, config.probes)  # likewise (replicas.readouts.specs)
        self._info = info.model_copy(update={
            "saes": self.saes.listing(), "probes": self.readouts.listing(), "tuned_lens": self.readouts.tuned_lens is not None,
        })
        self._taker = BatchedTake(llm, config.take_timeout_s)
        self._arena = ArenaReader()
        # Results view the arena in place (read-only arrays, as Ray hands out), their blocks held
        # until the arrays are dropped, while views hold at most this share of its blocks; past it
        # they are copied out, so a caller that keeps results cannot hold the whole arena and leave
        # admission waiting. (Copying 32 requests' 6.3 MB each out at a batch's end made its tail
        # after vLLM 11-14 ms on an H200 host; 7 ms with views.) A replica views always (Ray copies
        # a result as it returns it; its shard sink gives blocks back when admission waits).
        self.view_share = 0.5
        self._viewed_blocks = 0  # of the arena budget, held by results' views
        self._arena_budget: ArenaBudget | None = None  # sized on first use, once spill_dir is known
        self.spill_dir: str | None = None  # shared-memory folder for large worker results
        # why captures fail at once on this replica (its worker's outbox died); None while they work
        self.capture_failure: str | None = None
        self.progress = Progress()
        self.sweeper: Sweeper | None = None  # of this node's shared memory, set by start()
        self.kv_cache_tokens = 0  # what vLLM sized the KV cache to, set by start()

    @classmethod
    async def start(cls, config: EngineConfig | dict[str, Any], name: str | None = None) -> "CaptureEngine":
        config = config if isinstance(config, EngineConfig) else EngineConfig.model_validate(config)
        # The GPU default runner (V2) lays out the batch differently; capserve reads V1's layout.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from replicas import _vllm

        version = _vllm.check_version(config.allow_unverified_vllm)
        _vllm.skip_foreign_capture_plugins()
        architecture, hf_config, checkpoint_dtype = checkpoint_facts(config)
        shape = block_shape(architecture, hf_config)  # refuses an undeclared architecture before vLLM starts
        moe = moe_shape(architecture, hf_config)
        config = config.for_checkpoint(shape, checkpoint_dtype, hf_config, moe)
        platform = "cpu" if _vllm.is_cpu_platform() else "cuda"
        quantized = check_quantization(config.quantization, hf_config, platform, config.dtype, moe is not None)
        logger.info(
            "engine %s: %s (%s blocks), dtype %s%s%s, vLLM %s", name, architecture, shape, config.dtype,
            " (the checkpoint's own)" if checkpoint_dtype and config.dtype == checkpoint_dtype else "",
            f", {quantized} quantization" if quantized else "", version,
        )
        owner = Owner.current()
        parent = _spill_parent()
        sweeper = Sweeper(parent or tempfile.gettempdir())
        sweeper.maybe()
        spill_dir = tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=parent)
        owner.write(spill_dir)
        llm = None
        try:
            # vLLM sizing the KV cache by profiling would count a neighbour starting beside it on the
            # GPU as its own memory; a set kv_cache_memory_bytes is not profiled
            profiled = platform == "cuda" and config.kv_cache_memory_bytes is None
            async with gpu_start_turn(name) if profiled else contextlib.nullcontext():
                llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**config.engine_args(spill_dir, shape, asdict(owner), moe)))
            engine = cls(llm, config, _model_info(llm, config, moe), name, shape, moe)
            engine._info.attention = await attention_info(llm)
            outside = sorted(set(config.steer_layers or ()) - set(range(engine._info.n_layers)))
            if outside:
                raise ValueError(f"steer_layers: {outside} outside the model's layers 0..{engine._info.n_layers - 1}")
            engine.spill_dir, engine.sweeper = spill_dir, sweeper
            engine.kv_cache_tokens = _vllm.kv_cache_tokens(llm)
            # map the worker's arena, then delete its name: its memory goes back with the last
            # process that maps it, also when the engine is killed rather than shut down
            engine._arena.attach(arena_path(spill_dir))
            return engine
        except BaseException:
            if llm is not None:
                llm.shutdown()
            shutil.rmtree(spill_dir, ignore_errors=True)
            raise

    async def info(self) -> ModelInfo:
        return self._info

    async def check_health(self) -> None:
        """Raise if the engine core has failed or its process is gone. Answered here, in the
        replica's process: the engine-core thread may be busy for seconds in a large capture."""
        if self.sweeper is not None:
            self.sweeper.maybe()
        await self.llm.check_health()
        gone = [pid for pid in self.engine_pids() if not _running(pid)]
        if gone:
            raise RuntimeError(f"engine core process {gone} is gone")
        if self.capture_failure is not None:
            raise RuntimeError(f"captures fail on this replica: {self.capture_failure}")
        stalled = self.progress.stalled_s()
        if stalled > self.config.stall_timeout_s:
            raise RuntimeError(
                f"no output for {stalled:.0f} s with {self.progress.active} requests running "
                f"(stall_timeout_s={self.config.stall_timeout_s:g})"
            )

    async def stats(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The worker's counters (an RPC that waits for the engine core's next free moment)."""
        stats = await self.llm.collective_rpc("capserve_stats", timeout=timeout_s)
        return stats[0]

    async def decode_periods(self, timeout_s: float = 30.0) -> list[float]:
        """The worker's latest periods from one decode step to the next, in microseconds, oldest first."""
        periods = await self.llm.collective_rpc("capserve_decode_periods", timeout=timeout_s)
        return periods[0]

    async def forward_times(self, timeout_s: float = 30.0) -> dict[str, list[float]]:
        """Decode steps' model-call times in microseconds since the last call, on the host and the
        device (engine option `forward_timing`; empty lists when off)."""
        times = await self.llm.collective_rpc("capserve_forward_times", timeout=timeout_s)
        return times[0]

    @property
    def arena_reads(self) -> dict[str, float]:
        """What results took from the arena: bytes viewed in place, bytes copied out, seconds copying."""
        return dict(self._arena.totals)

    def engine_pids(self) -> list[int]:
        """The engine core process(es) this engine started."""
        from replicas import _vllm

        return _vllm.engine_core_pids(self.llm)

    async def shutdown(self) -> None:
        self.llm.shutdown()
        if self.spill_dir:
            shutil.rmtree(self.spill_dir, ignore_errors=True)

    # ------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest | dict[str, Any], on_output: Callable[[Any], None] | None = None) -> GenerateResult:
        """`on_output` sees each of vLLM's cumulative outputs as it comes (replicas.api.streaming); must not block."""
        request = validated(request)
        if self.capture_failure is not None and (request.capture is not None or request.logits is not None or request.readouts):
            raise ReplicaUnavailableError(f"replica {self.name}: {self.capture_failure}")
        turn = self._tool_turn(request)  # None without tools
        prompt_ids = self.prompt_token_ids(request, turn)
        key = uuid.uuid4().hex
        plan = self._plan(key, request, prompt_ids)
        params = self._sampling_params(request, plan, turn)
        # an edit-only request is taken too: an edit the worker could not install fails it there
        finish = Finish(plan is not None, request.capture, len(prompt_ids), self._arena_blocks(plan, request.n))
        finish.widened = plan is not None and "capture" in plan and plan["capture"]["positions"] != request.capture.positions
        finish.tool_turn = turn
        budget = self._budget()
        await budget.acquire(finish.arena_blocks)
        try:
            if request.interventions:
                async with self._edit_slots.hold(plan["edits"]):
                    return await self._run(key, prompt_ids, params, finish, on_output)
            return await self._run(key, prompt_ids, params, finish, on_output)
        finally:
            if not finish.ran:  # never submitted: its blocks were never used
                budget.release(finish.arena_blocks)

    async def _run(self, key: str, prompt_ids: list[int], params: Any, finish: Finish, on_output: Any = None) -> GenerateResult:
        from vllm.inputs import TokensPrompt

        final, completions, captured = None, {}, []
        finish.ran = True
        self.progress.started()
        try:
            try:
                async for output in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, request_id=key):
                    self.progress.output()
                    if on_output is not None:
                        on_output(output)
                    final = output
                    # with n > 1 a step's output carries only the completions that advanced in it
                    completions.update((c.index, c) for c in output.outputs)
            finally:
                # also on cancellation, so the worker forgets the request's rows
                captured = await self._take(key, finish) if finish.takes else []
            args = (key, final, [completions[i] for i in sorted(completions)], captured, finish)
            in_arena = [raw for raw in (captured[0].get("activations", {}) if captured else {}).values() if "blocks" in raw]
            if not in_arena:
                return self._result(*args)
            # reading a large capture (and computing patterns from it) must not hold up the event loop
            held = self._arena.hold(in_arena[0]["arena"]["path"]) if self._may_view(finish) else None
            result = await asyncio.to_thread(self._result, *args, held=held)
            if held is not None:
                self._free_when_dropped(held, captured, finish)
                finish.held = True  # freed with `held`
            return result
        finally:
            self.progress.finished()
            if not finish.taking and not finish.held:  # a take still under way frees what it gets itself
                self._free(captured, finish)  # read or not, the worker's storage of them goes back

    async def _take(self, key: str, finish: Finish) -> list[dict[str, Any]]:
        """The request's results. The take goes on when the caller is cancelled (again, while it
        waits here): then what it brings is freed once it comes, and nothing is left behind."""
        taken = self._taker.take(key)
        finish.taking = True
        try:
            captured = await asyncio.shield(taken)
        except asyncio.CancelledError:
            taken.add_done_callback(lambda done: self._free(taken_results(done), finish))
            raise
        except BaseException:
            finish.taking = False
            raise
        finish.taking = False
        return captured

    def _worker_array(self, raw: dict[str, Any], held: HeldArena | None = None) -> np.ndarray:
        if "blocks" in raw:
            return self._arena.read(raw, held)
        return arrays.from_file(raw) if "path" in raw else arrays.from_raw(raw)

    def _free(self, captured: list[dict[str, Any]], finish: Finish | None = None) -> None:
        """Give back what the worker stored for these results; the request's arena budget goes
        back once the worker has its blocks (after the take RPC that carries them)."""
        for result in captured:
            blocks, paths = stored_in(result)
            self._taker.release(blocks)
            delete_files(paths)
        if finish is not None and finish.arena_blocks:
            blocks, finish.arena_blocks = finish.arena_blocks, 0
            budget = self._budget()
            self._taker.after_release(lambda: budget.release(blocks))

    def _may_view(self, finish: Finish) -> bool:
        """Whether a result's rows may view the arena (`view_share`)."""
        return self._viewed_blocks + finish.arena_blocks <= self.view_share * self._budget().capacity

    def _free_when_dropped(self, held: HeldArena, captured: list[dict[str, Any]], finish: Finish) -> None:
        """Free what the worker stored for these results once no array views `held` any more."""
        loop = asyncio.get_running_loop()
        viewed = finish.arena_blocks
        self._viewed_blocks += viewed

        def freed() -> None:
            self._viewed_blocks -= viewed
            self._free(captured, finish)

        def free() -> None:  # on whichever thread drops the last view
            with contextlib.suppress(RuntimeError):  # the loop is closed: the engine and its arena are gone
                loop.call_soon_threadsafe(freed)

        weakref.finalize(held, free)

    def _budget(self) -> ArenaBudget:
        if self._arena_budget is None:
            self._arena_budget = ArenaBudget(*self._arena_geometry())
        return self._arena_budget

    @property
    def arena_budget(self) -> ArenaBudget:
        """Admission to the worker's arena: what requests hold and wait for (`replicas.shards.sink`
        watches it to give back what shard jobs hold)."""
        return self._budget()

    def _arena_geometry(self) -> tuple[int, int, int]:
        """(blocks, block bytes, limit in bytes) of the worker's arena; no blocks without one."""
        if self.spill_dir is None:
            return 0, 0, 0
        layout = ArenaLayout.for_model(self.spill_dir, self._info.d_model)
        limit = arena_limit_bytes(self.spill_dir, self.config.arena_max_bytes)
        chunk_blocks, chunks = arena_geometry(limit, layout.block_bytes)
        return chunk_blocks * chunks, layout.block_bytes, limit

    def _arena_blocks(self, plan: dict[str, Any] | None, n: int) -> int:
        """Arena blocks the request's capture may take at most, for all its n completions;
        refused when the whole arena could not hold them."""
        capture = (plan or {}).get("capture")
        if capture is None or self.spill_dir is None:
            return 0
        capacity, block_bytes, limit = self._budget().geometry
        row_bytes = capture.get("width", self._info.d_model) * arrays.DTYPES[capture["dtype"]].itemsize
        per_completion = arena_blocks(len(capture["sites"]), capture["max_rows"], row_bytes, capture["reduce"], block_bytes)
        blocks = n * per_completion
        if blocks > capacity:
            raise InvalidRequestError(
                f"capture: {len(capture['sites'])} hooks x {capture['max_rows']} positions{f' x n={n} completions' if n > 1 else ''} "
                f"need up to {blocks} blocks of {block_bytes} bytes in the replica's shared-memory arena, which "
                f"holds {capacity} (arena_max_bytes={limit}); capture fewer hooks or positions, lower n, or raise "
                f"the engine option arena_max_bytes"
            )
        return blocks

    def _tool_turn(self, request: GenerateRequest) -> ToolTurn | None:
        """The request's tools (rendering, constraint, parsing), or None without tools."""
        if request.tools and "_tool_calling" not in self.__dict__:  # vLLM's parser class, built once
            self._tool_calling = ToolCalling.for_engine(self.config, self.tokenizer, self.llm.model_config)
        return self._tool_calling.turn(request) if request.tools else None

    def prompt_token_ids(self, request: GenerateRequest, turn: ToolTurn | None = None) -> list[int]:
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
            messages, tools = template_inputs(request, turn or self._tool_turn(request))
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
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
            plan = build_wire_plan(
                key,
                # add by SAE feature -> add of its decoder row; `when` by probe or feature -> its inline read-out
                resolve_conditions(self.saes.resolve_features(request), self.readouts, self.saes),
                prompt_len=len(prompt_ids),
                n_layers=self._info.n_layers,
                d_model=self._info.d_model,
                armed_kinds=set(self.config.armed_kinds),
                steer_kinds=set(self.config.steerable_kinds()),
                steer_layers=None if self.config.steer_layers is None else set(self.config.steer_layers),
                edit_stages=self.config.edit_stages,
                max_capture_bytes=self.config.max_capture_bytes,
                absent_kinds=absent_kinds(self.shape, self.moe),
                d_vocab=self._info.d_vocab,
                max_set_edits=self.config.max_set_edits,
                head_shapes=head_shapes(self._info.attention),
                saes=self.saes,
                moe=self._info.moe,
                same_kinds=same_kinds(self.shape),
                readouts=self.readouts,
            )
            if plan is not None:
                self._edit_slots.check(plan["edits"])
            return plan
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None

    def _sampling_params(self, request: GenerateRequest, plan: dict[str, Any] | None, turn: ToolTurn | None = None) -> Any:
        from vllm import SamplingParams

        turn = turn or self._tool_turn(request)
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
            **(turn.sampling_options() if turn is not None else {}),  # structured outputs for a forced call
        )

    def _result(
        self, key: str, final: Any, completions: list[Any], captured: list[dict[str, Any]], finish: Finish,
        held: HeldArena | None = None,
    ) -> GenerateResult:
        result = generation_result(key, final, completions, finish.tool_turn, self.name)
        if not captured:
            return result
        taken = captured[0]
        if taken["error"] and taken.get("replica_fault"):  # the replica's fault: retry elsewhere
            if taken["replica_fault"] == OUTBOX_DEAD:
                self.capture_failure = taken["error"]
            raise ReplicaUnavailableError(f"replica {self.name}: {taken['error']}")
        if taken["error"]:
            raise CaptureFailedError(taken["error"])
        add_captured(result, taken, finish, self._info, lambda raw: self._worker_array(raw, held), self._token_texts())
        return result

    def _token_texts(self) -> Callable[[list[int]], list[str]] | None:
        """Token ids -> their texts (read-outs' `tokens`), as the OpenAI routes show logprobs; None without a tokenizer."""
        from replicas import _vllm

        return None if self.tokenizer is None else partial(_vllm.token_texts, self.tokenizer)


def _spill_parent() -> str | None:
    """/dev/shm, unless it is missing or small (a container's default is 64 MiB): then the
    temporary folder (None), whose page cache serves the worker's large results more slowly."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").total >= MIN_SHARED_MEMORY_BYTES:
        return "/dev/shm"
    return None


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _model_info(llm: Any, config: EngineConfig, moe: MoeShape | None = None) -> ModelInfo:
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
        hook_names=served_hook_names(n_layers, config.armed_kinds, moe.layers if moe is not None else ()),
        armed_kinds=list(config.armed_kinds),
        moe=MoeInfo(n_experts=moe.n_experts, top_k=moe.top_k, layers=list(moe.layers)) if moe is not None else None,
    )

