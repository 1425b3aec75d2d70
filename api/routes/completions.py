"""POST /v1/completions (live): queued to a worker and awaited, or streamed as text_completion chunks."""

import asyncio
import json

from fastapi import APIRouter, Request

from api import streaming
from api.deps import CeleryDep, SettingsDep, StoreDep, TenantDep
from api.inference_service import raise_unless_completed, submit, wait_for
from api.protocol.completions import CompletionRequest
from contract.inference_outputs import choices_of, completion, completion_logprobs, usage
from contract.records import RecordStore

router = APIRouter(prefix="/v1", tags=["completions"])


def echoed(body: CompletionRequest, result: dict) -> dict:
    """The result with each choice's prompt in front of its text (echo=true; text prompts only)."""
    prompts = body.prompts()
    choices = [{**c, "text": prompts[i // body.n] + c["text"]} for i, c in enumerate(choices_of(result))]
    return {**result, **choices[0], "choices": choices}


def chunks(body: CompletionRequest, record: dict, store: RecordStore):
    base = {"id": record["id"], "object": "text_completion", "created": record["created_at"],
            "model": record["model"]}

    def chunk(index: int, text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> str:
        return json.dumps({**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                                "finish_reason": finish_reason}]})

    async def send(batches: streaming.Batches):
        prompts = body.prompts()
        count = len(prompts) * body.n
        if body.echo:
            for index in range(count):
                yield chunk(index, prompts[index // body.n])
        offsets = [0] * count  # where each choice's next tokens start in its text, for logprobs' text_offset
        async for batch in batches:
            for d in batch:
                logprobs = completion_logprobs({"logprobs": d.logprobs}, offsets[d.choice])
                offsets[d.choice] += sum(len(e["token"]) for e in d.logprobs or [])
                yield chunk(d.choice, d.text, logprobs=logprobs)
        final = await asyncio.to_thread(store.get, "completion", record["id"])
        if final["status"] not in ("completed", "cancelled"):
            yield streaming.error_event(final)
            return
        for index, c in enumerate(choices_of(final["result"])):
            yield chunk(index, "", c["finish_reason"])
        if body.include_usage:
            yield json.dumps({**base, "choices": [], "usage": usage(final["result"])})
        yield "[DONE]"

    return send


@router.post("/completions")
async def create_completion(body: CompletionRequest, request: Request, tenant: TenantDep, settings: SettingsDep,
                            store: StoreDep, celery: CeleryDep):
    record = await asyncio.to_thread(submit, "completion", tenant, body.normal(), settings=settings, store=store,
                                     celery=celery, extra={"user": body.user})
    if body.stream:
        return await streaming.respond(request, "completion", record, store, settings.request_timeout_seconds,
                                       chunks(body, record, store))
    record = await wait_for(record["id"], "completion", store=store, client=request.app.state.aioredis,
                            timeout=settings.request_timeout_seconds, request=request)
    raise_unless_completed(record, store, "completion")
    result = echoed(body, record["result"]) if body.echo else record["result"]
    return completion(record["id"], record["created_at"], record["model"], result)
