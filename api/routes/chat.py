"""POST /v1/chat/completions: queued to a worker and awaited, or streamed as chat.completion.chunk events."""

import asyncio
import json

from fastapi import APIRouter, Request

from api import streaming
from api.deps import CeleryDep, SettingsDep, StoreDep, TenantDep
from api.inference_service import raise_unless_completed, submit, wait_for
from api.protocol.chat import ChatCompletionRequest
from contract.inference_outputs import assistant_message, chat_completion, choices_of, usage
from contract.records import RecordStore
from contract.tool_calls import callable_tools

router = APIRouter(prefix="/v1/chat", tags=["chat"])


def chunks(body: ChatCompletionRequest, record: dict, store: RecordStore):
    """OpenAI's chunks: each choice's role first, then its content and tool-call deltas as they come (content with
    the logprobs of the tokens that wrote it), each choice's finish reason, usage when asked for, and [DONE].
    Where tools may be called, a choice's role comes with its first output (content null before a call, as
    OpenAI's)."""
    base = {"id": record["id"], "object": "chat.completion.chunk", "created": record["created_at"],
            "model": record["model"], "system_fingerprint": None}
    if body.include_usage:
        base["usage"] = None

    def choice(index: int, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> dict:
        return {"index": index, "delta": delta, "finish_reason": finish_reason,
                "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None}

    def chunk(*args, **kwargs) -> str:
        return json.dumps({**base, "choices": [choice(*args, **kwargs)]})

    async def send(batches: streaming.Batches):
        with_tools = bool(callable_tools(record["request"]))
        started, said, called = set(), set(), set()  # choices whose role went out, that got content, that called
        if not with_tools:
            yield json.dumps({**base, "choices": [choice(i, {"role": "assistant", "content": ""})
                                                  for i in range(body.n)]})
            started.update(range(body.n))
            said.update(range(body.n))
        async for batch in batches:
            for d in batch:
                delta = {}
                if d.choice not in started:
                    started.add(d.choice)
                    delta = {"role": "assistant", **({"content": None} if d.tool_calls and not d.text else {})}
                if d.text:
                    delta["content"] = d.text
                    said.add(d.choice)
                if d.tool_calls:
                    delta["tool_calls"] = d.tool_calls
                    called.add(d.choice)
                # the tokens from a choice's first call on are not content, so not chat's logprobs
                yield chunk(d.choice, delta, logprobs=None if d.choice in called else d.logprobs)
        final = await asyncio.to_thread(store.get, "chat", record["id"])
        if final["status"] not in ("completed", "cancelled"):
            yield streaming.error_event(final)
            return
        for index, c in enumerate(choices_of(final["result"])):
            message = assistant_message(c)
            if index not in said and message["content"] == "":  # an empty answer
                yield chunk(index, {**({"role": "assistant"} if index not in started else {}), "content": ""})
            yield chunk(index, {}, c["finish_reason"])
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
                            timeout=settings.request_timeout_seconds, request=request)
    raise_unless_completed(record, store, "chat")
    return chat_completion(record["id"], record["created_at"], record["model"], record["result"])
