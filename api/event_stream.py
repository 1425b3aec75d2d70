"""A job's events as server-sent events (fine-tuning jobs and batches): the history oldest first, then each new
event as it is emitted, until the job has ended. Each SSE id is the event's id, so a client that reconnects with
Last-Event-ID (or `after`) resumes right after the last event it got."""

import json
import re
from typing import Callable

import anyio
from fastapi import Request
from sse_starlette import EventSourceResponse, ServerSentEvent

from api.errors import invalid
from contract import events

# Statuses after which a job emits nothing more (fine-tuning jobs and batches).
ENDED = {"succeeded", "failed", "cancelled", "completed", "expired"}
BLOCK_MS = 1000
# How many idle reads to wait, once the record has ended, for its closing event (emitted just after the status).
GRACE_READS = 3
_ENTRY = re.compile(r"\d+-\d+")


def wants_stream(request: Request, stream: bool) -> bool:
    return stream or "text/event-stream" in request.headers.get("accept", "")


def list_or_stream(request: Request, redis, job_id: str, object_name: str, after: str | None, limit: int | None,
                   stream_asked: bool, status_of: Callable[[], str | None]):
    """GET .../events of a job or batch: a page of its events, newest first, or with a stream every event."""
    if wants_stream(request, stream_asked):
        if limit is not None:
            raise invalid("limit pages the event list; a stream sends every event.", param="limit")
        return stream(request, job_id, object_name, after, status_of)
    try:
        page, has_more = events.read_newest_first(redis, job_id, after, limit or 20)
    except events.BadEventId as exc:
        raise invalid(str(exc), param="after") from None
    return {"object": "list", "data": [{**e, "object": object_name} for e in page], "has_more": has_more}


def stream(request: Request, job_id: str, object_name: str, after: str | None,
           status_of: Callable[[], str | None]) -> EventSourceResponse:
    """status_of: the record's current status (called in a thread: it reads Redis synchronously)."""
    resume = request.headers.get("last-event-id") or after
    try:
        start = events.entry_id(resume) if resume else "0-0"
    except events.BadEventId:
        start = ""
    if not _ENTRY.fullmatch(start):
        raise invalid(f"'{resume}' is not an event id of this job.",
                      param="Last-Event-ID" if request.headers.get("last-event-id") else "after")
    aioredis = request.app.state.aioredis

    async def generate():
        last, idle_after_end = start, 0
        while True:
            batch = await events.read_after(aioredis, job_id, last, BLOCK_MS)
            for event in batch:
                last = events.entry_id(event["id"])
                yield ServerSentEvent(json.dumps({**event, "object": object_name}), id=event["id"])
                if event["data"].get("status") in ENDED:
                    return
            if batch:
                idle_after_end = 0
            elif await anyio.to_thread.run_sync(status_of) in ENDED:
                idle_after_end += 1
                if idle_after_end >= GRACE_READS:
                    return

    return EventSourceResponse(generate(), ping=15)
