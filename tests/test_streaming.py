"""Streaming through the official openai client: chat chunks, completions chunks and the Responses API's typed
events carry the same text as the non-streamed answer, usage comes last when asked for, and a client that goes
away cancels its request."""

import asyncio
import json
import time
import uuid

import openai
import pytest
from conftest import StoppedEngines, _wait, wait_for_job
from transformers import AutoTokenizer

from api import streaming
from api.routes.responses import response_events
from contract.records import RecordStore
from worker.demo_model import build_demo_model
from worker.engine.requests import GenerationDelta, GenerationResult
from worker.serving.inference import outcome
from worker.serving.output_stream import RequestOutput

QUESTION = "Say hello."
ANSWER = "Hello from the fine-tuned adapter!"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
# What the taught model answers, unconstrained, when TOOL is offered: a sentence, then a call
PLAIN_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": TOOL["function"]["parameters"]}}
WEATHER = "Weather in Oslo?"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def same_logprobs(a, b) -> bool:
    """The same tokens and top tokens, their logprobs to 1e-3: separate requests are batched differently, and a
    batch's arithmetic can move a logprob in its fifth digit."""
    def tokens(entries):
        return [(e.token, [t.token for t in e.top_logprobs]) for e in entries]

    def values(entries):
        return [v for e in entries for v in (e.logprob, *(t.logprob for t in e.top_logprobs))]

    return tokens(a) == tokens(b) and values(a) == pytest.approx(values(b), abs=1e-3)


@pytest.fixture(scope="module")
def taught(client_a) -> str:
    """A model that answers QUESTION with ANSWER, and WEATHER (with PLAIN_TOOL offered) with a sentence and CALL,
    and then ends: the random-weight demo model's own chat answers are special tokens only (empty as text), and
    never end on their own."""
    line = json.dumps({"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]})
    call = json.dumps({"messages": [{"role": "user", "content": WEATHER},
                                    {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]}],
                       "tools": [PLAIN_TOOL]})
    upload = client_a.files.create(file=("hello.jsonl", "\n".join([line] * 8 + [call] * 8).encode()),
                                   purpose="fine-tune")
    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id, seed=7, suffix="hello",
                                           hyperparameters={"n_epochs": 40, "batch_size": 8,
                                                            "learning_rate_multiplier": 20})
    job = wait_for_job(client_a, job.id)
    assert job.status == "succeeded", job.error
    # the tests below read its greedy answers token for token: at loss 0.11 (learning rate x10) a full suite run once
    # garbled the call's arguments; x20 reaches about 0.007. (Token accuracy is measured in training mode, with
    # LoRA dropout: it read 0.997 in one run of the same training, so it is not the check.)
    last = max(client_a.fine_tuning.jobs.checkpoints.list(job.id).data, key=lambda c: c.step_number)
    assert last.metrics.train_loss < 0.05, last.metrics
    return job.fine_tuned_model


