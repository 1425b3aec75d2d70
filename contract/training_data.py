"""Training data: JSONL of chat examples ({"messages": [...]}) or prompt/completion pairs.

Validation runs in the API before a job is queued (pure Python, no model needed); the worker reads the same
examples through `read_examples`.
"""

import json
from pathlib import Path

ROLES = {"system", "user", "assistant"}
MAX_ERRORS = 20


def parse_jsonl(data: bytes) -> tuple[list[dict], list[str]]:
    """Objects of a JSONL file, and line-numbered errors for lines that are not JSON objects."""
    objects, errors = [], []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [f"the file is not UTF-8 text ({exc.reason} at byte {exc.start})"]
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"line {number}: not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(obj, dict):
            errors.append(f"line {number}: expected a JSON object, got {type(obj).__name__}")
            continue
        objects.append(obj)
    if not objects and not errors:
        errors.append("the file holds no lines")
    return objects, errors


def example_error(obj: dict) -> str | None:
    """Why one training line is unusable, or None."""
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
    """(number of usable examples, line-numbered errors, at most MAX_ERRORS)."""
    text_errors: list[str] = []
    count = 0
    objects, errors = parse_jsonl(data)
    if errors and not objects:
        return 0, errors[:MAX_ERRORS]
    text_errors.extend(errors)
    line_numbers = [n for n, line in enumerate(data.decode("utf-8").splitlines(), start=1) if line.strip()]
    parsed = iter(objects)
    for number in line_numbers:
        if any(e.startswith(f"line {number}:") for e in errors):
            continue
        problem = example_error(next(parsed))
        if problem:
            text_errors.append(f"line {number}: {problem}")
        else:
            count += 1
    return count, text_errors[:MAX_ERRORS]


def read_examples(path: Path) -> list[dict]:
    """Usable examples as chat messages (prompt/completion becomes a user and an assistant turn)."""
    objects, _ = parse_jsonl(path.read_bytes())
    examples = []
    for obj in objects:
        if example_error(obj):
            continue
        if "messages" in obj:
            examples.append(obj["messages"])
        else:
            examples.append([{"role": "user", "content": obj["prompt"]},
                             {"role": "assistant", "content": obj["completion"]}])
    return examples
