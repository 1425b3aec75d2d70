"""Per-job event streams (Redis Streams), the job's lease and its cancel flag.

A stream entry's id doubles as the event id, so clients page with `after` and resume after a disconnect.
"""

import json
import re
import threading
import time
from contextlib import contextmanager, suppress
from typing import Any

import redis
from redis.exceptions import LockError

from contract import webhooks

STREAM_MAXLEN = 10_000


def stream_key(job_id: str) -> str:
    return f"events:{job_id}"


def event_id(entry_id: str) -> str:
    return "ftevent-" + entry_id.replace("-", "_")


_EVENT_ID = re.compile(r"ftevent-[0-9]{1,20}_[0-9]{1,20}")


class BadEventId(ValueError):
    """An `after` cursor that is not an event id this service gave out."""


def entry_id(event_id_: str) -> str:
    if not _EVENT_ID.fullmatch(event_id_):
        raise BadEventId(f"'{event_id_}' is not an event id (ftevent-<digits>_<digits>).")
    return event_id_.removeprefix("ftevent-").replace("_", "-")


def emit(client: redis.Redis, job_id: str, message: str, *, level: str = "info",
         type_: str = "message", data: dict[str, Any] | None = None) -> str:
    fields = {
        "created_at": str(int(time.time())),
        "level": level,
        "message": message,
        "type": type_,
        "data": json.dumps(data or {}),
    }
    entry = client.xadd(stream_key(job_id), fields, maxlen=STREAM_MAXLEN, approximate=True)
    if data and "status" in data:  # a job's ending event goes out to its tenant's webhooks too
        webhooks.job_ended(client, job_id, data["status"])
    return entry


def _to_event(entry: str, fields: dict[str, str]) -> dict[str, Any]:
    return {
        "id": event_id(entry),
        "created_at": int(fields["created_at"]),
        "level": fields["level"],
        "message": fields["message"],
        "type": fields["type"],
        "data": json.loads(fields["data"]),
    }


def read_newest_first(client: redis.Redis, job_id: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
    """OpenAI's order: newest first; `after` is the id of the last event of the previous page (BadEventId if it
    is not an event id)."""
    top = "+"
    if after:
        top = "(" + entry_id(after)
    entries = client.xrevrange(stream_key(job_id), max=top, min="-", count=limit + 1)
    events = [_to_event(e, f) for e, f in entries]
    return events[:limit], len(events) > limit


async def read_after(client, job_id: str, after_entry: str, block_ms: int, count: int = 100) -> list[dict]:
    """Oldest first, the events after stream entry `after_entry` ("0-0": from the start), waiting up to block_ms
    for one when there is none yet (client: an asyncio Redis)."""
    reply = await client.xread({stream_key(job_id): after_entry}, count=count, block=block_ms)
    return [_to_event(e, f) for _, entries in reply or [] for e, f in entries]


def read_all(client: redis.Redis, job_id: str) -> list[dict]:
    return [_to_event(e, f) for e, f in client.xrange(stream_key(job_id))]


def latest_of_type(client: redis.Redis, job_id: str, type_: str, scan: int = 50) -> dict | None:
    """The newest event of one type among the job's last `scan` events (None if there is none)."""
    for entry, fields in client.xrevrange(stream_key(job_id), count=scan):
        if fields.get("type") == type_:
            return _to_event(entry, fields)
    return None


def _cancel_key(job_id: str) -> str:
    return f"cancel:{job_id}"


def request_cancel(client: redis.Redis, job_id: str) -> None:
    client.set(_cancel_key(job_id), "1", ex=7 * 24 * 3600)


def cancel_requested(client: redis.Redis, job_id: str) -> bool:
    return client.exists(_cancel_key(job_id)) == 1


def cancels_requested(client: redis.Redis, job_ids: list[str]) -> list[bool]:
    """cancel_requested for many jobs in one round trip."""
    return [flag is not None for flag in client.mget([_cancel_key(j) for j in job_ids])] if job_ids else []


def _pause_key(job_id: str) -> str:
    return f"pause:{job_id}"


def request_pause(client: redis.Redis, job_id: str) -> None:
    """A running fine-tune saves a checkpoint and stops, freeing its device; resume clears the flag."""
    client.set(_pause_key(job_id), "1", ex=7 * 24 * 3600)


def pause_requested(client: redis.Redis, job_id: str) -> bool:
    return client.exists(_pause_key(job_id)) == 1


def clear_pause(client: redis.Redis, job_id: str) -> None:
    client.delete(_pause_key(job_id))


def lease_key(job_id: str) -> str:
    return f"lease:{job_id}"


def refresh_lease(client: redis.Redis, job_id: str, holder: str, seconds: float) -> None:
    """Take the lease (a claim: whoever held it before lost the job)."""
    client.set(lease_key(job_id), holder, px=int(seconds * 1000))


_RENEW = """local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1"""


def renew_leases(client: redis.Redis, job_ids: list[str], holder: str, seconds: float) -> None:
    """Keep `holder`'s leases, in one round trip: each is renewed where it still holds it or where it lapsed (Redis
    was away longer than a lease), never where another holder has it (the job was requeued while this holder was
    stalled, and claimed elsewhere: it is theirs now)."""
    if not job_ids:
        return
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.eval(_RENEW, 1, lease_key(job_id), holder, int(seconds * 1000))
    pipe.execute()


def lease_holders(client: redis.Redis, job_ids: list[str]) -> list[str | None]:
    """Who holds each job's lease (None where it lapsed), in one round trip."""
    return client.mget([lease_key(j) for j in job_ids]) if job_ids else []


_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def release_lease(client: redis.Redis, job_id: str, holder: str) -> None:
    """Drop the lease only if `holder` still holds it: a requeued job's new holder keeps its own."""
    client.eval(_RELEASE, 1, lease_key(job_id), holder)


@contextmanager
def _renewed_every(seconds: float, renew, name: str):
    """Call renew every seconds / 3 while the body runs (a Redis blip skips a round: the body fails on its own
    calls)."""
    stop = threading.Event()

    def loop():
        while not stop.wait(seconds / 3):
            try:
                renew()
            except redis.RedisError:
                pass

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def lease_held(client: redis.Redis, job_id: str, holder: str, seconds: float):
    """Hold a job's lease while the body runs (renewed from a thread, however long the body takes), released
    at the end. If the process dies, the lease lapses within `seconds` and the reconciler takes over."""
    refresh_lease(client, job_id, holder, seconds)
    try:
        with _renewed_every(seconds, lambda: renew_leases(client, [job_id], holder, seconds), f"lease-{job_id}"):
            yield
    finally:
        release_lease(client, job_id, holder)


@contextmanager
def exclusive(client: redis.Redis, name: str, seconds: float):
    """A lock on `name` held while the body runs (renewed however long it takes; it lapses within `seconds` if
    the process dies). Yields whether this process has it: False while another does, and the body should skip."""
    lock = client.lock(f"lock:{name}", timeout=seconds, blocking=False, thread_local=False)
    if not lock.acquire():
        yield False
        return
    try:
        with _renewed_every(seconds, lock.reacquire, f"lock-{name}"):
            yield True
    finally:
        with suppress(LockError):
            lock.release()


def done_key(request_id: str) -> str:
    """A list the worker pushes to when a request finishes, so a synchronous caller can BLPOP it."""
    return f"done:{request_id}"


def signal_done(client: redis.Redis, request_id: str) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.rpush(done_key(request_id), "1")
    pipe.expire(done_key(request_id), 3600)
    pipe.execute()
