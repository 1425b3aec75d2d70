"""Streamed inference (stream=true on chat completions, completions and responses). The worker writes a request's
output to its Redis stream as the engine produces it (contract.live); this reads that stream and hands it to the
route, which sends it on as OpenAI's server-sent events. A client that goes away cancels its request (a background
response excepted), which frees its place in the engine."""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from sse_starlette import EventSourceResponse

from api.errors import APIError
from api.inference_service import raise_unless_completed
from contract import events
from contract.live import output_key
from contract.records import RecordStore

BLOCK_MS = 1000
Batches = AsyncIterator[list[tuple[int, str]]]


async def _read(client, record_id: str, timeout: float) -> AsyncIterator[list[dict]]:
    """The stream's entries as they arrive, a list per read, until (and with) the end entry."""
    deadline, last = time.monotonic() + timeout, "0-0"
    while time.monotonic() < deadline:
        reply = await client.xread({output_key(record_id): last}, block=BLOCK_MS, count=1000)
        if not reply:
            continue
        entries = reply[0][1]
        last = entries[-1][0]
        yield [fields for _, fields in entries]
        if "end" in entries[-1][1]:
            return
    raise TimeoutError


def texts(entries: list[dict]) -> list[tuple[int, str]]:
    """(choice, text) from a read's entries, a choice's consecutive deltas joined: one event each, however many
    engine steps a read caught up with."""
    joined: list[tuple[int, str]] = []
    for fields in entries:
        if "end" in fields:
            break
        choice = int(fields["c"])
        if not fields["t"]:
            continue
        if joined and joined[-1][0] == choice:
            joined[-1] = (choice, joined[-1][1] + fields["t"])
        else:
            joined.append((choice, fields["t"]))
    return joined


async def respond(request: Request, kind: str, record: dict, store: RecordStore, timeout: float,
                  send: Callable[[Batches], AsyncIterator], *, cancel_on_disconnect: bool = True
                  ) -> EventSourceResponse:
    """Wait for the request's first output, then stream: `send(batches)` turns the output's text deltas into
    events. A request that fails before producing anything gets its error status, not a stream."""
    record_id = record["id"]
    output = _read(request.app.state.aioredis, record_id, timeout)
    try:
        first = await anext(output)
    except TimeoutError:
        events.request_cancel(store.redis, record_id)
        raise APIError(504, f"The request produced nothing within {timeout:.0f} s and was cancelled.",
                       code="timeout") from None
    if "end" in first[0]:
        raise_unless_completed(await asyncio.to_thread(store.get, kind, record_id), store, kind)

    async def batches() -> Batches:
        yield texts(first)
        async for entries in output:
            yield texts(entries)

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


def buffered(request: dict) -> bool:
    """Whether the output is sent whole at the end rather than as it comes: text that may turn out to be a tool
    call is parsed only once complete, and logprobs come with the finished result."""
    offered = bool(request.get("tools")) and request.get("tool_choice") != "none"
    return offered or request.get("logprobs") is not None


async def drain(batches: Batches) -> None:
    async for _ in batches:
        pass


def error_event(record: dict) -> str:
    error = record.get("error") or {"message": f"The request ended {record['status']}.", "code": None}
    return json.dumps({"error": {"message": error["message"], "type": "server_error", "param": None,
                                 "code": error.get("code")}})
