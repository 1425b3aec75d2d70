"""`xpu-jobs up`: a port in use stops it with a reason before anything starts; shutdown stops the API and workers
first (softly, then at once on a second signal) and Redis last."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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