def test_streamed_chat_is_the_whole_answer(client_a, taught):
    args = {"model": taught, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "n": 2,
            "temperature": 0}
    whole = client_a.chat.completions.create(**args)
    assert [c.message.content for c in whole.choices] == [ANSWER, ANSWER]
    chunks = list(client_a.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert [c.delta.role for c in chunks[0].choices] == ["assistant", "assistant"]
    texts, finish = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [ANSWER, ANSWER] and finish == ["stop", "stop"]
    assert len(chunks) > 4  # the text came in pieces, not at the end in one
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_streamed_completion(client_a):
    # The demo model repeats the prompt's last token ("lololo..." after "Hello").
    args = {"model": "demo-tiny", "prompt": "Hello", "max_tokens": 16, "echo": True, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    whole = client_a.completions.create(**args)
    chunks = list(client_a.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.choices[0].text.startswith("Hellolo")
    assert chunks[-1].choices[0].finish_reason == "length"


def test_responses_stream_helper(client_a, taught):
    args = {"model": taught, "input": QUESTION, "max_output_tokens": 24, "temperature": 0}
    whole = client_a.responses.create(**args)
    with client_a.responses.stream(**args) as stream:
        seen = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in seen]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    deltas = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text == ANSWER
    assert final.status == "completed" and final.usage.output_tokens == whole.usage.output_tokens
    assert client_a.responses.retrieve(final.id).output_text == ANSWER


def test_streamed_response_cut_at_max_output_tokens(client_a):
    events = list(client_a.responses.create(model="demo-tiny", input="Go on.", max_output_tokens=5, stream=True,
                                            extra_body={"ignore_eos": True}))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens" and last.response.usage.output_tokens == 5


def test_disconnect_cancels_the_request(client_a, redis_client):
    stream = client_a.completions.create(model="demo-tiny", prompt="Hello", max_tokens=1000, stream=True,
                                         extra_body={"ignore_eos": True})
    first = next(iter(stream))
    stream.close()
    store = RecordStore(redis_client)
    record = _wait(lambda: (r := store.get("completion", first.id))["status"] != "in_progress" and r, 60,
                   "the request to end")
    assert record["status"] == "cancelled"
    assert record["result"]["completion_tokens"] < 1000


def test_streamed_tool_calls_come_in_pieces_and_add_up_to_the_whole(client_a):
    # A forced call (the grammar writes it): its name first, then its arguments in fragments as they are written.
    args = {"model": "demo-tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [TOOL],
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_tokens": 120}
    whole = client_a.chat.completions.create(**args).choices[0]
    chunks = list(client_a.chat.completions.create(stream=True, **args))
    fragments = [call for c in chunks for choice in c.choices for call in choice.delta.tool_calls or []]
    assert fragments[0].id.startswith("call_") and fragments[0].type == "function"
    assert fragments[0].function.name == "get_weather" and len(fragments) > 2
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments[1:])
    assert "".join(f.function.arguments for f in fragments) == whole.message.tool_calls[0].function.arguments
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the client's stream helper assembles the same message as the call that was not streamed
    with client_a.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert final.message.content is None and whole.message.content is None
    assert [(c.type, c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.type, c.function.name, c.function.arguments) for c in whole.message.tool_calls]

    flat = {"type": "function", **TOOL["function"]}
    args = {"model": "demo-tiny", "input": "Weather in Oslo?", "tools": [flat], "temperature": 0,
            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 120}
    whole = client_a.responses.create(**args)
    with client_a.responses.stream(**args) as stream:
        seen = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in seen]
    assert kinds[2] == "response.output_item.added" and seen[2].item.type == "function_call"
    assert kinds.count("response.function_call_arguments.delta") > 1
    assert kinds[-4:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"] or \
        kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    streamed = "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta")
    (item,) = final.output
    assert streamed == item.arguments == whole.output[0].arguments and item.name == whole.output[0].name
    assert client_a.responses.retrieve(final.id).output[0].call_id == item.call_id


def test_text_then_a_call_streams_as_written(client_a, taught):
    # tool_choice auto: the sentence streams as text (the space before the marker held back), then the call is
    # known from its name and its arguments stream as the model writes them
    args = {"model": taught, "messages": [{"role": "user", "content": WEATHER}], "tools": [PLAIN_TOOL],
            "temperature": 0, "max_tokens": 200}
    whole = client_a.chat.completions.create(**args).choices[0]
    assert whole.message.content == "Let me check." and whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls  # its arguments as the model learned them (the city is not its best)
    assert call.function.name == "get_weather" and call.function.arguments.startswith('{"city": ')
    chunks = list(client_a.chat.completions.create(stream=True, **args))
    pieces = [choice.delta.content for c in chunks for choice in c.choices if choice.delta.content]
    fragments = [f for c in chunks for choice in c.choices for f in choice.delta.tool_calls or []]
    # (how many pieces a read joins depends on timing; the parser's holding back is tested in test_tool_calls.py)
    assert "".join(pieces) == "Let me check."
    first_call = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls)
    assert all(not c.choices or not c.choices[0].delta.content for c in chunks[first_call + 1:])
    assert fragments[0].function.name == "get_weather" and len(fragments) > 1
    assert "".join(f.function.arguments for f in fragments) == call.function.arguments
    with client_a.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.content == whole.message.content and final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]

    args = {"model": taught, "input": WEATHER, "tools": [{"type": "function", **PLAIN_TOOL["function"]}],
            "temperature": 0, "max_output_tokens": 200}
    whole = client_a.responses.create(**args)
    with client_a.responses.stream(**args) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert [i.type for i in final.output] == [i.type for i in whole.output] == ["message", "function_call"]
    assert final.output_text == whole.output_text == "Let me check."
    assert final.output[1].arguments == whole.output[1].arguments == call.function.arguments
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")


