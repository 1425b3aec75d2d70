"""Training data as OpenAI defines it, in JSONL.

Supervised lines: `{"messages": [...], "tools"?: [...], "parallel_tool_calls"?: bool}` (every assistant message is
trained unless it has `"weight": 0`; assistant messages may hold `tool_calls`, answered by `tool` messages;
content may be a string or an array of text parts), or `{"prompt", "completion"}`.
DPO lines: `{"input": {"messages", "tools"?, "parallel_tool_calls"?}, "preferred_output": [assistant message],
"non_preferred_output": [assistant message]}`; an output may hold `tool_calls` (content then optional), as a
supervised assistant message may.

Validation runs in the API before a job is queued (pure Python, no model needed) and names the line and the
field; the worker reads the same lines, normalised, through `read_examples`.
"""

import json
from pathlib import Path

from contract.inference_requests import unencodable

ROLES = {"system", "developer", "user", "assistant", "tool"}
MESSAGE_FIELDS = {"role", "content", "name", "weight", "tool_calls", "tool_call_id"}
METHODS = ("supervised", "dpo")
MAX_ERRORS = 20


class BadExample(ValueError):
    """One field of one line is wrong; the message names the field."""


def numbered_lines(data: bytes) -> tuple[list[tuple[int, str]], str | None]:
    """The non-empty lines of a JSONL file with their 1-based numbers, or why the file is not text."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], f"the file is not UTF-8 text ({exc.reason} at byte {exc.start})"
    return [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()], None


def parse_jsonl(data: bytes) -> tuple[list[tuple[int, dict]], list[str]]:
    """(line number, object) for each JSON-object line, and line-numbered errors for the other lines."""
    objects, errors = [], []
    lines, not_text = numbered_lines(data)
    if not_text:
        return [], [not_text]
    for number, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"line {number}: not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(obj, dict):
            errors.append(f"line {number}: expected a JSON object, got {type(obj).__name__}")
            continue
        objects.append((number, obj))
    if not objects and not errors:
        errors.append("the file holds no lines")
    return objects, errors


def _text(content, field: str, *, optional: bool = False) -> str | None:
    """A message's content as one string: a string, or an array of text parts joined."""
    if content is None and optional:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadExample(f"{field}[{j}] must be a text part {{\"type\": \"text\", \"text\": \"...\"}} "
                                 "(only text is supported)")
            texts.append(part["text"])
        return "".join(texts)
    raise BadExample(f"{field} must be a string or a non-empty array of text parts")


def _tool_calls(calls, field: str, seen_ids: set[str]) -> list[dict]:
    if not isinstance(calls, list) or not calls:
        raise BadExample(f"{field} must be a non-empty list")
    normalised = []
    for k, call in enumerate(calls):
        where = f"{field}[{k}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise BadExample(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise BadExample(f"{where}.id must be a non-empty string")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadExample(f"{where}.function.name must be a non-empty string")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            raise BadExample(f"{where}.function.arguments must be a string of JSON")
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            raise BadExample(f"{where}.function.arguments is not valid JSON") from None
        seen_ids.add(call["id"])
        normalised.append({"id": call["id"], "type": "function",
                           "function": {"name": function["name"], "arguments": arguments}})
    return normalised


def _messages(messages, field: str, parallel_tool_calls: bool) -> list[dict]:
    """Checked and normalised messages: text content, developer as system, weight 0/1 on assistant turns."""
    if not isinstance(messages, list) or not messages:
        raise BadExample(f"'{field}' must be a non-empty list")
    normalised, call_ids = [], set()
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadExample(f"{where}.role must be one of system, developer, user, assistant, tool")
        unknown = sorted(set(m) - MESSAGE_FIELDS)
        if unknown:
            raise BadExample(f"{where} has an unknown field '{unknown[0]}'")
        role = m["role"]
        out = {"role": "system" if role == "developer" else role}
        if "name" in m:
            if not isinstance(m["name"], str):
                raise BadExample(f"{where}.name must be a string")
            out["name"] = m["name"]
        for key in ("weight", "tool_calls"):
            if key in m and role != "assistant":
                raise BadExample(f"{where}.{key} is allowed on assistant messages only")
        if "tool_call_id" in m and role != "tool":
            raise BadExample(f"{where}.tool_call_id is allowed on tool messages only")
        if role == "assistant":
            weight = m.get("weight", 1)
            if type(weight) is not int or weight not in (0, 1):
                raise BadExample(f"{where}.weight must be 0 or 1")
            out["weight"] = weight
            if m.get("tool_calls") is not None:
                out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls", call_ids)
                if not parallel_tool_calls and len(out["tool_calls"]) > 1:
                    raise BadExample(f"{where}.tool_calls holds {len(out['tool_calls'])} calls but "
                                     "parallel_tool_calls is false")
            out["content"] = _text(m.get("content"), f"{where}.content", optional="tool_calls" in out)
        elif role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or m["tool_call_id"] not in call_ids:
                raise BadExample(f"{where}.tool_call_id must name a tool call of an earlier assistant message")
            out["tool_call_id"] = m["tool_call_id"]
            out["content"] = _text(m.get("content"), f"{where}.content")
        else:
            out["content"] = _text(m.get("content"), f"{where}.content")
        normalised.append(out)
    return normalised


