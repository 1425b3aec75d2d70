"""The API through a Redis outage, on a stack of its own (its Redis is killed): OpenAI-shaped 503s with
retry-after while Redis is away, /health says so, and the API's connections recover by themselves once it is
back; a burst larger than the connection pool waits for connections instead of failing."""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import KEY_A, WorkerNode, _wait

from worker.node.redis_server import free_port, start_redis

pytestmark = pytest.mark.faults

POOL = 4  # the API's Redis connections per process: far fewer than the burst below


@pytest.fixture(scope="module")
def outage_stack(stack_env, tmp_path_factory):
    root = tmp_path_factory.mktemp("outage")
    port = free_port()
    redis_proc = {"proc": start_redis(port, root / "redis")}
    env = {**stack_env, "XPUJOBS_REDIS_URL": f"redis://127.0.0.1:{port}/0",
           "XPUJOBS_ARTIFACT_ROOT": str(root / "artifacts")}
    node = WorkerNode(env, "outage", root)
    api_port = free_port()
    log = (root / "api.log").open("wb")
    api = subprocess.Popen([sys.executable, "-m", "worker.cli", "api", "--port", str(api_port), "--workers", "1"],
                           env={**env, "XPUJOBS_REDIS_MAX_CONNECTIONS": str(POOL)}, stdout=log,
                           stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{api_port}"

    def ready():
        try:
            workers = httpx.get(url + "/v1/workers", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=2)
            return workers.status_code == 200 and workers.json()["data"]
        except httpx.HTTPError:
            return False

    _wait(ready, 240, "the outage stack")

    def restart_redis():
        redis_proc["proc"] = start_redis(port, root / "redis")

    yield url, redis_proc, restart_redis
    api.terminate()
    api.wait(10)
    node.stop()
    redis_proc["proc"].terminate()
    redis_proc["proc"].wait(10)


def chat(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=240,
                      json={"model": "demo-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})


def test_a_burst_larger_than_the_pool_waits_for_connections(outage_stack):
    url, _, _ = outage_stack
    with ThreadPoolExecutor(40) as pool:
        replies = list(pool.map(lambda _: chat(url), range(40)))
    assert [r.status_code for r in replies] == [200] * 40, [r.text for r in replies if r.status_code != 200][:3]


def test_redis_away_is_a_503_and_the_api_recovers(outage_stack, stack_env):
    url, redis_proc, restart_redis = outage_stack
    assert chat(url).status_code == 200  # connections in the pool, soon to be stale
    os.kill(redis_proc["proc"].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    redis_proc["proc"].wait(10)
    headers = {"Authorization": f"Bearer {KEY_A}"}
    for method, path, body in (("GET", "/v1/files", None), ("GET", "/v1/fine_tuning/jobs", None),
                               ("POST", "/v1/chat/completions", {"model": "demo-tiny", "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "Hi"}]})):
        reply = httpx.request(method, url + path, headers=headers, json=body, timeout=60)
        assert reply.status_code == 503, (path, reply.text)
        assert reply.headers["retry-after"].isdigit()
        error = reply.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "service_unavailable"
    health = httpx.get(url + "/health", timeout=60)
    assert health.status_code == 503 and health.json()["error"]["code"] == "service_unavailable"

    # Down for longer than a registry entry lives (the lease), so Redis comes back without the worker's entry.
    time.sleep(max(0.0, killed_at + float(stack_env["XPUJOBS_LEASE_SECONDS"]) + 1 - time.monotonic()))
    restart_redis()
    _wait(lambda: httpx.get(url + "/health", timeout=60).status_code == 200, 60, "health after the restart")
    # Chats sent at once, before the worker has written its entry again, wait for it (the node writes it as soon as
    # it reaches Redis); none meets a stale connection (a 5xx). Was: 400 no_capable_worker until the node's next
    # heartbeat.
    replies = [chat(url) for _ in range(8)]
    assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies if r.status_code != 200][:3]
    assert httpx.get(url + "/v1/workers", headers=headers, timeout=60).json()["data"]
    assert httpx.get(url + "/v1/files", headers=headers, timeout=60).status_code == 200
