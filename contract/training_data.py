"""Training data: JSONL of chat examples ({"messages": [...]}) or prompt/completion pairs.

Validation runs in the API before a job is queued (pure Python, no model needed); the worker reads the same
examples through `read_examples`.
"""

import json
from pathlib import Path

from contract.inference_requests import unencodable

ROLES = {"system", "user", "assistant"}
MAX_ERRORS = 20


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


def example_error(obj: dict) -> str | None:
    """Why one training line is unusable, or None."""
    texts = [m.get("content") for m in obj.get("messages") or [] if isinstance(m, dict)] + \
        [obj.get("prompt"), obj.get("completion")]
    if unencodable(texts):
        return "text must be valid Unicode (it holds a lone surrogate escape)"
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                return f"messages[{i}] needs a role of system, user or assistant"
            if not isinstance(m.get("content"), str):
                return f"messages[{i}].content must be a string"
        if not any(m["role"] == "assistant" for m in messages):
            return "no assistant message to learn from"
        return None
    if "prompt" in obj and "completion" in obj:
        if not isinstance(obj["prompt"], str) or not isinstance(obj["completion"], str):
            return "'prompt' and 'completion' must be strings"
        if not obj["completion"]:
            return "'completion' is empty"
        return None
    return "expected {\"messages\": [...]} or {\"prompt\": ..., \"completion\": ...}"


def validate_training_bytes(data: bytes) -> tuple[int, list[str]]:
    """(number of usable examples, line-numbered errors in line order, at most MAX_ERRORS)."""
    objects, errors = parse_jsonl(data)
    numbered = [(int(e.split(":")[0][5:]) if e.startswith("line ") else 0, e) for e in errors]
    usable = 0
    for number, obj in objects:
        problem = example_error(obj)
        if problem:
            numbered.append((number, f"line {number}: {problem}"))
        else:
            usable += 1
    numbered.sort(key=lambda pair: pair[0])
    return usable, [e for _, e in numbered][:MAX_ERRORS]


def read_examples(path: Path) -> list[dict]:
    """Usable examples as chat messages (prompt/completion becomes a user and an assistant turn)."""
    objects, _ = parse_jsonl(path.read_bytes())
    examples = []
    for _, obj in objects:
        if example_error(obj):
            continue
        if "messages" in obj:
            examples.append(obj["messages"])
        else:
            examples.append([{"role": "user", "content": obj["prompt"]},
                             {"role": "assistant", "content": obj["completion"]}])
    return examples
