"""What a worker could give back: each heartbeat publishes, beside every device's free memory, the bytes its engine
process would free by evicting its idle models (their weights, KV cache and on a device the engine's workspace),
and routing judges a worker by free plus that."""

import httpx
import pytest
import torch
from conftest import KEY_ADMIN, TEST_BACKEND, _wait

from contract.queues import backend_queue
from contract.registry import live_workers
from contract.routing import NoCapableWorker, Requirement, choose_queue
from contract.settings import Settings
from worker.models import model_bytes
from worker.node.node import Node

GIB = 2**30


def test_routing_adds_what_a_node_could_give_back_to_its_free_memory(redis_client, redis_url, monkeypatch):
    """A real node's registry entry in a real Redis; the engine process's report stands in as a reporter."""
    monkeypatch.setenv("XPUJOBS_NODE_NAME", "reclaim@test")
    node = Node(Settings(redis_url=redis_url, _env_file=None))
    reclaimable = {0: 0}
    node.reporters.append(lambda: {"models": [{"model": "m-loaded"}], "reclaimable_memory": dict(reclaimable)})

    def entry() -> dict:
        node.heartbeat()
        return next(w for w in live_workers(redis_client) if w["node"] == node.name)

    try:
        busy = entry()
        assert busy["reclaimable_memory"] == 0 and busy["devices"][0]["reclaimable_memory"] == 0
        # more than is free now, with a margin for what other processes take or free between two heartbeats
        need = sum(d["free_memory"] for d in busy["devices"]) + 4 * GIB
        with pytest.raises(NoCapableWorker, match="GiB"):
            choose_queue([busy], Requirement(need))
        queue = backend_queue(busy["backend"])
        assert choose_queue([busy], Requirement(need, model="m-loaded")) == queue  # loaded: needs nothing more

        reclaimable[0] = 8 * GIB  # idle models the engine process would evict
        idle = entry()
        assert idle["devices"][0]["reclaimable_memory"] == 8 * GIB and idle["reclaimable_memory"] == 8 * GIB
        assert choose_queue([idle], Requirement(need)) == queue
    finally:
        node.stop()


def admin_workers(api_url: str) -> list[dict]:
    reply = httpx.get(api_url + "/v1/workers", headers={"Authorization": f"Bearer {KEY_ADMIN}"})
    reply.raise_for_status()
    return reply.json()["data"]


def test_a_loaded_idle_model_is_reclaimable_in_the_registry(client_a, api_url, stack_dir):
    """The real stack: after a request loads a model and it goes idle, the worker that serves it publishes that
    memory as reclaimable: its weights and KV cache (on cpu, in the host's memory)."""
    before = admin_workers(api_url)
    assert not any(m["model"] == "demo-strict" for w in before for m in w.get("models", [])), \
        "this test needs demo-strict unloaded: run it before tests that use it"

    client_a.chat.completions.create(model="demo-strict", messages=[{"role": "user", "content": "Hi."}],
                                     max_tokens=2)

    def serving() -> tuple[dict, dict] | None:  # the worker and the model, once a heartbeat shows it idle
        for w in admin_workers(api_url):
            for m in w.get("models", []):
                if m["model"] == "demo-strict" and m["running_requests"] == 0:
                    return w, m
        return None

    worker, model = _wait(serving, 60, "demo-strict loaded and idle in the registry")
    held = sum(model["held_memory"].values())
    weights = model_bytes("demo-strict", Settings(models_root=stack_dir / "models", _env_file=None),
                          torch.float32 if TEST_BACKEND == "cpu" else torch.bfloat16)
    assert held >= weights + model["engine"]["kv_cache_bytes"] > weights
    # what the worker publishes is what its idle models hold, this one's included (a delta against the reading
    # before is racy: another model on the worker may go idle or change its engine in between)
    assert worker["reclaimable_memory"] >= held
    assert worker["reclaimable_memory"] == sum(d["reclaimable_memory"] for d in worker["devices"])
    assert worker["reclaimable_memory"] == sum(sum(m["held_memory"].values()) for m in worker["models"]
                                               if m["running_requests"] == 0)
