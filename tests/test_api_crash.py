"""An API process SIGKILLed inside POST /v1/batches (while it validates the input): the batch it left in
`validating` is failed by the reconciler once its creation lease lapses, none of its chunks runs, and every
call on it still answers."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import KEY_A, _wait

from contract.layout import file_path
from contract.records import RecordStore
from worker.node.redis_server import free_port

pytestmark = pytest.mark.faults

LINE = {"method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "demo-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}}


def test_api_killed_inside_batch_creation(stack_env, stack_dir, workers, redis_client, client_a):
    lines = "\n".join(json.dumps({"custom_id": f"r{i}", **LINE}) for i in range(1500)).encode()
    upload = client_a.files.create(file=("big.jsonl", lines), purpose="batch")
    # The stored input becomes a pipe nobody writes to, so the creating process stays inside validation until it
    # is killed (its split takes a tenth of a second: a poll for `validating` missed it on an idle machine).
    stored = file_path(Path(stack_env["XPUJOBS_ARTIFACT_ROOT"]), "tenant-a", upload.id)
    stored.unlink()
    os.mkfifo(stored)
    before = set(redis_client.zrange("idx:batch:tenant-a", 0, -1))
    port = free_port()
    log = (stack_dir / "api-crash.log").open("wb")
    # A second API process of the same stack.
    api = subprocess.Popen([sys.executable, "-m", "worker.cli", "api", "--port", str(port), "--workers", "1"],
                           env=stack_env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: _healthy(url), 240, "the second API")
    threading.Thread(target=_create, args=(url, upload.id), daemon=True).start()

    def validating():
        fresh = set(redis_client.zrange("idx:batch:tenant-a", 0, -1)) - before
        return next((b for b in fresh if json.loads(redis_client.hget(f"rec:batch:{b}", "status") or '""')
                     == "validating"), None)

    batch_id = _wait(validating, 60, "the batch in validating")
    os.kill(api.pid, signal.SIGKILL)
    api.wait(10)
    log.close()

    batch = _wait(lambda: (b := client_a.batches.retrieve(batch_id)).status != "validating" and b, 60,
                  "the reconciler to settle the batch")
    assert batch.status == "failed" and batch.errors.data[0].code == "creation_interrupted"
    store = RecordStore(redis_client)
    assert batch_id not in store.tracked("batch")
    assert not [c for c in store.tracked("chunk") if c.startswith(batch_id)]  # none handed over, none runs
    time.sleep(2)
    assert not [c for c in redis_client.zrange("idx:chunk:tenant-a", 0, -1) if c.startswith(batch_id)
                and json.loads(redis_client.hget(f"rec:chunk:{c}", "status") or '""') != "queued"]
    with pytest.raises(openai.ConflictError):
        client_a.batches.cancel(batch_id)
    stored.unlink()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _create(url: str, file_id: str) -> None:
    try:
        httpx.post(url + "/v1/batches", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120,
                   json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    except httpx.HTTPError:
        pass  # the process is killed under it
