"""Streamed inference (stream=true on chat completions, completions and responses). The worker writes a request's
output to its Redis stream as the engine produces it (contract.live): content text, tool-call fragments and
logprobs; this reads that stream and hands it to the route, which sends it on as OpenAI's server-sent events. A
client that goes away, before the first output or after, cancels its request (a background response excepted),
which frees its place in the engine."""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from sse_starlette import EventSourceResponse

from api.errors import APIError
from api.inference_service import client_gone, raise_unless_completed
from contract import events
from contract.live import output_key
from contract.records import RecordStore

BLOCK_MS = 1000
# While this process reads streams more than BUSY_READS times in READ_INTERVAL_SECONDS, each stream is read at most
# once in that interval after its first output. Each read is an event sent, and read at every engine step (a few ms
# apart on a GPU), the streams of a burst's first requests would take the event loop from the requests still
# arriving; a read that waited brings every step since, joined into one event (deltas()). Otherwise (a few
# streams) each is read as its output comes.
BUSY_READS = 16
READ_INTERVAL_SECONDS = 0.02
_window = [0.0, 0]  # the current interval's start, and the reads in it


def _busy() -> bool:
    """Counts a read; whether this interval's reads are over BUSY_READS."""
    now = time.monotonic()
    if now - _window[0] > READ_INTERVAL_SECONDS:
        _window[:] = [now, 0]
    _window[1] += 1
    return _window[1] > BUSY_READS


@dataclass
class Delta:
    """A choice's new output: content text, its tokens' logprobs (chat's per-token entries; they go with the
    tokens, which may be ahead of the text) and tool-call fragments in chat's delta.tool_calls shape."""
    choice: int
    text: str = ""
    logprobs: list[dict] | None = None
    tool_calls: list[dict] = field(default_factory=list)


Batches = AsyncIterator[list[Delta]]


class ClientGone(Exception):
    pass


async def _read(client, record_id: str, timeout: float, request: Request) -> AsyncIterator[list[dict]]:
    """The stream's entries as they arrive, a list per read, until (and with) the end entry. Raises ClientGone
    if the client disconnects before the first output (after it, the event stream's own watch sees that)."""
    deadline, last, read_at = time.monotonic() + timeout, "0-0", None
    while time.monotonic() < deadline:
        if read_at is not None and _busy() and (wait := read_at + READ_INTERVAL_SECONDS - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        reply = await client.xread({output_key(record_id): last}, block=BLOCK_MS, count=1000)
        if not reply:
            if last == "0-0" and await request.is_disconnected():
                raise ClientGone
            continue
        entries = reply[0][1]
        last, read_at = entries[-1][0], time.monotonic()
        yield [fields for _, fields in entries]
        if "end" in entries[-1][1]:
            return
    raise TimeoutError


def deltas(entries: list[dict]) -> list[Delta]:
    """A read's entries as deltas, a choice's consecutive ones joined (one event each, however many engine steps a
    read caught up with) up to a call's start, and a call's consecutive argument fragments joined."""
    joined: list[Delta] = []
    for fields in entries:
        if "end" in fields:
            break
        delta = Delta(int(fields["c"]), fields["t"], json.loads(fields["l"]) if "l" in fields else None,
                      json.loads(fields["tc"]) if "tc" in fields else [])
        if not (delta.text or delta.logprobs or delta.tool_calls):
            continue
        # A call's first fragment starts a delta of its own: the logprobs before it are the text's (its message's).
        if not joined or joined[-1].choice != delta.choice or any("id" in f for f in delta.tool_calls):
            joined.append(delta)
            continue
        last = joined[-1]
        last.text += delta.text
        if delta.logprobs:
            last.logprobs = (last.logprobs or []) + delta.logprobs
        for fragment in delta.tool_calls:
            if last.tool_calls and last.tool_calls[-1]["index"] == fragment["index"] and "id" not in fragment:
                function = last.tool_calls[-1]["function"]
                function["arguments"] += fragment["function"]["arguments"]
            else:
                last.tool_calls.append(fragment)
    return joined


async def respond(request: Request, kind: str, record: dict, store: RecordStore, timeout: float,
                  send: Callable[[Batches], AsyncIterator], *, cancel_on_disconnect: bool = True
                  ) -> EventSourceResponse:
    """Wait for the request's first output, then stream: `send(batches)` turns the output's text deltas into
    events. A request that fails before producing anything gets its error status, not a stream."""
    record_id = record["id"]
    output = _read(request.app.state.aioredis, record_id, timeout, request)
    try:
        first = await anext(output)
    except TimeoutError:
        events.request_cancel(store.redis, record_id)
        raise APIError(504, f"The request produced nothing within {timeout:.0f} s and was cancelled.",
                       code="timeout") from None
    except ClientGone:
        if cancel_on_disconnect:
            events.request_cancel(store.redis, record_id)
        raise client_gone() from None
    if "end" in first[0]:
        raise_unless_completed(await asyncio.to_thread(store.get, kind, record_id), store, kind)

    async def batches() -> Batches:
        yield deltas(first)
        async for entries in output:
            yield deltas(entries)

    async def generate():
        finished = False
        try:
            async for event in send(batches()):
                yield event
            finished = True
        except TimeoutError:
            yield json.dumps({"error": {"message": f"The request did not finish within {timeout:.0f} s.",
                                        "type": "server_error", "param": None, "code": "timeout"}})
        finally:
            if not finished and cancel_on_disconnect:
                # Synchronous on purpose: this task is being cancelled, and an await here would be cancelled too.
                events.request_cancel(store.redis, record_id)

    return EventSourceResponse(generate(), ping=15)


def error_event(record: dict) -> str:
    error = record.get("error") or {"message": f"The request ended {record['status']}.", "code": None}
    return json.dumps({"error": {"message": error["message"], "type": "server_error", "param": None,
                                 "code": error.get("code")}})
