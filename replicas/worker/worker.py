"""The vLLM worker side: hook sites installed before compilation, per-request bookkeeping per step.

`CaptureWorker` is vLLM's own worker class for the platform with one change: right after the
weights load (and before vLLM compiles the model and captures CUDA graphs) it installs the hook
sites. A worker *extension* cannot do this — vLLM only mixes it in as a base class after the
worker's own methods, so it never sees `load_model` — hence `worker_cls`. All methods and
attributes capserve adds carry the `capserve_` prefix; `collective_rpc("capserve_take", ...)` etc.

Per step (`_CaptureState.before_step` / `after_step`, run around the runner's model call):
before — read the step's request layout and point the rows each request edits at its slots in the
static buffers; after — gather the rows each request asked for from the staging buffers on the
device, reduce them there, and start their copy to host memory. Requests that capture and edit
nothing cost one set lookup per step.

`_CaptureState` only orchestrates the parts: `replicas.worker.blocks` installs the sites,
`replicas.worker.request_table` keeps what each request asked for, `replicas.worker.edit_table` its edit slots,
and `replicas.worker.collector` gathers the rows and hands them to `replicas.worker.outbox`. The parts never call
back into the worker nor into each other, so each can be read alone; a part that needs a
neighbour's data gets it as an argument.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from typing import Any

import torch

from replicas import _vllm
from replicas.worker.blocks import SiteOptions, install_sites
from replicas.worker.collector import MAX_STEP_BYTES, Collector
from replicas.worker.context_switch import context_switches
from replicas.worker.edit_table import EditTable
from replicas.worker.diagnostics.forward_timing import ForwardTimes
from replicas.arena.lifeline import Owner, watch_owner
from replicas.worker.outbox import TIMEOUT_S as OUTBOX_TIMEOUT_S
from replicas.worker.outbox import DEAD, Outbox, RequestBuffers
from replicas.plans.request import PLAN_KEY
from replicas.worker.request_table import UNPLANNED, Batch, Entry, RequestTable
from replicas.readouts.device import DeviceReadouts, Unembed
from replicas.sae.device import load_saes
from replicas.worker.diagnostics.step_profile import StepProfiler

RECENT_PERIODS = 4096  # decode periods kept for their spread (`capserve_decode_periods`)


class _CaptureState:
    """One worker's capture: the sites on its model and the step loop around its forward."""

    def __init__(self, runner: Any, options: dict[str, Any]):
        self.runner = runner
        self.layout = _vllm.model_layout(runner, options["block_shape"], options.get("moe"))
        self.device = _vllm.runner_device(runner)
        self.eager = bool(options.get("eager", False))
        site_options = SiteOptions.from_options(options)
        model_dtype = next(runner.get_model().parameters()).dtype
        self.sites = install_sites(
            self.layout, site_options, max_tokens=_vllm.max_num_tokens(runner), dtype=model_dtype, device=self.device
        )
        self.outbox = Outbox(
            options.get("spill_dir"), self.layout.d_model, arena_max_bytes=options.get("arena_max_bytes"),
            arena_reserve_bytes=int(options.get("arena_reserve_bytes") or 0),
            timeout_s=float(options.get("outbox_timeout_s", OUTBOX_TIMEOUT_S)), device=self.device,
        )
        self.table = RequestTable()
        self.edits = EditTable(self.sites, site_options.edit_slots, self.device, site_options.max_set_edits)
        self.collector = Collector(
            runner, self.sites, self.layout.vocab_size, self.device, self.outbox,
            max_step_bytes=int(options.get("max_step_temp_bytes", MAX_STEP_BYTES)),
            arena_graphs=bool(options.get("arena_graphs", True)),
            saes=load_saes(options.get("saes"), self.device),  # SAE weights on the device (replicas.sae.device)
            readouts=DeviceReadouts.load(options, self._unembed(), self.device, model_dtype),  # lenses, probes
        )
        # results of the latest take RPC, kept until the next one says whether the replica got them
        self.delivered: dict[int, dict[str, list[dict[str, Any]]]] = {}
        self.device_bytes = 0  # what the above allocated on the GPU (set by the worker, which measures it)
        self._batch: Batch | None = None
        self.steps = 0
        self.tokens = 0  # scheduled over all steps: against steps, how full they ran
        self.last_step_at = 0.0  # wall clock: what a caller waited for after the engine's last step
        self.seconds = {"prepare": 0.0, "collect": 0.0, "take": 0.0, "decode_period": 0.0}
        self.decode_periods = 0  # decode steps timed from the decode step before them
        self.recent_periods: deque[float] = deque(maxlen=RECENT_PERIODS)
        self._decode_began: float | None = None
        self.profiler = StepProfiler.maybe(options, on_gpu=self.device.type == "cuda")
        self.forward_times = ForwardTimes(on_gpu=self.device.type == "cuda") if options.get("forward_timing") else None
        self.switches = context_switches(options.get("switch_context_every_s"), self.device)
        _vllm.wrap_model_forward(runner, self.before_step, self.after_step)

    def _unembed(self) -> Unembed:
        """The model's head for the lenses (replicas.readouts.device)."""
        layout, runner, vocab = self.layout, self.runner, self.layout.vocab_size
        return Unembed(norm=lambda x: _vllm.final_norm(layout, x), logits=lambda x: _vllm.compute_logits(runner, x, vocab))

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            with self.profiler.phase(phase) if self.profiler is not None else nullcontext():
                yield
        finally:
            self.seconds[phase] += time.perf_counter() - began

    def before_step(self) -> None:
        began = time.perf_counter()
        if self.profiler is not None:
            self.profiler.at_step(self.steps)
        with self._timed("prepare"):
            self._prepare(began)
        if self.forward_times is not None and self._decode_began is not None:  # a decode step
            self.forward_times.begin()

    def after_step(self) -> None:
        if self.forward_times is not None:
            self.forward_times.end()
        rows_before = self.collector.rows_captured
        with self._timed("collect"):
            if self._batch is not None and self.table.requests:
                self.collector.collect(self._batch, self.table)
        if self.switches is not None:
            self.switches.after_step(self.collector.rows_captured != rows_before)

    def _prepare(self, began: float) -> None:
        """Admit the step's new requests and point the rows each request edits at its slots."""
        step = _vllm.step_layout(self.runner)
        self.steps += 1
        self.tokens += step.num_tokens
        self.last_step_at = time.time()
        self._time_decode(step, began)
        self._release_finished()
        batch = self._batch = self.table.batch(step, self._batch, self._admit)
        edited = self.edits.prepare(batch, self.table)
        if self.eager:  # compiled graphs never read these flags; eager mode skips idle sites
            captured = self.collector.captured_sites(batch, self.table)
            for site in self.sites.values():
                site.run_capture = site in captured
                site.run_edits = site in edited

    def _time_decode(self, step: _vllm.StepLayout, began: float) -> None:
        """The engine's period from one decode step to the next: whether a cost lies in the engine
        process (the period grows) or only in the caller's handling of the outputs (it does not)."""
        decode = step.one_token_each
        if decode and self._decode_began is not None:
            self.seconds["decode_period"] += began - self._decode_began
            self.decode_periods += 1
            self.recent_periods.append(began - self._decode_began)
        self._decode_began = began if decode else None

    # ------------------------------------------------------------ request lifecycle

    def _admit(self, req_id: str) -> int:
        """The new request's handle. One whose edits find no free slot runs on unsteered and its
        result is the error: a full table fails that request, not the step."""
        plan = self.table.plan(req_id, _vllm.request_extra_args(self.runner, req_id).get(PLAN_KEY))
        if plan is None:
            return UNPLANNED
        returns_data = plan.capture is not None or plan.logits_positions is not None or bool(plan.sae) or bool(plan.readouts)
        buffers = RequestBuffers.for_plan(plan, self.layout.d_model, self.layout.vocab_size, self.outbox.arena_layout,
                                          self.outbox.probes) if returns_data else None
        group = -1 if plan.capture is None else self.collector.group(plan.capture)
        entry = self.table.admit(req_id, plan, buffers, group)
        if returns_data and self.outbox.failure is not None:  # nothing it captures could be delivered
            self._fail(entry, self.outbox.failure, DEAD)
            return entry.handle
        try:
            self.edits.assign(entry, self.table.columns)
        except Exception as exc:
            self._fail(entry, f"interventions could not be installed: {exc}")
        return entry.handle

    def _fail(self, entry: Entry, error: str, replica_fault: str = "") -> None:
        """The request runs on unsteered, capturing nothing; its result is the error."""
        self.edits.free_slots_of(entry)
        self.collector.release_group(entry.group)
        self.table.fail(entry, error, replica_fault)

    def _retire(self, req_id: str, entry: Entry) -> None:
        """The request will run no more steps: free its slots and handle, queue its result."""
        if not self.table.retire(req_id, entry):
            return
        self.edits.free_slots_of(entry)
        self.collector.release_group(entry.group)
        entry.group = -1
        if entry.buffers is not None and entry.error is None:
            self.outbox.finish(entry.name, entry.buffers)

    def _release_finished(self) -> None:
        """Retire the requests vLLM has finished; forget those that return nothing (the others
        wait for `take`)."""
        for req_id in _vllm.requests_gone(self.runner, self.table.running()):
            entry = self.table.finished(req_id)
            if entry is None:  # unplanned
                continue
            self._retire(req_id, entry)
            if entry.buffers is None and entry.error is None:
                self.table.forget(req_id)

    def take_many(
        self, keys: list[str], released: list[int], call: int | None, abandoned: list[int]
    ) -> dict[str, list[dict[str, Any]]]:
        """One take RPC. The replica numbers its calls; `abandoned` are earlier calls whose answer
        it never got (timed out): what they delivered goes back here. Every other earlier call
        was answered, so only this call's results are kept until the next."""
        self.outbox.release(released)
        for old in abandoned:
            for results in self.delivered.pop(old, {}).values():
                for result in results:
                    self.outbox.discard(result)
        self.delivered.clear()
        taken: dict[str, list[dict[str, Any]]] = {}
        if call is not None:
            self.delivered[call] = taken  # filled as it goes: a call that fails half way is freed too
        deadline = time.monotonic() + self.outbox.timeout_s  # one wait for the whole call
        with self._timed("take"):
            # Every result is queued to the outbox before the first wait: requests that finish
            # together (a batch's last step) are written one after another on its thread, not
            # with a round trip between threads each (32 requests' tail after vLLM: 7.0 -> 5.4 ms, H200).
            closed = {key: self._close(key) for key in keys}
            for key, entries in closed.items():
                taken[key] = self._first_result(entries, deadline)
        return taken

    def _close(self, key: str) -> list[tuple[str, Entry]]:
        """Every completion of the request with this key, retired (its result queued) and forgotten."""
        entries = self.table.close(key)
        for req_id, entry in entries:
            self._retire(req_id, entry)
        return entries

    def _first_result(self, entries: list[tuple[str, Entry]], deadline: float) -> list[dict[str, Any]]:
        """What the request captured: from its first completion when n > 1, as GenerateRequest.n
        documents; the siblings' results are freed."""
        results = [_result(entry, deadline) for _, entry in entries]
        for sibling in results[1:]:
            self.outbox.discard(sibling)
        return results[:1]

    def attention(self) -> list[dict[str, Any]]:
        return [asdict(_vllm.attention_geometry(op)) for op in self.layout.attention]

    def stats(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "last_step_at": self.last_step_at,
            "rows_captured": self.collector.rows_captured,
            "steady_decode_steps": self.collector.steady_steps,
            "decode_periods": self.decode_periods,
            "context_switches": self.switches.count if self.switches is not None else 0,
            "requests_held": len(self.table.requests),
            "capture_groups": self.collector.live_groups,
            "bytes_held": self.table.bytes_held(),
            "device_bytes": self.device_bytes,  # sites, edit tables, SAEs and probes on the GPU (0 on the CPU)
            # worker time outside the forward, for profiling; "outbox" runs on its own thread
            "seconds": dict(self.seconds, outbox=self.outbox.busy_seconds, backlog_wait=self.outbox.wait_seconds),
            **self.outbox.stats(),
            "time": time.time(),
        }


