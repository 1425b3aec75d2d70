"""POST /v1/responses (background or waited; previous_response_id continues a stored one), GET, DELETE, cancel,
and the input items."""

import asyncio
import itertools
import json
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from sse_starlette import ServerSentEvent

from api import streaming
from api.deps import CeleryDep, RedisDep, SettingsDep, StoreDep, TenantDep
from api.errors import APIError, invalid, not_found
from api.inference_service import TERMINAL, submit, wait_for
from api.protocol.responses import ResponseRequest
from contract import events, webhooks
from contract import inference_outputs as outputs
from contract.records import RecordStore, after_cursor

router = APIRouter(prefix="/v1/responses", tags=["responses"])


def to_openai(record: dict) -> dict:
    return outputs.response(record["id"], record["created_at"], record["model"], record["status"],
                            record.get("result"), record["request"], background=record.get("background", False),
                            metadata=record.get("metadata"), error=record.get("error"),
                            options=record.get("options"))


def stored(store: RecordStore, response_id: str, tenant: str, param: str | None = None) -> dict:
    record = store.get("response", response_id, tenant)
    if record is None or record.get("options", {}).get("store") is False:
        raise not_found("response", response_id, param)
    return record


def history(store: RecordStore, tenant: str, previous_id: str | None) -> list[dict]:
    """The conversation a new response continues: the previous one's turns (without its instructions, which
    OpenAI does not carry over) and its answer."""
    if previous_id is None:
        return []
    previous = stored(store, previous_id, tenant, "previous_response_id")
    status, _ = outputs.response_status(previous["status"], previous.get("result"))
    if status not in ("completed", "incomplete"):
        raise invalid(f"Response '{previous_id}' is {status}; only a finished response can be continued.",
                      param="previous_response_id")
    result = previous["result"]
    answer = {"role": "assistant", "content": result["text"]}
    if result.get("tool_calls"):  # the next input answers them with function_call_output items
        answer = {"role": "assistant", "content": result.get("content"), "tool_calls": result["tool_calls"]}
    return previous.get("conversation", []) + [answer]


def response_events(record: dict, store: RecordStore):
    """The Responses API's typed events, numbered in order, from response.created to response.completed (or
    .incomplete, .failed), each terminal one carrying the whole response. The output items stream one after the
    other as the model writes them: the message's text deltas (with the logprobs of the tokens they bring), then
    each function call's arguments deltas. A message closed because a call began is done with what was streamed of
    it, which is the finished response's message: its whole text and the logprobs of the tokens that wrote it (the
    worker sends those with the text, and the calls' tokens with the calls, whose items have no logprobs). The
    other items, and the terminal event, are as the finished response has them."""
    numbers = itertools.count()

    def event(kind: str, **fields) -> ServerSentEvent:
        return ServerSentEvent(json.dumps({"type": kind, "sequence_number": next(numbers), **fields}), event=kind)

    def added(index: int, item: dict):
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                        part={**item["content"][0], "text": "", "logprobs": []})
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})

    def delta(index: int, item: dict, text: str, logprobs: list | None = None) -> ServerSentEvent:
        if item["type"] == "message":
            return event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                         delta=text, logprobs=logprobs or [])
        return event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=text)

    def done(index: int, item: dict):
        if item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            yield event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
            yield event("response.content_part.done", **where, part=part)
        else:
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)

    async def send(batches: streaming.Batches):
        running = to_openai({**record, "status": "in_progress"})
        yield event("response.created", response=running)
        yield event("response.in_progress", response=running)
        streamed: list[dict] = []  # the items opened so far, as streamed; the last is open
        held_logprobs: list = []  # those of tokens whose text has not come yet
        closed = 0  # how many items got their done events

        async for batch in batches:
            for d in batch:
                held_logprobs += d.logprobs or []
                if d.text:
                    if not streamed:
                        streamed.append(outputs.output_message(record["id"], ""))
                        for e in added(0, streamed[0]):
                            yield e
                    yield delta(0, streamed[0], d.text, held_logprobs)
                    streamed[0]["content"][0]["text"] += d.text
                    streamed[0]["content"][0]["logprobs"] += held_logprobs
                    held_logprobs = []
                for fragment in d.tool_calls:
                    if "id" in fragment:  # a new call: the item before it is complete
                        if streamed:
                            for e in done(len(streamed) - 1, streamed[-1]):
                                yield e
                            closed = len(streamed)
                        call = {"id": fragment["id"], "function": fragment["function"]}
                        streamed.append(outputs.function_call_item({**call, "function": {**call["function"]}},
                                                                   "in_progress"))
                        for e in added(len(streamed) - 1, streamed[-1]):
                            yield e
                        if fragment["function"]["arguments"]:
                            yield delta(len(streamed) - 1, streamed[-1], fragment["function"]["arguments"])
                    else:
                        yield delta(len(streamed) - 1, streamed[-1], fragment["function"]["arguments"])
                        streamed[-1]["arguments"] += fragment["function"]["arguments"]
        if held_logprobs and streamed and closed < len(streamed) and streamed[-1]["type"] == "message":
            yield delta(0, streamed[0], "", held_logprobs)  # tokens that added no text (the end token, say)
        final = await asyncio.to_thread(store.get, "response", record["id"])
        response = to_openai(final)
        for index, item in enumerate(response["output"][closed:], closed):
            if index >= len(streamed):  # not streamed (an empty answer)
                for e in added(index, item):
                    yield e
            for e in done(index, item):
                yield e
        terminal = {"completed": "response.completed", "incomplete": "response.incomplete"}
        yield event(terminal.get(response["status"], "response.failed"), response=response)
        if final.get("options", {}).get("store") is False:
            await asyncio.to_thread(store.delete, "response", record["id"], record["tenant"])

    return send


