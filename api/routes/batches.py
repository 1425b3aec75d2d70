"""The Batch API: create (validated, split into chunks that workers run in parallel), retrieve, list, cancel,
and the batch's event stream (extension)."""

import json
import os
from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request
from pydantic import StringConstraints

from api import event_stream
from api.deps import CeleryDep, LimiterDep, RedisDep, SettingsDep, StoreDep, TenantDep
from api.errors import APIError, invalid, not_found
from api.placement import route
from api.protocol.base import StrictModel
from api.routes.files import get_file
from contract import batches, events
from contract.inference_requests import Metadata
from contract.layout import file_path
from contract.queues import backend_queue, node_queue, publish
from contract.records import new_id, now
from contract.routing import Requirement
from contract.training_data import numbered_lines

router = APIRouter(prefix="/v1/batches", tags=["batches"])

WINDOW_SECONDS = 24 * 3600


class BatchCreate(StrictModel):
    input_file_id: Annotated[str, StringConstraints(max_length=64)]
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: Metadata | None = None


def to_openai(store, record: dict) -> dict:
    stamps = ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
              "cancelling_at", "cancelled_at")
    batch = {"id": record["id"], "object": "batch", "endpoint": record["endpoint"], "model": record.get("model"),
             "input_file_id": record["input_file_id"], "completion_window": "24h", "status": record["status"],
             "output_file_id": record.get("output_file_id"), "error_file_id": record.get("error_file_id"),
             "created_at": record["created_at"], "errors": record.get("errors"), "metadata": record.get("metadata"),
             **{k: record.get(k) for k in stamps}}
    if record.get("request_counts_final"):  # settled: the totals were kept when it finished
        batch["request_counts"], batch["usage"] = record["request_counts_final"], record["usage"]
    elif record.get("n_chunks") is not None:
        batch["request_counts"], batch["usage"], _ = batches.tally(store, record)
    else:  # failed in validating, or not split yet
        batch["request_counts"], batch["usage"] = {"total": 0, "completed": 0, "failed": 0}, None
    return batch


def _validation_errors(data: bytes) -> tuple[list[tuple[int, str]], list[str]]:
    """(lines as (number, text), errors that make the file unusable as a whole)."""
    lines, not_text = numbered_lines(data)
    if not_text:
        return [], [not_text]
    if not lines:
        return [], ["the file holds no requests"]
    parsed, problems, seen = 0, [], {}
    for number, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not valid JSON ({exc.msg})")
            continue
        parsed += 1
        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        if isinstance(custom_id, str) and custom_id in seen:
            return lines, [f"line {number}: custom_id '{custom_id}' repeats line {seen[custom_id]}"]
        if isinstance(custom_id, str):
            seen[custom_id] = number
    return lines, (problems if not parsed else [])


def _model_of(line: str) -> str | None:
    try:
        body = json.loads(line).get("body")
    except (json.JSONDecodeError, AttributeError):
        return None
    return body.get("model") if isinstance(body, dict) else None


@router.post("")
def create_batch(body: BatchCreate, tenant: TenantDep, settings: SettingsDep, store: StoreDep, celery: CeleryDep,
                 redis: RedisDep, limiter: LimiterDep,
                 idempotency_key: Annotated[str | None, Header(max_length=256)] = None):
    limiter.check_active_jobs(store, tenant)
    source = get_file(store, body.input_file_id, tenant, "input_file_id")
    if source["purpose"] != "batch":
        raise invalid(f"File '{body.input_file_id}' has purpose '{source['purpose']}', not 'batch'.",
                      param="input_file_id")
    queue, workers = route(redis, Requirement(), settings, param=None)
    # Chunks are dealt round-robin to the nodes of the chosen queue's backend, least busy first, so a large batch
    # runs on several devices at once (a node's threads would otherwise reserve every chunk it could).
    nodes = sorted((w for w in workers if queue in (backend_queue(w["backend"]), node_queue(w["node"]))),
                   key=lambda w: len(w.get("current_jobs", [])))
    chunk_queues = [node_queue(w["node"]) for w in nodes] or [queue]
    created = now()
    record = {"id": new_id("batch"), "tenant": tenant, "status": "validating", "endpoint": body.endpoint,
              "input_file_id": body.input_file_id, "metadata": body.metadata, "created_at": created,
              "expires_at": created + WINDOW_SECONDS, "queue": queue,
              "output_expires_after": settings.retention_seconds}
    # The creating process holds a lease while it validates and splits: if it dies, the lease lapses and the
    # reconciler fails the batch (it is tracked from the start); nothing of it has run.
    with events.lease_held(redis, record["id"], f"api:{os.getpid()}", settings.lease_seconds):
        record, fresh = store.create("batch", record, idempotency_key, track=True)
        if not fresh:
            return to_openai(store, record)
        return _validate_and_split(record["id"], body, tenant, created, chunk_queues, settings, store, celery,
                                   redis)