def _result(entry: Entry, deadline: float) -> dict[str, Any]:
    if entry.error is not None:
        return {"error": entry.error, "replica_fault": entry.replica_fault}
    if entry.buffers is None:  # it only edited, and its edits were installed
        return {"error": None, "positions": [], "activations": {}, "logits": None, "logits_positions": []}
    return entry.buffers.wait(deadline - time.monotonic())


def device_allocated(device: torch.device) -> int:
    """Bytes torch holds on a GPU (0 on the CPU, whose KV cache has a set size)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class _CaptureWorkerMixin:
    """Methods capserve adds to vLLM's worker (all `capserve_`-prefixed)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        options = _vllm.capserve_options(self.vllm_config)  # type: ignore[attr-defined]
        if options.get("owner"):  # from here on, the engine dies with its replica
            watch_owner(Owner(**options["owner"]), options.get("spill_dir"))
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        self.capserve_install()

    def capserve_install(self) -> None:
        options = _vllm.capserve_options(self.vllm_config)  # type: ignore[attr-defined]
        runner = _vllm.worker_runner(self)
        device = _vllm.runner_device(runner)
        before = device_allocated(device)
        self.capserve_state = _CaptureState(runner, options)
        installed = self.capserve_state.device_bytes = device_allocated(device) - before
        if installed > 0:  # in vLLM's budget for the KV cache, as the weights are
            _vllm.count_with_weights(runner, installed)

    def capserve_take(
        self, keys: list[str], released: list[int] | None = None, call: int | None = None, abandoned: list[int] | None = None
    ) -> dict[str, list[dict[str, Any]]]:
        """The results of these keys; `released`: arena blocks the replica has read; `call` numbers
        this RPC and `abandoned` lists earlier ones whose answer the replica never got."""
        return self.capserve_state.take_many(keys, released or [], call, abandoned or [])

    def capserve_stats(self) -> dict[str, Any]:
        return self.capserve_state.stats()

    def capserve_decode_periods(self) -> list[float]:
        """The latest decode periods (`RECENT_PERIODS` at most), oldest first, in microseconds."""
        return [round(seconds * 1e6, 1) for seconds in self.capserve_state.recent_periods]

    def capserve_forward_times(self) -> dict[str, list[float]]:
        """Decode steps' model-call times since the last call (`replicas.worker.diagnostics.forward_timing`); empty when off."""
        times = self.capserve_state.forward_times
        return times.drain() if times is not None else {"host": [], "device": []}

    def capserve_attention(self) -> list[dict[str, Any]]:
        """Each layer's attention geometry (`_vllm.AttentionGeometry`), for patterns on the replica."""
        return self.capserve_state.attention()


def __getattr__(name: str) -> type:
    """`replicas.worker.CaptureWorker` is built on first use from the platform's vLLM worker."""
    if name != "CaptureWorker":
        raise AttributeError(name)
    worker = type("CaptureWorker", (_CaptureWorkerMixin, _vllm.worker_base_class()), {"__module__": __name__})
    setattr(sys.modules[__name__], name, worker)
    return worker
