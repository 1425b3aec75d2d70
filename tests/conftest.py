"""The real stack for the tests: a Redis server of the session's own, worker nodes started through the
production launcher, the API under uvicorn, and a tiny model built locally (random weights)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from worker.demo_model import build_demo_model
from worker.node.redis_server import free_port, start_redis

KEY_A, KEY_B, KEY_ADMIN = "key-tenant-a", "key-tenant-b", "key-operator"
# cpu everywhere by default; XPUJOBS_TEST_BACKEND=cuda (or xpu) runs the same suite on a GPU machine.
TEST_BACKEND = os.environ.get("XPUJOBS_TEST_BACKEND", "cpu")


@pytest.fixture(scope="session")
def stack_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stack")


@pytest.fixture(scope="session")
def redis_url(stack_dir):
    port = free_port()
    proc = start_redis(port, stack_dir / "redis")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def service_env(redis_url: str, root: Path, base_models: list[str]) -> dict[str, str]:
    """The environment of a test stack's processes (the session's, or the fault suite's own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XPUJOBS_", "ZE_", "CUDA_VISIBLE"))}
    env.update({
        "XPUJOBS_REDIS_URL": redis_url,
        "XPUJOBS_ARTIFACT_ROOT": str(root / "artifacts"),
        "XPUJOBS_MODELS_ROOT": str(root / "models"),
        "XPUJOBS_BASE_MODELS": json.dumps(base_models),
        "XPUJOBS_API_KEYS": json.dumps({KEY_A: "tenant-a", KEY_B: "tenant-b"}),
        "XPUJOBS_ADMIN_API_KEYS": json.dumps([KEY_ADMIN]),
        "XPUJOBS_DEVICE_BACKEND": TEST_BACKEND,
        "XPUJOBS_LEASE_SECONDS": "4",
        "XPUJOBS_HEARTBEAT_SECONDS": "1",
        "XPUJOBS_MAX_UPLOAD_BYTES": str(256 * 1024),
        "XPUJOBS_WORKER_CONCURRENCY": "8",
        "XPUJOBS_REQUEST_TIMEOUT_SECONDS": "120",
        "XPUJOBS_WEBHOOK_RETRY_SECONDS": "[1, 1, 1]",
        # every engine step's tokens in their own chunk: the streaming tests count chunks (tests/test_engine.py
        # covers the interval)
        "XPUJOBS_ENGINE_STREAM_INTERVAL_MS": "0",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    })
    return env


@pytest.fixture(scope="session")
def stack_env(stack_dir, redis_url) -> dict[str, str]:
    build_demo_model(stack_dir / "models" / "demo-tiny")
    build_strict_demo_model(stack_dir / "models" / "demo-strict")
    return service_env(redis_url, stack_dir, ["demo-tiny", "demo-strict"])


