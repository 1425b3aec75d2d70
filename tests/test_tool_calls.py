"""Tool-call parsing (contract/tool_calls.py) for each model family's format: pure logic. The streaming parser
must give the same answer whatever pieces the output comes in, and hold back no more than it must."""

import json
import random

import pytest

from contract.tool_calls import ToolCallStream, as_template_message, parse

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
    # the arguments as the model wrote them; ids repeat for the same seed
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    assert parse(text, "hermes", NAMES, seed="chat_1") == parse(text, "hermes", NAMES, seed="chat_1")


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
                      ("a <tool_calling> b ", "hermes"), ('<tool_call> x {"name": "lookup"}', "hermes"),
                      ('{"answer": 42}', "llama3"), ("  Sure. {}", "llama3"), ("[1, 2]", "mistral")]:
        assert parse(text, fmt, NAMES) == (text, []), text
    assert parse('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', "hermes", []) == \
        ('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', [])


def test_a_call_named_is_a_call_and_what_follows_the_calls_is_not_content():
    # Once the JSON names a tool and opens its arguments, the call is out (streamed): cut short, it stays cut.
    assert parse('<tool_call>{"name": "lookup", "arguments": {"q": </tool_call>', "hermes", NAMES)[1][0][
        "function"] == {"name": "lookup", "arguments": '{"q": '}
    assert calls_of('{"name": "get_weather", "parameters": {"city": "Oslo"}} and more', "llama3") == \
        (None, [("get_weather", {"city": "Oslo"})])


def test_arguments_given_as_a_string_or_after_the_name_and_template_messages():
    assert calls_of('<tool_call>{"name": "lookup", "arguments": "{\\"q\\": 2}"}</tool_call>', "hermes")[1] == \
        [("lookup", {"q": 2})]
    assert calls_of('<tool_call>{"arguments": {"q": 3}, "name": "lookup"}</tool_call>', "hermes")[1] == \
        [("lookup", {"q": 3})]
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "call_1", "type": "function",
                               "function": {"name": "lookup", "arguments": '{"q": 2}'}}]}
    assert as_template_message(message)["tool_calls"][0]["function"]["arguments"] == {"q": 2}


OUTPUTS = [
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}"}}\n'
               '</tool_call>\n<tool_call>\n{"arguments": {"q": [1, {"a": "}"}]}, "name": "lookup"}\n</tool_call>\n'),
    ("hermes", "Plain text with a < and <tool and trailing space  "),
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call> then <tool_call>{"name": "lookup", '
               '"arguments": {"q": 1}, "extra": {"x": 1}}</tool_call> dropped'),
    ("llama3", '<|python_tag|>{"name": "lookup", "parameters": {"q": "a;b"}}; {"name": "get_weather", '
               '"parameters": {"city": "Oslo"}}'),
    ("llama3", '  {"not": "a call"} and text'),
    ("mistral", '[TOOL_CALLS] [{"name": "lookup", "arguments": {"q": 1}}, {"name": "lookup", "arguments": "{}"}]'),
    ("mistral", "[no calls] here"),
]


@pytest.mark.parametrize("fmt,text", OUTPUTS)
def test_streamed_pieces_add_up_to_the_whole(fmt, text):
    whole = parse(text, fmt, NAMES, seed="r")
    rng = random.Random(text)
    for _ in range(30):
        stream, content, calls = ToolCallStream(fmt, NAMES, seed="r"), "", {}
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        for released in [stream.feed(p) for p in pieces] + [stream.close()]:
            piece, fragments = released
            content += piece
            for f in fragments:
                call = calls.setdefault(f["index"], {"id": f.get("id"), "type": "function",
                                                     "function": {"name": f["function"].get("name"),
                                                                  "arguments": ""}})
                call["function"]["arguments"] += f["function"]["arguments"]
        assert ((content or None) if calls else content, [calls[i] for i in sorted(calls)]) == whole
    if not whole[1]:
        assert whole[0] == text


def test_only_what_may_start_a_call_is_held_back():
    stream = ToolCallStream("hermes", NAMES)
    assert stream.feed("Hello <tool") == ("Hello", [])  # the space and a possible marker wait
    assert stream.feed("box> x") == (" <toolbox> x", [])
    stream = ToolCallStream("hermes", NAMES)
    assert stream.feed('<tool_call>\n{"name": "lookup", "arg') == ("", [])
    assert stream.feed('uments": {"q"') == ("", [{"index": 0, "id": stream.calls[0]["id"], "type": "function",
                                                  "function": {"name": "lookup", "arguments": ""}},
                                                 {"index": 0, "function": {"arguments": '{"q"'}}])
    assert stream.feed(": 1}}\n</tool_call>") == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    stream = ToolCallStream("llama3", NAMES)
    assert stream.feed("The answer") == ("The answer", [])
