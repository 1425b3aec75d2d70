"""POST /v1/completions (live): queued to a worker and awaited."""

import asyncio

from fastapi import APIRouter, Request

from api.deps import CeleryDep, SettingsDep, StoreDep, TenantDep
from api.errors import invalid
from api.inference_service import raise_unless_completed, submit, wait_for
from api.protocol.completions import CompletionRequest
from contract.inference_outputs import choices_of, completion

router = APIRouter(prefix="/v1", tags=["completions"])


def echoed(body: CompletionRequest, result: dict) -> dict:
    """The result with each choice's prompt in front of its text (echo=true; text prompts only)."""
    prompts = body.prompts()
    choices = [{**c, "text": prompts[i // body.n] + c["text"]} for i, c in enumerate(choices_of(result))]
    return {**result, **choices[0], "choices": choices}


@router.post("/completions")
async def create_completion(body: CompletionRequest, request: Request, tenant: TenantDep, settings: SettingsDep,
                            store: StoreDep, celery: CeleryDep):
    if body.stream:
        raise invalid("Streaming is not available yet.", param="stream")
    record = await asyncio.to_thread(submit, "completion", tenant, body.normal(), settings=settings, store=store,
                                     celery=celery, extra={"user": body.user})
    record = await wait_for(record["id"], "completion", store=store, client=request.app.state.aioredis,
                            timeout=settings.request_timeout_seconds)
    raise_unless_completed(record)
    result = echoed(body, record["result"]) if body.echo else record["result"]
    return completion(record["id"], record["created_at"], record["model"], result)