def test_streamed_logprobs_come_with_their_tokens(client_a, taught):
    # an answer that ends (the stream helper refuses one cut at max_tokens)
    args = {"model": taught, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    whole = client_a.chat.completions.create(**args).choices[0].logprobs.content
    chunks = list(client_a.chat.completions.create(stream=True, **args))
    with_logprobs = [choice.logprobs.content for c in chunks for choice in c.choices if choice.logprobs]
    assert len(with_logprobs) > 1  # not all at the end

    assert same_logprobs([e for part in with_logprobs for e in part], whole)
    with client_a.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion().choices[0]
    assert same_logprobs(final.logprobs.content, whole) and final.message.content == \
        client_a.chat.completions.create(**args).choices[0].message.content

    args = {"model": taught, "input": QUESTION, "max_output_tokens": 24, "temperature": 0, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}
    whole = client_a.responses.create(**args).output[0].content[0]
    with client_a.responses.stream(**args) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response().output[0].content[0]
    assert len(deltas) > 1 and sum(len(e.logprobs) for e in deltas) == len(whole.logprobs) > 1
    assert [e.token for d in deltas for e in d.logprobs] == [e.token for e in whole.logprobs]
    assert same_logprobs(final.logprobs, whole.logprobs) and final.text == whole.text

    args = {"model": "demo-tiny", "prompt": "Hi", "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "extra_body": {"ignore_eos": True}}
    whole = client_a.completions.create(**args).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client_a.completions.create(stream=True, **args)
              if c.choices[0].logprobs]
    assert len(chunks) > 1
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert [o for c in chunks for o in c.text_offset] == whole.text_offset


def test_disconnect_cancels_a_request_that_is_not_streamed(client_a, redis_client, api_url):
    # The client gives up after a second; the API sees it go and cancels the request in the engine, which would
    # otherwise write its 1000 tokens for nobody. The engine processes are held stopped until the cancel is asked
    # for, so the request is still unanswered when the client gives up however fast the device is (on a GPU its
    # 1000 tokens could come within the second).
    user = f"gone-{uuid.uuid4().hex[:8]}"
    impatient = client_a.with_options(timeout=1.0, max_retries=0)
    store = RecordStore(redis_client)

    def mine():
        return next((r for r in store.page("chat", "tenant-a", limit=20)[0] if r.get("user") == user), None)

    with StoppedEngines(api_url):
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "Hi"}], n=4,
                                              max_tokens=1000, user=user, extra_body={"ignore_eos": True})
        _wait(lambda: redis_client.exists(f"cancel:{mine()['id']}"), 30, "the API to ask for the cancel")
        time.sleep(1)  # ten ticks of the node's cancel watch (0.1 s), which sends the cancel to the engine process

    def ended():
        record = mine()
        return record["status"] not in ("queued", "in_progress") and record

    record = _wait(ended, 60, "the request to end")
    assert record["status"] == "cancelled"
    assert all(c["completion_tokens"] < 1000 for c in record["result"]["choices"])


def test_chat_logprobs_of_a_message_with_a_call_are_its_content_tokens(client_a, taught):
    # OpenAI's logprobs.content are the message content's tokens: the call's (and the end token after it) are not
    args = {"model": taught, "messages": [{"role": "user", "content": WEATHER}], "tools": [PLAIN_TOOL],
            "temperature": 0, "max_tokens": 200, "logprobs": True, "top_logprobs": 2}
    whole = client_a.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.message.content == "Let me check." and choice.message.tool_calls, choice
    content = choice.logprobs.content
    assert "".join(e.token for e in content).strip() == "Let me check." and len(content) < whole.usage.completion_tokens
    chunks = list(client_a.chat.completions.create(stream=True, **args))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert same_logprobs(streamed, content)
    assert all(not ch.logprobs for c in chunks for ch in c.choices if ch.delta.tool_calls)


