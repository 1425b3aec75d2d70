"""Training data as OpenAI defines it: which lines are accepted, and what each error names."""

import json

import pytest

from contract.training_data import example, validate_training_bytes

CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def errors_of(*lines, method="supervised") -> list[str]:
    return validate_training_bytes("\n".join(json.dumps(line) for line in lines).encode(), method)[1]


def test_openai_chat_lines_are_accepted_and_normalised():
    line = {"messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                                      {"type": "text", "text": "in Oslo?"}]},
                         {"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
                         {"role": "assistant", "content": "12 C.", "weight": 0},
                         {"role": "user", "content": "Thanks"},
                         {"role": "assistant", "content": "You are welcome."}],
            "tools": TOOLS, "parallel_tool_calls": False}
    got = example(line)
    assert got["tools"] == TOOLS
    assert [m["role"] for m in got["messages"]][:2] == ["system", "user"]
    assert got["messages"][1]["content"] == "Weather in Oslo?"
    assert [m.get("weight") for m in got["messages"] if m["role"] == "assistant"] == [1, 0, 1]
    assert got["messages"][2]["tool_calls"][0]["function"]["name"] == "weather"
    assert example({"prompt": "p", "completion": "c"})["messages"][1] == {"role": "assistant", "content": "c",
                                                                          "weight": 1}


@pytest.mark.parametrize(("line", "error"), [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 2}]},
     "messages[1].weight must be 0 or 1"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": True}]},
     "messages[1].weight must be 0 or 1"),
    ({"messages": [{"role": "user", "content": "a", "weight": 1}, {"role": "assistant", "content": "b"}]},
     "messages[0].weight is allowed on assistant messages only"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0}]},
     "every assistant message has weight 0"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                   {"role": "assistant", "content": "b"}]}, "messages[0].content[0] must be a text part"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]},
     "messages[1].content must be a string"),
    ({"messages": [{"role": "user", "content": "a"},
                   {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "w", "arguments": "{"}}]}]},
     "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "nope", "content": "x"},
                   {"role": "assistant", "content": "b"}]}, "messages[1].tool_call_id must name a tool call"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [CALL, CALL]}],
      "parallel_tool_calls": False}, "parallel_tool_calls is false"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "tools": [{"x": 1}]},
     "tools[0] must be"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "extra": 1},
     "unknown field 'extra'"),
    ({"messages": [{"role": "function", "content": "a"}]}, "messages[0].role must be one of"),
    ({"prompt": "p", "completion": "c", "weight": 1}, "unknown field 'weight'"),
])
def test_errors_name_the_line_and_the_field(line, error):
    good = {"prompt": "p", "completion": "c"}
    [message] = errors_of(good, line)
    assert message.startswith("line 2: ") and error in message, message


def test_dpo_lines():
    line = {"input": {"messages": [{"role": "user", "content": "Hi"}]},
            "preferred_output": [{"role": "assistant", "content": "Hello!"}],
            "non_preferred_output": [{"role": "assistant", "content": "Go away."}]}
    got = example(line, "dpo")
    assert got["chosen"]["content"] == "Hello!" and got["rejected"]["content"] == "Go away."
    assert errors_of(line, method="dpo") == []
    assert "the job's method is supervised" in errors_of(line)[0]
    assert "DPO lines are" in errors_of({"prompt": "p", "completion": "c"}, method="dpo")[0]
    same = {**line, "non_preferred_output": line["preferred_output"]}
    assert "are the same" in errors_of(same, method="dpo")[0]
    with_tools = {"input": {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS},
                  "preferred_output": [{"role": "assistant", "tool_calls": [CALL]}],
                  "non_preferred_output": [{"role": "assistant", "content": "No idea."}]}
    got = example(with_tools, "dpo")
    assert got["tools"] == TOOLS and got["chosen"] == {"role": "assistant", "tool_calls": [CALL], "content": None}
    two_calls = {**with_tools, "input": {**with_tools["input"], "parallel_tool_calls": False},
                 "preferred_output": [{"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "call_2"}]}]}
    bad_tools = {**with_tools, "input": {**with_tools["input"], "tools": [{"type": "function"}]}}
    for bad, error in (
            (two_calls, "line 1: preferred_output[0].tool_calls holds 2 calls but input.parallel_tool_calls is false"),
            (bad_tools, "line 1: input.tools[0] must be"),
            ({**with_tools, "non_preferred_output": [{"role": "assistant", "tool_calls": []}]},
             "line 1: non_preferred_output[0].tool_calls must be a non-empty list"),
            ({**with_tools, "preferred_output": [{"role": "assistant", "tool_calls": [CALL], "weight": 1}]},
             "line 1: unknown field 'preferred_output[0].weight'"),
            ({**with_tools, "non_preferred_output": with_tools["preferred_output"]}, "are the same")):
        assert error in errors_of(bad, method="dpo")[0], errors_of(bad, method="dpo")
    assert "preferred_output' must be a list of one assistant message" in errors_of(
        {**line, "preferred_output": []}, method="dpo")[0]
