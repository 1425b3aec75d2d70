"""Tool calls in a model's output text, as OpenAI's `tool_calls`. The formats of the model families served:
Hermes/Qwen (`<tool_call>{"name", "arguments"}</tool_call>`, one block per call), Llama 3 (a bare JSON
`{"name", "parameters"}` object, optionally after `<|python_tag|>`, several joined by `;`) and Mistral
(`[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`). worker/engine/grammar.py generates the same
shapes when a call is forced."""

import json
import secrets

FORMATS = ("hermes", "llama3", "mistral")
_decoder = json.JSONDecoder()


def tool_call_format(chat_template) -> str:
    """Which format a chat template renders tool calls in (Hermes/Qwen when it names none)."""
    template = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(obj, names: set[str]) -> dict | None:
    """An OpenAI tool call from a parsed {"name", "arguments" | "parameters"} object, or None if it is not one of
    the request's tools."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _objects(text: str) -> tuple[list, str]:
    """JSON values in `text` one after another (separated by whitespace, `,` or `;`); also what is left over."""
    values, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i >= len(text):
            return values, ""
        try:
            value, i = _decoder.raw_decode(text, i)
        except ValueError:
            return values, text[i:]
        values.append(value)


def parse(text: str, fmt: str, tool_names: list[str]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a model's output. Text that holds no well-formed call of a known tool stays
    content, whole; content before the calls is kept."""
    names = set(tool_names)
    if not names:
        return text, []
    if fmt == "hermes":
        head, sep, rest = text.partition("<tool_call>")
        calls = []
        for block in (sep + rest).split("<tool_call>")[1:]:
            body = block.split("</tool_call>")[0]
            values, left = _objects(body.strip())
            call = _call(values[0], names) if len(values) == 1 and not left else None
            if call is None:
                return text, []
            calls.append(call)
        return (head.strip() or None) if calls else text, calls
    if fmt == "llama3":
        body = text.strip().removeprefix("<|python_tag|>")
    else:  # mistral; the [TOOL_CALLS] marker is a special token a decoder may already have dropped
        body = text.strip().removeprefix("[TOOL_CALLS]").strip()
    values, left = _objects(body)
    if fmt == "mistral" and len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    calls = [_call(v, names) for v in values]
    if left or not calls or None in calls:
        return text, []
    return None, calls


def as_template_message(message: dict) -> dict:
    """An assistant message with tool_calls as chat templates read it: arguments as a mapping (templates print
    them with `tojson`), not OpenAI's JSON string."""
    calls = []
    for call in message.get("tool_calls") or []:
        args = call["function"]["arguments"]
        try:
            args = json.loads(args)
        except ValueError:
            pass
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": call["function"]["name"], "arguments": args}})
    return {**message, "tool_calls": calls}
