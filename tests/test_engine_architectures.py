"""The engine on architectures other than the demo model's, on CPU in float32 with tiny random models built here
from transformers' config classes (nothing downloaded): native families (fused Phi-3 projections, Gemma's norms,
GELU and embedding scale, Mistral) give greedy `generate`'s tokens on the native path; architectures outside the
native list (Phi-2; Gemma-2, whose sliding-window caches cannot be merged) give them on the fallback path, with
more requests than rows so requests join and leave its running batch."""

import random

import pytest
import torch

from worker.engine.engine import Engine
from worker.engine.requests import GenerationRequest, SamplingParams

transformers = pytest.importorskip("transformers")

MB = 1 << 20
NEW = 10
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build(kind: str):
    from transformers import AutoModelForCausalLM, Gemma2Config, GemmaConfig, MistralConfig, Phi3Config, PhiConfig

    configs = {
        "phi3": lambda: Phi3Config(**TINY, num_key_value_heads=2, sliding_window=None),
        "gemma": lambda: GemmaConfig(**TINY, num_key_value_heads=1, head_dim=32),
        "mistral": lambda: MistralConfig(**TINY, num_key_value_heads=2, sliding_window=None),
        "phi2": lambda: PhiConfig(**TINY, partial_rotary_factor=0.5),
        "gemma2": lambda: Gemma2Config(**TINY, num_key_value_heads=2, head_dim=16, sliding_window=8),
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs[kind](), dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from their initial values, so a wrong norm formula changes tokens
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def reference(model, prompt, new):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=new, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


def run(model, ps, news, **kw):
    with Engine(model, None, device="cpu", memory_budget_bytes=64 * MB, max_seq_len=128, **kw) as eng:
        res = eng.generate([GenerationRequest(str(i), p, SamplingParams(max_new_tokens=n, temperature=0.0))
                            for i, (p, n) in enumerate(zip(ps, news))])
        return res, dict(eng.stats)


@pytest.mark.parametrize("kind", ["phi3", "gemma", "mistral"])
def test_native_families_match_generate(kind):
    model = build(kind)
    ps = prompts(6, seed=2)
    news = [NEW - i % 3 for i in range(len(ps))]
    refs = [reference(model, p, n) for p, n in zip(ps, news)]
    res, stats = run(model, ps, news, max_batch_size=4)
    assert stats["path"] == "native", stats["fallback_reason"]
    assert [r.output_ids for r in res] == refs


@pytest.mark.parametrize("kind,merged", [("phi2", True), ("gemma2", False)])
def test_fallback_matches_generate_as_requests_join_and_leave(kind, merged):
    model = build(kind)
    ps = prompts(9, seed=3)
    news = [NEW - i % 4 for i in range(len(ps))]  # staggered ends: rows leave while others still run
    refs = [reference(model, p, n) for p, n in zip(ps, news)]
    res, stats = run(model, ps, news, max_batch_size=4, prefill_tokens=64)
    assert stats["path"] == "hf"
    assert [r.output_ids for r in res] == refs
    if merged:  # one running batch that requests join and leave: 4 rows at once, far fewer steps than 1 by 1
        assert stats["max_running"] == 4
        assert stats["decode_steps"] < sum(news) / 2


def test_fallback_batch_grows_its_cache_in_place():
    """A decode step on the merged batch writes its column into the cache's buffers instead of copying the whole
    cache (DynamicLayer's torch.cat, most of a step's time at a large batch): the keys' storage changes only where
    rows join or leave. Rows that need per-row work (sampling, logprobs) share the batch with plain greedy rows,
    and every row keeps the tokens it gets alone."""
    model = build("phi2")
    ps = prompts(9, seed=4)
    news = [NEW - i % 4 for i in range(len(ps))]
    refs = [reference(model, p, n) for p, n in zip(ps, news)]
    sampled = SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=7)
    with Engine(model, None, device="cpu", memory_budget_bytes=64 * MB, max_seq_len=128) as eng:
        alone = eng.generate([GenerationRequest("s", ps[0], sampled)])[0]
    storages = []

    def record(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            storages.append(kwargs["cache"].layers[0].keys.untyped_storage().data_ptr())

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with Engine(model, None, device="cpu", memory_budget_bytes=64 * MB, max_seq_len=128, max_batch_size=4,
                    prefill_tokens=64) as eng:
            reqs = [GenerationRequest(str(i), p, SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                logprobs=1 if i == 3 else None))
                    for i, (p, n) in enumerate(zip(ps, news))]
            res = eng.generate([*reqs, GenerationRequest("s", ps[0], sampled)])
            steps = eng.stats["decode_steps"]
    finally:
        hook.remove()
    assert [r.output_ids for r in res[:-1]] == refs
    assert [t for t, _, _ in res[3].logprobs] == refs[3]
    assert res[-1].output_ids == alone.output_ids
    changes = sum(a != b for a, b in zip(storages, storages[1:]))
    assert len(storages) == steps and changes < steps / 3, (changes, steps)


