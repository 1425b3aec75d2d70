"""Bounded storage: finished records, their events and their artifacts are removed after a retention age, and
files after their `expires_at`, so Redis (which runs with noeviction) and the artifact disk do not fill up.

One sweep walks each per-tenant index from its oldest entry (the index is scored by creation time), at most
BATCH records of each index per call, and removes the records that are both older than their kind's retention
and finished: a record still queued or running is never touched, nor a fine-tuning job that succeeded (its
fine-tuned model stays usable until it is deleted). Files carry their own expiry in one sorted set.

Every API process and every worker node offers to sweep each retention_sweep_seconds (a deployment may run
workers without an API, or the reverse); a Redis lock held for that period lets one of them sweep per period.
"""

import logging
import shutil
import time
from pathlib import Path

from contract.events import stream_key
from contract.layout import file_path, job_dir
from contract.records import RecordStore, index_key
from contract.settings import Settings

# Statuses after which a record of each kind may be removed once old enough.
FINISHED = {
    "ftjob": {"failed", "cancelled"},
    "batch": {"completed", "failed", "expired", "cancelled"},
    "chunk": {"completed", "failed", "cancelled"},
    "chat": {"completed", "failed", "cancelled", "incomplete"},
    "completion": {"completed", "failed", "cancelled", "incomplete"},
    "response": {"completed", "failed", "cancelled", "incomplete"},
}
# Kinds whose artifacts (under jobs/<id>) go with the record.
WITH_ARTIFACTS = {"ftjob", "batch"}
EXPIRING = "expiring:file"  # sorted set: "<tenant>/<file id>" scored by expires_at
BATCH = 1000
LOCK = "lock:retention"

log = logging.getLogger("xpujobs.retention")


def retention_of(kind: str, settings: Settings) -> int:
    return settings.inference_retention_seconds if kind in ("chat", "completion", "response") \
        else settings.retention_seconds


def expire_file_at(store: RecordStore, tenant: str, file_id: str, expires_at: int) -> None:
    store.redis.zadd(EXPIRING, {f"{tenant}/{file_id}": expires_at})


def sweep(store: RecordStore, root: Path, settings: Settings, now: float | None = None) -> dict[str, int]:
    """One pass; returns how many records of each kind were removed."""
    now = time.time() if now is None else now
    removed: dict[str, int] = {}
    for kind, finished in FINISHED.items():
        cutoff = now - retention_of(kind, settings)
        for index in store.redis.scan_iter(match=index_key(kind, "*"), count=1000):
            tenant = index.split(":", 2)[2]
            ids = store.redis.zrangebyscore(index, "-inf", cutoff, start=0, num=BATCH)
            gone = []
            for record_id, record in zip(ids, store.get_many(kind, ids)):
                if record is None:
                    gone.append(record_id)  # an index entry left by a deleted record
                elif record.get("status") in finished:
                    gone.append(record_id)
                    if kind in WITH_ARTIFACTS:
                        shutil.rmtree(job_dir(root, tenant, record_id), ignore_errors=True)
            if gone:
                store.delete_many(kind, gone, tenant)
                store.redis.delete(*[stream_key(r) for r in gone])
                removed[kind] = removed.get(kind, 0) + len(gone)
    due = store.redis.zrangebyscore(EXPIRING, "-inf", now, start=0, num=BATCH)
    for entry in due:
        tenant, file_id = entry.split("/", 1)
        file_path(root, tenant, file_id).unlink(missing_ok=True)
        store.delete("file", file_id, tenant)
    if due:
        store.redis.zrem(EXPIRING, *due)
        removed["file"] = len(due)
    return removed


def sweep_when_due(store: RecordStore, root: Path, settings: Settings) -> dict[str, int] | None:
    """One pass, unless another process took this period's lock (None then). Errors are logged, not raised: Redis
    away or a file busy, the next period tries again."""
    try:
        if not store.redis.set(LOCK, "1", nx=True, px=int(settings.retention_sweep_seconds * 1000)):
            return None
        removed = sweep(store, root, settings)
    except Exception:
        log.exception("retention sweep failed")
        return None
    if removed:
        log.info("retention removed %s", removed)
    return removed
