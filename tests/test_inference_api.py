"""The inference surface through the official openai client: n, stop, max_completion_tokens, live completions,
previous_response_id, incomplete, input items, delete, and every field of OpenAI's reference either honoured or
refused with a 400 naming it."""

import typing

import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

MODEL = "demo-tiny"
USER = [{"role": "user", "content": "Say something."}]
# Extensions that make the random-weight demo model's outputs long and repeatable.
FIXED = {"ignore_eos": True}


def chat(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "messages": USER, "max_tokens": 4, **kw})


def assert_refused(call, param: str):
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    body = exc.value.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    assert body["param"] == param, body


def test_n_choices_and_their_usage(client_a):
    reply = chat(client_a, n=2, max_completion_tokens=5, temperature=1.0, seed=7, extra_body=FIXED)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.message.content is not None for c in reply.choices)
    assert reply.usage.completion_tokens == 10
    single = chat(client_a, max_completion_tokens=5, temperature=1.0, seed=7, extra_body=FIXED)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert_refused(lambda: chat(client_a, n=9), "n")


def test_stop_cuts_the_text(client_a):
    # The demo model repeats the prompt's last token: after "Hello" it goes on "lololo...".
    args = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "extra_body": FIXED}
    assert client_a.completions.create(**args).choices[0].text.startswith("lolo")
    cut = client_a.completions.create(stop=["ol"], **args).choices[0]
    assert cut.finish_reason == "stop" and cut.text == "l"
    assert_refused(lambda: chat(client_a, stop=["a", "b", "c", "d", "e"]), "stop")


def test_live_completions(client_a):
    reply = client_a.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                        extra_body=FIXED)
    assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    echoed = client_a.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                         echo=True, extra_body=FIXED)
    assert echoed.choices[0].text == "Once upon a time" + reply.choices[0].text
    several = client_a.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=3,
                                          extra_body=FIXED)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.usage.completion_tokens == 12
    assert_refused(lambda: client_a.completions.create(model=MODEL, prompt=["a", "b", "c"], n=3), "n")
    assert_refused(lambda: client_a.completions.create(model=MODEL, prompt=[1, 2], echo=True), "echo")


def test_incomplete_at_max_output_tokens(client_a):
    response = client_a.responses.create(model=MODEL, input="Go on.", max_output_tokens=3, extra_body=FIXED)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    assert client_a.responses.retrieve(response.id).status == "incomplete"


def test_previous_response_id_continues_the_conversation(client_a, client_b):
    first = client_a.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                      max_output_tokens=4, extra_body=FIXED)
    second = client_a.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                       max_output_tokens=4, extra_body=FIXED)
    alone = client_a.responses.create(model=MODEL, input="What is my name?", max_output_tokens=4,
                                      extra_body=FIXED)
    assert second.previous_response_id == first.id
    # The first turn, its answer and the new input are all in the prompt (the instructions are not carried over).
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 5
    items = client_a.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["What is my name?"]
    with pytest.raises(openai.NotFoundError) as exc:  # another tenant's response cannot be continued
        client_b.responses.create(model=MODEL, input="Hi", previous_response_id=first.id)
    assert exc.value.response.json()["error"]["param"] == "previous_response_id"


def test_input_items_delete_and_store_false(client_a):
    response = client_a.responses.create(
        model=MODEL, max_output_tokens=2,
        input=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
               {"role": "user", "content": [{"type": "input_text", "text": "c"}]}])
    items = client_a.responses.input_items.list(response.id, order="asc", limit=2)
    assert [i.content[0].text for i in items.data] == ["a", "b"] and items.has_more
    rest = client_a.responses.input_items.list(response.id, order="asc", after=items.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["c"] and not rest.has_more
    client_a.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client_a.responses.retrieve(response.id)
    unstored = client_a.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    assert unstored.store is False and unstored.output_text is not None
    with pytest.raises(openai.NotFoundError):
        client_a.responses.retrieve(unstored.id)
    assert_refused(lambda: client_a.responses.create(model=MODEL, input="x", background=True, store=False), "store")


def test_image_and_audio_parts_are_refused(client_a):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert_refused(lambda: chat(client_a, messages=[{"role": "user", "content": [image]}]), "messages.0.content")
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    assert_refused(lambda: chat(client_a, messages=[{"role": "user", "content": [audio]}]), "messages.0.content")
    picture = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}
    assert_refused(lambda: client_a.responses.create(model=MODEL, input=[{"role": "user", "content": [picture]}]),
                   "input.0.content")


