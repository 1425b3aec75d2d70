"""Which sequences run each engine step (vLLM v1's scheduler, smaller): every decoding sequence takes one token,
and prefill takes a token budget per step, so a long prompt is prefilled in chunks interleaved with the running
batch's decode steps (chunked prefill) instead of stalling them.

Cache blocks (kv_cache.BlockManager) are handed out as sequences need them: a waiting request is admitted when
the blocks for its prompt (or its first chunk) are free; a decoding sequence takes a new block when its last one
fills. When the pool runs dry mid-decode, the most recently admitted sequences are preempted: their blocks go
back, they return to the front of the queue with the tokens they have, and are recomputed (prefilled again,
prompt and output so far) when blocks free up. A request's longest possible length (max_seq_len) never exceeds
the pool, so the oldest request always makes progress.

Priority (requests.Priority): live requests wait in a queue of their own and are admitted before any waiting batch
request (arrival order within each). When the rows or blocks a waiting live request needs are taken, running batch
sequences are preempted for it, youngest first, as above; a live one never is. Running out of blocks mid-decode,
batch sequences go before live ones too, so a batch sequence never takes a live one's blocks.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from worker.engine.kv_cache import BlockManager
from worker.engine.requests import GenerationDelta, GenerationRequest, Priority

if TYPE_CHECKING:
    from worker.engine.detokenizer import IncrementalDetokenizer
    from worker.engine.logits import RequestLogits


class Sequence:
    """One request inside the engine: its settings, its output so far, where its cache is."""

    __slots__ = ("req", "fut", "prompt_len", "limit", "out", "n_launched", "cache_len", "target", "slot",
                 "order", "finished", "temperature", "top_p", "seed", "stops", "ignore_eos", "t_submit",
                 "on_delta", "sent_tokens", "sent_text", "delta_at", "preemptions", "logits", "detok")

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
        self.detok: IncrementalDetokenizer | None = None  # its text as it is written, for stop strings and streams

    def ids(self) -> list[int]:
        """The tokens known so far: the prompt, then the output."""
        return list(self.req.prompt_ids) + self.out

    @property
    def prefilling(self) -> bool:
        return self.slot >= 0 and self.cache_len < self.target


def preemption_rank(seq: Sequence) -> tuple[int, int]:
    """Sorted by this, the last goes first when something must be preempted: batch before live, then the youngest."""
    return seq.req.priority, seq.order


class WaitingQueue:
    """Requests waiting for a decode row: one queue per priority, in arrival order; the live queue is served first.
    A sequence put back (preempted, or not admitted this step) goes to the front of its own queue."""

    def __init__(self):
        self._queues = {p: deque() for p in sorted(Priority)}

    def append(self, seq: Sequence) -> None:
        self._queues[seq.req.priority].append(seq)

    def push_front(self, seqs: list[Sequence]) -> None:
        """seqs, in their order, ahead of the others of their priority."""
        for seq in reversed(seqs):
            self._queues[seq.req.priority].appendleft(seq)

    def popleft(self) -> Sequence | None:
        for queue in self._queues.values():
            if queue:
                return queue.popleft()
        return None

    def first(self, priority: Priority, n: int) -> list[Sequence]:
        """The first n waiting requests of one priority (not removed)."""
        queue = self._queues[priority]
        return [queue[i] for i in range(min(n, len(queue)))]

    def remove(self, request_ids: Iterable[str]) -> list[Sequence]:
        """Take out the requests with these ids; returns them."""
        ids = set(request_ids)
        removed = []
        for p, queue in self._queues.items():
            removed += [s for s in queue if s.req.request_id in ids]
            self._queues[p] = deque(s for s in queue if s.req.request_id not in ids)
        return removed

    def clear(self) -> list[Sequence]:
        everything = list(self)
        for queue in self._queues.values():
            queue.clear()
        return everything

    def __len__(self) -> int:
        return sum(map(len, self._queues.values()))

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self._queues.values():
            yield from queue


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
        """A block for every decoding sequence's next position, live ones first, then the oldest first. When the pool
        runs dry, holders (every sequence that holds blocks) are preempted batch first, youngest first, until the
        rest fit; returns them, their blocks already released. A preempted sequence in `run` must not decode this
        step."""
        victims: list[Sequence] = []
        gone: set[int] = set()
        queue = sorted(holders, key=preemption_rank)
        for seq in sorted(run, key=preemption_rank):
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

    def make_room(self, live: list[Sequence], holders: list[Sequence], free_rows: int) -> list[Sequence]:
        """Rows and blocks for the waiting live requests `live` (arrival order) that one prefill step could admit:
        running batch sequences among `holders` are preempted, youngest first, until they fit or none is left (live
        holders are never touched). Returns the victims, their blocks already released. Blocks a live request
        might share with a registered prefix are not counted off, so this may free a few blocks more than needed."""
        rows = blocks = tokens = longest = 0
        for seq in live[:self.max_prompts]:
            n = seq.prompt_len + len(seq.out)
            cost = tokens + n if self.packed else (rows + 1) * max(longest, n)
            if rows and cost > self.token_budget:
                break
            rows += 1
            blocks += self.blocks.blocks_for(min(n, self.token_budget))  # a long prompt starts with one chunk
            tokens += n
            longest = max(longest, n)
        victims: list[Sequence] = []
        queue = sorted((s for s in holders if s.req.priority != Priority.LIVE), key=lambda s: s.order)
        while queue and (free_rows + len(victims) < rows or blocks > self.blocks.num_free - (
                self.watermark if self.blocks.num_used else 0)):
            victim = queue.pop()
            self.blocks.release(victim)
            victims.append(victim)
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
