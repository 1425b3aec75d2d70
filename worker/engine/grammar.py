"""Constrained decoding with xgrammar: JSON (any object, or a JSON schema) and tool calls in the serving model's
own format. One compiler per tokenizer (it caches what it compiles); a Constraint per request that gives the
allowed next tokens as a bitmask and follows the tokens generated.

xgrammar was picked over llguidance by measurement (bench/constrained.py --grammar-libs; docs/benchmarks.md): on a
32k vocabulary their median masks were close (18 and 15 us on the H200's host), but llguidance's worst was 10-100
times xgrammar's (1.8 ms against 0.14 ms there), and one slow mask stalls the whole batch's step. Compiling a
schema costs a few ms in either, and is cached.

Response formats are generated compact (`, ` and `: ` separators, no free whitespace): a model cannot wander
into endless whitespace that a schema allows, and the output is what OpenAI's structured outputs return. Tool-call
arguments allow one whitespace character at a time (xgrammar's structural tags have no compact mode)."""

import re
import threading

import torch
import xgrammar as xgr
from xgrammar import structural_tag as st

from contract.tool_calls import tool_call_format
from worker.engine.logits import words

# The tool-call formats of the model families served, as the chat templates render a call (see
# contract/tool_calls.py, which parses them back): Hermes/Qwen, Llama 3 (JSON), Mistral.
_CALL = {
    "hermes": ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n"),
    "llama3": ('{"name": "', '", "parameters": ', "}", "; "),
    "mistral": ('{"name": "', '", "arguments": ', "}", ", "),
}


