"""Bounded storage: the retention sweep removes old finished records with their events and artifacts (never
running work or a succeeded job's model), files at their expiry; listing pages through an index by rank; a
tenant's stored bytes are reported."""

import time

import pytest
import redis
from conftest import WorkerNode, _wait

from contract import events, retention
from contract.layout import file_path, job_dir
from contract.records import RecordStore, index_key
from contract.settings import Settings

DAY = 86400


@pytest.fixture
def store(redis_url):
    """A database of the session's Redis of its own: a sweep here cannot touch the other tests' records."""
    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/3", decode_responses=True)
    client.flushdb()
    yield RecordStore(client)
    client.flushdb()


def add(store: RecordStore, kind: str, record_id: str, status: str, age: float, tenant: str = "t") -> None:
    store.create(kind, {"id": record_id, "tenant": tenant, "status": status, "created_at": 0})
    store.redis.zadd(index_key(kind, tenant), {record_id: time.time() - age})  # created `age` seconds ago
    events.emit(store.redis, record_id, "something happened")


def test_sweep_removes_only_old_finished_records(store, tmp_path):
    settings = Settings(redis_url="redis://unused", artifact_root=tmp_path, retention_seconds=30 * DAY,
                        inference_retention_seconds=7 * DAY)
    add(store, "chat", "chatcmpl-old", "completed", 8 * DAY)
    add(store, "chat", "chatcmpl-young", "completed", 6 * DAY)
    add(store, "chat", "chatcmpl-stuck", "in_progress", 8 * DAY)
    add(store, "ftjob", "ftjob-failed", "failed", 31 * DAY)
    add(store, "ftjob", "ftjob-model", "succeeded", 31 * DAY)
    add(store, "batch", "batch_old", "completed", 31 * DAY)
    add(store, "batch", "batch_running", "in_progress", 31 * DAY)
    store.redis.zadd(index_key("chat", "t"), {"chatcmpl-deleted": time.time() - 8 * DAY})  # a dangling entry
    for job in ("ftjob-failed", "ftjob-model", "batch_old"):
        (job_dir(tmp_path, "t", job) / "x").mkdir(parents=True)
    removed = retention.sweep(store, tmp_path, settings)
    assert removed == {"chat": 2, "ftjob": 1, "batch": 1}
    left = {kind: set(store.redis.zrange(index_key(kind, "t"), 0, -1)) for kind in ("chat", "ftjob", "batch")}
    assert left == {"chat": {"chatcmpl-young", "chatcmpl-stuck"}, "ftjob": {"ftjob-model"},
                    "batch": {"batch_running"}}
    assert store.get("chat", "chatcmpl-old") is None and store.get("ftjob", "ftjob-model") is not None
    assert not store.redis.exists(events.stream_key("chatcmpl-old"), events.stream_key("batch_old"))
    assert store.redis.exists(events.stream_key("chatcmpl-young"))
    assert not job_dir(tmp_path, "t", "ftjob-failed").exists() and not job_dir(tmp_path, "t", "batch_old").exists()
    assert job_dir(tmp_path, "t", "ftjob-model").exists()
    assert retention.sweep(store, tmp_path, settings) == {}


def test_files_go_at_their_expiry(store, tmp_path):
    settings = Settings(redis_url="redis://unused", artifact_root=tmp_path)
    for file_id, expires in (("file-soon", 100), ("file-later", 10_000)):
        path = file_path(tmp_path, "t", file_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"{}\n")
        store.create("file", {"id": file_id, "tenant": "t", "bytes": 3, "created_at": 0})
        retention.expire_file_at(store, "t", file_id, int(time.time()) + expires)
    assert store.stored_bytes("t") == 6
    assert retention.sweep(store, tmp_path, settings, now=time.time() + 101) == {"file": 1}
    assert store.get("file", "file-soon") is None and not file_path(tmp_path, "t", "file-soon").exists()
    assert store.get("file", "file-later") is not None and store.stored_bytes("t") == 3