def static_run(model, reqs, **kw):
    with Engine(model, None, device="cpu", memory_budget_bytes=kw.pop("budget", 64 * MB), max_seq_len=128,
                static_fallback=True, **kw) as eng:
        res = eng.generate(reqs)
        return res, dict(eng.stats)


def greedy_reqs(ps, news):
    return [GenerationRequest(str(i), p, SamplingParams(max_new_tokens=n, temperature=0.0))
            for i, (p, n) in enumerate(zip(ps, news))]


def test_fallback_static_rows_join_and_leave_a_bucketed_batch():
    """The static batch (what cuda/xpu capture, run uncaptured here): 9 requests through 4 slots, ending at
    staggered steps, so rows leave and new ones take their slots while the others decode; steps run with padding
    rows (3 live rows decode in the 4-row bucket) over a span wider than the rows use. Every greedy row keeps
    generate's tokens (one asks for logprobs), a seeded sampled row the tokens it gets alone, and every decode step
    took the static batch."""
    model = build("phi2")
    ps = prompts(9, seed=3)
    news = [NEW - i % 4 for i in range(len(ps))]
    refs = [reference(model, p, n) for p, n in zip(ps, news)]
    sampled = GenerationRequest("s", ps[0], SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=7))
    alone, _ = static_run(model, [sampled], max_batch_size=4)
    reqs = greedy_reqs(ps, news)
    reqs[3].params.logprobs = 1
    res, stats = static_run(model, [*reqs, sampled], max_batch_size=4, prefill_tokens=64)
    assert res[-1].output_ids == alone[0].output_ids
    assert [t for t, _, _ in res[3].logprobs] == refs[3]
    res = res[:-1]
    assert [r.output_ids for r in res] == refs
    assert stats["fallback_decode"] == "static" and stats["fallback_graphs"] == "use_graphs off on cpu"
    assert stats["fallback_static_steps"] == stats["decode_steps"] and stats["fallback_dynamic_steps"] == 0
    assert stats["max_running"] == 4 and stats["decode_steps"] < sum(news) / 2
    assert stats["decode_rows"] < 4 * stats["decode_steps"]  # some steps ran fewer live rows than the bucket


def test_fallback_static_moves_rows_down_to_a_smaller_bucket():
    """Short prompts take the low slots and end first; the two long-running rows left in slots 6 and 7 move to
    slots 0 and 1 (the 2-row bucket instead of the 8-row one) and keep generate's tokens."""
    model = build("phi2")
    ps = [p[:3 + i] + [5] * i for i, p in enumerate(prompts(8, seed=5, lo=12, hi=13))]  # lengths 3..17 rising
    news = [2] * 6 + [NEW, NEW]
    refs = [reference(model, p, n) for p, n in zip(ps, news)]
    res, stats = static_run(model, greedy_reqs(ps, news), max_batch_size=8)
    assert [r.output_ids for r in res] == refs
    assert stats["fallback_migrations"] == 2


def test_fallback_static_request_at_capacity():
    """A budget that gives 2 slots fewer columns than max_seq_len (keeping one max_seq_len request's worth out of
    the buffers): a request whose last input token lands in a slot's last column runs in the static batch, one
    needing a column more runs beside it in a dynamic batch, and both give generate's tokens. With the default
    budget, slots of max_seq_len columns: prompts of max_seq_len - 2 and - 1 tokens run to the end there."""
    model = build("phi2")
    budget = 964_608  # the 64-token prefill workspace, one piece's cache, the logits and 249 tokens of KV
    _, stats = static_run(model, greedy_reqs(prompts(1, seed=6), [2]), budget=budget, max_batch_size=2,
                          prefill_tokens=64)
    cap = stats["fallback_static_columns"]
    assert stats["fallback_static_slots"] == 2 and 32 <= cap < 128, cap
    rng = random.Random(7)
    fits = [rng.randrange(5, 300) for _ in range(cap - 4)]  # cap - 4 prompt columns + 4 decode inputs = cap
    over = fits + [9]
    refs = [reference(model, fits, 5), reference(model, over, 5)]
    res, stats = static_run(model, greedy_reqs([fits, over], [5, 5]), budget=budget, max_batch_size=2,
                            prefill_tokens=64)
    assert [r.output_ids for r in res] == refs
    assert stats["fallback_static_steps"] == stats["fallback_dynamic_steps"] == 4
    long_ps = [[rng.randrange(5, 300) for _ in range(n)] for n in (126, 127)]
    refs = [reference(model, p, n) for p, n in zip(long_ps, (3, 2))]
    res, stats = static_run(model, greedy_reqs(long_ps + prompts(2, seed=9), [10, 10, 4, 4]), max_batch_size=4)
    assert stats["fallback_static_columns"] == 128 and stats["fallback_dynamic_steps"] == 0
    assert [r.output_ids for r in res[:2]] == refs and [len(r.output_ids) for r in res[:2]] == [3, 2]
    assert all(r.finish_reason == "length" for r in res)