@router.post("")
async def create_response(body: ResponseRequest, request: Request, tenant: TenantDep, settings: SettingsDep,
                          store: StoreDep, celery: CeleryDep):
    earlier = await asyncio.to_thread(history, store, tenant, body.previous_response_id)
    job = {**body.normal_with(earlier), "instructions": body.instructions,
           "max_output_tokens": body.max_output_tokens}
    options = {"store": body.store, "previous_response_id": body.previous_response_id, "user": body.user,
               "safety_identifier": body.safety_identifier}
    record = await asyncio.to_thread(submit, "response", tenant, job, settings=settings, store=store, celery=celery,
                                     extra={"background": body.background, "metadata": body.metadata or {},
                                            "options": options, "input_items": body.input_messages(),
                                            "conversation": earlier + body.input_messages()})
    if body.stream:
        return await streaming.respond(request, "response", record, store, settings.request_timeout_seconds,
                                       response_events(record, store), cancel_on_disconnect=not body.background)
    if not body.background:
        record = await wait_for(record["id"], "response", store=store, client=request.app.state.aioredis,
                                timeout=settings.request_timeout_seconds, request=request)
        error = record.get("error") or {}
        if record["status"] == "failed" and error.get("param"):  # a request field the worker refused: a 400
            raise APIError(400, error["message"], param=error["param"], code=error.get("code"))
        if not body.store:
            await asyncio.to_thread(store.delete, "response", record["id"], tenant)
    return to_openai(record)


@router.get("/{response_id}")
def retrieve_response(response_id: str, tenant: TenantDep, store: StoreDep):
    return to_openai(stored(store, response_id, tenant))


@router.delete("/{response_id}")
def delete_response(response_id: str, tenant: TenantDep, store: StoreDep, redis: RedisDep):
    record = stored(store, response_id, tenant)
    if record["status"] not in TERMINAL:
        events.request_cancel(redis, response_id)  # nothing keeps running for a response that is gone
    store.delete("response", response_id, tenant)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def input_item(response_id: str, index: int, message: dict) -> dict:
    part = "output_text" if message["role"] == "assistant" else "input_text"
    return {"id": f"msg_{response_id.removeprefix('resp_')}_{index}", "type": "message", "role": message["role"],
            "status": "completed", "content": [{"type": part, "text": message["content"]}]}


@router.get("/{response_id}/input_items")
def list_input_items(response_id: str, tenant: TenantDep, store: StoreDep, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "desc",
                     include: Annotated[list[str] | None, Query(alias="include[]")] = None):
    if include:
        raise invalid("No extra input item data can be included.", param="include")
    record = stored(store, response_id, tenant)
    items = [input_item(response_id, i, m) for i, m in enumerate(record.get("input_items", []))]
    if order == "desc":
        items.reverse()
    items = after_cursor(items, after, key=lambda item: item["id"])
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.post("/{response_id}/cancel")
def cancel_response(response_id: str, tenant: TenantDep, store: StoreDep, redis: RedisDep):
    record = stored(store, response_id, tenant)
    if not record.get("background"):
        raise APIError(400, "Only responses created with background=true can be cancelled.", code="invalid_request")
    if record["status"] in TERMINAL:
        return to_openai(record)
    events.request_cancel(redis, response_id)
    # Still queued: it never starts, since its task claims the record by compare-and-set. Running: the worker
    # sees the cancel flag and stops it in the engine.
    if store.transition("response", response_id, ["queued"], {"status": "cancelled"}):
        webhooks.job_ended(redis, response_id, "cancelled")
    return to_openai(store.get("response", response_id, tenant))
