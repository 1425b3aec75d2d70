"""A whole stack of the fault suite's own (Redis with AOF, worker nodes, the API), whose parts the tests kill and
start again: the session stack of tests/conftest.py is shared by the other tests and must not see these faults."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
from conftest import KEY_A, WorkerNode, _wait, build_demo_model, service_env

from contract.records import RecordStore
from worker.node.redis_server import free_port, start_redis


class FaultStack:
    def __init__(self, root: Path):
        self.root = root
        self.redis_port, self.api_port = free_port(), free_port()
        self.redis_proc: subprocess.Popen | None = None
        self.api_proc: subprocess.Popen | None = None
        self.workers: dict[str, WorkerNode] = {}
        build_demo_model(root / "models" / "demo-tiny")
        self.env = {**service_env(f"redis://127.0.0.1:{self.redis_port}/0", root, ["demo-tiny"]),
                    "XPUJOBS_MAX_UPLOAD_BYTES": str(8 * 1024 * 1024), "XPUJOBS_WORKER_CONCURRENCY": "4"}
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)

    # Redis -------------------------------------------------------------------------------------------------------
    def start_redis(self) -> None:
        self.redis_proc = start_redis(self.redis_port, self.root / "redis")

    def kill_redis(self) -> None:
        self.redis_proc.kill()
        self.redis_proc.wait(10)

    @property
    def redis(self):
        import redis

        return redis.Redis(port=self.redis_port, decode_responses=True)

    @property
    def store(self) -> RecordStore:
        return RecordStore(self.redis)

    # workers -----------------------------------------------------------------------------------------------------
    def start_worker(self, name: str) -> WorkerNode:
        node = WorkerNode(self.env, name, self.root)
        self.workers[name] = node
        _wait(lambda: node.registered(self.redis) or node.proc.poll() is not None, 240, f"worker {name}")
        assert node.proc.poll() is None, (self.root / f"{name}.log").read_text()
        return node

    def node_of(self, name: str) -> str:
        return next(w["node"] for w in self.workers_info() if w["node"].startswith(name + "@"))

    def workers_info(self) -> list[dict]:
        from contract.registry import live_workers

        return live_workers(self.redis)

    # API ---------------------------------------------------------------------------------------------------------
    def start_api(self) -> None:
        log = (self.root / "api.log").open("ab")
        self.api_proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "api", "--port", str(self.api_port), "--workers", "2"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT)
        _wait(self.healthy, 240, "the API")

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill_api_master(self) -> None:
        """SIGKILL the uvicorn master only, as the OOM killer or a `kill -9` would: its workers must not stay."""
        os.kill(self.api_proc.pid, signal.SIGKILL)
        self.api_proc.wait(10)

    def stop(self) -> None:
        for node in self.workers.values():
            node.stop()
        if self.api_proc is not None and self.api_proc.poll() is None:
            self.api_proc.terminate()
            self.api_proc.wait(20)
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            self.redis_proc.wait(10)


def listening(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