def _validate_and_split(batch_id: str, body: BatchCreate, tenant: str, created: int, chunk_queues: list[str],
                        settings, store, celery, redis) -> dict:
    events.emit(redis, batch_id, "Validating input file", data={"status": "validating"})
    lines, errors = _validation_errors(file_path(settings.artifact_root, tenant, body.input_file_id).read_bytes())
    if errors:
        data = [{"code": "invalid_request", "line": int(e.split(":")[0][5:]) if e.startswith("line ") else None,
                 "message": e, "param": "input_file_id"} for e in errors]
        if store.transition("batch", batch_id, ["validating"], {"status": "failed", "failed_at": now(),
                                                                 "errors": {"object": "list", "data": data}}):
            store.untrack("batch", batch_id)
            events.emit(redis, batch_id, "Batch failed validation: " + "; ".join(errors[:5]), level="error",
                        data={"status": "failed"})
        return to_openai(store, store.get("batch", batch_id))

    first_model = next(filter(None, (_model_of(text) for _, text in lines)), None)
    size = settings.batch_chunk_lines
    n_chunks = (len(lines) + size - 1) // size
    chunk_ids = [batches.chunk_id(batch_id, index) for index in range(n_chunks)]
    for index in range(n_chunks):
        batches.write_chunk_input(settings.artifact_root, tenant, batch_id, index,
                                  lines[index * size:(index + 1) * size])
    store.create_many("chunk", [{"id": chunk_ids[index], "tenant": tenant, "batch_id": batch_id, "index": index,
                                 "status": "queued", "queue": chunk_queues[index % len(chunk_queues)],
                                 "attempts": 0, "created_at": created} for index in range(n_chunks)])
    # One transaction: the batch is in progress with its chunk count and the reconciler owns its chunks (it
    # publishes any this process does not get to), or, cancelled meanwhile, none of them ever runs.
    started = store.transition_and_track(
        "batch", batch_id, ["validating"], {"status": "in_progress", "in_progress_at": now(), "total": len(lines),
                                            "n_chunks": n_chunks, "chunks_settled": 0, "model": first_model},
        {"chunk": chunk_ids})
    if not started:  # cancelled, or failed by the reconciler: its chunks go
        store.delete_many("chunk", chunk_ids, tenant)
        return to_openai(store, store.get("batch", batch_id))
    events.emit(redis, batch_id, f"Batch in progress: {len(lines)} requests in {n_chunks} chunks",
                data={"status": "in_progress"})
    for index in range(n_chunks):
        publish(celery, store, "chunk", chunk_ids[index], chunk_queues[index % len(chunk_queues)])
    return to_openai(store, store.get("batch", batch_id))


@router.get("")
def list_batches(tenant: TenantDep, store: StoreDep, after: str | None = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20):
    records, has_more = store.page("batch", tenant, after, limit)
    data = [to_openai(store, r) for r in records]
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def get_batch(store, batch_id: str, tenant: str) -> dict:
    record = store.get("batch", batch_id, tenant)
    if record is None:
        raise not_found("batch", batch_id)
    return record


@router.get("/{batch_id}")
def retrieve_batch(batch_id: str, tenant: TenantDep, store: StoreDep):
    return to_openai(store, get_batch(store, batch_id, tenant))


@router.post("/{batch_id}/cancel")
def cancel_batch(batch_id: str, tenant: TenantDep, settings: SettingsDep, store: StoreDep, redis: RedisDep):
    record = get_batch(store, batch_id, tenant)
    if record["status"] == "cancelling":
        return to_openai(store, record)
    # Still validating: nothing of it has run, and its creator's final step (a compare-and-set) will not start it.
    if store.transition("batch", batch_id, ["validating"], {"status": "cancelled", "cancelled_at": now()}):
        store.untrack("batch", batch_id)
        events.emit(redis, batch_id, "Batch cancelled before it started", data={"status": "cancelled"})
        return to_openai(store, get_batch(store, batch_id, tenant))
    if not store.transition("batch", batch_id, ["in_progress"], {"status": "cancelling", "cancelling_at": now()}):
        record = get_batch(store, batch_id, tenant)
        if record["status"] == "cancelling":
            return to_openai(store, record)
        raise APIError(409, f"Batch {batch_id} is {record['status']} and cannot be cancelled.",
                       code="invalid_state")
    record = get_batch(store, batch_id, tenant)
    events.request_cancel(redis, batch_id)
    events.emit(redis, batch_id, "Batch cancelling", data={"status": "cancelling"})
    # Chunks not yet started never start; running ones stop at their next request and keep what finished.
    for index in range(record["n_chunks"]):
        if store.transition("chunk", batches.chunk_id(batch_id, index), ["queued"], {"status": "cancelled"}):
            batches.chunk_settled(store, settings.artifact_root, batch_id)
    return to_openai(store, get_batch(store, batch_id, tenant))


@router.get("/{batch_id}/events")
def list_batch_events(request: Request, batch_id: str, tenant: TenantDep, store: StoreDep, redis: RedisDep,
                      after: str | None = None, limit: Annotated[int | None, Query(ge=1, le=1000)] = None,
                      stream: bool = False):
    get_batch(store, batch_id, tenant)
    return event_stream.list_or_stream(request, redis, batch_id, "batch.event", after, limit, stream,
                                       lambda: get_batch(store, batch_id, tenant)["status"])