class _Replay:
    """Stands in for a device graph on cpu: replay runs the captured body again."""

    def __init__(self, body):
        self.body = body

    def replay(self):
        self.body()


def test_fallback_static_takes_the_graph_path_and_survives_a_failed_capture(monkeypatch):
    """Where capture is on, every decode step replays a graph of its (rows bucket, span) and warm-up captures the
    full bucket at every span; a capture that fails turns capture off, says why in stats, and the same requests
    go on uncaptured with the same tokens."""
    from worker.engine import graphs

    model = build("phi2")
    ps = prompts(9, seed=3)
    news = [NEW - i % 4 for i in range(len(ps))]
    refs = [reference(model, p, n) for p, n in zip(ps, news)]
    captured = []

    def capture(body, device, pool):
        body()  # as graphs.capture: the body runs before capture, so running it more than once must be harmless
        captured.append(body)
        return _Replay(body)

    monkeypatch.setattr(graphs, "new_pool", lambda backend: None)
    monkeypatch.setattr(graphs, "capture", capture)
    with Engine(model, None, device="cpu", memory_budget_bytes=64 * MB, max_seq_len=128, max_batch_size=4,
                prefill_tokens=64, static_fallback=True) as eng:
        with eng.model_lock:
            eng.fallback.capture = True
            eng.warmup()
        warm = len(captured)
        res = eng.generate(greedy_reqs(ps, news))
        stats = dict(eng.stats)
    assert warm == 1 and stats["graphs_captured"] == len(captured) > warm  # span 128 at 4 rows; then smaller buckets
    assert [r.output_ids for r in res] == refs
    assert stats["fallback_graph_steps"] == stats["decode_steps"] > 0 and stats["fallback_static_steps"] == 0

    def broken(body, device, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "capture", broken)
    with Engine(model, None, device="cpu", memory_budget_bytes=64 * MB, max_seq_len=128, max_batch_size=4,
                prefill_tokens=64, static_fallback=True) as eng:
        with eng.model_lock:
            eng.fallback.capture = True
        res = eng.generate(greedy_reqs(ps, news))
        stats = dict(eng.stats)
    assert [r.output_ids for r in res] == refs
    assert stats["fallback_graphs"].startswith("capture failed: RuntimeError") and stats["fallback_decode"] == "static"
    assert stats["fallback_static_steps"] == stats["decode_steps"] and stats["fallback_graph_steps"] == 0


def test_fallback_static_off_for_sliding_window_caches():
    """Gemma-2's sliding-window layers cannot sit in the static buffers: its requests take the dynamic batches,
    and stats say why."""
    model = build("gemma2")
    ps = prompts(3, seed=3)
    refs = [reference(model, p, NEW) for p in ps]
    res, stats = static_run(model, greedy_reqs(ps, [NEW] * 3), max_batch_size=4)
    assert [r.output_ids for r in res] == refs
    assert stats["fallback_decode"] == "dynamic" and "DynamicSlidingWindowLayer" in stats["fallback_graphs"]
    assert stats["fallback_dynamic_steps"] == stats["decode_steps"] and stats["kv_cache_bytes"] == 0


