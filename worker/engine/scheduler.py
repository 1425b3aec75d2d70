"""Which sequences run each engine step (vLLM v1's scheduler, smaller): every decoding sequence takes one token,
and prefill takes a token budget per step, so a long prompt is prefilled in chunks interleaved with the running
batch's decode steps (chunked prefill) instead of stalling them.

Cache blocks (kv_cache.BlockManager) are handed out as sequences need them: a waiting request is admitted when
the blocks for its prompt (or its first chunk) are free; a decoding sequence takes a new block when its last one
fills. When the pool runs dry mid-decode, the most recently admitted sequences are preempted: their blocks go
back, they return to the front of the queue with the tokens they have, and are recomputed (prefilled again,
prompt and output so far) when blocks free up. A request's longest possible length (max_seq_len) never exceeds
the pool, so the oldest request always makes progress.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from worker.engine.kv_cache import BlockManager
from worker.engine.requests import GenerationDelta, GenerationRequest

if TYPE_CHECKING:
    from worker.engine.logits import RequestLogits


class Sequence:
    """One request inside the engine: its settings, its output so far, where its cache is."""

    __slots__ = ("req", "fut", "prompt_len", "limit", "out", "n_launched", "cache_len", "target", "slot",
                 "order", "finished", "temperature", "top_p", "seed", "stops", "ignore_eos", "t_submit",
                 "on_delta", "sent_tokens", "sent_text", "delta_at", "preemptions", "logits")

    def __init__(self, req: GenerationRequest, fut: concurrent.futures.Future,
                 on_delta: Callable[[GenerationDelta], None] | None = None):
        self.req = req
        self.fut = fut
        self.prompt_len = len(req.prompt_ids) if isinstance(req.prompt_ids, (list, tuple)) else 0
        self.limit = 0  # output tokens at most
        self.out: list[int] = []
        self.n_launched = 0  # output tokens whose computation has been launched
        self.cache_len = 0  # positions whose keys and values are in the cache
        self.target = 0  # positions to prefill: prompt and output so far, when admitted
        self.slot = -1  # decode row while admitted
        self.order = 0  # admission order: the most recent are preempted first
        self.finished = False
        p = req.params
        self.temperature = float(p.temperature)
        self.top_p = float(p.top_p)
        self.seed = p.seed if p.seed is not None else random.getrandbits(63)
        self.stops = [s for s in (p.stop or []) if s]
        self.ignore_eos = bool(getattr(p, "ignore_eos", False))
        self.t_submit = time.perf_counter()
        self.on_delta = on_delta if req.stream else None
        self.sent_tokens = 0  # output tokens and characters of text already reported in deltas
        self.sent_text = 0
        self.delta_at = 0.0  # when its last delta was sent (perf_counter)
        self.preemptions = 0
        self.logits: RequestLogits | None = None  # logits processing it asks for (set when first admitted)

    def ids(self) -> list[int]:
        """The tokens known so far: the prompt, then the output."""
        return list(self.req.prompt_ids) + self.out

    @property
    def prefilling(self) -> bool:
        return self.slot >= 0 and self.cache_len < self.target


@dataclass
class PrefillPlan:
    whole: list[Sequence] = field(default_factory=list)  # admitted now, prefilled whole in one call
    chunk: tuple[Sequence, int, int] | None = None  # or one sequence's positions [start, end)


class Scheduler:
    """The decisions only; the engine carries them out (device buffers, tokens, results)."""

    def __init__(self, blocks: BlockManager, token_budget: int, max_prompts: int, packed: bool):
        self.blocks = blocks
        self.token_budget = token_budget
        self.max_prompts = max_prompts
        self.packed = packed  # whole prompts cost their real tokens (packed) or rows x the longest (padded)
        # Blocks kept free at admission while others run, so that running sequences can grow a while before
        # anything must be preempted (vLLM's watermark).
        self.watermark = max(1, blocks.num_blocks // 100)

    def reserve_decode(self, run: list[Sequence], holders: list[Sequence]) -> list[Sequence]:
        """A block for every decoding sequence's next position, oldest first. When the pool runs dry, holders
        (every sequence that holds blocks) are preempted youngest first until the rest fit; returns them, their
        blocks already released. A preempted sequence in `run` must not decode this step."""
        victims: list[Sequence] = []
        gone: set[int] = set()
        queue = sorted(holders, key=lambda s: s.order)
        for seq in sorted(run, key=lambda s: s.order):
            if id(seq) in gone:
                continue
            while self.blocks.ensure(seq, seq.cache_len + 1) is None:
                victim = queue.pop()
                victims.append(victim)
                gone.add(id(victim))
                self.blocks.release(victim)
                if victim is seq:
                    break
        return victims

    def plan_prefill(self, partial: Sequence | None, take: Callable[[], Sequence | None],
                     give_back: Callable[[Sequence], None], free_rows: int) -> PrefillPlan:
        """This step's prefill: the next chunk of a prompt being prefilled in chunks, else waiting requests
        (`take` gives the next, its target set and any shared prefix in its table; `give_back` returns one not
        admitted) in arrival order while rows, blocks and the token budget allow, all from one start position; a
        prompt longer than the budget starts alone, in chunks. Blocks for what is planned are taken here."""
        budget, blocks = self.token_budget, self.blocks
        if partial is not None:
            end = min(partial.target, partial.cache_len + budget)
            if blocks.ensure(partial, end) is None:
                return PrefillPlan()  # running sequences free blocks as they finish
            return PrefillPlan(chunk=(partial, partial.cache_len, end))
        plan = PrefillPlan()
        tokens = longest = 0
        while len(plan.whole) < min(free_rows, self.max_prompts):
            seq = take()
            if seq is None:
                break
            if plan.whole and seq.cache_len != plan.whole[0].cache_len:
                give_back(seq)  # one call prefills prompts from one start (a shared prefix's length, or 0)
                break
            start = seq.cache_len  # positions already in shared blocks
            n = seq.target - start
            cost = tokens + n if self.packed else (len(plan.whole) + 1) * max(longest, n)
            reserve = self.watermark if blocks.num_used else 0
            if cost > budget:
                if plan.whole or blocks.missing(seq, start + budget) > blocks.num_free - reserve:
                    give_back(seq)
                    break
                blocks.ensure(seq, start + budget)
                return PrefillPlan(chunk=(seq, start, start + budget))
            if blocks.missing(seq, seq.target) > blocks.num_free - reserve:
                give_back(seq)
                break
            blocks.ensure(seq, seq.target)
            plan.whole.append(seq)
            tokens += n
            longest = max(longest, n)
        return plan
