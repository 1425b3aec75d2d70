"""The paged KV cache's block manager and the scheduler's decisions (pure logic, no model): allocation, freeing,
preemption and resumption, chunked prefill under a token budget, live requests before batch ones."""

import concurrent.futures
from collections import deque

import pytest

from worker.engine.kv_cache import BlockManager
from worker.engine.requests import GenerationRequest, Priority, SamplingParams
from worker.engine.scheduler import Scheduler, Sequence, WaitingQueue


def seq(n_prompt: int, name: str = "r", priority: Priority = Priority.LIVE) -> Sequence:
    s = Sequence(GenerationRequest(name, list(range(n_prompt)), SamplingParams(max_new_tokens=100),
                                   priority=priority), concurrent.futures.Future())
    s.target = n_prompt
    return s


def test_blocks_are_taken_as_needed_and_given_back():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = object(), object()
    assert bm.ensure(a, 5) is not None and len(bm.table(a)) == 2  # 5 positions: 2 blocks of 4
    assert bm.ensure(a, 8) == [] and bm.num_used == 2  # still covered
    assert len(bm.ensure(a, 9)) == 1 and bm.num_free == 3
    assert bm.ensure(b, 16) is None and not bm.holds(b) and bm.num_free == 3  # too few: nothing taken
    assert bm.ensure(b, 12) is not None and bm.num_free == 0
    assert len(set(bm.table(a)) | set(bm.table(b))) == 6  # no block given twice
    t = bm.table(a)
    assert bm.slot(a, 0) == t[0] * 4 and bm.slot(a, 6) == t[1] * 4 + 2
    assert bm.release(a) == 3 and bm.num_free == 3 and not bm.holds(a)
    assert bm.release(a) == 0  # twice is harmless
    assert bm.scratch_block == 6 and bm.capacity_tokens == 24
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_decode_preempts_the_youngest_until_the_rest_fit():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, token_budget=64, max_prompts=8, packed=True)
    old, mid, young = seq(4, "old"), seq(4, "mid"), seq(3, "young")
    for order, s in enumerate((old, mid, young)):
        s.order = order
        s.cache_len = s.target
        assert bm.ensure(s, s.target) is not None
    assert bm.num_free == 1
    # old and mid each need a new block for position 4, young still has room in its block
    victims = sched.reserve_decode([old, mid, young], [old, mid, young])
    assert victims == [young]  # its block went to mid
    assert not bm.holds(young) and len(bm.table(old)) == 2 and len(bm.table(mid)) == 2
    # a sequence that is the youngest holder preempts itself rather than an older one
    old.cache_len, mid.cache_len = 8, 8
    assert sched.reserve_decode([old, mid], [old, mid]) == [mid]
    assert len(bm.table(old)) == 3 and not bm.holds(mid)


def test_prefill_admits_by_free_blocks_in_arrival_order():
    bm = BlockManager(num_blocks=10, block_size=4)
    sched = Scheduler(bm, token_budget=100, max_prompts=8, packed=True)
    queue = deque([seq(8, "a"), seq(12, "b"), seq(40, "c"), seq(4, "d")])
    plan = sched.plan_prefill(None, lambda: queue.popleft() if queue else None, queue.appendleft, free_rows=8)
    # a (2 blocks) and b (3) fit; c needs 10 of the 5 left (less the watermark): it waits, and d behind it too
    assert [s.req.request_id for s in plan.whole] == ["a", "b"] and plan.chunk is None
    assert [s.req.request_id for s in queue] == ["c", "d"] and bm.num_used == 5
    plan = sched.plan_prefill(None, lambda: queue.popleft() if queue else None, queue.appendleft, free_rows=1)
    assert plan.whole == [] and [s.req.request_id for s in queue] == ["c", "d"]  # still no room for c


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, token_budget=16, max_prompts=8, packed=True)
    long, short = seq(40, "long"), seq(6, "short")
    queue = deque([long, short])
    take = lambda: queue.popleft() if queue else None  # noqa: E731
    plan = sched.plan_prefill(None, take, queue.appendleft, free_rows=4)
    assert plan.whole == [] and plan.chunk == (long, 0, 16)  # alone, first chunk
    assert len(bm.table(long)) == 4 and [s.req.request_id for s in queue] == ["short"]
    chunks = [plan.chunk]
    long.slot, long.cache_len = 0, 16
    while long.prefilling:  # the engine runs one chunk per step, each step also decoding the running batch
        plan = sched.plan_prefill(long, take, queue.appendleft, free_rows=3)
        assert plan.whole == [] and plan.chunk[0] is long
        chunks.append(plan.chunk)
        long.cache_len = plan.chunk[2]
    assert [(a, b) for _, a, b in chunks] == [(0, 16), (16, 32), (32, 40)]
    assert len(bm.table(long)) == 10
    plan = sched.plan_prefill(None, take, queue.appendleft, free_rows=3)
    assert plan.whole == [short]  # then the queue moves on


def test_padded_prefill_counts_rows_times_the_longest():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, token_budget=30, max_prompts=8, packed=False)
    queue = deque([seq(10, "a"), seq(12, "b"), seq(3, "c")])
    plan = sched.plan_prefill(None, lambda: queue.popleft() if queue else None, queue.appendleft, free_rows=8)
    assert [s.req.request_id for s in plan.whole] == ["a", "b"]  # a + b padded: 24; with c: 36 > 30
    assert [s.req.request_id for s in queue] == ["c"]


