"""Single inference requests (responses, chat completions, completions): record, route, enqueue, and wait when
synchronous."""

import asyncio
import json
import time

import redis.asyncio as aioredis
from celery import Celery
from starlette.requests import Request

from api.catalog import resolve
from api.errors import APIError
from api.placement import route
from contract import events
from contract.queues import publish
from contract.records import RecordStore, new_id, now
from contract.routing import inference_requirement
from contract.settings import Settings

TERMINAL = {"completed", "failed", "cancelled", "incomplete"}
# A failed request's code -> the status the caller gets; anything else is a server error.
STATUS_OF = {"invalid_prompt": 400, "invalid_value": 400, "context_length_exceeded": 400, "unsupported_attention": 400,
             "kernels_unavailable": 400, "model_not_found": 404, "model_capacity": 503}


# No tokenizer puts more than this many UTF-8 bytes in one token on average, so a prompt over
# engine_max_seq_len x this many bytes cannot fit and is refused here, without tokenizing it on a worker.
MAX_BYTES_PER_TOKEN = 64


def _refuse_what_cannot_fit(kind: str, request: dict, settings: Settings) -> None:
    prompt = request.get("prompt", request.get("messages"))
    param = "prompt" if "prompt" in request else ("input" if kind == "response" else "messages")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        size, unit, limit = len(prompt), "tokens", settings.engine_max_seq_len
    else:
        size, unit = len(json.dumps(prompt, ensure_ascii=False).encode("utf-8", "replace")), "bytes"
        limit = settings.engine_max_seq_len * MAX_BYTES_PER_TOKEN
    if size > limit:
        raise APIError(400, f"The input ({size} {unit}) cannot fit the context of at most "
                            f"{settings.engine_max_seq_len} tokens.", param=param, code="context_length_exceeded")


def submit(kind: str, tenant: str, request: dict, *, settings: Settings, store: RecordStore, celery: Celery,
           extra: dict | None = None) -> dict:
    """Create a queued record of an inference request and publish it. Nothing is created on a 4xx."""
    received = time.time()
    base, ref = resolve(request["model"], tenant, settings, store)
    _refuse_what_cannot_fit(kind, request, settings)
    queue, _ = route(store.redis, inference_requirement(settings.models_root, base), settings)
    record = {
        "id": new_id(kind), "tenant": tenant, "status": "queued", "created_at": now(),
        "timings": {"received": received}, "model": request["model"],
        "base_model": base, "adapter_job": ref.job_id if ref else None,
        "adapter_step": ref.checkpoint_step if ref else None, "request": request, "queue": queue,
        **(extra or {}),
    }
    store.create(kind, record, track=True)
    publish(celery, store, kind, record["id"], queue)
    return record


def client_gone() -> APIError:
    """What a request whose client went away ends with (nobody reads it; nginx's status for it, in the logs)."""
    return APIError(499, "The client closed the connection; the request was cancelled.", code="client_closed")


def _cancel(kind: str, record_id: str, store: RecordStore) -> None:
    """Stop the request in the engine, or (still queued) before it starts."""
    events.request_cancel(store.redis, record_id)
    store.transition(kind, record_id, ["queued"], {"status": "cancelled"})


async def wait_for(record_id: str, kind: str, *, store: RecordStore, client: aioredis.Redis, timeout: float,
                   request: Request) -> dict:
    """Block (without holding a thread) until the request has finished, then read it. A client that disconnects
    meanwhile cancels it, as a streaming one does, so it does not hold its place in the engine for nobody.

    A done signal whose record is not finished (it was requeued meanwhile) means: keep waiting. Short BLPOPs in
    a loop, since one long one would outlast the client's socket timeout (5 s by default); the disconnect is
    looked for between them."""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        if await client.blpop([events.done_key(record_id)], timeout=max(0.01, min(1.0, remaining))):
            record = await asyncio.to_thread(store.get, kind, record_id)
            if record["status"] in TERMINAL:
                return record
        elif await request.is_disconnected():
            await asyncio.to_thread(_cancel, kind, record_id, store)
            raise client_gone()
    record = await asyncio.to_thread(store.get, kind, record_id)
    if record["status"] in TERMINAL:
        return record
    _cancel(kind, record_id, store)
    raise APIError(504, f"The request did not finish within {timeout:.0f} s and was cancelled.", code="timeout")


def raise_unless_completed(record: dict, store: RecordStore, kind: str) -> None:
    """A synchronous request that did not complete: the caller gets its error. A chat completion or completion
    refused with a 4xx (its input was wrong) leaves no record behind, as if refused before it was queued (a
    response stays: it is an object the client can retrieve, with its error)."""
    if record["status"] != "completed":
        error = record.get("error") or {"message": f"The request ended {record['status']}.", "code": None}
        status = STATUS_OF.get(error.get("code"), 500)
        if status < 500 and kind in ("chat", "completion"):
            store.delete(kind, record["id"], record["tenant"])
        raise APIError(status, error["message"], param=error.get("param"), code=error.get("code"))