def _tools(obj: dict, field: str) -> tuple[list[dict] | None, bool]:
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadExample(f"'{field}tools' must be a list")
        for k, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
                    or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
                raise BadExample(f"{field}tools[{k}] must be {{\"type\": \"function\", \"function\": "
                                 "{\"name\", \"parameters\"?, ...}}")
    parallel = obj.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadExample(f"'{field}parallel_tool_calls' must be true or false")
    return tools or None, parallel


def _only(obj: dict, allowed: set[str], where: str = "") -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise BadExample(f"unknown field '{where}{unknown[0]}'")


def _supervised(obj: dict) -> dict:
    if "messages" in obj:
        _only(obj, {"messages", "tools", "parallel_tool_calls"})
        tools, parallel = _tools(obj, "")
        messages = _messages(obj["messages"], "messages", parallel)
        if not any(m["role"] == "assistant" for m in messages):
            raise BadExample("no assistant message to learn from")
        if not any(m["role"] == "assistant" and m["weight"] for m in messages):
            raise BadExample("every assistant message has weight 0: nothing to learn from")
        return {"messages": messages, "tools": tools}
    if "prompt" in obj and "completion" in obj:
        _only(obj, {"prompt", "completion"})
        if not isinstance(obj["prompt"], str) or not isinstance(obj["completion"], str):
            raise BadExample("'prompt' and 'completion' must be strings")
        if not obj["completion"]:
            raise BadExample("'completion' is empty")
        return {"messages": [{"role": "user", "content": obj["prompt"]},
                             {"role": "assistant", "content": obj["completion"], "weight": 1}], "tools": None}
    if "input" in obj:
        raise BadExample("this is a DPO line (input/preferred_output); the job's method is supervised")
    raise BadExample("expected {\"messages\": [...]} or {\"prompt\": ..., \"completion\": ...}")


def _dpo_output(value, field: str, parallel_tool_calls: bool) -> dict:
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict):
        raise BadExample(f"'{field}' must be a list of one assistant message")
    message, where = value[0], f"{field}[0]"
    if message.get("role") != "assistant":
        raise BadExample(f"{where}.role must be assistant")
    _only(message, {"role", "content", "tool_calls"}, f"{where}.")
    out = {"role": "assistant"}
    if message.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls", set())
        if not parallel_tool_calls and len(out["tool_calls"]) > 1:
            raise BadExample(f"{where}.tool_calls holds {len(out['tool_calls'])} calls but "
                             "input.parallel_tool_calls is false")
    out["content"] = _text(message.get("content"), f"{where}.content", optional="tool_calls" in out)
    return out


def _dpo(obj: dict) -> dict:
    if "messages" in obj or "prompt" in obj:
        raise BadExample("DPO lines are {\"input\", \"preferred_output\", \"non_preferred_output\"}")
    _only(obj, {"input", "preferred_output", "non_preferred_output"})
    source = obj.get("input")
    if not isinstance(source, dict):
        raise BadExample("'input' must be an object {\"messages\": [...]}")
    _only(source, {"messages", "tools", "parallel_tool_calls"}, "input.")
    tools, parallel = _tools(source, "input.")
    messages = _messages(source.get("messages"), "input.messages", parallel)
    if messages[-1]["role"] == "assistant":
        raise BadExample("input.messages must end with a turn the outputs answer (not an assistant message)")
    chosen = _dpo_output(obj.get("preferred_output"), "preferred_output", parallel)
    rejected = _dpo_output(obj.get("non_preferred_output"), "non_preferred_output", parallel)
    if chosen == rejected:
        raise BadExample("preferred_output and non_preferred_output are the same")
    return {"messages": messages, "tools": tools, "chosen": chosen, "rejected": rejected}


def example(obj: dict, method: str = "supervised") -> dict:
    """One line, checked and normalised; BadExample names the wrong field."""
    if unencodable(obj):
        raise BadExample("text must be valid Unicode (it holds a lone surrogate escape)")
    return _dpo(obj) if method == "dpo" else _supervised(obj)


def example_error(obj: dict, method: str = "supervised") -> str | None:
    """Why one training line is unusable, or None."""
    try:
        example(obj, method)
    except BadExample as exc:
        return str(exc)
    return None


def validate_training_bytes(data: bytes, method: str = "supervised") -> tuple[int, list[str]]:
    """(number of usable examples, line-numbered errors in line order, at most MAX_ERRORS)."""
    objects, errors = parse_jsonl(data)
    numbered = [(int(e.split(":")[0][5:]) if e.startswith("line ") else 0, e) for e in errors]
    usable = 0
    for number, obj in objects:
        problem = example_error(obj, method)
        if problem:
            numbered.append((number, f"line {number}: {problem}"))
        else:
            usable += 1
    numbered.sort(key=lambda pair: pair[0])
    return usable, [e for _, e in numbered][:MAX_ERRORS]


def read_examples(path: Path, method: str = "supervised") -> list[dict]:
    """The usable lines, normalised: {"messages", "tools"} (prompt/completion becomes a user and an assistant
    turn), plus "chosen" and "rejected" for DPO."""
    objects, _ = parse_jsonl(path.read_bytes())
    examples = []
    for _, obj in objects:
        try:
            examples.append(example(obj, method))
        except BadExample:
            continue
    return examples
