"""Durable job and file records in Redis hashes (not Celery's result backend: it expires and cannot list).

Each record is a hash whose values are JSON. A per-tenant sorted set indexes records by creation time,
status changes go through compare-and-set, and an Idempotency-Key maps to the first record created with it.
"""

import json
import secrets
import time
from typing import Any, Iterable

import redis

ID_PREFIX = {
    "file": "file-",
    "ftjob": "ftjob-",
    "response": "resp_",
    "chat": "chatcmpl-",
    "completion": "cmpl-",
    "batch": "batch_",
    "batch_request": "batch_req_",
    "webhook": "wh_",
}

_CAS = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
current = cjson.decode(current)
for i = 1, #ARGV - 1 do
  if ARGV[i] == current then
    local fields = cjson.decode(ARGV[#ARGV])
    for k, v in pairs(fields) do redis.call('HSET', KEYS[1], k, v) end
    return 1
  end
end
return 0
"""

# _CAS and the lease in one step, for a node taking a record: where the status is one of ARGV[4..], the lease
# (KEYS[2]) is set to ARGV[1] for ARGV[2] ms, the fields (ARGV[3]) applied and attempts counted; where it is not,
# neither key changes (another holder's lease stays). Returns whether it was taken, and the record as it is now.
_CLAIM = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return {0, {}} end
current = cjson.decode(current)
for i = 4, #ARGV do
  if ARGV[i] == current then
    redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
    for k, v in pairs(cjson.decode(ARGV[3])) do redis.call('HSET', KEYS[1], k, v) end
    local attempts = tonumber(cjson.decode(redis.call('HGET', KEYS[1], 'attempts') or 'null')) or 0
    redis.call('HSET', KEYS[1], 'attempts', string.format('%d', attempts + 1))
    return {1, redis.call('HGETALL', KEYS[1])}
  end
end
return {0, redis.call('HGETALL', KEYS[1])}
"""


def new_id(kind: str) -> str:
    return ID_PREFIX[kind] + secrets.token_hex(12)


def now() -> int:
    return int(time.time())


def after_cursor(items: list, after: str | None, key=lambda item: item) -> list:
    """OpenAI's `after` paging: the items following the one whose key is `after`; all of them without a cursor,
    none for a cursor that is not there."""
    if not after:
        return items
    keys = [key(item) for item in items]
    return items[keys.index(after) + 1:] if after in keys else []


def _key(kind: str, record_id: str) -> str:
    return f"rec:{kind}:{record_id}"


def index_key(kind: str, tenant: str) -> str:
    """The tenant's records of a kind, scored by creation time."""
    return f"idx:{kind}:{tenant}"


def _encode(fields: dict[str, Any]) -> dict[str, str]:
    return {k: json.dumps(v) for k, v in fields.items()}


class RecordStore:
    def __init__(self, client: redis.Redis):
        self.redis = client
        self._cas = client.register_script(_CAS)
        self._claim = client.register_script(_CLAIM)

    def create(self, kind: str, record: dict[str, Any], idempotency_key: str | None = None, *,
               track: bool = False) -> tuple[dict, bool]:
        """Store a new record; with an idempotency key already used, return the first record instead. With
        track, the record is watched by the reconciler from the moment it exists (one transaction).

        Returns (record, created).
        """
        tenant = record["tenant"]
        if idempotency_key:
            idem = f"idem:{kind}:{tenant}:{idempotency_key}"
            if not self.redis.set(idem, record["id"], nx=True, ex=24 * 3600):
                first = self.get(kind, self.redis.get(idem), tenant)
                if first is not None:
                    return first, False
                self.redis.set(idem, record["id"], ex=24 * 3600)
        pipe = self.redis.pipeline()
        pipe.hset(_key(kind, record["id"]), mapping=_encode(record))
        pipe.zadd(index_key(kind, tenant), {record["id"]: time.time()})
        if track:
            pipe.sadd(f"active:{kind}", record["id"])
        pipe.execute()
        return record, True

    def create_many(self, kind: str, records: list[dict[str, Any]]) -> None:
        """Store new records in one round trip (no idempotency keys, not tracked)."""
        pipe = self.redis.pipeline(transaction=False)
        for record in records:
            pipe.hset(_key(kind, record["id"]), mapping=_encode(record))
            pipe.zadd(index_key(kind, record["tenant"]), {record["id"]: time.time()})
        pipe.execute()

    def get(self, kind: str, record_id: str | None, tenant: str | None = None) -> dict | None:
        """The record, or None when it does not exist or belongs to another tenant."""
        if not record_id:
            return None
        record = self.get_many(kind, [record_id])[0]
        if record is None:
            return None
        if tenant is not None and record.get("tenant") != tenant:
            return None
        return record

    def get_many(self, kind: str, record_ids: list[str]) -> list[dict | None]:
        """get for many records in one round trip, in the same order (None where one is gone)."""
        pipe = self.redis.pipeline(transaction=False)
        for record_id in record_ids:
            pipe.hgetall(_key(kind, record_id))
        return [{k: json.loads(v) for k, v in raw.items()} if raw else None for raw in pipe.execute()]

    def tenants(self, refs: list[tuple[str, str]]) -> list[str | None]:
        """The tenant owning each (kind, record id), in one round trip (None where there is no such record)."""
        pipe = self.redis.pipeline(transaction=False)
        for kind, record_id in refs:
            pipe.hget(_key(kind, record_id), "tenant")
        return [json.loads(t) if t else None for t in pipe.execute()]

    def update(self, kind: str, record_id: str, fields: dict[str, Any]) -> None:
        self.redis.hset(_key(kind, record_id), mapping=_encode(fields))

    def transition(self, kind: str, record_id: str, from_status: Iterable[str], fields: dict[str, Any]) -> bool:
        """Apply fields (normally a new status) only if the current status is one of from_status."""
        return bool(self._cas(keys=[_key(kind, record_id)], args=[*from_status, json.dumps(_encode(fields))]))

    def claim_many(self, records: list[tuple[str, str]], from_status: Iterable[str], fields: dict[str, Any],
                   lease_keys: list[str], holder: str, lease_seconds: float) -> list[tuple[bool, dict | None]]:
        """For each (kind, record id), in one round trip: where its status is one of from_status, its lease (the
        matching lease key) is held by holder and fields applied, its attempts counted, as one step (the reconciler
        never sees it running without a lease). Each: (whether it was taken, the record after, None if gone)."""
        pipe = self.redis.pipeline(transaction=False)
        encoded = json.dumps(_encode(fields))
        for (kind, record_id), lease in zip(records, lease_keys, strict=True):
            self._claim(keys=[_key(kind, record_id), lease],
                        args=[holder, int(lease_seconds * 1000), encoded, *from_status], client=pipe)
        return [(bool(taken), {k: json.loads(v) for k, v in zip(raw[::2], raw[1::2])} if raw else None)
                for taken, raw in pipe.execute()]

    def transition_and_track(self, kind: str, record_id: str, from_status: Iterable[str], fields: dict[str, Any],
                             track: dict[str, list[str]]) -> bool:
        """transition, and in the same transaction hand records (kind -> ids) to the reconciler: either the
        status changes and they are tracked, or neither happens."""
        key, allowed = _key(kind, record_id), set(from_status)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    current = pipe.hget(key, "status")
                    if current is None or json.loads(current) not in allowed:
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.hset(key, mapping=_encode(fields))
                    for tracked_kind, ids in track.items():
                        if ids:
                            pipe.sadd(f"active:{tracked_kind}", *ids)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def incr(self, kind: str, record_id: str, field: str, amount: int = 1) -> int:
        """Atomically add to an integer field (stored as JSON, so a plain integer string)."""
        return self.redis.hincrby(_key(kind, record_id), field, amount)

    def add_counts(self, kind: str, record_id: str, counts: dict[str, int]) -> None:
        """Several incr in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for field, amount in counts.items():
            pipe.hincrby(_key(kind, record_id), field, amount)
        pipe.execute()

    def delete(self, kind: str, record_id: str, tenant: str) -> None:
        pipe = self.redis.pipeline()
        pipe.delete(_key(kind, record_id))
        pipe.zrem(index_key(kind, tenant), record_id)
        pipe.execute()

    def delete_many(self, kind: str, record_ids: list[str], tenant: str) -> None:
        if not record_ids:
            return
        pipe = self.redis.pipeline()
        pipe.delete(*[_key(kind, r) for r in record_ids])
        pipe.zrem(index_key(kind, tenant), *record_ids)
        pipe.execute()

    def page(self, kind: str, tenant: str, after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        """Newest first; `after` is the id of the last record of the previous page. Returns (page, has_more).
        Reads only the page's part of the index (from the cursor's rank), whatever the index's size."""
        index, start = index_key(kind, tenant), 0
        if after:
            rank = self.redis.zrevrank(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = self.redis.zrevrange(index, start, start + limit)
        page = [r for r in self.get_many(kind, ids) if r is not None and r.get("tenant") == tenant]
        return page[:limit], len(ids) > limit

    def count(self, kind: str, tenant: str) -> int:
        return self.redis.zcard(index_key(kind, tenant))

    def stored_bytes(self, tenant: str) -> int:
        """The bytes of the tenant's files (uploads and outputs)."""
        return sum(int(r.get("bytes") or 0) for r in self.scan("file", tenant))

    def scan(self, kind: str, tenant: str, batch: int = 500):
        """Every record of the tenant's kind, newest first, read a batch at a time."""
        start = 0
        while ids := self.redis.zrevrange(index_key(kind, tenant), start, start + batch - 1):
            yield from (r for r in self.get_many(kind, ids) if r is not None and r.get("tenant") == tenant)
            start += batch

    # Records the reconciler watches: queued or running work that a dead worker could strand.
    def track(self, kind: str, record_id: str) -> None:
        self.redis.sadd(f"active:{kind}", record_id)

    def untrack(self, kind: str, record_id: str) -> None:
        self.redis.srem(f"active:{kind}", record_id)

    def tracked(self, kind: str) -> set[str]:
        return self.redis.smembers(f"active:{kind}")