# Every request field of OpenAI's reference (as the openai package declares it), with a value a client might
# send: "ok" is honoured, "refused" gets a 400 naming the field.
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CHAT_FIELDS = {
    "model": (MODEL, "ok"), "messages": (USER, "ok"), "max_tokens": (3, "ok"), "max_completion_tokens": (3, "ok"),
    "temperature": (0.5, "ok"), "top_p": (0.9, "ok"), "n": (2, "ok"), "stop": (["\n\n"], "ok"), "seed": (1, "ok"),
    "user": ("u-1", "ok"), "safety_identifier": ("s-1", "ok"), "service_tier": ("default", "ok"),
    "stream_options": ({"include_usage": True}, "refused"), "store": (True, "refused"),
    "metadata": ({"k": "v"}, "refused"), "modalities": (["text", "audio"], "refused"),
    "audio": ({"voice": "alloy", "format": "wav"}, "refused"),
    "prediction": ({"type": "content", "content": "x"}, "refused"), "reasoning_effort": ("low", "refused"),
    "verbosity": ("low", "refused"), "web_search_options": ({}, "refused"),
    "moderation": ({"model": "omni-moderation-latest"}, "refused"), "prompt_cache_key": ("k", "refused"),
    "prompt_cache_retention": ("24h", "refused"), "prompt_cache_options": ({"mode": "auto"}, "refused"),
    "functions": ([TOOL["function"]], "refused"), "function_call": ("auto", "refused"), "tools": ([TOOL], "ok"),
    "tool_choice": ("none", "ok"), "parallel_tool_calls": (True, "ok"),
    "response_format": ({"type": "json_object"}, "ok"), "logprobs": (True, "ok"),
    "top_logprobs": (2, "refused"),  # without logprobs=true
    "presence_penalty": (0.5, "ok"), "frequency_penalty": (0.5, "ok"), "logit_bias": ({"5": 10}, "ok"),
}
RESPONSE_FIELDS = {
    "model": (MODEL, "ok"), "input": ("Hi", "ok"), "instructions": ("Be brief.", "ok"), "max_output_tokens": (3, "ok"),
    "temperature": (0.5, "ok"), "top_p": (0.9, "ok"), "metadata": ({"k": "v"}, "ok"), "store": (False, "ok"),
    "background": (False, "ok"), "previous_response_id": (None, "ok"), "user": ("u-1", "ok"),
    "safety_identifier": ("s-1", "ok"), "service_tier": ("auto", "ok"), "truncation": ("disabled", "ok"),
    "stream_options": ({"include_obfuscation": False}, "refused"), "include": (["reasoning.encrypted_content"],
                                                                              "refused"),
    "reasoning": ({"effort": "low"}, "refused"), "conversation": ("conv_1", "refused"),
    "prompt": ({"id": "pmpt_1"}, "refused"), "context_management": ([{"type": "compaction"}], "refused"),
    "background_options": ({"mode": "x"}, "refused"), "access_programs": ({"x": 1}, "refused"),
    "image": ({"x": 1}, "refused"), "moderation": ({"model": "omni-moderation-latest"}, "refused"),
    "prompt_cache_key": ("k", "refused"), "prompt_cache_retention": ("24h", "refused"),
    "prompt_cache_options": ({"mode": "auto"}, "refused"), "text": ({"format": {"type": "json_object"}}, "ok"),
    "tools": ([{"type": "function", "name": "f", "parameters": {}}], "ok"),
    "tool_choice": ("none", "ok"), "parallel_tool_calls": (True, "ok"), "max_tool_calls": (2, "refused"),
    "top_logprobs": (2, "ok"),
}
COMPLETION_FIELDS = {
    "model": (MODEL, "ok"), "prompt": ("Hi", "ok"), "max_tokens": (3, "ok"), "temperature": (0.5, "ok"),
    "top_p": (0.9, "ok"), "n": (2, "ok"), "stop": ("\n\n", "ok"), "seed": (1, "ok"), "echo": (True, "ok"),
    "best_of": (1, "ok"), "user": ("u-1", "ok"), "stream_options": ({"include_usage": True}, "refused"),
    "suffix": ("end", "refused"), "logprobs": (2, "ok"), "presence_penalty": (0.5, "ok"),
    "frequency_penalty": (0.5, "ok"), "logit_bias": ({"5": 10}, "ok"),
}
ENDPOINTS = {
    "chat": (chat_create_params.CompletionCreateParamsBase, CHAT_FIELDS,
             {"model": MODEL, "messages": USER, "max_tokens": 3}),
    "responses": (response_create_params.ResponseCreateParamsBase, RESPONSE_FIELDS,
                  {"model": MODEL, "input": "Hi", "max_output_tokens": 3}),
    "completions": (completion_create_params.CompletionCreateParamsBase, COMPLETION_FIELDS,
                    {"model": MODEL, "prompt": "Hi", "max_tokens": 3}),
}


def send(client, endpoint: str, body: dict):
    create = {"chat": client.chat.completions.create, "responses": client.responses.create,
              "completions": client.completions.create}[endpoint]
    return create(**body)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_reference_field_is_honoured_or_refused(client_a, endpoint):
    params, fields, base = ENDPOINTS[endpoint]
    assert set(typing.get_type_hints(params)) == set(fields), "a field of the reference is not covered"
    for field, (value, expected) in fields.items():
        body = {**base, field: value}
        if expected == "ok":
            assert send(client_a, endpoint, body).usage is not None, field
        else:
            assert_refused(lambda body=body: send(client_a, endpoint, body), field)
    with pytest.raises(openai.BadRequestError) as exc:  # a field OpenAI does not define
        send(client_a, endpoint, {**base, "extra_body": {"no_such_field": 1}})
    assert exc.value.response.json()["error"]["param"] == "no_such_field"
