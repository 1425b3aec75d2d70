"""Structured outputs, tools and the sampling surface through the official openai client, on the tiny demo model
(random weights): what it writes is noise, so each test makes the property it checks come from the service
(a grammar, a bias, a penalty), not from the model."""

import json
import math
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    sunny: bool
    unit: Literal["c", "f"]
    chance: int = Field(ge=0, le=100)


def test_parse_with_a_pydantic_model(client_a):
    completion = client_a.chat.completions.parse(model="demo-tiny", messages=ASK, response_format=Forecast,
                                                 temperature=0, max_tokens=120)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Forecast), message.content
    assert Forecast.model_validate_json(message.content) == message.parsed


def test_json_schema_and_json_object_validate(client_a):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    for seed in range(2):  # sampled, not only greedy
        reply = client_a.chat.completions.create(
            model="demo-tiny", messages=ASK, max_tokens=60, seed=seed, temperature=1.0,
            response_format={"type": "json_schema", "json_schema": {"name": "flags", "schema": schema,
                                                                    "strict": True}})
        value = json.loads(reply.choices[0].message.content)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    # Responses: text.format, flat
    response = client_a.responses.create(model="demo-tiny", input="Flags?", temperature=0, max_output_tokens=60,
                                         text={"format": {"type": "json_schema", "name": "flags", "schema": schema,
                                                          "strict": True}})
    assert set(json.loads(response.output_text)) == {"ok", "n"}
    assert response.text.format.type == "json_schema"
    # json_object: a JSON object; a bias against "}" keeps it short of nothing but the grammar decides its shape
    reply = client_a.chat.completions.create(model="demo-tiny", messages=ASK, max_tokens=40, temperature=0,
                                             response_format={"type": "json_object"})
    assert reply.choices[0].message.content.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_tool_call_round_trip(client_a):
    first = client_a.chat.completions.create(model="demo-tiny", messages=ASK, tools=[WEATHER_TOOL], temperature=0,
                                             max_tokens=200, tool_choice="required", parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    # the call goes back with its result; tool_choice none: the model answers in text
    messages = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    final = client_a.chat.completions.create(model="demo-tiny", messages=messages, tools=[WEATHER_TOOL],
                                             tool_choice="none", temperature=0, max_tokens=8)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content is not None
    # the tool message reached the model: the prompt holds the call and the result
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_streamed_tool_call(client_a):
    stream = client_a.chat.completions.create(model="demo-tiny", messages=ASK, tools=[WEATHER_TOOL], temperature=0,
                                              max_tokens=200, tool_choice={"type": "function",
                                                                           "function": {"name": "get_weather"}},
                                              stream=True, stream_options={"include_usage": True})
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    assert set(json.loads(calls[0]["arguments"])) == {"city", "unit"}


def test_named_tool_in_responses(client_a):
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    response = client_a.responses.create(model="demo-tiny", input="Weather in Oslo?", tools=[tool], temperature=0,
                                         tool_choice={"type": "function", "name": "get_weather"},
                                         max_output_tokens=200)
    (item,) = response.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert set(json.loads(item.arguments)) == {"city", "unit"}
    followup = client_a.responses.create(
        model="demo-tiny", temperature=0, max_output_tokens=8, tools=[tool], tool_choice="none",
        input=[{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
               {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}])
    assert followup.output[0].type == "message"
    assert followup.usage.input_tokens > response.usage.input_tokens
    # the same turn through previous_response_id: the stored call is the history the output answers
    chained = client_a.responses.create(
        model="demo-tiny", temperature=0, max_output_tokens=8, tools=[tool], tool_choice="none",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}])
    assert chained.output[0].type == "message" and chained.usage.input_tokens == followup.usage.input_tokens


def test_logprobs(client_a):
    reply = client_a.chat.completions.create(model="demo-tiny", messages=ASK, max_tokens=6, temperature=0,
                                             logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-3)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    response = client_a.responses.create(model="demo-tiny", input="Hi", max_output_tokens=4, temperature=0,
                                         top_logprobs=2, include=["message.output_text.logprobs"],
                                         extra_body={"ignore_eos": True})
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 4 and all(len(e.top_logprobs) == 2 for e in logprobs)
    completion = client_a.completions.create(model="demo-tiny", prompt="Hi", max_tokens=4, temperature=0, logprobs=2,
                                             extra_body={"ignore_eos": True})
    legacy = completion.choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 4
    assert legacy.text_offset[0] == 0 and all(1 <= len(top) <= 2 for top in legacy.top_logprobs)
    plain = client_a.chat.completions.create(model="demo-tiny", messages=ASK, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logit_bias_and_penalties_change_output(client_a, stack_env):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(f"{stack_env['XPUJOBS_MODELS_ROOT']}/demo-tiny")

    def tokens(**kw) -> list[str]:
        reply = client_a.chat.completions.create(model="demo-tiny", messages=ASK, max_tokens=12, temperature=0,
                                                 logprobs=True, extra_body={"ignore_eos": True}, **kw)
        return [e.token for e in reply.choices[0].logprobs.content]

    base = tokens()
    # +100 makes one token win every step; -100 bans the token greedy chose first
    assert tokens(logit_bias={"42": 100}) == [tokenizer.decode([42])] * 12
    first = tokenizer.encode(base[0], add_special_tokens=False)[0]
    assert tokens(logit_bias={str(first): -100})[0] != base[0]
    # repeats cost more under the penalties: the greedy output (noise that repeats itself) repeats less
    repeated = max(base.count(t) for t in set(base))
    assert repeated > 2, base
    penalized = tokens(frequency_penalty=2.0, presence_penalty=2.0)
    assert max(penalized.count(t) for t in set(penalized)) < repeated, penalized


def test_refusals_name_the_param(client_a):
    cases = [({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice"),
             ({"top_logprobs": 3}, "top_logprobs"),
             ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
             ({"logit_bias": {"99999999": 5}}, "logit_bias"),
             ({"presence_penalty": 3}, "presence_penalty"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                          "schema": {"type": "nonsense"}}}},
              "response_format"),
             ({"response_format": {"type": "xml"}}, "response_format"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                 "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}}}},
              "response_format.json_schema.schema")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            client_a.chat.completions.create(model="demo-tiny", messages=ASK, max_tokens=2, **extra)
        assert exc.value.status_code == 400 and (exc.value.param or "").startswith(param), (extra, exc.value)
