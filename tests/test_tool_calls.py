"""Tool-call parsing (contract/tool_calls.py) for each model family's format: pure logic."""

import json

from contract.tool_calls import as_template_message, parse

NAMES = ["get_weather", "lookup"]


def calls_of(text: str, fmt: str):
    content, calls = parse(text, fmt, NAMES)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_blocks_and_leading_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>')
    assert calls_of(text, "hermes") == ("Let me check.", [("get_weather", {"city": "Paris"}),
                                                          ("lookup", {"q": "x"})])
    content, calls = parse(text, "hermes", NAMES)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_llama3_and_mistral():
    assert calls_of('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "llama3") == \
        (None, [("get_weather", {"city": "Oslo"})])
    assert calls_of('{"name": "lookup", "parameters": {}}; {"name": "lookup", "parameters": {"q": 1}}',
                    "llama3") == (None, [("lookup", {}), ("lookup", {"q": 1})])
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "lookup", "arguments": {}}]'
    assert calls_of(text, "mistral") == (None, [("get_weather", {"city": "Rome"}), ("lookup", {})])
    # the marker is a special token: a decoder that skips special tokens leaves the list alone
    assert calls_of(text.removeprefix("[TOOL_CALLS]"), "mistral")[1][0] == ("get_weather", {"city": "Rome"})


def test_text_that_is_not_a_call_stays_content():
    for text, fmt in [("The weather is fine.", "hermes"), ('<tool_call>{"name": "unknown", "arguments": {}}'
                                                          "</tool_call>", "hermes"),
                      ('<tool_call>{"name": "lookup", "arguments": {"q": </tool_call>', "hermes"),
                      ('{"name": "get_weather", "parameters": {"city": "Oslo"}} and more', "llama3"),
                      ('{"answer": 42}', "llama3"), ("[1, 2]", "mistral")]:
        assert parse(text, fmt, NAMES) == (text, []), text
    assert parse('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', "hermes", []) == \
        ('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', [])


def test_arguments_given_as_a_string_and_template_messages():
    assert calls_of('<tool_call>{"name": "lookup", "arguments": "{\\"q\\": 2}"}</tool_call>', "hermes")[1] == \
        [("lookup", {"q": 2})]
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "call_1", "type": "function",
                               "function": {"name": "lookup", "arguments": '{"q": 2}'}}]}
    assert as_template_message(message)["tool_calls"][0]["function"]["arguments"] == {"q": 2}
