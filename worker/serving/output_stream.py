"""Streamed output on its way to the API: each engine delta of a streaming request becomes an entry of the
request's Redis stream (contract.live). One thread per node shapes them (tool calls split out of the text,
logprobs in chat's shape) and writes them, as many per round trip as are waiting, so the engine host's reader
thread (which calls on_delta for every request) never waits on Redis or the tokenizer."""

import bisect
import json
import queue
import threading
import time
from typing import Callable

import redis

from contract import tool_calls
from contract.live import OUTPUT_TTL_SECONDS, output_key
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.requests import GenerationDelta


def logprob_entries(tokenizer, logprobs: list) -> list[dict]:
    """The engine's (token, logprob, top) triples as chat's per-token entries {token, logprob, bytes,
    top_logprobs}."""
    def token(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    return [dict(token(t, lp), top_logprobs=[token(i, v) for i, v in top]) for t, lp, top in logprobs]


class TextByToken:
    """How much of an output's text its first tokens wrote, kept as the tokens come: the tokens that wrote the
    content before a call (whose message has their logprobs) are found without decoding the output again for
    each delta (that was quadratic in the output's length)."""

    def __init__(self, tokenizer, token_ids: list[int] = ()):
        self._detok = IncrementalDetokenizer(tokenizer)
        self.ids: list[int] = []
        self._ends: list[int] = []  # the text's length once each token is in
        self.extend(token_ids)

    def extend(self, token_ids: list[int]) -> None:
        for token in token_ids:
            self.ids.append(token)
            self._detok.update(self.ids)
            self._ends.append(len(self._detok.text))

    def tokens_writing(self, text: str) -> int:
        """How many of the first tokens it takes to write `text`, a prefix of the output's text."""
        return min(len(self.ids), bisect.bisect_left(self._ends, len(text)) + 1) if text else 0


class _Choice:
    """A choice's output where tools may be called: its parser, its tokens, and the logprobs not yet sent."""

    def __init__(self, parser: tool_calls.ToolCallStream, tokenizer):
        self.parser, self.tokens, self.held = parser, TextByToken(tokenizer), []
        self.wrote = 0  # how many tokens wrote the content released so far


class RequestOutput:
    """One streaming request's entries: per choice, its text goes through a ToolCallStream where tools may be
    called (seeded with the engine request id, as the stored result's parse is, so the call ids agree). There the
    logprobs go with the text their tokens wrote, and a call's with its first fragment, in an entry of their own:
    the message before a call gets the logprobs of its own tokens, as the stored result's `content_tokens` count
    them, however many tokens an engine delta holds."""

    def __init__(self, request: dict, tokenizer_of: Callable[[], object]):
        self._tokenizer_of = tokenizer_of
        self._names = tool_calls.callable_tools(request)
        self._choices: dict[int, _Choice] = {}
        self.first_written: float | None = None  # when its first entry reached Redis (the record's timings)

    def entries(self, choice: int, delta: GenerationDelta) -> list[dict]:
        logprobs = logprob_entries(self._tokenizer_of(), delta.logprobs) if delta.logprobs else []
        if not self._names:
            return [{"c": choice, "t": delta.text, **({"l": json.dumps(logprobs)} if logprobs else {})}]
        state = self._choices.get(choice)
        if state is None:
            fmt = tool_calls.tool_call_format(self._tokenizer_of().chat_template)
            state = self._choices[choice] = _Choice(tool_calls.ToolCallStream(fmt, self._names, delta.request_id),
                                                    self._tokenizer_of())
        called_before = bool(state.parser.calls)
        text, fragments = state.parser.feed(delta.text)
        if delta.logprobs is None:  # not asked for
            return [self._entry(choice, state, text, fragments, 0)]
        state.tokens.extend(delta.token_ids)
        state.held += logprobs
        if called_before:  # the calls' tokens
            return [self._entry(choice, state, text, fragments, len(state.held))]
        sent = len(state.tokens.ids) - len(state.held)
        if text:
            state.wrote = state.tokens.tokens_writing(state.parser.content)
        entries = [self._entry(choice, state, text, [], state.wrote - sent)]
        if fragments:  # the first call began: the tokens after the content are its
            entries.append(self._entry(choice, state, "", fragments, len(state.held)))
        return entries

    @staticmethod
    def _entry(choice: int, state: _Choice, text: str, fragments: list[dict], n_logprobs: int) -> dict:
        logprobs, state.held = state.held[:n_logprobs], state.held[n_logprobs:]
        return {"c": choice, "t": text, **({"tc": json.dumps(fragments)} if fragments else {}),
                **({"l": json.dumps(logprobs)} if logprobs else {})}

    def closing(self) -> list[dict]:
        """What each choice's parser still held, once the output is complete, with the logprobs not sent yet."""
        entries = []
        for choice, state in self._choices.items():
            text, fragments = state.parser.close()
            if text or fragments or state.held:
                entries.append(self._entry(choice, state, text, fragments, len(state.held)))
        return entries


class OutputStreams:
    def __init__(self, client: redis.Redis):
        self._redis = client
        self._outbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._started: set[str] = set()  # requests whose first entry went out (the writer thread's)
        threading.Thread(target=self._run, name="xpujobs-output-streams", daemon=True).start()

    def delta(self, record_id: str, choice: int, delta: GenerationDelta, output: RequestOutput) -> None:
        self._outbox.put((record_id, choice, delta, output))

    def end(self, record_id: str, output: RequestOutput | None = None) -> None:
        """After the record holds the final status and result: the reader reads them then."""
        self._outbox.put((record_id, None, None, output))

    def _entries(self, record_id: str, choice: int | None, delta: GenerationDelta | None,
                 output: RequestOutput | None) -> list[dict]:
        if choice is None:
            self._started.discard(record_id)
            return (output.closing() if output is not None else []) + [{"end": 1}]
        # The first goes out even when empty (text still held back, say): the client's stream starts then.
        entries = [fields for fields in output.entries(choice, delta)
                   if fields["t"] or len(fields) > 2 or record_id not in self._started]
        if entries:
            self._started.add(record_id)
        return entries

    def _run(self) -> None:
        while True:
            waiting = [self._outbox.get()]
            while True:
                try:
                    waiting.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            pipe = self._redis.pipeline(transaction=False)
            firsts = []
            for record_id, *item in waiting:
                try:
                    entries = self._entries(record_id, *item)
                except Exception as exc:  # one request's shaping must not stop the others' output
                    print(f"xpu-jobs output streams: {record_id}: {exc!r}", flush=True)
                    entries = [{"end": 1}] if item[0] is None else []
                output = item[2]
                if entries and output is not None and output.first_written is None:
                    firsts.append(output)
                for fields in entries:
                    pipe.xadd(output_key(record_id), fields)
            for record_id in {record_id for record_id, *_ in waiting}:
                pipe.expire(output_key(record_id), OUTPUT_TTL_SECONDS)
            try:
                pipe.execute()
            except redis.RedisError as exc:  # the API reader times out and the record still has the result
                print(f"xpu-jobs output streams: {exc}", flush=True)
            written = time.time()
            for output in firsts:
                output.first_written = written
