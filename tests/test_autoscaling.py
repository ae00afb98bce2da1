"""Autoscaling under a load ramp: 1 -> 2 -> 1 CPU replicas through `autoscaling`, nothing lost.

A steady trickle of requests runs throughout; a surge on top makes Serve add a replica, and when
the surge ends Serve drains one away while the trickle goes on. Every result is checked against
HuggingFace on the same weights. The replica taken away must leave no engine process and no
shared memory behind. docs/serving.md explains the settings.
"""

from __future__ import annotations

import json

import pytest

from bench.common import free_port
from bench.load import Fleet, Mix, Stream, wait_engine_gone, wait_until
from replicas.tiny import make_tiny_model
from tests.reliability.reference import Reference

pytestmark = [pytest.mark.serve, pytest.mark.soak]

ARGS = {
    "autoscaling": {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 4,
        "upscale_delay_s": 2,
        "downscale_delay_s": 10,
        "look_back_period_s": 2,
    },
    "drain_timeout_s": 30,
    "health_check_period_s": 2,
    "engine": {"max_model_len": 512, "max_num_seqs": 32},
}
TRICKLE, SURGE = 2, 24  # requests in flight; the target is 4 per replica
MAX_TOKENS = 24



@pytest.fixture(scope="module")
def fleet():
    import ray
    from ray import serve

    from deploy.app import build_app

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    handle = serve.run(build_app(ARGS), name="capserve", route_prefix=None)
    yield Fleet(handle, serve.get_deployment_handle("EngineReplica", "capserve"))
    serve.shutdown()
    ray.shutdown()


def test_a_load_ramp_scales_one_two_one_and_loses_nothing(fleet, loop):
    reference = Reference(make_tiny_model("llama"))
    mix = Mix(max_tokens=MAX_TOKENS)
    wait_until(lambda: fleet.running() == 1, "one replica", 300)
    (first,) = fleet.identities()

    trickle = loop.run(Stream(fleet.router, mix, reference.verify, TRICKLE, 10**6, deadline_s=1200).start())
    surge = loop.run(Stream(fleet.router, mix, reference.verify, SURGE, 10**6, deadline_s=1200).start())
    try:
        up_s = wait_until(lambda: fleet.running() == 2, "Serve to add a replica under the surge", 300)
        (added,) = [i for i in fleet.identities() if i["replica"] != first["replica"]]
        # its engine starts on the same 2 CPU cores as a replica serving the surge and the HF checks of
        # its results: once (a CI run, 2026-12-03) it took over 5 minutes to boot
        wait_until(lambda: surge.tally.replicas[added["replica"]] >= 16, "the added replica to serve", 900, 0.5)
        surged = loop.run(surge.finish(), timeout=600)

        both = {i["replica"]: i for i in fleet.identities()}
        down_s = wait_until(lambda: fleet.running() == 1, "Serve to drain a replica once the surge ended", 300)
        (kept,) = fleet.identities()
        (removed,) = [i for name, i in both.items() if name != kept["replica"]]
        served = trickle.tally.counts["ok"]
        wait_until(lambda: trickle.tally.counts["ok"] >= served + 10, "the trickle to go on", 300, 0.5)
    finally:
        loop.loop.call_soon_threadsafe(surge.stop)
        trickle_tally = loop.run(trickle.finish(), timeout=600)
    wait_engine_gone(removed)

    figures = {"scale_up_s": round(up_s, 1), "scale_down_s": round(down_s, 1),
               "surge": surged.summary(), "trickle": trickle_tally.summary()}
    print(json.dumps(figures, indent=1))
    for tally in (surged, trickle_tally):
        assert tally.total > 0 and tally.counts["ok"] == tally.total, tally.summary()
    assert len(trickle_tally.replicas) == 2  # the trickle ran on both replicas, before and after the drain
