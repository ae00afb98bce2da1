"""What an engine refuses or decides before vLLM starts: architectures, locked settings, the vLLM
release, the dtype. No engine runs here; refusals must come before one would."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from replicas import _vllm
from replicas.engine.architectures import ARCHITECTURES, UnsupportedArchitectureError, block_shape, layer_kinds
from replicas.engine import CaptureEngine, EngineConfig
from replicas.engine.config import checkpoint_facts


def test_an_undeclared_architecture_is_refused_at_start_with_the_supported_list(tmp_path: Path):
    """A real checkpoint vLLM would load (BLOOM), whose block shape capserve has not declared."""
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=64, n_layer=2, n_head=1)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError) as refused:
        asyncio.run(CaptureEngine.start(EngineConfig(model=str(tmp_path))))
    message = str(refused.value)
    assert "'BloomForCausalLM' is not supported" in message
    assert all(name in message for name in ARCHITECTURES)


def test_block_shapes_and_their_kinds():
    assert block_shape("Gemma2ForCausalLM") == "sandwich"
    assert block_shape("GPTNeoXForCausalLM", type("C", (), {"use_parallel_residual": True})()) == "parallel"
    assert block_shape("GPTNeoXForCausalLM", type("C", (), {"use_parallel_residual": False})()) == "pre_norm"
    assert "resid_mid" not in layer_kinds("parallel")
    assert layer_kinds("sandwich") == layer_kinds("pre_norm") and len(layer_kinds("pre_norm")) == 5


def test_mixture_of_experts_shapes_come_from_the_config_and_refused_families_say_why():
    from transformers import MixtralConfig, Qwen3MoeConfig

    from replicas.engine.architectures import MoeShape, moe_shape

    qwen = Qwen3MoeConfig(num_hidden_layers=6, num_experts=16, num_experts_per_tok=4, mlp_only_layers=[0], decoder_sparse_step=2)
    assert moe_shape("Qwen3MoeForCausalLM", qwen) == MoeShape(n_experts=16, top_k=4, layers=(1, 3, 5))
    assert moe_shape("MixtralForCausalLM", MixtralConfig(num_hidden_layers=3)) == MoeShape(8, 2, (0, 1, 2))
    assert moe_shape("LlamaForCausalLM", qwen) is None
    assert layer_kinds("pre_norm", moe_shape("MixtralForCausalLM", MixtralConfig()))[-2:] == ("router_logits", "expert_ids")
    with pytest.raises(UnsupportedArchitectureError, match="'DeepseekV2ForCausalLM' is not supported: its multi-head latent"):
        block_shape("DeepseekV2ForCausalLM")
    with pytest.raises(UnsupportedArchitectureError, match="'Qwen2MoeForCausalLM' is not supported: vLLM's MoE runner fuses"):
        block_shape("Qwen2MoeForCausalLM")
    with pytest.raises(ValueError, match="steer_kinds: 'expert_ids' is the router's choice"):
        EngineConfig(model="m", steer_kinds=["expert_ids"]).steerable_kinds()
    assert "expert_ids" not in EngineConfig(model="m", armed_kinds=["router_logits", "expert_ids"]).steerable_kinds()


def test_the_default_kinds_follow_the_shape_and_a_missing_one_asked_by_name_is_refused():
    config = EngineConfig(model="m")
    assert "resid_mid" not in config.for_checkpoint("parallel", None).armed_kinds
    assert config.for_checkpoint("sandwich", None).armed_kinds == list(layer_kinds("sandwich"))
    with pytest.raises(ValueError, match="armed_kinds: 'resid_mid' does not exist in this model: .*parallel"):
        EngineConfig(model="m", armed_kinds=["resid_mid", "resid_post"]).for_checkpoint("parallel", None)
    with pytest.raises(ValueError, match="steer_kinds: 'resid_mid'"):
        EngineConfig(model="m", steer_kinds=["resid_mid"]).for_checkpoint("parallel", None)


@pytest.mark.parametrize("key, value", [("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
                                        ("kv_transfer_config", {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
                                        ("enable_prefix_caching", True)])
def test_settings_that_add_or_skip_rows_are_locked(key, value):
    from deploy.config import AppArgs

    with pytest.raises(ValueError, match=f"engine_kwargs.{key} cannot be set: .*speculative decoding or KV transfer"):
        EngineConfig(model="m", engine_kwargs={key: value}).engine_args()
    with pytest.raises(ValueError, match=f"engine.{key} cannot be set"):
        AppArgs.model_validate({"engine": {key: value}})


def test_dtype_auto_runs_the_checkpoint_in_its_own_dtype(tmp_path: Path):
    """vLLM's own auto would run a float32 checkpoint (GPT-2, Pythia) in bfloat16."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=64, n_layer=1, n_head=1)).save_pretrained(tmp_path)
    architecture, _, dtype = checkpoint_facts(EngineConfig(model=str(tmp_path)))
    assert (architecture, dtype) == ("GPT2LMHeadModel", "float32")
    assert EngineConfig(model="m").for_checkpoint("pre_norm", "float32").dtype == "float32"
    assert EngineConfig(model="m", dtype="bfloat16").for_checkpoint("pre_norm", "float32").dtype == "bfloat16"
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_facts(EngineConfig(model=str(tmp_path)))[2] is None  # none stored: vLLM decides


