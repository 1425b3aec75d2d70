"""What goes into the engine and what comes out: requests, their sampling settings, results, incremental output
(deltas) and the errors a caller sees."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Priority(enum.IntEnum):
    """Who waits for a request: a live one (a chat, completion or response) has a client waiting on it, a batch line
    has a completion window. The engine admits live requests before waiting batch ones and takes rows and cache
    blocks from running batch sequences to make room for them; lower values come first."""
    LIVE = 0
    BATCH = 1


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep going past EOS until max_new_tokens (benchmarks)
    # Per-request logits processing (worker/engine/logits.py): [(token id, bias)], OpenAI's penalties, and the
    # number of top logprobs to report per token (None: no logprobs).
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    # What the output must match (worker/engine/grammar.py's spec: JSON, a JSON schema, a forced tool call).
    grammar: dict | None = None


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None
    # Report each step's newly accepted tokens as a GenerationDelta (Engine.submit's on_delta) before the result.
    stream: bool = False
    # params.grammar compiled for this engine's tokenizer (Engine.grammars().compile), done before submitting so
    # the engine's thread never compiles
    grammar: object = None
    priority: Priority = Priority.LIVE


@dataclass
class GenerationResult:
    request_id: str
    output_ids: list[int]  # generated tokens; includes the EOS token when one ended the request
    text: str  # decoded without special tokens, cut before a matched stop string
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    # an OpenAI error code for finish_reason "error" where one fits (context_length_exceeded, invalid_prompt, ...)
    error_code: str | None = None
    served_by: str = ""  # the path and kernels that generated it (the response's system_fingerprint)
    # with params.logprobs: per output token (token id, logprob, [(id, logprob)] of the most likely)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


@dataclass
class GenerationDelta:
    """New output of a streaming request: the token ids accepted since the last delta and the text they add. The
    texts of a request's deltas concatenate to its result's text (text held back while it may still turn out to
    be part of a stop string or an incomplete character comes in a later delta, the last one at the finish)."""

    request_id: str
    token_ids: list[int]
    text: str
    # with params.logprobs: those of token_ids, as GenerationResult.logprobs has them
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


class EngineClosed(RuntimeError):
    pass


class EngineMemoryError(ValueError):
    """The engine's memory budget cannot hold one request of its longest length next to its workspace."""


class RequestFailed(Exception):
    """A request that cannot be served; `code` is the OpenAI-style error code the client sees."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param  # the request field at fault, where one is


class EngineProcessExited(RequestFailed):
    """The node's engine process died while the request ran: nothing about the request failed, so it can be sent
    again (the next one starts a new process)."""

    def __init__(self, exit_code: int | None):
        super().__init__("server_error", f"The worker's engine process exited (exit code {exit_code}) while this "
                                         "request ran; it can be sent again.")
