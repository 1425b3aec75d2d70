"""POST /v1/responses (background or waited), GET and cancel."""

import asyncio

from fastapi import APIRouter, Request

from api.deps import CeleryDep, RedisDep, SettingsDep, StoreDep, TenantDep
from api.errors import APIError, not_found
from api.inference_service import TERMINAL, submit, wait_for
from contract import events
from contract import inference_outputs as outputs
from contract.inference_requests import ResponseCreate

router = APIRouter(prefix="/v1/responses", tags=["responses"])


def to_openai(record: dict) -> dict:
    return outputs.response(record["id"], record["created_at"], record["model"], record["status"],
                            record.get("result"), record["request"], background=record.get("background", False),
                            metadata=record.get("metadata"), error=record.get("error"))


@router.post("")
async def create_response(body: ResponseCreate, request: Request, tenant: TenantDep, settings: SettingsDep,
                          store: StoreDep, celery: CeleryDep):
    job = {**body.normal(), "instructions": body.instructions, "max_output_tokens": body.max_output_tokens}
    record = await asyncio.to_thread(submit, "response", tenant, job, settings=settings, store=store, celery=celery,
                                     extra={"background": body.background, "metadata": body.metadata or {}})
    if not body.background:
        record = await wait_for(record["id"], "response", store=store, client=request.app.state.aioredis,
                                timeout=settings.request_timeout_seconds)
    return to_openai(record)


@router.get("/{response_id}")
def retrieve_response(response_id: str, tenant: TenantDep, store: StoreDep):
    record = store.get("response", response_id, tenant)
    if record is None:
        raise not_found("response", response_id)
    return to_openai(record)


@router.post("/{response_id}/cancel")
def cancel_response(response_id: str, tenant: TenantDep, store: StoreDep, redis: RedisDep):
    record = store.get("response", response_id, tenant)
    if record is None:
        raise not_found("response", response_id)
    if not record.get("background"):
        raise APIError(400, "Only responses created with background=true can be cancelled.", code="invalid_request")
    if record["status"] in TERMINAL:
        return to_openai(record)
    events.request_cancel(redis, response_id)
    # Still queued: it never starts, since its task claims the record by compare-and-set. Running: the worker
    # sees the cancel flag and stops it in the engine.
    store.transition("response", response_id, ["queued"], {"status": "cancelled"})
    return to_openai(store.get("response", response_id, tenant))
