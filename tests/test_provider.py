"""The provider and client pieces with a fake app handle: no Ray cluster, no engine.

The real-cluster acceptance tests are in test_provider_serve.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import provider._registry  # noqa: F401  (registers capserve/ even where the package is not pip-installed)
from provider import CaptureClient, activation_info, read_activations, read_logits
from provider.activations import (
    decode_activations,
    read_tensors,
    result_metadata,
    write_tensors,
)
from provider.client import capture_request
from replicas.api import Choice, GenerateRequest, GenerateResult, ModelInfo
from replicas.api.errors import (
    BackPressureError,
    CaptureFailedError,
    InvalidRequestError,
    ReplicaUnavailableError,
)

D_MODEL = 8


# ---------------------------------------------------------------- a fake Router handle


class FakeResponse:
    def __init__(self, coro: Any) -> None:
        self._coro = coro
        self.cancelled = False

    def __await__(self) -> Any:
        return self._coro.__await__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeMethod:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> FakeResponse:
        return FakeResponse(self.fn(*args, **kwargs))


def rows_for(prompt: Any, n: int) -> np.ndarray:
    seed = int(hashlib.sha256(repr(prompt).encode()).hexdigest()[:8], 16)
    return np.random.default_rng(seed).standard_normal((n, D_MODEL)).astype(np.float32)


class FakeApp:
    """Answers like the Router: prompt rows from a hash of the prompt, `n_positions` of them."""

    def __init__(self, n_positions: int = 2, failures: list[BaseException] | None = None, delay: float = 0.0) -> None:
        self.n_positions = n_positions
        self.failures = list(failures or [])
        self.delay = delay
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.generate = FakeMethod(self._generate)
        self.capture = FakeMethod(self._generate)
        self.info = FakeMethod(self._info)

    async def _info(self) -> ModelInfo:
        return ModelInfo(
            model="/models/fake", architecture="LlamaForCausalLM", n_layers=2, d_model=D_MODEL, d_vocab=16,
            max_model_len=64, dtype="float32", hook_names=[], armed_kinds=[],
        )

    async def _generate(self, request: Any, by_reference: bool = False) -> GenerateResult:
        request = request.model_dump() if isinstance(request, GenerateRequest) else request
        GenerateRequest.model_validate(request)
        self.requests.append(request)
        request_id = f"req-{len(self.requests)}"
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.failures:
                raise self.failures.pop(0)
        finally:
            self.in_flight -= 1
        capture = request.get("capture") or {}
        dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[capture.get("dtype", "float32")]
        acts = {h: rows_for((request["prompt"], h), self.n_positions).astype(dtype) for h in capture.get("hooks", [])}
        n_tokens = request.get("max_tokens", 16)
        choices = [
            Choice(text=f"answer {i}", token_ids=list(range(3, 3 + n_tokens)), finish_reason="length" if i else "stop",
                   logprobs=[{t: -0.5, 7: -1.0, 8: -2.0} for t in range(3, 3 + n_tokens)] if request.get("logprobs") is not None else None)
            for i in range(request.get("n", 1))
        ]
        logits = np.ones((1, 16), np.float32) if request.get("logits") else None
        return GenerateResult(
            request_id=request_id, text=choices[0].text, token_ids=choices[0].token_ids,
            prompt_token_ids=[1, 2, 3, 4], finish_reason=choices[0].finish_reason, choices=choices,
            activations=acts, positions=list(range(self.n_positions)) if acts else [],
            capture_token_ids=[1, 2][: self.n_positions] if acts else [], logits=logits,
            logits_positions=[3] if logits is not None else [], logprobs=choices[0].logprobs, replica="fake-0",
            prompt_logprobs=[None, {2: -0.25}, {3: -0.5, 9: -0.1}, {4: -1.0}] if request.get("prompt_logprobs") is not None else None,
        )


def result_with(activations: dict[str, np.ndarray], logits: np.ndarray | None = None) -> GenerateResult:
    return GenerateResult(
        request_id="r1", text="x", token_ids=[1], prompt_token_ids=[1, 2], finish_reason="stop",
        choices=[Choice(text="x", token_ids=[1], finish_reason="stop")], activations=activations,
        positions=[0, 1], capture_token_ids=[1, 2], logits=logits, logits_positions=[1] if logits is not None else [],
    )


# ---------------------------------------------------------------- metadata encoding


def test_small_captures_are_inline_base64_keyed_by_wire_key_and_read_back_exactly():
    a = np.arange(16, dtype=np.float32).reshape(2, 8)
    b = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    meta, tensors = result_metadata(
        result_with({"blocks.1.hook_resid_post": a, "ln_final.hook_normalized": b}),
        ["blocks.1.hook_resid_post", "ln_final.hook_normalized"],
    )
    assert tensors is None
    assert list(meta["activations"]) == ["1:resid_post", "ln_final.hook_normalized"]
    entry = meta["activations"]["1:resid_post"]
    assert entry["dtype"] == "float32" and entry["shape"] == [2, 8] and isinstance(entry["data"], str)
    assert meta["activation_hooks"] == ["blocks.1.hook_resid_post", "ln_final.hook_normalized"]
    assert meta["activation_positions"] == [0, 1] and meta["activation_token_ids"] == [1, 2]
    back = decode_activations(meta)
    np.testing.assert_array_equal(back["blocks.1.hook_resid_post"], a)
    np.testing.assert_array_equal(back["ln_final.hook_normalized"], b)
    assert list(decode_activations(meta, by="wire")) == ["1:resid_post", "ln_final.hook_normalized"]


def test_captures_over_the_limit_go_to_a_safetensors_file_bfloat16_included(tmp_path: Path):
    big = np.random.default_rng(0).standard_normal((64, 8)).astype(ml_dtypes.bfloat16)
    logits = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    meta, tensors = result_metadata(result_with({"3:mlp_out": big}, logits), ["3:mlp_out"], inline_bytes=100, capture_dir=None)
    assert tensors is not None and set(tensors) == {"3:mlp_out", "logits"}
    entry = meta["activations"]["3:mlp_out"]
    assert "data" not in entry and entry["dtype"] == "bfloat16" and entry["shape"] == [64, 8]
    assert entry["path"].endswith("r1.safetensors") and Path(entry["path"]).is_absolute()
    # a moved folder is found through capture_dir
    moved = tmp_path / "moved"
    write_tensors(moved / Path(entry["path"]).name, tensors)
    back = decode_activations(meta, capture_dir=moved)
    assert back["3:mlp_out"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back["3:mlp_out"], big)
    np.testing.assert_array_equal(read_logits(meta, capture_dir=moved), logits)
    # the file is ordinary safetensors
    from safetensors import safe_open

    with safe_open(str(moved / Path(entry["path"]).name), framework="numpy") as f:  # keys only: numpy cannot load BF16
        assert set(f.keys()) == {"3:mlp_out", "logits"}
    with pytest.raises(FileNotFoundError, match="capture_dir"):
        decode_activations(meta)


def test_capture_dir_forces_files_and_duplicate_hook_points_are_refused(tmp_path: Path):
    a = np.ones((2, 8), np.float32)
    meta, tensors = result_metadata(result_with({"blocks.0.hook_resid_pre": a}), ["blocks.0.hook_resid_pre"], capture_dir=tmp_path)
    assert tensors is not None and meta["activations"]["0:resid_pre"]["path"] == str(tmp_path.resolve() / "r1.safetensors")
    write_tensors(meta["activations"]["0:resid_pre"]["path"], tensors)
    np.testing.assert_array_equal(read_tensors(tmp_path / "r1.safetensors")["0:resid_pre"], a)
    with pytest.raises(ValueError, match="same hook point"):
        result_metadata(result_with({"blocks.0.hook_resid_pre": a, "0:resid_pre": a}), ["blocks.0.hook_resid_pre", "0:resid_pre"])


# ---------------------------------------------------------------- model args and GenerateConfig


def test_model_args_parse_like_the_cli_gives_them():
    from provider.inspect_provider import capture_defaults, parse_positions

    assert parse_positions("last_prompt") == "last_prompt"
    assert parse_positions(-1) == [-1]
    assert parse_positions(["0", "3", "-1"]) == [0, 3, -1]  # -M positions=0,3,-1
    assert parse_positions("0, 2") == [0, 2]
    with pytest.raises(ValueError, match="last_prompt"):
        parse_positions(["a", "b"])
    spec = capture_defaults({"capture": ["blocks.1.hook_resid_post", "ln_final.hook_normalized"], "positions": "last_prompt", "reduce": "mean"})
    assert spec == {"hooks": ["blocks.1.hook_resid_post", "ln_final.hook_normalized"], "positions": "last_prompt", "reduce": "mean"}
    assert capture_defaults({"capture": "a,b"})["hooks"] == ["a", "b"]
    assert capture_defaults({}) is None
    with pytest.raises(ValueError, match="needs -M capture"):
        capture_defaults({"positions": "all"})


def test_generate_config_maps_onto_the_request_and_extra_body_merges_over_the_defaults():
    from inspect_ai.model import ChatMessageSystem, ChatMessageUser, GenerateConfig

    from provider.inspect_provider import build_request

    messages = [ChatMessageSystem(content="Be brief."), ChatMessageUser(content="Hi")]
    config = GenerateConfig(
        max_tokens=12, temperature=0.0, top_p=0.9, top_k=5, seed=3, stop_seqs=["\n"], num_choices=2,
        logprobs=True, top_logprobs=3,
        extra_body={"capture": {"positions": "all"}, "interventions": [{"hook": "blocks.0.hook_resid_post", "op": "scale", "factor": 0.0}]},
    )
    defaults = {"hooks": ["blocks.1.hook_resid_post"], "positions": "last_prompt"}
    request = build_request(messages, config, defaults)
    assert request == {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 12, "temperature": 0.0, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["\n"], "n": 2, "logprobs": 3,
        "capture": {"hooks": ["blocks.1.hook_resid_post"], "positions": "all"},
        "interventions": [{"hook": "blocks.0.hook_resid_post", "op": "scale", "factor": 0.0}],
    }
    assert "capture" not in build_request(messages, GenerateConfig(extra_body={"capture": None}), defaults)
    assert build_request(messages, GenerateConfig(logprobs=True), None)["logprobs"] == 0
    with pytest.raises(InvalidRequestError, match="tempreature"):
        build_request(messages, GenerateConfig(extra_body={"tempreature": 1}), None)
    with pytest.raises(InvalidRequestError, match="extra_body.prompt"):
        build_request(messages, GenerateConfig(extra_body={"prompt": "x"}), None)


# ---------------------------------------------------------------- retry decisions


def test_errors_map_to_retry_decisions():
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
    from ray.serve.exceptions import BackPressureError as ServeBackPressure
    from ray.serve.exceptions import DeploymentUnavailableError

    from provider.inspect_provider import CapserveAPI

    api = CapserveAPI("m")

    def decision(exc: Exception) -> tuple[bool, str | None]:
        d = api.should_retry(exc)
        return bool(d), d.kind if d else None

    remote = lambda cause: RayTaskError("generate", "Traceback ...", cause).as_instanceof_cause()
    assert decision(BackPressureError("queue full")) == (True, "rate_limit")
    assert decision(remote(BackPressureError("queue full"))) == (True, "rate_limit")
    assert decision(ServeBackPressure(num_queued_requests=5, max_queued_requests=5)) == (True, "rate_limit")
    assert decision(remote(ReplicaUnavailableError("all attempts failed"))) == (True, "transient")
    assert decision(ActorDiedError()) == (True, "transient")
    assert decision(ActorUnavailableError("gone", None)) == (True, "transient")
    assert decision(DeploymentUnavailableError.__new__(DeploymentUnavailableError)) == (True, "transient")
    assert decision(remote(InvalidRequestError("capture.hooks: unknown"))) == (False, None)
    assert decision(remote(CaptureFailedError("worker"))) == (False, None)
    assert decision(RuntimeError("anything else")) == (False, None)


def test_inspect_retries_backpressure_and_fails_a_bad_request_at_once():
    from inspect_ai.model import GenerateConfig, get_model

    app = FakeApp(failures=[BackPressureError("queue full"), ReplicaUnavailableError("replica died")])
    model = get_model("capserve/fake", config=GenerateConfig(max_retries=3), handle=app, memoize=False)
    output = asyncio.run(model.generate("Hello"))
    assert output.completion == "answer 0" and len(app.requests) == 3  # two retries, then the answer
    app.failures = [InvalidRequestError("capture.hooks: hook 'x' is not a known hook name")]
    with pytest.raises(InvalidRequestError, match="capture.hooks"):
        asyncio.run(model.generate("Hello"))
    assert len(app.requests) == 4  # no retry


# ---------------------------------------------------------------- the provider end to end (in-process eval, fake app)


def test_provider_output_usage_stop_reason_logprobs_and_warnings(caplog: pytest.LogCaptureFixture):
    from inspect_ai.model import GenerateConfig, get_model

    app = FakeApp()
    model = get_model("capserve/fake", handle=app, memoize=False, capture="blocks.0.hook_resid_post")
    config = GenerateConfig(max_tokens=3, num_choices=2, top_logprobs=2, prompt_logprobs=1, frequency_penalty=0.5)
    with caplog.at_level(logging.WARNING):
        output = asyncio.run(model.generate("Hello", config=config))
        asyncio.run(model.generate("Hello", config=config))
    assert [c.stop_reason for c in output.choices] == ["stop", "max_tokens"]
    assert output.usage.input_tokens == 4 and output.usage.output_tokens == 6 and output.usage.total_tokens == 10
    content = output.choices[0].logprobs.content
    assert len(content) == 3 and content[0].logprob == -0.5 and [t.logprob for t in content[0].top_logprobs] == [-0.5, -1.0]
    prompt = output.choices[0].prompt_logprobs.content  # the first prompt token has no logprob
    assert [p.logprob for p in prompt] == [-0.25, -0.5, -1.0] and prompt[1].top_logprobs[0].logprob == -0.1
    assert output.metadata["replica"] == "fake-0" and output.metadata["activation_hooks"] == ["blocks.0.hook_resid_post"]
    assert sum("frequency_penalty" in r.message for r in caplog.records) == 1  # warned once
    assert app.requests[0]["prompt"] == [{"role": "user", "content": "Hello"}]


def test_activations_survive_an_inspect_log_inline_and_in_files(tmp_path: Path):
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import get_model
    from inspect_ai.scorer import includes

    task = Task(dataset=[Sample(input=f"question {i}", target="answer", id=i) for i in range(4)], scorer=includes())
    small = get_model("capserve/fake", handle=FakeApp(n_positions=2), memoize=False,
                      capture="blocks.1.hook_resid_post,ln_final.hook_normalized", positions="last_prompt")
    (log,) = eval(task, model=small, log_dir=str(tmp_path / "logs"), display="none")
    assert log.status == "success" and log.results.scores[0].metrics["accuracy"].value == 1.0
    for sample in log.samples:
        prompt = [{"role": "user", "content": f"question {sample.id}"}]
        got = read_activations(log.location, sample.id)
        np.testing.assert_array_equal(got["blocks.1.hook_resid_post"], rows_for((prompt, "blocks.1.hook_resid_post"), 2))
        np.testing.assert_array_equal(got["ln_final.hook_normalized"], rows_for((prompt, "ln_final.hook_normalized"), 2))
        assert "data" in sample.output.metadata["activations"]["1:resid_post"]
        assert activation_info(sample)["activation_positions"] == [0, 1]

    files = tmp_path / "acts"
    big = get_model("capserve/fake", handle=FakeApp(n_positions=300), memoize=False,
                    capture="blocks.1.hook_resid_post", capture_dir=str(files), capture_dtype="float16")
    (log,) = eval(task, model=big, log_dir=str(tmp_path / "logs"), display="none")
    assert log.status == "success" and len(list(files.glob("*.safetensors"))) == 4
    for sample in log.samples:
        prompt = [{"role": "user", "content": f"question {sample.id}"}]
        got = read_activations(log.location, sample.id)["blocks.1.hook_resid_post"]
        assert got.dtype == np.float16 and got.shape == (300, D_MODEL)
        np.testing.assert_array_equal(got, rows_for((prompt, "blocks.1.hook_resid_post"), 300).astype(np.float16))


def test_a_context_overflow_ends_the_sample_with_model_length():
    from inspect_ai.model import get_model

    app = FakeApp(failures=[InvalidRequestError("prompt: 70 prompt tokens + max_tokens 16 exceed the model's max_model_len=64")])
    output = asyncio.run(get_model("capserve/fake", handle=app, memoize=False).generate("Hello"))
    assert output.stop_reason == "model_length" and "max_model_len" in output.error


# ---------------------------------------------------------------- client


def test_capture_request_shapes():
    assert capture_request("hi", "blocks.0.hook_resid_post", "last_prompt", None, None, {}) == {
        "prompt": "hi", "capture": {"hooks": ["blocks.0.hook_resid_post"], "positions": "last_prompt"}}
    own = {"prompt": [1, 2], "capture": {"hooks": ["0:mlp_out"]}}
    assert capture_request(own, ["blocks.1.hook_resid_post"], None, None, None, {"seed": 1}) == {**own, "seed": 1}
    with pytest.raises(InvalidRequestError, match="capture.hooks"):
        capture_request("hi", None, None, None, None, {})


def test_client_capture_many_keeps_order_bounds_concurrency_and_names_the_failing_index():
    app = FakeApp(delay=0.01)
    client = CaptureClient(handle=app, backoff_s=0.0)
    prompts = [f"prompt {i}" for i in range(25)]
    results = client.capture_many(prompts, ["blocks.0.hook_resid_post"], concurrency=4, progress=False)
    assert app.most_in_flight == 4
    for prompt, result in zip(prompts, results):
        np.testing.assert_array_equal(result.activations["blocks.0.hook_resid_post"], rows_for((prompt, "blocks.0.hook_resid_post"), 2))
    app.failures = [BackPressureError("full")]  # retried
    assert client.capture("x", "blocks.0.hook_resid_post").activations["blocks.0.hook_resid_post"].shape == (2, D_MODEL)
    app.failures = [InvalidRequestError("capture.hooks: bad")]
    with pytest.raises(InvalidRequestError, match=r"prompts\[0\]: capture.hooks"):
        client.capture_many(["a"], ["blocks.0.hook_resid_post"], progress=False)
    assert client.info().d_model == D_MODEL
    assert client.generate({"prompt": "hi"}, max_tokens=2).token_ids == [3, 4]

    async def both() -> list[GenerateResult]:
        return [await client.agenerate(prompt="x", max_tokens=1), *(await client.acapture_many(["a", "b"], "0:resid_post", progress=False))]

    assert [len(r.token_ids) for r in asyncio.run(both())] == [1, 16, 16]
    client.close()


def test_client_calls_end_at_timeout_s_and_cancel_their_request():
    from replicas.api.errors import DeadlineExceededError

    app = FakeApp(delay=30.0)
    sent: list[FakeResponse] = []
    remote = app.capture.remote
    app.capture.remote = lambda *a, **k: sent.append(remote(*a, **k)) or sent[-1]
    client = CaptureClient(handle=app, timeout_s=0.2)
    with pytest.raises(DeadlineExceededError, match=r"capture: no result within timeout_s=0.2 s"):
        client.capture("x", "blocks.0.hook_resid_post")
    assert len(sent) == 1 and sent[0].cancelled  # the router (and the engine) are told to stop
    with pytest.raises(ValueError, match="timeout_s=0"):
        CaptureClient(handle=app, timeout_s=0)
    client.close()


def test_client_errors_from_the_router_come_without_ray_s_traceback():
    from ray.exceptions import RayTaskError

    from replicas.api.errors import DeadlineExceededError

    cause = DeadlineExceededError("no result within routing.request_timeout_s=1 s")
    app = FakeApp(failures=[RayTaskError("capture", "Traceback ...", cause, pid=7, ip="10.0.0.9").as_instanceof_cause()])
    client = CaptureClient(handle=app, backoff_s=0.0)
    with pytest.raises(DeadlineExceededError) as info:
        client.capture("x", "blocks.0.hook_resid_post")
    assert type(info.value) is DeadlineExceededError and "10.0.0.9" not in str(info.value)
    client.close()
