"""Per-request logits processing inside the engine's batch: logit_bias, presence/frequency penalties, a grammar
(structured outputs, forced tool calls) and logprobs. Only the rows of the requests that ask for one of them are
touched, so the rest of the batch keeps its plain greedy/sampled path.

Penalty counts live on the device (a [V] vector per penalized request, updated with each token it draws), so
they need no host round trip. A grammar does: its mask for the next token depends on the token just drawn, so a
step with a constrained row reads the previous step's tokens before picking."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.engine.device import to_device

if TYPE_CHECKING:  # xgrammar is imported only where a grammar is used (worker/engine/grammar.py)
    from worker.engine.grammar import Constraint


def words(vocab_size: int) -> int:
    """int32 words of a token bitmask (one bit per token id, as xgrammar fills it)."""
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed, on the host."""
    return torch.full((rows, words(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens of each row of `logits` [R, V] to -inf in place; `bitmask` [R, words(V)] int32 on the
    logits' device. Plain torch ops, so any device runs it."""
    rows, vocab = logits.shape
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).view(rows, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


class RequestLogits:
    """What one request asks of its logits. Built when the engine admits the request."""

    __slots__ = ("bias_ids", "bias_values", "presence", "frequency", "counts", "constraint", "top", "steps")

    def __init__(self, params, vocab_size: int, device: torch.device, constraint: Constraint | None):
        bias = [(int(t), float(b)) for t, b in (params.logit_bias or [])]
        self.bias_ids = to_device([t for t, _ in bias], torch.int64, device) if bias else None
        self.bias_values = to_device([b for _, b in bias], torch.float32, device) if bias else None
        self.presence = float(params.presence_penalty or 0.0)
        self.frequency = float(params.frequency_penalty or 0.0)
        penalized = self.presence != 0.0 or self.frequency != 0.0
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device) if penalized else None
        self.constraint = constraint
        self.top = params.logprobs  # None: no logprobs; k: the chosen token's and the k most likely
        self.steps: list[torch.Tensor] = []  # per step on the device: [token, logprob, k values, k ids]

    @classmethod
    def of(cls, request, vocab_size: int, device: torch.device, grammars) -> RequestLogits | None:
        """None for a request that asks for nothing here (the common case costs nothing). `request` is a
        GenerationRequest (its compiled grammar, if any, in request.grammar); `grammars` the engine's compiler."""
        p = request.params
        if not (p.logit_bias or p.presence_penalty or p.frequency_penalty or p.logprobs is not None
                or request.grammar is not None):
            return None
        constraint = grammars.constraint(request.grammar) if request.grammar is not None else None
        return cls(p, vocab_size, device, constraint)

    @property
    def changes_logits(self) -> bool:
        return self.bias_ids is not None or self.counts is not None or self.constrained

    @property
    def constrained(self) -> bool:
        return self.constraint is not None and not self.constraint.done

    def accept(self, token: int) -> bool:
        """The token drawn, on the host; False if the grammar does not allow it."""
        return self.constraint is None or self.constraint.done or self.constraint.accept(token)

    def logprobs(self, n_tokens: int, start: int = 0) -> list[tuple[int, float, list[tuple[int, float]]]] | None:
        """(token, logprob, [(id, logprob)] * top) for output tokens start to n_tokens."""
        if self.top is None:
            return None
        if not self.steps[start:n_tokens]:
            return []
        rows = torch.stack(self.steps[start:n_tokens]).tolist()
        k = self.top
        return [(int(r[0]), r[1], [(int(i), v) for v, i in zip(r[2:2 + k], r[2 + k:2 + 2 * k])]) for r in rows]


def process(logits: torch.Tensor, rows: list, greedy: torch.Tensor | None) -> torch.Tensor | None:
    """Apply bias, penalties and grammar masks in place to the rows of `logits` [N, V] whose requests ask for
    them. `rows` pairs row indices with sequences (`.logits` a RequestLogits or None). Returns the greedy tokens
    to use: `greedy` when no row changed, else None (recomputed from the processed logits)."""
    change = [(i, s.logits) for i, s in rows if s.logits is not None and not s.finished and s.logits.changes_logits]
    if not change:
        return greedy
    dev = logits.device
    index = to_device([i for i, _ in change], torch.int64, dev)
    sub = logits.index_select(0, index).float()
    for r, (_, p) in enumerate(change):
        if p.bias_ids is not None:
            sub[r].index_add_(0, p.bias_ids, p.bias_values)
        if p.counts is not None:
            sub[r] -= p.frequency * p.counts + p.presence * (p.counts > 0).float()
    masked = [(r, p.constraint) for r, (_, p) in enumerate(change) if p.constrained]
    if masked:
        bitmask = new_bitmask(len(change), logits.shape[-1])  # all allowed for rows without a grammar
        masked[0][1].grammars.fill([c for _, c in masked], bitmask, [r for r, _ in masked])
        apply_bitmask(sub, bitmask.to(dev, non_blocking=True) if dev.type != "cpu" else bitmask)
    logits.index_copy_(0, index, sub.to(logits.dtype))
    return None


def record(logits: torch.Tensor, toks: torch.Tensor, rows: list) -> None:
    """After the tokens are chosen: count them for penalties and keep the logprobs asked for (on the device)."""
    counted = [(i, s.logits) for i, s in rows if s.logits is not None and s.logits.counts is not None]
    for i, p in counted:
        p.counts.index_add_(0, toks[i:i + 1], torch.ones(1, dtype=torch.float32, device=toks.device))
    wanted = [(i, s.logits) for i, s in rows if s.logits is not None and s.logits.top is not None]
    if not wanted:
        return
    index = to_device([i for i, _ in wanted], torch.int64, logits.device)
    # OpenAI's floor for a token that cannot occur (JSON has no -inf; a grammar makes many tokens impossible)
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1).clamp_(min=-9999.0)
    chosen = toks.index_select(0, index)
    picked = lp.gather(1, chosen[:, None])
    k = max(p.top for _, p in wanted)
    values, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen[:, None][:, :0])
    packed = torch.cat([chosen[:, None].float(), picked, values, ids.float()], dim=1)
    for r, (_, p) in enumerate(wanted):
        top = p.top
        p.steps.append(torch.cat([packed[r, :2], packed[r, 2:2 + top], packed[r, 2 + k:2 + k + top]]))
