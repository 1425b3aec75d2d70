"""Tool calls in a model's output text, as OpenAI's `tool_calls`. The formats of the model families served:
Hermes/Qwen (`<tool_call>{"name", "arguments"}</tool_call>`, one block per call), Llama 3 (a bare JSON
`{"name", "parameters"}` object, optionally after `<|python_tag|>`, several joined by `;`) and Mistral
(`[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`). worker/engine/grammar.py generates the same
shapes when a call is forced, and under tool_choice "auto" holds to them what may be read as a call here."""

import hashlib
import json
import re
import secrets

FORMATS = ("hermes", "llama3", "mistral")


def tool_call_format(chat_template) -> str:
    """Which format a chat template renders tool calls in (Hermes/Qwen when it names none)."""
    template = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def callable_tools(request: dict) -> list[str]:
    """The names a call in the output may have: tool_choice "none" keeps the tools in the prompt (the
    conversation may hold calls of them) but none is called."""
    return [t["name"] for t in request.get("tools") or []] if request.get("tool_choice") != "none" else []


def _call(obj, names: set[str]) -> dict | None:
    """{"name", "arguments"} of an OpenAI tool call from a parsed {"name", "arguments" | "parameters"} object, or
    None if it is not one of the request's tools."""
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
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


# A call's JSON up to its arguments object, in the order every format writes it
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_MARKER = {"hermes": "<tool_call>", "llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
_HERMES_END = "</tool_call>"
_WHITESPACE = " \t\r\n"


def _overlap(text: str, marker: str) -> int:
    """How many of text's last characters are the start of marker (so may still become it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class _Scan:
    """Where a JSON value being written ends: its nesting depth and string state, a character at a time."""

    def __init__(self, depth: int = 0):
        self.depth, self.in_string, self.escaped = depth, False, False

    def closes(self, ch: str) -> bool:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class ToolCallStream:
    """A model's output, fed as it is produced, split into content and OpenAI tool calls, each released as soon as
    it is known. Content streams while it cannot be part of a call: only what may start one is held back (part
    of a format's marker; in Llama 3 and Mistral, JSON at the start of the output) and trailing whitespace (a call
    after it drops it). A call is known once its JSON names one of the tools and opens its arguments object: its id
    and name come out then, and its arguments as the model writes them, so arguments cut short stay cut short. A
    call in another shape (keys in another order, arguments as a JSON string) comes out once its JSON is complete;
    text that turns out not to be a call is content. Text after the calls is not part of the answer (OpenAI's
    messages have none).

    feed() and close() return (content, fragments): the content text released and the tool-call fragments, in
    chat's `delta.tool_calls` shape ({index, id, type, function: {name, arguments}} first, then {index, function:
    {arguments}}). Whatever pieces the output comes in, they add up to the same answer. `seed` (the engine request
    id) makes the call ids repeatable, so the streamed calls and the request's stored result agree."""

    def __init__(self, fmt: str, tool_names, seed: str | None = None):
        self.fmt, self.names, self.seed = fmt, set(tool_names), seed
        self.content, self.calls = "", []
        self._pending = ""  # text not yet decided
        self._held = ""  # whitespace after the content released
        self._raw = ""  # what a possible call consumed (content after all if it is not one)
        self._mode = "start" if fmt in ("llama3", "mistral") else "content"
        self._scan: _Scan | None = None  # inside a call's arguments, or after them in its JSON
        self._texts: list[str] = []
        self._fragments: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._pending += text
        while self._pending and self._step():
            pass
        return self._take()

    def close(self) -> tuple[str, list[dict]]:
        if not self.calls:
            self._say(self._raw + self._pending, hold=False)
        self._pending, self._mode = "", "done"
        return self._take()

    def result(self) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) once closed; content is None when there are calls and no text before them."""
        return (self.content or None) if self.calls else self.content, self.calls

    def _take(self) -> tuple[str, list[dict]]:
        text, fragments = "".join(self._texts), self._fragments
        self._texts, self._fragments = [], []
        return text, fragments

    def _say(self, text: str, hold: bool = True) -> None:
        text, self._raw = self._held + text, ""
        kept = text.rstrip(_WHITESPACE) if hold else text
        self._held = text[len(kept):]
        if kept:
            self.content += kept
            self._texts.append(kept)

    def _consume(self, n: int) -> None:
        self._raw += self._pending[:n]
        self._pending = self._pending[n:]

    def _not_a_call(self, n: int = 0) -> bool:
        """The possible call and the next n pending characters are content after all (after calls: nothing)."""
        self._consume(n)
        if self.calls:
            self._mode, self._pending = "done", ""
            return False
        self._say(self._raw)
        self._mode = "content" if self.fmt == "hermes" else "text"
        return True

    def _open(self, name: str, arguments: str = "") -> None:
        index = len(self.calls)
        if self.seed is None:
            call_id = "call_" + secrets.token_hex(12)
        else:
            call_id = "call_" + hashlib.sha256(f"{self.seed}:{index}".encode()).hexdigest()[:24]
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        self._fragments.append({"index": index, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": arguments}})
        self._held = self._raw = ""

    def _arguments(self, text: str) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            self._fragments.append({"index": len(self.calls) - 1, "function": {"arguments": text}})

    def _step(self) -> bool:
        """Advance on the pending text; False when it must wait for more."""
        text = self._pending
        if self._mode == "done":
            self._pending = ""
            return False
        if self._mode == "text":
            self._say(text)
            self._pending = ""
            return False
        if self._mode == "content":  # Hermes: content until a <tool_call> marker
            at = text.find(_MARKER["hermes"])
            if at < 0:
                at = len(text) - _overlap(text, _MARKER["hermes"])
                self._say(text[:at])
                self._pending = text[at:]
                return False
            self._say(text[:at])
            self._pending = text[at:]
            self._consume(len(_MARKER["hermes"]))
            self._mode = "head"
            return True
        if self._mode in ("start", "between"):
            return self._between(text)
        if self._mode == "head":
            return self._head(text)
        return self._json(text)

    def _between(self, text: str) -> bool:
        """The start of a Llama 3 or Mistral output, or what follows a call: markers, separators, the next call."""
        stripped = text.lstrip(_WHITESPACE + (",;]" if self._mode == "between" else ""))
        self._consume(len(text) - len(stripped))
        if not stripped:
            return False
        markers = [_HERMES_END, _MARKER["hermes"]] if self.fmt == "hermes" else [_MARKER[self.fmt]]
        if self.fmt == "mistral" and self._mode == "start":
            markers.append("[")
        for marker in markers:
            if stripped.startswith(marker):
                self._consume(len(marker))
                if marker == _MARKER["hermes"]:
                    self._mode = "head"
                return True
            if marker.startswith(stripped):
                return False
        if stripped[0] == "{" and self.fmt != "hermes":
            self._mode = "head"
            return True
        return self._not_a_call()

    def _head(self, text: str) -> bool:
        """A possible call's JSON, kept pending until it is known to be a call or not."""
        stripped = text.lstrip(_WHITESPACE)
        self._consume(len(text) - len(stripped))
        if not stripped:
            return False
        if stripped[0] != "{":
            return self._not_a_call()
        head = _HEAD.match(stripped)
        if head and head.end() < len(stripped) and head.group(1) in self.names and stripped[head.end()] == "{":
            self._open(head.group(1))
            self._pending, self._mode, self._scan = stripped[head.end():], "arguments", _Scan()
            return True
        scan = _Scan()
        for i, ch in enumerate(stripped):
            if ch == "<" and not scan.in_string and self.fmt == "hermes":  # </tool_call> before the JSON ended
                return self._not_a_call(i)
            if scan.closes(ch):
                try:
                    call = _call(json.loads(stripped[:i + 1]), self.names)
                except (ValueError, RecursionError):
                    call = None
                if call is None:
                    return self._not_a_call(i + 1)
                self._pending = stripped[i + 1:]
                self._open(call["name"], call["arguments"])
                self._mode = "between"
                return True
        return False

    def _json(self, text: str) -> bool:
        """Inside a known call: its arguments (released as written), then the rest of its JSON (dropped)."""
        arguments = self._mode == "arguments"
        for i, ch in enumerate(text):
            if ch == "<" and not self._scan.in_string and self.fmt == "hermes":  # cut short by </tool_call>
                end, self._mode = i, "between"
            elif self._scan.closes(ch):
                end, self._mode = i + 1, "tail" if arguments else "between"
            else:
                continue
            if arguments:
                self._arguments(text[:end])
            self._pending, self._scan = text[end:], _Scan(1) if self._mode == "tail" else None
            return True
        if arguments:
            self._arguments(text)
        self._pending = ""
        return False


def parse(text: str, fmt: str, tool_names: list[str], seed: str | None = None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a model's whole output, as ToolCallStream finds them."""
    if not tool_names:
        return text, []
    stream = ToolCallStream(fmt, tool_names, seed)
    stream.feed(text)
    stream.close()
    return stream.result()


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