def test_fallback_static_failures_leave_the_dynamic_batches_serving(monkeypatch):
    """A static batch whose probe step disagrees with the model's own forward is never used; one whose step fails
    at run time fails the requests of that step, gives its buffers back, and later requests take the dynamic
    batches with generate's tokens."""
    from worker.engine import fallback

    model = build("phi2")
    ps = prompts(6, seed=10)
    refs = [reference(model, p, NEW) for p in ps]
    body = fallback._Static.body

    def wrong(self, rows, span):
        body(self, rows, span)
        self.logits[:rows] += 1.0  # what a cache layer writing the wrong column would look like

    monkeypatch.setattr(fallback._Static, "body", wrong)
    res, stats = static_run(model, greedy_reqs(ps[:2], [NEW] * 2), max_batch_size=4)
    assert [r.output_ids for r in res] == refs[:2]
    assert stats["fallback_decode"] == "dynamic" and "differ" in stats["fallback_graphs"]
    assert stats["fallback_static_steps"] == 0 and stats["kv_cache_bytes"] == 0

    monkeypatch.setattr(fallback._Static, "body", body)
    with Engine(model, None, device="cpu", memory_budget_bytes=64 * MB, max_seq_len=128, max_batch_size=4,
                static_fallback=True) as eng:
        assert [r.output_ids for r in eng.generate(greedy_reqs(ps[:2], [NEW] * 2))] == refs[:2]
        assert eng.stats["fallback_decode"] == "static" and eng.stats["kv_cache_bytes"] > 0

        def broken(self, rows, span):
            raise RuntimeError("device lost")

        monkeypatch.setattr(fallback._Static, "body", broken)
        failed = eng.generate(greedy_reqs(ps[2:4], [NEW] * 2))
        assert all(r.finish_reason == "error" and "device lost" in r.error for r in failed)
        res = eng.generate(greedy_reqs(ps[4:], [NEW] * 2))
        stats = dict(eng.stats)
    assert [r.output_ids for r in res] == refs[4:]
    assert stats["fallback_decode"] == "dynamic" and stats["fallback_graphs"].startswith("decode failed")
    assert stats["fallback_dynamic_steps"] > 0 and stats["kv_cache_bytes"] == 0


@pytest.mark.parametrize("kind,attention", [("phi2", "sdpa"), ("phi2", "eager"), ("mistral", "sdpa")])
def test_fallback_static_step_reads_nothing_on_the_host(kind, attention):
    """What a device graph cannot capture is a host read of a tensor's value (.item(), a tensor in an `if`, nonzero)
    or a tensor made from host data (torch.tensor: a copy from the host on a device): the static batch's decode step
    (the body a graph captures) does neither, for the model's own forward with sdpa or eager attention and with
    grouped KV heads (mistral, run through its own forward); with sdpa the dynamic batches' step reads the padding
    mask on the host (transformers' check to skip it), so the check can fail."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache

    reads = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.is_nonzero,
             torch.ops.aten.equal, torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy}

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in reads:
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    model = build(kind)
    model.config._attn_implementation = attention
    with Engine(model, None, device="cpu", memory_budget_bytes=64 * MB, max_seq_len=128, max_batch_size=4,
                static_fallback=True, native=False) as eng:
        res = eng.generate(greedy_reqs(prompts(3, seed=11), [4, 4, 4]))
        assert eng.stats["fallback_static_steps"] == eng.stats["decode_steps"] > 0
        with eng.model_lock, torch.no_grad():
            static = HostReads()
            with static:
                eng.fallback._static.body(4, 128)
            cache = DynamicCache(config=model.config)
            eng.fallback._forward(cache, input_ids=torch.tensor([[5, 6], [0, 7]]),
                                  attention_mask=torch.tensor([[1, 1], [0, 1]]))
            ids, mask = torch.tensor([[8], [9]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
            dynamic = HostReads()
            with dynamic:
                eng.fallback._forward(cache, input_ids=ids, attention_mask=mask)
    assert all(r.error is None for r in res)
    assert static.seen == [] and bool(dynamic.seen) == (attention == "sdpa"), (static.seen, dynamic.seen)


@pytest.mark.parametrize("static", [None, True], ids=["dynamic", "static"])
def test_fallback_engine_frees_its_memory_when_closed_after_the_heap_froze(static):
    """The worker freezes its heap after loading a model (model_cache.freeze_heap: gc.freeze), so an evicted
    engine left in a reference cycle is never collected: a closed fallback engine, its model's weights and its
    static buffers are freed by reference counting (failed before: the engine and FallbackPath referenced each
    other, and the static batch and its path)."""
    import gc
    import weakref

    model = build("phi2")
    eng = Engine(model, None, device="cpu", memory_budget_bytes=64 * MB, max_seq_len=128, max_batch_size=4,
                 static_fallback=static)
    eng.generate(greedy_reqs(prompts(2, seed=12), [3, 3]))
    held = [weakref.ref(eng), weakref.ref(next(model.parameters()))]
    if static:
        held.append(weakref.ref(eng.fallback._static.k[0]))
    gc.collect()
    gc.freeze()
    try:
        eng.close()
        del eng, model
        gc.collect()
        assert [ref() is None for ref in held] == [True] * len(held)
    finally:
        gc.unfreeze()