def test_an_unverified_vllm_release_is_refused_unless_allowed(monkeypatch: pytest.MonkeyPatch):
    import vllm

    assert _vllm.check_version(False) == vllm.__version__  # the installed one is verified
    monkeypatch.setattr(vllm, "__version__", "0.99.1")
    with pytest.raises(RuntimeError, match=r"vLLM 0.99.1 .* not a release .* allow_unverified_vllm: true"):
        _vllm.check_version(False)
    assert _vllm.check_version(True) == "0.99.1"


def test_the_arena_graphs_switch_reaches_the_worker():
    """`arena_graphs: false` (small decode steps' rows by the side stream, not a graph replay)
    travels to the worker's options; on by default."""
    options = EngineConfig(model="m").engine_args()["additional_config"]["capserve"]
    assert options["arena_graphs"] is True
    options = EngineConfig(model="m", arena_graphs=False).engine_args()["additional_config"]["capserve"]
    assert options["arena_graphs"] is False


def test_the_attention_in_place_switch_reaches_the_sites_options():
    """`attention_in_place: false` (hook_z copied after vLLM's attention op, not written there by
    it) travels to the worker's options and into its sites' options; on by default."""
    from replicas.worker.blocks import SiteOptions

    for fields, expected in (({}, True), ({"attention_in_place": False}, False)):
        options = EngineConfig(model="m", **fields).engine_args()["additional_config"]["capserve"]
        assert options["attention_in_place"] is expected
        assert SiteOptions.from_options(options).attention_in_place is expected

def test_forward_timing_is_off_unless_asked_and_times_only_the_calls_it_began():
    from replicas.worker.diagnostics.forward_timing import ForwardTimes

    assert EngineConfig(model="m").engine_args()["additional_config"]["capserve"]["forward_timing"] is False
    assert EngineConfig(model="m", forward_timing=True).engine_args()["additional_config"]["capserve"]["forward_timing"] is True
    times = ForwardTimes(on_gpu=False)
    times.end()  # a step that began no timing (not a decode step)
    for seconds in (0.002, 0.004):
        times.begin()
        time.sleep(seconds)
        times.end()
    drained = times.drain()
    assert drained["device"] == [] and len(drained["host"]) == 2
    assert drained["host"][0] >= 2000 and drained["host"][1] >= 4000
    assert times.drain() == {"host": [], "device": []}


def test_context_switches_come_while_rows_are_written_at_most_every_interval_and_once_after_the_last():
    """`switch_context_every_s` reaches the worker (0.05 s by default, None for off, positive when set); the worker
    switches after a step that wrote rows once the interval passed, and after the first step
    without rows that follows them; a driver error stops the switches, not the step loop; on the CPU
    there is nothing to switch."""
    import torch

    from replicas.worker.context_switch import ContextSwitches, context_switches

    def every_s(**fields: Any) -> float | None:
        return EngineConfig(model="m", **fields).engine_args()["additional_config"]["capserve"]["switch_context_every_s"]

    assert every_s() == 0.05 and every_s(switch_context_every_s=0.02) == 0.02
    assert every_s(switch_context_every_s=None) is None
    with pytest.raises(ValidationError, match="switch_context_every_s"):
        EngineConfig(model="m", switch_context_every_s=0)
    assert context_switches(0.05, torch.device("cpu")) is None

    now, launched = [0.0], []
    switches = ContextSwitches(lambda: launched.append(now[0]), every_s=0.05, clock=lambda: now[0])
    for at, wrote_rows in [(0.00, False), (0.01, True), (0.02, True), (0.07, True), (0.08, True), (0.09, False),
                           (0.10, False), (0.30, False), (0.31, True), (0.32, False)]:
        now[0] = at
        switches.after_step(wrote_rows)
    assert launched == [0.01, 0.07, 0.09, 0.31, 0.32] and switches.count == 5

    def refused() -> None:
        raise RuntimeError("cuLaunchKernel failed with CUDA driver error 700")

    broken = ContextSwitches(refused, every_s=0.05, clock=lambda: now[0])
    for wrote_rows in (True, False, True):  # the step loop goes on; after the first refusal nothing is tried
        broken.after_step(wrote_rows)
    assert broken.count == 0 and "error 700" in broken.failed