class GrammarError(ValueError):
    """A response format or tool schema that cannot be compiled; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# Under tool_choice "auto", Hermes text is free until it starts a call (this trigger); the call must then be
# well-formed. Llama 3 and Mistral calls are read from the output's start only (their templates render a call as the
# whole message): there the output is the calls, or text that does not begin (after whitespace) as a call could be
# read, with one of these, and in which the format's marker never appears.
_TRIGGER = "<tool_call>"
_CALL_STARTS = {"llama3": ["{", "<|python_tag|>"], "mistral": ["{", "["]}
_MARKERS = {"hermes": ["<tool_call>", "</tool_call>"], "llama3": ["<|python_tag|>"], "mistral": ["[TOOL_CALLS]"]}
_WHITESPACE = " \t\r\n"
_SPACES = "[ \\t\\r\\n]*"


def _chars(excluded: str) -> str:
    """A regex character class of any character but these."""
    escapes = {"\t": "\\t", "\r": "\\r", "\n": "\\n", "\\": "\\\\", "]": "\\]", "^": "\\^", "-": "\\-", "[": "\\["}
    return "[^" + "".join(escapes.get(c, c) for c in excluded) + "]"


def _text_start(prefixes: list[str]) -> str:
    """A regex of an output's start that, after whitespace, has left all of `prefixes` behind: its last character
    is the first that none of them (nor whitespace, at first) can continue with."""
    def node(remaining: list[str], also: str = "") -> str:
        firsts = sorted({p[0] for p in remaining})
        branches = [_chars(also + "".join(firsts))]
        for c in firsts:
            rest = [p[1:] for p in remaining if p[0] == c]
            if all(rest):  # else c completes a prefix: a call's start
                branches.append(re.escape(c) + node(rest))
        return "(" + "|".join(branches) + ")"

    return _SPACES + node(prefixes, _WHITESPACE)


def _text_short_of(prefixes: list[str]) -> str:
    """A regex of a whole output that is whitespace and at most part of one of `prefixes`."""
    parts = sorted({p[:i] for p in prefixes for i in range(1, len(p))})
    return _SPACES + "(" + "|".join(re.escape(p) for p in parts) + ")?"


def structural_tag(spec: dict) -> st.StructuralTag:
    """The grammar of tool calls: `spec` = {format, tools: [{name, parameters}], choice: "auto" | "required" |
    name, parallel}. "required" allows any of the tools (several calls when parallel), a name one call of it;
    "auto" any text, in which a call, once begun, is a well-formed call of one of the tools (and, unless
    parallel, the last thing written); in Llama 3 and Mistral, whose calls are read from the output's start only,
    either the calls or text that does not start as one could."""
    fmt = spec["format"]
    begin, middle, end, separator = _CALL[fmt]
    tools = spec["tools"] if spec["choice"] in ("auto", "required") else [t for t in spec["tools"]
                                                                              if t["name"] == spec["choice"]]
    tags = [st.TagFormat(begin=begin + t["name"] + middle, end=end,
                         content=st.JSONSchemaFormat(json_schema=t.get("parameters") or {"type": "object"},
                                                     style="json", max_whitespace_cnt=1))
            for t in tools]
    if spec["choice"] == "auto" and fmt == "hermes":
        return st.StructuralTag(format=st.TriggeredTagsFormat(triggers=[_TRIGGER], tags=tags,
                                                               stop_after_first=not spec.get("parallel")))
    several = spec.get("parallel") and spec["choice"] in ("auto", "required")
    calls = st.TagsWithSeparatorFormat(tags=tags, separator=separator, at_least_one=True, stop_after_first=not several)
    if fmt == "mistral":
        calls = st.SequenceFormat(elements=[st.ConstStringFormat(value="[TOOL_CALLS]["), calls,
                                            st.ConstStringFormat(value="]")])
    elif fmt == "llama3" and spec["choice"] == "auto":  # as Llama 3 may write a call (of a built-in tool, say)
        calls = st.SequenceFormat(elements=[st.OptionalFormat(content=st.ConstStringFormat(value="<|python_tag|>")),
                                            calls])
    if spec["choice"] != "auto":
        return st.StructuralTag(format=calls)
    starts = _CALL_STARTS[fmt]
    text = st.SequenceFormat(elements=[st.RegexFormat(pattern=_text_start(starts)),
                                       st.AnyTextFormat(excludes=_MARKERS[fmt])])
    return st.StructuralTag(format=st.OrFormat(elements=[calls, text,
                                                         st.RegexFormat(pattern=_text_short_of(starts))]))


class Grammars:
    """The grammar compiler of one tokenizer. `vocab_size` is the width of the model's logits, which may exceed
    the tokenizer's vocabulary (those extra ids are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.tool_format = tool_call_format(getattr(tokenizer, "chat_template", None))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=256 << 20)
        self._lock = threading.Lock()
        # Masks of a step's constrained rows are filled together, on several threads (half the host's cores).
        self._batch = xgr.BatchGrammarMatcher("auto")
        # xgrammar's JSON strings admit raw control characters, which JSON forbids (and strict parsers such as
        # pydantic's reject): tokens holding one are never allowed under a grammar.
        refused = {i for i, piece in enumerate(info.decoded_vocab)
                   if any(b < 0x20 and b not in b"\t\n\r" for b in piece)}
        # Nor a special token but the stop tokens and the tool-call format's markers (which its parser does
        # without): the served text is decoded without them, so it would not be the text the grammar checked (a
        # call behind one would be read from the text unchecked).
        refused |= {i for i, token in tokenizer.added_tokens_decoder.items()
                    if token.special and i < vocab_size and i not in stop_ids
                    and token.content not in _MARKERS[self.tool_format]}
        self.refused = frozenset(refused)
        allow = torch.ones(words(vocab_size) * 32, dtype=torch.bool)
        allow[list(self.refused)] = False
        packed = (allow.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(1)
        self.allowed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)

    def compile(self, spec: dict) -> xgr.CompiledGrammar:
        """spec: {"type": "json_object"} | {"type": "json_schema", "schema", "strict"} | {"type": "tool_calls",
        "tools", "choice", "parallel"}."""
        try:
            with self._lock:
                if spec["type"] == "json_object":
                    return self._compiler.compile_json_schema({"type": "object"}, any_whitespace=False,
                                                              strict_mode=False)
                if spec["type"] == "json_schema":
                    return self._compiler.compile_json_schema(spec["schema"], any_whitespace=False,
                                                              strict_mode=bool(spec.get("strict")))
                return self._compiler.compile_structural_tag(structural_tag({**spec, "format": self.tool_format}))
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors for a schema it cannot use
            param = "tools" if spec["type"] == "tool_calls" else "response_format"
            raise GrammarError(f"The JSON schema in '{param}' cannot be used for constrained decoding: "
                               f"{str(exc).splitlines()[0][:300]}", param) from None

    def constraint(self, compiled: xgr.CompiledGrammar) -> "Constraint":
        return Constraint(xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_ids), self)

    def fill(self, constraints: list["Constraint"], bitmask: torch.Tensor, rows: list[int]) -> None:
        """The tokens each constraint allows next into its row of `bitmask` (int32, on the host; one bit per
        token id)."""
        if len(constraints) == 1:
            constraints[0].matcher.fill_next_token_bitmask(bitmask, rows[0])
        else:
            self._batch.batch_fill_next_token_bitmask([c.matcher for c in constraints], bitmask, rows)
        index = torch.tensor(rows)
        bitmask[index] &= self.allowed


class Constraint:
    """One request's position in its grammar (`grammars`: the compiler it came from)."""

    __slots__ = ("matcher", "grammars")

    def __init__(self, matcher: xgr.GrammarMatcher, grammars: Grammars):
        self.matcher = matcher
        self.grammars = grammars

    def accept(self, token: int) -> bool:
        """Advance by a generated token; False if the grammar does not allow it (or has already ended)."""
        return token not in self.grammars.refused and not self.matcher.is_terminated() \
            and self.matcher.accept_token(token)

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()
