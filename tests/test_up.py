"""`xpu-jobs up`: a port in use stops it with a reason before anything starts; shutdown stops the API and workers
first (softly, then at once on a second signal) and Redis last."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import _wait

from worker.node.redis_server import free_port


def up(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZE_", "CUDA_", "XPUJOBS_"))}
    return subprocess.run([sys.executable, "-m", "worker.cli", "up", "--data-dir", str(tmp_path), *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_a_port_in_use_stops_up_with_the_reason(tmp_path):
    """Was: exit 15 and no reason, once the API had died on the port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        api = up("--port", str(port), "--redis-port", str(free_port()), tmp_path=tmp_path)
        assert api.returncode == 1
        assert f"the API's port {port} on 127.0.0.1 is already in use" in api.stderr and "--port" in api.stderr
        redis = up("--port", str(free_port()), "--redis-port", str(port), tmp_path=tmp_path)
        assert redis.returncode == 1
        assert f"the embedded Redis's port {port}" in redis.stderr and "--redis-port" in redis.stderr
    assert not (tmp_path / "redis").exists()  # nothing was started


def test_a_redis_that_fails_to_start_says_why(tmp_path):
    aof = tmp_path / "redis" / "appendonlydir"
    aof.mkdir(parents=True)
    (aof / "appendonly.aof.manifest").write_text("not a manifest\n")  # a damaged AOF
    result = up("--port", str(free_port()), "--redis-port", str(free_port()), tmp_path=tmp_path)
    assert result.returncode == 1
    assert "the embedded Redis did not start: redis-server exited with code 1" in result.stderr
    assert "manifest" in result.stderr.lower()  # Redis's own words


CHILD = """
import signal, sys, time
path = sys.argv[1]
def on(signum, _):
    open(path, "a").write(f"{signal.Signals(signum).name} {time.monotonic()}\\n")
    if signum == signal.SIGQUIT or sys.argv[2] == "quick":
        sys.exit(0)
signal.signal(signal.SIGTERM, on)
signal.signal(signal.SIGQUIT, on)
open(path, "a").write("up\\n")
while True:
    time.sleep(0.05)
"""


SUPERVISOR = """
import subprocess, sys
from worker.cli import _supervise
def child(name, mode):
    return subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2] + "/" + name, mode],
                            start_new_session=True)
procs = {"the API": child("api", "quick"), "the workers": child("workers", "slow")}
sys.exit(_supervise(procs, {"Redis": child("redis", "quick")}))
"""


def test_shutdown_stops_redis_last_and_a_second_signal_is_cold(tmp_path):
    """A worker that takes its time over a warm shutdown (a fine-tune saving its checkpoint) still has Redis
    until it exits; a second Ctrl-C makes it stop at once (SIGQUIT, Celery's cold shutdown)."""
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, CHILD, str(tmp_path)],
                                  env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 30
    while not all((tmp_path / n).exists() for n in ("api", "workers", "redis")):
        assert supervisor.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    supervisor.send_signal(signal.SIGINT)
    time.sleep(1.5)
    assert "SIGTERM" not in (tmp_path / "redis").read_text()  # the workers are still shutting down softly
    supervisor.send_signal(signal.SIGINT)
    assert supervisor.wait(30) == 0
    lines = {n: (tmp_path / n).read_text().split("\n")[1:-1] for n in ("api", "workers", "redis")}
    assert [line.split()[0] for line in lines["workers"]] == ["SIGTERM", "SIGQUIT"]
    assert [line.split()[0] for line in lines["api"]] == ["SIGTERM"]
    assert [line.split()[0] for line in lines["redis"]] == ["SIGTERM"]
    assert float(lines["redis"][0].split()[1]) > float(lines["workers"][1].split()[1])


def start_up(tmp_path: Path) -> tuple[subprocess.Popen, Path, str]:
    """The real `xpu-jobs up` (embedded Redis, one CPU worker, one API process), once its worker is ready."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZE_", "CUDA_", "XPUJOBS_"))}
    env.update({"XPUJOBS_API_WORKERS": "1", "XPUJOBS_DEVICE_BACKEND": "cpu", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    port, log = free_port(), tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "up", "--data-dir", str(tmp_path / "data"),
                                 "--port", str(port), "--redis-port", str(free_port())], env=env, cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.poll() is None, log.read_text()
        try:  # Celery's "ready." comes once the worker handles signals (before, SIGTERM would just kill it)
            return " ready." in log.read_text() and httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(ready, 240, "xpu-jobs up")
    return proc, log, url


def said(log: Path) -> list[str]:
    return [line.removeprefix("xpu-jobs: ") for line in log.read_text().splitlines() if line.startswith("xpu-jobs: ")]


@pytest.mark.faults
def test_ctrl_c_once_is_a_warm_stop_in_order(tmp_path):
    """Was: exit code 15 (uvicorn re-raises the SIGTERM it shut down on) and nothing said of the order."""
    proc, log, _ = start_up(tmp_path)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 0, log.read_text()[-3000:]
    lines = said(log)
    assert lines[0] == "stopping the workers, the API softly (warm shutdown; again to stop at once)", lines
    assert set(lines[1:3]) == {"the API stopped", "the workers stopped"}  # both before Redis
    assert lines[3:] == ["stopping Redis", "Redis stopped"]
    assert "Warm shutdown" in log.read_text() and "Cold shutdown" not in log.read_text()


@pytest.mark.faults
def test_ctrl_c_twice_is_a_cold_stop_with_redis_last(tmp_path):
    proc, log, _ = start_up(tmp_path)
    proc.send_signal(signal.SIGINT)
    _wait(lambda: any(line.startswith("stopping the workers, the API softly") for line in said(log)), 30,
          "the warm stop to begin")
    proc.send_signal(signal.SIGINT)  # the idle worker's warm shutdown takes seconds: it is still under way
    assert proc.wait(120) == 0, log.read_text()[-3000:]
    lines = said(log)
    cold = next(i for i, line in enumerate(lines) if line.endswith("at once (cold shutdown)"))
    assert lines[cold].startswith("stopping the workers") and "Cold shutdown" in log.read_text()
    assert lines.index("the workers stopped") > cold
    assert lines[-2:] == ["stopping Redis", "Redis stopped"]
