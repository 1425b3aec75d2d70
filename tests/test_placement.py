"""Routing while Redis rebuilds the worker registry (api/placement.py), on a Redis server started here: a job no
listed worker can run waits for the nodes' next heartbeat while Redis is younger than a lease, then is a 503 to
retry; on an older Redis it is the client's 400 at once."""

import threading

import pytest
import redis

from api.errors import APIError
from api.placement import route
from contract import registry
from contract.routing import Requirement
from contract.settings import Settings
from worker.node.redis_server import free_port, start_redis

CPU_WORKER = {"node": "n@h", "backend": "cpu", "devices": [{"total_memory": 1}], "bf16": False}


@pytest.fixture
def fresh_redis(tmp_path):
    port = free_port()
    proc = start_redis(port, tmp_path, appendonly=False)
    yield f"redis://127.0.0.1:{port}/0", redis.Redis(port=port, decode_responses=True)
    proc.terminate()
    proc.wait(10)


def test_a_just_restarted_redis_waits_for_the_registry(fresh_redis):
    url, client = fresh_redis
    settings = Settings(redis_url=url, lease_seconds=60, heartbeat_seconds=5)
    threading.Timer(0.3, registry.register, (client, "n@h", CPU_WORKER, 60)).start()  # the node's first beat
    queue, workers = route(client, Requirement(), settings)
    assert queue == "xpujobs.cpu" and [w["node"] for w in workers] == ["n@h"]


def test_no_worker_back_is_a_503_then_a_400(fresh_redis):
    url, client = fresh_redis
    with pytest.raises(APIError) as young:
        route(client, Requirement(), Settings(redis_url=url, lease_seconds=60, heartbeat_seconds=0.1))
    assert young.value.status == 503 and young.value.code == "service_unavailable"
    assert young.value.headers["Retry-After"].isdigit()
    with pytest.raises(APIError) as settled:  # Redis has been up longer than a lease: the registry is whole
        route(client, Requirement(), Settings(redis_url=url, lease_seconds=0, heartbeat_seconds=60))
    assert settled.value.status == 400 and settled.value.code == "no_capable_worker"