def test_resumed_sequence_recomputes_prompt_and_output():
    s = seq(5)
    s.out = [7, 8, 9]
    assert s.ids() == [0, 1, 2, 3, 4, 7, 8, 9]


def test_registered_prefix_blocks_are_shared_and_kept_until_needed():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b, c = object(), object(), object()
    prompt = list(range(10))  # two full blocks and two tokens
    assert bm.match(None, prompt) == []
    bm.ensure(a, 10)
    bm.register(a, None, prompt, 10)
    first_two = bm.table(a)[:2]
    assert bm.match(None, prompt + [99]) == first_two
    assert bm.match(None, prompt[:8]) == first_two[:1]  # at least one token is left to compute
    assert bm.match("adapter", prompt) == []  # another adapter's keys and values differ
    assert bm.match(None, [0, 1, 2, 7] + prompt[4:]) == []  # a block matches only after the same start
    bm.share(b, first_two)
    bm.ensure(b, 12)
    assert bm.table(b)[:2] == first_two and bm.num_used == 4  # 3 of a's + 1 of b's own
    bm.release(a)
    assert bm.num_used == 3 and bm.match(None, prompt) == first_two  # b still holds them
    bm.release(b)
    assert bm.num_free == 6 and bm.match(None, prompt) == first_two  # free, and still there to share
    bm.ensure(c, 16)  # empty blocks go first: the registered ones survive
    assert bm.match(None, prompt) == first_two
    bm.ensure(c, 24)  # the pool needs them now: forgotten
    assert bm.match(None, prompt) == [] and bm.num_free == 0


def running(bm: BlockManager, seqs: list[Sequence]) -> None:
    """seqs admitted in this order, their prompts in the cache."""
    for order, s in enumerate(seqs):
        s.order = order
        s.cache_len = s.target
        assert bm.ensure(s, s.target) is not None


def ids(seqs) -> list[str]:
    return [s.req.request_id for s in seqs]


def test_waiting_live_requests_leave_before_batch_ones_in_arrival_order():
    queue = WaitingQueue()
    for name, priority in [("b1", Priority.BATCH), ("l1", Priority.LIVE), ("b2", Priority.BATCH),
                           ("l2", Priority.LIVE)]:
        queue.append(seq(4, name, priority))
    assert ids(queue) == ["l1", "l2", "b1", "b2"] and len(queue) == 4
    first, second, third = queue.popleft(), queue.popleft(), queue.popleft()
    assert ids([first, second, third]) == ["l1", "l2", "b1"]
    queue.push_front([first, third])  # back ahead of the others of their own priority
    assert ids(queue) == ["l1", "b1", "b2"] and ids(queue.first(Priority.LIVE, 5)) == ["l1"]
    assert ids(queue.remove({"b1", "l1"})) == ["l1", "b1"] and ids(queue) == ["b2"]
    assert ids(queue.clear()) == ["b2"] and queue.popleft() is None and not queue


def test_live_request_preempts_the_youngest_batch_sequences_never_live_ones():
    bm = BlockManager(num_blocks=10, block_size=4)
    sched = Scheduler(bm, token_budget=64, max_prompts=8, packed=True)
    live_old, batch_old, batch_young, live_young = (seq(8, "live-old"), seq(8, "batch-old", Priority.BATCH),
                                                    seq(8, "batch-young", Priority.BATCH), seq(8, "live-young"))
    holders = [live_old, batch_old, batch_young, live_young]
    running(bm, holders)  # 8 of 10 blocks
    # 12 tokens: 3 blocks and the watermark's 1; batch-young's 2 give 4 free
    assert sched.make_room([seq(12, "new")], holders, free_rows=4) == [batch_young]
    assert not bm.holds(batch_young) and bm.num_free == 4
    # rows full, blocks enough: one batch row goes (the youngest left)
    assert sched.make_room([seq(4, "new")], [live_old, batch_old, live_young], free_rows=0) == [batch_old]
    # what only live holders could make room for is not made: the request waits
    running(bm, [live_old, live_young])
    assert sched.make_room([seq(30, "big")], [live_old, live_young], free_rows=4) == []
    assert bm.holds(live_old) and bm.holds(live_young)


def test_room_is_made_for_the_live_requests_one_prefill_step_admits():
    bm = BlockManager(num_blocks=12, block_size=4)
    sched = Scheduler(bm, token_budget=20, max_prompts=8, packed=True)
    batch = [seq(8, f"b{i}", Priority.BATCH) for i in range(6)]
    running(bm, batch)  # every block
    # 8 + 8 tokens fit the step's budget of 20, the third does not: 4 blocks and the watermark's 1 (3 victims)
    victims = sched.make_room([seq(8, "l1"), seq(8, "l2"), seq(8, "l3")], batch, free_rows=8)
    assert ids(victims) == ["b5", "b4", "b3"] and bm.num_free == 6


def test_running_out_of_blocks_preempts_batch_before_live():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, token_budget=64, max_prompts=8, packed=True)
    live_old, batch, live_young = seq(3, "live-old"), seq(3, "batch", Priority.BATCH), seq(4, "live-young")
    running(bm, [live_old, batch, live_young])
    bm.ensure(object(), 4)  # the last block held elsewhere
    # live-young, the youngest, needs a block for position 4: the older batch sequence gives its own
    assert sched.reserve_decode([live_old, batch, live_young], [live_old, batch, live_young]) == [batch]
    assert len(bm.table(live_young)) == 2 and bm.holds(live_old)
