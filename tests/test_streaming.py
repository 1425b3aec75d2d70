"""Streaming through the official openai client: chat chunks, completions chunks and the Responses API's typed
events carry the same text as the non-streamed answer, usage comes last when asked for, and a client that goes
away cancels its request."""

import json

import pytest
from conftest import _wait, wait_for_job

from contract.records import RecordStore

QUESTION = "Say hello."
ANSWER = "Hello from the fine-tuned adapter!"


@pytest.fixture(scope="module")
def taught(client_a) -> str:
    """A model that answers QUESTION with ANSWER and then ends: the random-weight demo model's own chat answers
    are special tokens only (empty as text), and never end on their own."""
    line = json.dumps({"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]})
    upload = client_a.files.create(file=("hello.jsonl", "\n".join([line] * 8).encode()), purpose="fine-tune")
    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id, seed=7, suffix="hello",
                                           hyperparameters={"n_epochs": 40, "batch_size": 8,
                                                            "learning_rate_multiplier": 10})
    job = wait_for_job(client_a, job.id)
    assert job.status == "succeeded", job.error
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


TOOL = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


def test_streamed_tool_calls_and_logprobs(client_a):
    # Where the text may be a tool call, or carries logprobs, it comes whole at the end, in the same chunks.
    args = {"model": "demo-tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [TOOL],
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_tokens": 120}
    whole = client_a.chat.completions.create(**args).choices[0].message.tool_calls
    chunks = list(client_a.chat.completions.create(stream=True, **args))
    calls = [call for c in chunks for choice in c.choices for call in choice.delta.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == \
        [(0, w.function.name, w.function.arguments) for w in whole]
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    flat = {"type": "function", **TOOL["function"]}
    with client_a.responses.stream(model="demo-tiny", input="Weather in Oslo?", tools=[flat], temperature=0,
                                   tool_choice={"type": "function", "name": "get_weather"},
                                   max_output_tokens=120) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output[0].type == "function_call" and json.loads(final.output[0].arguments)["city"]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"

    chunks = list(client_a.chat.completions.create(
        model="demo-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}))
    entries = [e for c in chunks for choice in c.choices if choice.logprobs for e in choice.logprobs.content]
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)
