"""POST /v1/chat/completions: queued to a worker and awaited."""

import asyncio

from fastapi import APIRouter, Request

from api.deps import CeleryDep, SettingsDep, StoreDep, TenantDep
from api.errors import APIError
from api.inference_service import submit, wait_for
from contract.inference_outputs import chat_completion
from contract.inference_requests import ChatCompletionCreate

router = APIRouter(prefix="/v1/chat", tags=["chat"])

# A failed request's code -> the status the caller gets; anything else is a server error.
STATUS_OF = {"invalid_prompt": 400, "unsupported_attention": 400, "kernels_unavailable": 400,
             "model_not_found": 404}


@router.post("/completions")
async def create_chat_completion(body: ChatCompletionCreate, request: Request, tenant: TenantDep,
                                 settings: SettingsDep, store: StoreDep, celery: CeleryDep):
    # Redis calls off the event loop, so concurrent requests are accepted at once.
    record = await asyncio.to_thread(submit, "chat", tenant, body.normal(), settings=settings, store=store,
                                     celery=celery)
    record = await wait_for(record["id"], "chat", store=store, client=request.app.state.aioredis,
                            timeout=settings.request_timeout_seconds)
    if record["status"] != "completed":
        error = record.get("error") or {"message": f"The request ended {record['status']}.", "code": None}
        raise APIError(STATUS_OF.get(error.get("code"), 500), error["message"], code=error.get("code"))
    return chat_completion(record["id"], record["created_at"], record["model"], record["result"])