# Like many real templates (Llama 2, Mistral), one that raises on roles that do not alternate.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_strict_demo_model(out: Path) -> None:
    build_demo_model(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": STRICT_TEMPLATE}))
    (out / "chat_template.jinja").unlink(missing_ok=True)


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


class WorkerNode:
    """One worker node started through `xpu-jobs worker`, as production starts it."""

    def __init__(self, env: dict[str, str], name: str, log_dir: Path):
        self.name = name
        # appended: a node restarted under the same name keeps its predecessor's log (what a killed run did)
        self.log = (log_dir / f"{name}.log").open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "worker", "--name", name], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def registered(self, redis_client) -> bool:
        from contract.registry import live_workers

        # this process's own entry: a node restarted under the same name must not pass on its predecessor's
        return any(w["node"].startswith(self.name + "@") and w.get("pid") == self.proc.pid
                   for w in live_workers(redis_client))

    def kill(self):
        """SIGKILL the node and its training child: a machine lost mid-job."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


@pytest.fixture(scope="session")
def redis_client(redis_url):
    import redis

    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture(scope="session")
def start_worker(stack_env, stack_dir, redis_client):
    started: list[WorkerNode] = []

    def start(name: str) -> WorkerNode:
        node = WorkerNode(stack_env, name, stack_dir)
        started.append(node)
        _wait(lambda: node.registered(redis_client) or node.proc.poll() is not None, 240, f"worker {name}")
        assert node.proc.poll() is None, (stack_dir / f"{name}.log").read_text()
        return node

    yield start
    for node in started:
        node.stop()


@pytest.fixture(scope="session")
def workers(start_worker):
    return [start_worker("wa"), start_worker("wb")]


@contextlib.contextmanager
def running_api(env: dict[str, str], log_path: Path, processes: int = 2):
    """The API under uvicorn with two processes by default, as in production (several): every call may land on
    either. Yields its base URL once /health answers."""
    port = free_port()
    log = log_path.open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "api", "--port", str(port),
                             "--workers", str(processes)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait(healthy, 240, f"the API ({log_path.name})")  # generous: CI and shared machines are slow to import
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="session")
def api_url(stack_env, stack_dir, workers):
    with running_api(stack_env, stack_dir / "api.log") as url:
        yield url


@pytest.fixture(scope="session")
def client_a(api_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_url + "/v1", api_key=KEY_A, max_retries=0, timeout=180)


@pytest.fixture(scope="session")
def client_b(api_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_url + "/v1", api_key=KEY_B, max_retries=0, timeout=180)


@pytest.fixture
def http_a(api_url):
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=180) as c:
        yield c


def wait_for_job(client: openai.OpenAI, job_id: str, statuses=("succeeded", "failed", "cancelled"),
                 timeout: float = 240):
    return _wait(lambda: (j := client.fine_tuning.jobs.retrieve(job_id)).status in statuses and j, timeout,
                 f"job {job_id} to reach {statuses}")


def _workers(api_url: str) -> dict[str, dict]:
    headers = {"Authorization": f"Bearer {KEY_A}"}
    return {w["node"]: w for w in httpx.get(api_url + "/v1/workers", headers=headers).json()["data"]}


def _engine_processes(worker_pids: set[int]) -> set[int]:
    """The workers' engine processes, read from /proc: a new one shows there as soon as it is spawned, long before
    it has imported torch and could take a request (the registry shows it only at the next heartbeat)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent in worker_pids and b"spawn_main" in command:
            found.add(int(stat.parent.name))
    return found


class StoppedEngines:
    """The workers' engine processes held in SIGSTOP, each as soon as /proc shows it: a stopped one takes the lines
    handed to it and can finish none, so what a test kills holds them however fast the device is (on an H200 the
    lines of a batch ended before a kill timed from the registry could reach them). Resumed on exit."""

    def __init__(self, api_url: str):
        self.api_url = api_url
        self.worker_pids = {w["pid"] for w in _workers(api_url).values()}
        self.stopped: set[int] = set()
        self.killed: set[int] = set()

    def __enter__(self):
        self.stop_new()
        return self

    def __exit__(self, *_):
        for pid in self.stopped - self.killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def stop_new(self) -> None:
        for pid in _engine_processes(self.worker_pids) - self.stopped:
            os.kill(pid, signal.SIGSTOP)
            self.stopped.add(pid)

    def kill_holding(self, lines: int) -> set[int]:
        """Wait until stopped engine processes not killed yet hold `lines` requests between them (as the workers
        count them in the registry), then SIGKILL those."""
        def holders():
            self.stop_new()  # a replacement, spawned for the lines of a killed one, is stopped before it imports torch
            held = {w["engine_pid"]: w.get("engine_requests", 0) for w in _workers(self.api_url).values()
                    if w.get("engine_pid") in self.stopped - self.killed}
            return sum(held.values()) == lines and {pid for pid, n in held.items() if n}
        victims = _wait(holders, 60, f"stopped engine processes holding {lines} lines")
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        self.killed |= victims
        return victims

    def run_for(self, seconds: float) -> None:
        """Let the stopped engine processes run a moment, then stop them again: a bounded stretch of work."""
        alive = self.stopped - self.killed
        for pid in alive:
            os.kill(pid, signal.SIGCONT)
        time.sleep(seconds)
        for pid in alive:
            os.kill(pid, signal.SIGSTOP)