class FakeDriver:
    """libcuda's calls `SecondContext.open` makes, recorded; `refuse` names one that fails."""

    def __init__(self, refuse: str = ""):
        self.calls: list[tuple[str, tuple]] = []
        self.refuse = refuse

    def __getattr__(self, name: str):
        def call(*args: Any) -> int:
            self.calls.append((name, args))
            return 1 if name == self.refuse else 0

        return call


def test_the_second_context_sets_its_memory_limits_to_zero_and_is_destroyed_when_the_driver_refuses(monkeypatch):
    """Its stack, printf FIFO and malloc heap limits go to zero before the kernel loads (half its
    device memory on an H200); a refused call destroys the context (which also makes torch's
    current again) and raises, so the worker runs without switches; so does a driver that lacks a call."""
    import ctypes

    from replicas.worker import context_switch

    driver = FakeDriver()
    monkeypatch.setattr(context_switch.ctypes, "CDLL", lambda name: driver)
    context_switch.SecondContext.open(0)
    names = [name for name, _ in driver.calls]
    assert names == ["cuDeviceGet", "cuCtxCreate_v2", "cuCtxSetLimit", "cuCtxSetLimit", "cuCtxSetLimit",
                     "cuModuleLoadData", "cuModuleGetFunction", "cuCtxPopCurrent_v2"]
    limits = [(args[0], args[1].value) for name, args in driver.calls if name == "cuCtxSetLimit"]
    assert limits == [(0, 0), (1, 0), (2, 0)]  # CU_LIMIT_STACK_SIZE, _PRINTF_FIFO_SIZE, _MALLOC_HEAP_SIZE

    driver = FakeDriver(refuse="cuModuleLoadData")
    monkeypatch.setattr(context_switch.ctypes, "CDLL", lambda name: driver)
    with pytest.raises(RuntimeError, match="cuModuleLoadData failed"):
        context_switch.SecondContext.open(0)
    names = [name for name, _ in driver.calls]
    assert names[-2:] == ["cuModuleLoadData", "cuCtxDestroy_v2"] and "cuCtxPopCurrent_v2" not in names
    assert isinstance(driver.calls[-1][1][0], ctypes.c_void_p)

    class OldDriver(FakeDriver):  # lacks cuCtxSetLimit: AttributeError, and the context must not stay current
        def __getattr__(self, name: str):
            if name == "cuCtxSetLimit":
                raise AttributeError(name)
            return super().__getattr__(name)

    driver = OldDriver()
    monkeypatch.setattr(context_switch.ctypes, "CDLL", lambda name: driver)
    with pytest.raises(AttributeError):
        context_switch.SecondContext.open(0)
    assert [name for name, _ in driver.calls][-1] == "cuCtxDestroy_v2"


def test_the_compile_cache_key_leaves_out_what_changes_every_start():
    """vLLM hashes additional_config into its compile-cache key: two starts of the same settings
    (another arena folder, another owning process) share it, other settings do not."""
    first = EngineConfig(model="m").engine_args("/dev/shm/capserve-a", owner={"pid": 1, "start_ticks": 10})
    again = EngineConfig(model="m").engine_args("/dev/shm/capserve-b", owner={"pid": 2, "start_ticks": 20})
    other = EngineConfig(model="m", armed_kinds=["resid_post"]).engine_args("/dev/shm/capserve-a")
    key = first["additional_config"].compute_hash()
    assert key == again["additional_config"].compute_hash() != other["additional_config"].compute_hash()
    assert first["additional_config"].get("capserve")["spill_dir"] == "/dev/shm/capserve-a"
    cached = EngineConfig(model="m", compile_cache_dir="/cache/vllm", engine_kwargs={"compilation_config": {"mode": 3}})
    assert cached.engine_args()["compilation_config"] == {"mode": 3, "cache_dir": "/cache/vllm"}