def test_pages_follow_the_cursor(store):
    for i in range(7):
        store.create("file", {"id": f"file-{i}", "tenant": "t", "bytes": 1, "created_at": i})
    seen, after = [], None
    while True:
        page, more = store.page("file", "t", after, 3)
        seen += [r["id"] for r in page]
        if not more:
            break
        after = page[-1]["id"]
    assert seen == [f"file-{i}" for i in reversed(range(7))]
    assert store.page("file", "t", "file-nope", 3) == ([], False)
    assert [r["id"] for r in store.scan("file", "t", batch=2)] == seen


def test_upload_expiry_and_stored_bytes_through_the_api(client_a, http_a, redis_client, stack_env):
    before = http_a.get("/v1/storage").json()
    upload = client_a.files.create(file=("e.jsonl", b'{"prompt": "a", "completion": "b"}\n'), purpose="batch",
                                   expires_after={"anchor": "created_at", "seconds": 3600})
    assert upload.expires_at == upload.created_at + 3600
    usage = http_a.get("/v1/storage").json()
    assert usage["file_bytes"] == before["file_bytes"] + upload.bytes
    assert usage["file_count"] == before["file_count"] + 1
    reply = http_a.post("/v1/files", files={"file": ("e.jsonl", b"{}\n")},
                        data={"purpose": "batch", "expires_after[anchor]": "created_at",
                              "expires_after[seconds]": "60"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "expires_after.seconds"
    settings = Settings(redis_url=stack_env["XPUJOBS_REDIS_URL"], artifact_root=stack_env["XPUJOBS_ARTIFACT_ROOT"])
    retention.sweep(RecordStore(redis_client), settings.artifact_root, settings, now=time.time() + 3601)
    assert http_a.get(f"/v1/files/{upload.id}").status_code == 404
    assert http_a.get("/v1/storage").json()["file_bytes"] == before["file_bytes"]


def test_a_worker_node_sweeps_without_an_api(stack_env, stack_dir, redis_url):
    """A deployment of workers alone (no API process) is swept too: by a node's reconciler, under the same lock.
    Was: only API processes swept, so such a deployment kept every record."""
    db = redis_url.rsplit("/", 1)[0] + "/4"  # a Redis database of its own: nothing of the session stack is swept
    client = redis.Redis.from_url(db, decode_responses=True)
    client.flushdb()
    store = RecordStore(client)
    add(store, "chat", "chatcmpl-old", "completed", 2 * DAY)
    add(store, "chat", "chatcmpl-young", "completed", 0)
    env = {**stack_env, "XPUJOBS_REDIS_URL": db, "XPUJOBS_INFERENCE_RETENTION_SECONDS": str(DAY),
           "XPUJOBS_RETENTION_SWEEP_SECONDS": "1"}
    node = WorkerNode(env, "sweeper", stack_dir)
    try:
        _wait(lambda: node.registered(client) or node.proc.poll() is not None, 240, "the node")
        assert node.proc.poll() is None, (stack_dir / "sweeper.log").read_text()
        _wait(lambda: store.get("chat", "chatcmpl-old") is None, 30, "the node's retention sweep (every second)")
        assert store.get("chat", "chatcmpl-young") is not None
        assert not client.exists(events.stream_key("chatcmpl-old"))
    finally:
        node.stop()
        client.flushdb()


def test_one_sweep_per_period_across_processes(store, tmp_path):
    settings = Settings(redis_url="redis://unused", artifact_root=tmp_path, retention_sweep_seconds=60)
    add(store, "chat", "chatcmpl-old", "completed", 8 * DAY)
    assert retention.sweep_when_due(store, tmp_path, settings) == {"chat": 1}
    add(store, "chat", "chatcmpl-older", "completed", 9 * DAY)
    assert retention.sweep_when_due(store, tmp_path, settings) is None  # another process's turn was this period's
    assert store.get("chat", "chatcmpl-older") is not None