def test_a_message_closed_by_a_call_is_done_as_the_response_has_it(client_a, taught):
    # The message's done events come when the call begins: they carry its whole text and the logprobs of the tokens
    # that wrote it, as the finished response's message does (the call's tokens are not the message's).
    args = {"model": taught, "input": WEATHER, "tools": [{"type": "function", **PLAIN_TOOL["function"]}],
            "temperature": 0, "max_output_tokens": 200, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}
    whole = client_a.responses.create(**args)
    assert [i.type for i in whole.output] == ["message", "function_call"], whole.output

    def same(a, b) -> bool:  # content parts
        return (a.type, a.text) == (b.type, b.text) and same_logprobs(a.logprobs, b.logprobs)

    part = whole.output[0].content[0]
    assert part.text == "Let me check." and 1 < len(part.logprobs) < whole.usage.output_tokens
    assert "".join(e.token for e in part.logprobs).strip() == "Let me check."
    with client_a.responses.stream(**args) as stream:
        seen = list(stream)
        final = stream.get_final_response()
    assert same(final.output[0].content[0], part)
    deltas = [e for e in seen if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == part.text
    assert same_logprobs([e for d in deltas for e in d.logprobs], part.logprobs)
    text_done = next(e for e in seen if e.type == "response.output_text.done")
    assert text_done.text == part.text and same_logprobs(text_done.logprobs, part.logprobs)
    assert same(next(e for e in seen if e.type == "response.content_part.done").part, part)
    item_done = next(e for e in seen if e.type == "response.output_item.done")
    assert item_done.output_index == 0 and item_done.item.id == final.output[0].id
    assert same(item_done.item.content[0], part) and item_done.item.status == "completed"
    call_added = next(i for i, e in enumerate(seen) if e.type == "response.output_item.added" and e.output_index == 1)
    assert seen.index(item_done) < call_added


@pytest.mark.parametrize("step", [1, 3, 12])
def test_the_message_before_a_call_has_its_own_tokens_however_the_steps_come(tmp_path_factory, redis_client, step):
    # The engine's deltas hold `step` tokens each (more than one when engine_stream_interval_ms gathers steps, as it
    # does on a fast device) and the API reads them all at once: the message's done events still carry its text and
    # the logprobs of the tokens that wrote it, as the stored response has them, and its deltas add up to them.
    tokenizer = AutoTokenizer.from_pretrained(build_demo_model(tmp_path_factory.getbasetemp() / "demo-tiny"))
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    logprobs = [(t, -0.01 * i, [(t, -0.01 * i)]) for i, t in enumerate(ids)]
    request = {"tools": [PLAIN_TOOL["function"]], "tool_choice": "auto", "logprobs": 1, "max_output_tokens": 200}
    response_id = "resp_" + uuid.uuid4().hex[:24]
    result = outcome(GenerationResult(response_id, ids, text, "stop", 5, len(ids), logprobs=logprobs), request,
                     tokenizer)
    record = {"id": response_id, "tenant": "tenant-t", "created_at": 1, "model": "demo-tiny", "status": "completed",
              "request": request, "result": result}
    RecordStore(redis_client).create("response", record)

    output, entries, written = RequestOutput(request, lambda: tokenizer), [], ""
    for at in range(0, len(ids), step):  # as the engine's deltas come: each its tokens and the text they add
        new = tokenizer.decode(ids[:at + step], skip_special_tokens=True)[len(written):]
        written += new
        delta = GenerationDelta(response_id, ids[at:at + step], new, logprobs[at:at + step])
        entries += output.entries(0, delta)
    entries += output.closing()
    # every token's logprobs go out once, in order (a streamed chat's chunks add up to them all)
    assert [e for fields in entries if "l" in fields for e in json.loads(fields["l"])] == result["logprobs"]

    async def batches():
        yield streaming.deltas(entries)

    async def events():
        return [json.loads(e.data) async for e in response_events(record, RecordStore(redis_client))(batches())]

    seen = asyncio.run(events())
    message = seen[-1]["response"]["output"][0]
    part = message["content"][0]
    assert part["text"] == "Let me check." and [e["token"] for e in part["logprobs"]] == \
        [tokenizer.decode([t]) for t in ids[:10]]  # "L", "et", " ", ..., "."
    assert "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta") == part["text"]
    assert [e for d in seen if d["type"] == "response.output_text.delta" for e in d["logprobs"]] == part["logprobs"]
    (text_done,) = [e for e in seen if e["type"] == "response.output_text.done"]
    assert (text_done["text"], text_done["logprobs"]) == (part["text"], part["logprobs"])
    assert [e["part"] for e in seen if e["type"] == "response.content_part.done"] == [part]
    assert [e["item"] for e in seen if e["type"] == "response.output_item.done"][0] == message
    kinds = [e["type"] for e in seen]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
