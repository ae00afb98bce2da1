"""Several nodes: a head (the client and Serve's controller and proxy), a router node and a replica
node, all Ray nodes on this machine (`ray.cluster_utils.Cluster`), placed by custom resources.

Captures through the handle and over HTTP, a dataset capture with `capserve capture`, and a replica
killed in the middle of one, must all come back whole and equal HuggingFace. Nothing may rely on
the router, the client and the replicas sharing /dev/shm or a file system: results cross nodes
through Ray's object store, and the capture folder is written by the client alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from bench.common import free_port
from bench.load import wait_engine_gone, wait_until
from provider.dataset.shards import finished_shards, load_capture
from replicas.api import arrays
from replicas.tiny import make_tiny_model
from tests.hf_reference import hf_activations

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[1]
HOOK = "blocks.1.hook_resid_post"
LAYER = (1, "resid_post")
N_PROMPTS = 120
TOL = 1e-4
ARGS = {
    "num_replicas": 2,
    "router_resources": {"router_node": 1},
    "replica_resources": {"replica_node": 1},
    "health_check_period_s": 2,
    "drain_timeout_s": 5,
    "engine": {"max_model_len": 512, "max_num_seqs": 32},
}



def prompt(i: int) -> str:
    return f"Line {i}: the {['grey', 'tall', 'quiet'][i % 3]} heron {'waits ' * (i % 5)}by the water."


@dataclass
class Nodes:
    gcs: str
    url: str
    head: str
    router_node: str
    replica_node: str
    handle: Any
    replicas: Any
    model: str

    def identities(self) -> list[dict[str, Any]]:
        results = self.replicas.broadcast("identity").results(timeout_s=60, return_exceptions=True)
        return [r for r in results if isinstance(r, dict)]

    def running(self) -> int:
        from ray import serve

        return serve.status().applications["capserve"].deployments["EngineReplica"].replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def nodes():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deploy.app import build_app

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    router_node = cluster.add_node(num_cpus=1, resources={"router_node": 1})
    replica_node = cluster.add_node(num_cpus=2, resources={"replica_node": 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(build_app(ARGS), name="capserve", route_prefix="/")
    yield Nodes(
        gcs=cluster.address, url=f"http://127.0.0.1:{port}", head=cluster.head_node.node_id,
        router_node=router_node.node_id, replica_node=replica_node.node_id, handle=handle,
        replicas=serve.get_deployment_handle("EngineReplica", "capserve"), model=make_tiny_model("llama"),
    )
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def assert_equals_hf(model: str, prompt_ids: list[int], rows: np.ndarray) -> None:
    np.testing.assert_allclose(rows, hf_activations(model, prompt_ids)[LAYER], atol=TOL, rtol=0)


def test_router_replicas_and_client_sit_on_their_own_nodes_and_captures_are_exact(nodes):
    import ray

    wait_until(lambda: nodes.running() == 2, "two replicas", 300)
    assert ray.get_runtime_context().get_node_id() == nodes.head
    assert nodes.handle.stats.remote().result(timeout_s=60)["node_id"] == nodes.router_node
    assert {i["node_id"] for i in nodes.identities()} == {nodes.replica_node}

    requests = [{"prompt": prompt(i), "capture": {"hooks": [HOOK]}} for i in range(16)]
    for result in nodes.handle.capture_batch.remote(requests).result(timeout_s=300):
        assert_equals_hf(nodes.model, result.prompt_token_ids, result.activations[HOOK])
    by_reference = nodes.handle.capture.remote(requests[0], by_reference=True).result(timeout_s=300)
    result = ray.get(by_reference)  # the replica's own result object, fetched across nodes
    assert_equals_hf(nodes.model, result.prompt_token_ids, result.activations[HOOK])

    body = httpx.post(f"{nodes.url}/v1/capture", json=requests[1], timeout=300).json()
    assert_equals_hf(nodes.model, body["prompt_token_ids"], arrays.from_raw(body["activations"][HOOK]))


def test_a_dataset_capture_survives_a_replica_kill_with_nothing_lost(nodes, tmp_path):
    import ray

    source, out = tmp_path / "prompts.jsonl", tmp_path / "capture"
    source.write_text("".join(json.dumps({"text": prompt(i), "id": i}) + "\n" for i in range(N_PROMPTS)))
    wait_until(lambda: nodes.running() == 2, "two replicas", 300)
    victim = nodes.identities()[0]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "provider.dataset.cli", "capture", str(source), "--out", str(out), "--hooks", HOOK,
               "--positions", "prompt", "--no-progress", "--address", nodes.gcs, "--shard-lines", "10",
               "--concurrency", "16", "--max-tokens", "16"]
    with open(tmp_path / "cli.log", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        def victim_busy() -> bool:
            assert process.poll() is None, (tmp_path / "cli.log").read_text()[-3000:]
            loads = nodes.replicas.broadcast("load").results(timeout_s=60)
            return bool(out.exists() and finished_shards(out)) and any(
                load["replica"] == victim["replica"] and load["in_flight"] > 0 for load in loads
            )

        wait_until(victim_busy, "a finished shard while the victim holds requests", 600, 0.2)
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        assert process.wait(timeout=900) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
    wait_engine_gone(victim)

    capture = load_capture(out)
    records = list(capture.records())
    assert [r["line"] for r in records] == list(range(N_PROMPTS))  # each line once, in order
    rows = np.asarray(capture[HOOK])
    for record in records[:: max(1, N_PROMPTS // 30)]:
        ids = record["prompt_token_ids"]
        assert_equals_hf(nodes.model, ids, rows[record["row"]: record["row"] + len(ids)])
    assert victim["replica"] in {r["replica"] for r in records}  # it served lines before it died
    wait_until(lambda: nodes.running() == 2, "Serve to replace the killed replica", 300)
    assert {i["node_id"] for i in nodes.identities()} == {nodes.replica_node}
