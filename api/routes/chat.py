"""POST /v1/chat/completions: queued to a worker and awaited, or streamed as chat.completion.chunk events."""

import asyncio
import json

from fastapi import APIRouter, Request

from api import streaming
from api.deps import CeleryDep, SettingsDep, StoreDep, TenantDep
from api.inference_service import raise_unless_completed, submit, wait_for
from api.protocol.chat import ChatCompletionRequest
from contract.inference_outputs import assistant_message, chat_completion, chat_logprobs, choices_of, usage
from contract.records import RecordStore

router = APIRouter(prefix="/v1/chat", tags=["chat"])


def whole_delta(choice: dict) -> dict:
    """A choice's whole answer as one delta: its text, or its tool calls (each with its index in the list)."""
    message = assistant_message(choice)
    delta = {"content": message["content"]}
    if calls := message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
    return delta


def chunks(body: ChatCompletionRequest, record: dict, store: RecordStore):
    """OpenAI's chunks: the role first, then content deltas, each choice's finish reason, usage when asked for,
    and [DONE]."""
    base = {"id": record["id"], "object": "chat.completion.chunk", "created": record["created_at"],
            "model": record["model"], "system_fingerprint": None}
    if body.include_usage:
        base["usage"] = None

    def chunk(choices: list[dict]) -> str:
        return json.dumps({**base, "choices": choices})

    def choice(index: int, delta: dict, finish_reason: str | None = None) -> dict:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    whole = streaming.buffered(record["request"])

    async def send(batches: streaming.Batches):
        yield chunk([choice(i, {"role": "assistant", "content": ""}) for i in range(body.n)])
        if whole:
            await streaming.drain(batches)
        else:
            async for batch in batches:
                for index, text in batch:
                    yield chunk([choice(index, {"content": text})])
        final = await asyncio.to_thread(store.get, "chat", record["id"])
        if final["status"] not in ("completed", "cancelled"):
            yield streaming.error_event(final)
            return
        for index, c in enumerate(choices_of(final["result"])):
            if whole:
                yield json.dumps({**base, "choices": [{**choice(index, whole_delta(c)), "logprobs": chat_logprobs(c)}]})
            yield chunk([choice(index, {}, c["finish_reason"])])
        if body.include_usage:
            yield json.dumps({**base, "choices": [], "usage": usage(final["result"])})
        yield "[DONE]"

    return send


@router.post("/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, tenant: TenantDep,
                                 settings: SettingsDep, store: StoreDep, celery: CeleryDep):
    # Redis calls off the event loop, so concurrent requests are accepted at once.
    record = await asyncio.to_thread(submit, "chat", tenant, body.normal(), settings=settings, store=store,
                                     celery=celery, extra={"user": body.user,
                                                           "safety_identifier": body.safety_identifier})
    if body.stream:
        return await streaming.respond(request, "chat", record, store, settings.request_timeout_seconds,
                                       chunks(body, record, store))
    record = await wait_for(record["id"], "chat", store=store, client=request.app.state.aioredis,
                            timeout=settings.request_timeout_seconds)
    raise_unless_completed(record, store, "chat")
    return chat_completion(record["id"], record["created_at"], record["model"], record["result"])
