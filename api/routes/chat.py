"""POST /v1/chat/completions: queued to a worker and awaited."""

import asyncio

from fastapi import APIRouter, Request

from api.deps import CeleryDep, SettingsDep, StoreDep, TenantDep
from api.errors import invalid
from api.inference_service import raise_unless_completed, submit, wait_for
from api.protocol.chat import ChatCompletionRequest
from contract.inference_outputs import chat_completion

router = APIRouter(prefix="/v1/chat", tags=["chat"])


@router.post("/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, tenant: TenantDep,
                                 settings: SettingsDep, store: StoreDep, celery: CeleryDep):
    if body.stream:
        raise invalid("Streaming is not available yet.", param="stream")
    # Redis calls off the event loop, so concurrent requests are accepted at once.
    record = await asyncio.to_thread(submit, "chat", tenant, body.normal(), settings=settings, store=store,
                                     celery=celery, extra={"user": body.user,
                                                           "safety_identifier": body.safety_identifier})
    record = await wait_for(record["id"], "chat", store=store, client=request.app.state.aioredis,
                            timeout=settings.request_timeout_seconds)
    raise_unless_completed(record)
    return chat_completion(record["id"], record["created_at"], record["model"], record["result"])
