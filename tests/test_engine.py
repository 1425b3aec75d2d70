"""worker/engine on CPU with the tiny demo model (fp32): same tokens as greedy `generate`, per-request LoRA in
one batch, sampling, stop strings, errors, cancellation, concurrent submission, model swaps, memory budget."""

import gc
import random
import threading
import time
import weakref

import pytest
import torch

from worker.engine.engine import Engine
from worker.engine.requests import GenerationRequest, Priority, SamplingParams
from worker.engine.sampling import _mix32, _mix32_py, _mul32, sample_tokens

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MB = 1 << 20
NEW = 12


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from worker.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("engine") / "tiny")


def load(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # the demo model's output gain (20, for fine-tuning) makes sampling all but greedy
        model.model.norm.weight.fill_(1.0)
    return model


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load(tiny_dir)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_dir, tmp_path_factory):
    """Two LoRA adapters with random, non-zero A and B, so each changes the output."""
    from peft import LoraConfig, get_peft_model

    out = {}
    for i, name in enumerate(("alpha", "beta")):
        torch.manual_seed(100 + i)
        cfg = LoraConfig(r=4 + 4 * i, lora_alpha=16, target_modules="all-linear", init_lora_weights=False,
                         lora_dropout=0.0)
        pm = get_peft_model(load(tiny_dir), cfg)
        with torch.no_grad():  # make the deltas large enough to change greedy tokens
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.mul_(3.0)
        path = tmp_path_factory.mktemp("adapters") / name
        pm.save_pretrained(path)
        out[name] = path
    return out


def prompts(n, seed=0, lo=3, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def reference(model, prompt, new=NEW):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=new)
    return out[0, len(prompt):].tolist()


def greedy(prompt_ids, i, new=NEW, adapter=None, **kw):
    return GenerationRequest(str(i), prompt_ids, SamplingParams(max_new_tokens=new, temperature=0.0, **kw), adapter)


@pytest.mark.parametrize("native,slots,prefill_tokens,static",
                         [(True, 3, 2048, None), (True, 8, 32, None), (False, 3, 2048, None), (False, 3, 32, True)],
                         ids=["native", "native-chunked-prefill", "hf-fallback", "hf-fallback-static"])
def test_greedy_matches_generate(model, tokenizer, native, slots, prefill_tokens, static):
    ps = prompts(7, seed=1) + [[7] * 45]  # different lengths; 45 > 32 exercises segmented prefill
    refs = [reference(model, p) for p in ps]
    seen = []
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=slots, native=native,
                max_seq_len=128, prefill_tokens=prefill_tokens, static_fallback=static) as eng:
        # Different max_new_tokens stagger finishes, so requests join and leave between steps.
        reqs = [greedy(p, i, new=NEW - (i % 3)) for i, p in enumerate(ps)]
        res = eng.generate(reqs, on_result=seen.append)
        assert eng.stats["path"] == ("native" if native else "hf")
        if not native:  # on cpu the dynamic batches unless asked (static_fallback=True: uncaptured static rows)
            steps = eng.stats["fallback_static_steps" if static else "fallback_dynamic_steps"]
            assert steps == eng.stats["decode_steps"] > 0
    assert sorted(r.request_id for r in seen) == sorted(r.request_id for r in res)
    for i, (r, ref) in enumerate(zip(res, refs)):
        n = NEW - (i % 3)
        assert r.request_id == str(i)
        assert r.output_ids == ref[:n], (i, r.output_ids, ref)
        assert r.finish_reason == ("stop" if len(ref) < n or ref[n - 1] == model.generation_config.eos_token_id
                                   else "length")
        assert r.prompt_tokens == len(ps[i]) and r.completion_tokens == len(r.output_ids)
        assert r.text == tokenizer.decode(r.output_ids, skip_special_tokens=True)


def small_cache_budget(model, tokenizer, blocks: int, **kw) -> int:
    """A budget whose cache holds `blocks` blocks (the workspace estimate measured on an engine like it)."""
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, **kw) as probe:
        ws, per_block = probe.stats["workspace_estimate_bytes"], probe.kv_bytes_per_token * probe.block_size
    return ws + (blocks + 1) * per_block + per_block // 2


def test_preempted_requests_resume_with_the_same_tokens(model, tokenizer):
    """More requests than the cache holds at once: they are admitted by free blocks, the youngest are preempted
    when decode runs out of blocks and recomputed later, and every one still gets generate's greedy tokens."""
    ps = prompts(6, seed=11, lo=20, hi=40)
    new = 40
    refs = [reference(model, p, new=new) for p in ps]
    kw = dict(max_batch_size=8, max_seq_len=128)
    budget = small_cache_budget(model, tokenizer, 12, **kw)
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=budget, **kw) as eng:
        assert eng.stats["kv_blocks_total"] == 12  # 192 positions; the six need up to 480
        res = eng.generate([greedy(p, i, new=new) for i, p in enumerate(ps)])
        assert eng.stats["preemptions"] >= 1
        assert eng.stats["kv_blocks_used"] == 0 and eng.stats["kv_blocks_free"] == 12  # all given back
    for r, ref in zip(res, refs):
        assert r.error is None and r.output_ids == ref, (r.request_id, r.output_ids, ref)


def test_sampled_tokens_survive_preemption(model, tokenizer):
    """Sampling noise is keyed by (seed, token index): a preempted, recomputed request draws the same tokens."""
    ps = prompts(6, seed=12, lo=20, hi=40)
    reqs = lambda: [GenerationRequest(str(i), p, SamplingParams(max_new_tokens=40, temperature=0.8, seed=i,  # noqa: E731
                                                                ignore_eos=True)) for i, p in enumerate(ps)]
    kw = dict(max_batch_size=8, max_seq_len=128)
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, **kw) as eng:
        roomy = eng.generate(reqs())
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=small_cache_budget(model, tokenizer, 12, **kw),
                **kw) as eng:
        tight = eng.generate(reqs())
        assert eng.stats["preemptions"] >= 1
    assert [r.output_ids for r in tight] == [r.output_ids for r in roomy]
    assert all(len(set(r.output_ids)) > 3 for r in roomy)  # really sampled, not one likely token


def unpreempted(model, tokenizer, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    """Each request's output ids from an engine with room for all of them at once (nothing preempted)."""
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=len(requests),
                max_seq_len=128) as eng:
        results = eng.generate([GenerationRequest(r.request_id, r.prompt_ids, r.params) for r in requests])
        assert eng.stats["preemptions"] == 0
    return {r.request_id: r.output_ids for r in results}


class SubmitLater:
    """on_delta for streaming requests: records the decode step count at each request's first delta, and at the
    first delta after which ready() holds (on the engine's thread, so the state cannot move meanwhile) submits
    `later`, noting which requests were waiting then without any output yet."""

    def __init__(self, eng: Engine, ready, later: list[GenerationRequest]):
        self.eng, self.ready, self.later = eng, ready, later
        self.firsts: dict[str, int] = {}
        self.futures = None
        self.waiting: list[str] = []

    def __call__(self, delta) -> None:
        self.firsts.setdefault(delta.request_id, self.eng.stats["decode_steps"])
        if self.futures is None and self.ready():
            self.waiting = [s.req.request_id for s in self.eng._waiting if not s.out]
            self.futures = [self.eng.submit(r, self) for r in self.later]

    def results(self, futures) -> list:
        done = [f.result(timeout=120) for f in futures]
        assert self.futures is not None, "the engine never reached the state asked for"
        return done + [f.result(timeout=120) for f in self.futures]


def test_live_request_goes_before_waiting_batch_and_preempts_running_batch(model, tokenizer):
    """A pool full of batch sequences and more batch requests waiting: a live request submitted then is admitted
    before every waiting one (its first token comes no later than theirs), running batch sequences are preempted
    to make room for it, and every request, preempted or not, gets the greedy tokens it gets when nothing is
    preempted."""
    batch = [GenerationRequest(str(i), p, SamplingParams(max_new_tokens=40, temperature=0.0), stream=True,
                               priority=Priority.BATCH) for i, p in enumerate(prompts(8, seed=21, lo=20, hi=40))]
    live = GenerationRequest("live", prompts(1, seed=22, lo=60, hi=61)[0],  # 4 blocks, and the watermark's 1
                             SamplingParams(max_new_tokens=NEW, temperature=0.0), stream=True)
    refs = unpreempted(model, tokenizer, batch + [live])
    kw = dict(max_batch_size=8, max_seq_len=128)
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=small_cache_budget(model, tokenizer, 12, **kw),
                **kw) as eng:
        later = SubmitLater(eng, lambda: eng.stats["running"] and eng.stats["waiting"]
                            and eng.stats["kv_blocks_free"] < 5, [live])
        with eng.model_lock:  # the first step sees them all
            futures = [eng.submit(r, later) for r in batch]
        results = later.results(futures)
        assert eng.stats["preemptions_for_live"] >= 1
    assert later.waiting
    assert all(later.firsts["live"] <= later.firsts[rid] for rid in later.waiting), (later.firsts, later.waiting)
    for r in results:
        assert r.error is None and r.output_ids == refs[r.request_id], (r.request_id, r.output_ids)


def test_live_request_never_preempts_another_live_one(model, tokenizer):
    """Live requests fill the pool: a further live request waits for room rather than preempting one of them, and
    batch requests sent just before it still wait behind it."""
    live = [GenerationRequest(f"live{i}", p, SamplingParams(max_new_tokens=40, temperature=0.0), stream=True)
            for i, p in enumerate(prompts(3, seed=23, lo=40, hi=41))]  # 3 blocks each, growing to 5
    batch = [GenerationRequest(f"b{i}", p, SamplingParams(max_new_tokens=4, temperature=0.0), stream=True,
                               priority=Priority.BATCH) for i, p in enumerate(prompts(4, seed=25, lo=5, hi=10))]
    late = GenerationRequest("late", prompts(1, seed=24, lo=60, hi=61)[0],  # 4 blocks, and the watermark's 1
                             SamplingParams(max_new_tokens=NEW, temperature=0.0), stream=True)
    refs = unpreempted(model, tokenizer, live + batch + [late])
    kw = dict(max_batch_size=8, max_seq_len=128)
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=small_cache_budget(model, tokenizer, 12, **kw),
                **kw) as eng:
        later = SubmitLater(eng, lambda: eng.stats["running"] == 3 and eng.stats["kv_blocks_free"] < 5,
                            batch + [late])
        with eng.model_lock:  # admitted together in the first step: 9 of 12 blocks
            futures = [eng.submit(r, later) for r in live]
        results = later.results(futures)
        assert eng.stats["preemptions_for_live"] == 0
    assert all(later.firsts["late"] <= later.firsts[r.request_id] for r in batch), later.firsts
    for r in results:
        assert r.error is None and r.output_ids == refs[r.request_id], (r.request_id, r.output_ids)


@pytest.mark.parametrize("static", [None, True], ids=["dynamic", "static"])
def test_fallback_path_admits_live_requests_before_waiting_batch(model, tokenizer, static):
    """The model's own forward (no preemption there): when a row frees, a live request waiting takes it before the
    batch requests that were waiting before it came."""
    batch = [GenerationRequest(str(i), p, SamplingParams(max_new_tokens=20, temperature=0.0), stream=True,
                               priority=Priority.BATCH) for i, p in enumerate(prompts(6, seed=26))]
    live = GenerationRequest("live", prompts(1, seed=27)[0], SamplingParams(max_new_tokens=NEW, temperature=0.0),
                             stream=True)
    refs = unpreempted(model, tokenizer, batch + [live])
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=2, native=False,
                max_seq_len=128, static_fallback=static) as eng:
        later = SubmitLater(eng, lambda: len(eng._waiting) == 4, [live])
        with eng.model_lock:
            futures = [eng.submit(r, later) for r in batch]
        results = later.results(futures)
    assert later.waiting
    assert all(later.firsts["live"] <= later.firsts[rid] for rid in later.waiting), (later.firsts, later.waiting)
    for r in results:
        assert r.error is None and r.output_ids == refs[r.request_id], (r.request_id, r.output_ids)


def test_long_prompt_prefills_in_chunks_while_others_decode(model, tokenizer):
    """A prompt longer than the step's prefill budget arrives while another request decodes: it is prefilled a
    chunk per step, the running request keeps decoding between the chunks, and both match generate."""
    short, long = prompts(1, seed=13, lo=5, hi=6)[0], prompts(1, seed=14, lo=100, hi=101)[0]
    refs = [reference(model, short, new=60), reference(model, long, new=NEW)]
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=4, max_seq_len=256,
                prefill_tokens=16) as eng:
        first = eng.submit(greedy(short, "short", new=60, ignore_eos=True))
        deadline = time.time() + 60
        while eng.stats["decode_steps"] < 3 and time.time() < deadline:
            time.sleep(0.01)
        steps_before = eng.stats["decode_steps"]
        second = eng.submit(greedy(long, "long"))
        r_long = second.result(timeout=120)
        steps_during = eng.stats["decode_steps"] - steps_before
        r_short = first.result(timeout=120)
        assert eng.stats["prefill_chunks"] >= 7  # 100 tokens in chunks of 16
    assert steps_during >= 7  # the short one decoded a step per chunk, not stalled for the whole prompt
    assert r_short.output_ids[:len(refs[0])] == refs[0][:len(r_short.output_ids)]
    assert r_long.output_ids == refs[1]


def test_compaction_moves_requests_to_low_slots(model, tokenizer):
    rng = random.Random(9)
    ps = [[rng.randrange(5, 300) for _ in range(n)] for n in (5, 10, 20)]  # prefilled into slots 0, 1, 2
    news = [3, 15, 15]  # slot 0 frees first, then slot 2 moves down to it
    refs = [reference(model, p, new=n) for p, n in zip(ps, news)]
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=3, max_seq_len=128) as eng:
        res = eng.generate([greedy(p, i, new=n) for i, (p, n) in enumerate(zip(ps, news))])
        assert eng.stats["migrations"] >= 1
    assert [r.output_ids for r in res] == refs


@pytest.mark.parametrize("native", [True, False], ids=["native", "hf-fallback"])
def test_mixed_lora_batch_matches_each_adapter_alone(tiny_dir, tokenizer, adapter_dirs, native):
    from peft import PeftModel

    pm = PeftModel.from_pretrained(load(tiny_dir), adapter_dirs["alpha"], adapter_name="alpha").eval()
    pm.load_adapter(adapter_dirs["beta"], adapter_name="beta")
    ps = prompts(6, seed=2)
    names = [None, "alpha", "beta", "alpha", None, "beta"]
    refs = []
    for p, name in zip(ps, names):
        if name is None:
            with pm.disable_adapter():
                refs.append(reference(pm, p))
        else:
            pm.set_adapter(name)
            refs.append(reference(pm, p))
    with pm.disable_adapter():
        base_refs = [reference(pm, p) for p in ps]
    assert any(r != b for r, b, n in zip(refs, base_refs, names) if n), "adapters must change the output"
    with Engine(pm, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=8, native=native,
                max_seq_len=128) as eng:
        assert eng.stats["path"] == ("native" if native else "hf")
        res = eng.generate([greedy(p, i, adapter=n) for i, (p, n) in enumerate(zip(ps, names))])
        assert eng.stats["max_running"] == len(ps)  # one batch
    for r, ref, n in zip(res, refs, names):
        assert r.output_ids == ref, (n, r.output_ids, ref)



def test_a_step_without_adapter_rows_skips_the_adapters(tiny_dir, tokenizer, adapter_dirs):
    """With adapters loaded, a step whose rows all run the base leaves the adapters' matmuls out (and gives the
    base's tokens); once an adapter row is in the step they run again."""
    from peft import PeftModel

    pm = PeftModel.from_pretrained(load(tiny_dir), adapter_dirs["alpha"], adapter_name="alpha").eval()
    ps = prompts(3, seed=4)
    with pm.disable_adapter():
        base_refs = [reference(pm, p) for p in ps]
    pm.set_adapter("alpha")
    alpha_ref = reference(pm, ps[0])
    assert alpha_ref != base_refs[0]
    kw = dict(device="cpu", memory_budget_bytes=64 * MB, max_batch_size=4, native=True, max_seq_len=128)
    with Engine(pm, tokenizer, **kw) as eng:
        res = eng.generate([greedy(p, i) for i, p in enumerate(ps)])
    assert eng.stats["decode_steps_without_adapters"] == eng.stats["decode_steps"] > 0  # read once it stopped
    with Engine(pm, tokenizer, **kw) as eng:
        mixed = eng.generate([greedy(ps[0], "a", adapter="alpha"), greedy(ps[1], "b")])
    assert eng.stats["decode_steps_without_adapters"] == 0
    assert [r.output_ids for r in res] == base_refs
    assert [r.output_ids for r in mixed] == [alpha_ref, base_refs[1]]

@pytest.mark.parametrize("native,static", [(True, None), (False, None), (False, True)],
                         ids=["native", "hf-fallback", "hf-fallback-static"])
def test_update_model_wraps_base_in_peft(tiny_dir, tokenizer, adapter_dirs, native, static):
    from peft import PeftModel

    base = load(tiny_dir)
    p = prompts(1, seed=3)[0]
    base_ref = reference(base, p)
    with Engine(base, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=4, max_seq_len=128,
                native=native, static_fallback=static) as eng:
        assert eng.generate([greedy(p, 0)])[0].output_ids == base_ref
        if static:
            assert eng.stats["fallback_decode"] == "static" and eng.stats["kv_cache_bytes"] > 0
            buffer = weakref.ref(eng.fallback._static.k[0])
        bad = eng.generate([greedy(p, 1, adapter="alpha")])[0]
        assert bad.finish_reason == "error" and "alpha" in bad.error
        gc.disable()  # the static buffers must go when the batch is dropped, not wait for a collection
        try:
            with eng.model_lock:
                pm = PeftModel.from_pretrained(base, adapter_dirs["alpha"], adapter_name="alpha").eval()
                eng.update_model(pm)
            assert not static or buffer() is None
        finally:
            gc.enable()
        pm.set_adapter("alpha")
        alpha_ref = reference(pm, p)
        res = eng.generate([greedy(p, 2, adapter="alpha"), greedy(p, 3)])
        assert res[0].output_ids == alpha_ref
        assert res[1].output_ids == base_ref
        if static:  # adapters are picked per row on the host: dynamic batches, the idle static buffers given back
            assert eng.stats["fallback_decode"] == "dynamic" and eng.stats["kv_cache_bytes"] == 0
            assert "adapters" in eng.stats["fallback_graphs"]
        with eng.model_lock:  # a second adapter loaded into the live PeftModel
            pm.load_adapter(adapter_dirs["beta"], adapter_name="beta")
            eng.update_model(pm)
        pm.set_adapter("beta")
        beta_ref = reference(pm, p)
        assert eng.generate([greedy(p, 4, adapter="beta")])[0].output_ids == beta_ref


def test_sampling_seed_reproduces_whatever_the_batch(model, tokenizer):
    ps = prompts(4, seed=4)
    # demo-tiny's output gain makes its base model near certain at temperature 1 (p ~ 0.998): flatten it so that
    # different seeds can draw different tokens
    params = dict(max_new_tokens=16, temperature=4.0, top_p=0.9)
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=8, max_seq_len=128) as eng:
        alone = eng.generate([GenerationRequest("a", ps[0], SamplingParams(seed=7, **params))])[0]
        mixed = eng.generate([GenerationRequest(str(i), p, SamplingParams(seed=7 if i == 0 else i, **params))
                              for i, p in enumerate(ps)])
        other = eng.generate([GenerationRequest("b", ps[0], SamplingParams(seed=8, **params))])[0]
        greedy_out = eng.generate([greedy(ps[0], "g", new=16)])[0]
    assert alone.output_ids == mixed[0].output_ids
    assert other.output_ids != alone.output_ids
    assert alone.output_ids != greedy_out.output_ids


def test_a_failing_fused_sampler_hands_over_to_torch_ops(model, tokenizer):
    """The fused kernel's draw raising (a Triton build that fails on the device) costs no request: the same
    tokens come from torch ops, from then on, and stats say which sampler runs and why."""
    ps = prompts(3, seed=9)
    params = dict(max_new_tokens=8, temperature=4.0)
    requests = [GenerationRequest(str(i), p, SamplingParams(seed=i, **params)) for i, p in enumerate(ps)]
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=4, max_seq_len=128) as eng:
        expected = [r.output_ids for r in eng.generate(requests)]
        calls = []

        def broken(*args):
            calls.append(1)
            raise RuntimeError("no launcher for this device")

        with eng.model_lock:  # as _choose_sampler leaves an engine on cuda/xpu
            eng._fused_draw, eng.draw, eng.stats["sampler"] = broken, eng._draw_fused, "triton"
        assert [r.output_ids for r in eng.generate(requests)] == expected
        assert [r.output_ids for r in eng.generate(requests)] == expected
        assert len(calls) == 1  # not tried again
        assert eng.stats["sampler"] == "torch" and "no launcher" in eng.stats["sampler_fallback_reason"]


def test_sampler_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    toks = sample_tokens(logits, [1.0] * 4000, [1.0] * 4000, list(range(4000)), [0] * 4000)
    freq = torch.bincount(toks, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)
    toks = sample_tokens(logits, [1.0] * 4000, [0.7] * 4000, list(range(4000)), [5] * 4000)
    assert set(toks.tolist()) <= {0, 1}  # p = .64, .24, ...: top_p 0.7 keeps two tokens
    x = torch.randint(0, 2**32, (1000,), dtype=torch.int64)
    assert _mul32(x, 0x846CA68B).tolist() == [(v * 0x846CA68B) & 0xFFFFFFFF for v in x.tolist()]
    assert _mix32(x).tolist() == [_mix32_py(v) for v in x.tolist()]


def test_stop_string_truncates_text(model, tokenizer):
    p = prompts(1, seed=5, lo=10, hi=11)[0]
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=4, max_seq_len=128) as eng:
        full = eng.generate([greedy(p, 0, new=30, ignore_eos=True)])[0]
        text = full.text
        assert len(text) > 8
        stop = text[6:9]
        cut = text.find(stop)
        res = eng.generate([greedy(p, 1, new=30, ignore_eos=True, stop=[stop, "\x00never"])])[0]
    assert res.finish_reason == "stop"
    assert res.text == text[:cut]
    assert res.output_ids == full.output_ids[:len(res.output_ids)] and len(res.output_ids) < 30


@pytest.mark.parametrize("native,static", [(True, None), (False, None), (False, True)],
                         ids=["native", "hf-fallback", "hf-fallback-static"])
def test_streaming_deltas_add_up_to_the_result(model, tokenizer, native, static):
    p = prompts(1, seed=5, lo=10, hi=11)[0]
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=4, max_seq_len=128,
                native=native, static_fallback=static) as eng:
        full = eng.generate([greedy(p, 0, new=20, ignore_eos=True)])[0]
        stop = full.text[8:11]
        results = {}
        for name, stops in (("plain", []), ("stop", [stop])):
            req = greedy(p, name, new=20, ignore_eos=True, stop=stops)
            req.stream = True
            deltas = []
            results[name] = eng.submit(req, on_delta=deltas.append).result(timeout=60), deltas
    res, deltas = results["plain"]
    assert res.output_ids == full.output_ids and len(deltas) >= 10  # one per step, not one at the end
    assert all(d.request_id == "plain" for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == res.output_ids
    assert "".join(d.text for d in deltas) == res.text
    res, deltas = results["stop"]
    assert res.finish_reason == "stop" and res.text == full.text[:full.text.find(stop)]
    assert [t for d in deltas for t in d.token_ids] == res.output_ids
    assert "".join(d.text for d in deltas) == res.text  # a stop string's start is never sent


@pytest.mark.parametrize("native", [True, False], ids=["native", "hf-fallback"])
def test_stream_interval_gathers_steps_into_fewer_deltas(model, tokenizer, native):
    """With a stream interval, a request's first token goes out at once and later ones are gathered: far fewer
    deltas than steps, the same tokens and text."""
    p = prompts(1, seed=5, lo=10, hi=11)[0]
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=4, max_seq_len=128,
                native=native, stream_interval=3600.0) as eng:
        req = greedy(p, "gathered", new=20, ignore_eos=True)
        req.stream = True
        deltas = []
        res = eng.submit(req, on_delta=deltas.append).result(timeout=60)
    assert len(res.output_ids) == 20
    assert len(deltas) == 2 and len(deltas[0].token_ids) == 1  # the first token at once, the rest at the finish
    assert [t for d in deltas for t in d.token_ids] == res.output_ids
    assert "".join(d.text for d in deltas) == res.text


def test_bad_requests_fail_alone(model, tokenizer):
    ok = prompts(1, seed=6)[0]
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=4, max_seq_len=64) as eng:
        res = eng.generate([
            greedy([5] * 64, "too-long"),
            greedy(ok, "good"),
            greedy([], "empty"),
            greedy(ok, "adapter", adapter="nope"),
            greedy([10**6], "vocab"),
            GenerationRequest("temp", ok, SamplingParams(temperature=-1)),
            GenerationRequest("zero", ok, SamplingParams(max_new_tokens=0)),
        ])
        near = eng.generate([greedy([5] * 60, "near-limit", new=50, ignore_eos=True)])[0]
    by = {r.request_id: r for r in res}
    assert by["good"].finish_reason in ("stop", "length") and by["good"].error is None
    assert "64 tokens" in by["too-long"].error and by["too-long"].error_code == "context_length_exceeded"
    for rid in ("too-long", "empty", "adapter", "vocab", "temp", "zero"):
        assert by[rid].finish_reason == "error" and by[rid].error, rid
    # A prompt near the context limit stops at the limit with "length" (64 - 60 + 1 tokens).
    assert near.finish_reason == "length" and near.completion_tokens == 5


def test_concurrent_submissions_share_one_batch(model, tokenizer):
    ps = prompts(32, seed=7)
    refs = {i: reference(model, p) for i, p in enumerate(ps[:3])}
    results = {}
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=64, max_seq_len=128) as eng:
        barrier = threading.Barrier(len(ps))

        def client(i):
            barrier.wait()
            results[i] = eng.submit(greedy(ps[i], i, new=NEW)).result(timeout=60)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert eng.stats["max_running"] >= 16
        assert eng.stats["decode_steps"] < 4 * NEW  # batched, not one request after another
    assert len(results) == len(ps)
    for i, ref in refs.items():
        assert results[i].output_ids == ref


@pytest.mark.parametrize("native,static", [(None, None), (False, True)], ids=["native", "hf-fallback-static"])
def test_cancel_running_and_waiting(model, tokenizer, native, static):
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=1, max_seq_len=1024,
                native=native, static_fallback=static) as eng:
        long = eng.submit(greedy([5, 6, 7], "long", new=1000, ignore_eos=True))
        waiting = eng.submit(greedy([5, 6, 7], "waiting", new=5))
        deadline = time.time() + 30
        while eng.stats["decode_steps"] < 5 and time.time() < deadline:
            time.sleep(0.01)
        eng.cancel("waiting")
        eng.cancel("long")
        r1 = long.result(timeout=30)
        r2 = waiting.result(timeout=30)
        after = eng.generate([greedy([5, 6, 7], "after", new=3, ignore_eos=True)])[0]
    assert r1.finish_reason == "cancelled" and 0 < r1.completion_tokens < 1000
    assert r2.finish_reason == "cancelled" and r2.completion_tokens == 0
    assert after.finish_reason == "length" and after.completion_tokens == 3


def test_memory_budget_bounds_the_cache(model, tokenizer):
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        Engine(model, tokenizer, device="cpu", memory_budget_bytes=10_000, max_seq_len=128)
    budget = 20 * MB
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=budget, max_batch_size=10_000,
                max_seq_len=1024) as eng:
        s = eng.stats
        assert 1 <= s["num_slots"] < 10_000
        assert s["kv_cache_bytes"] + s["workspace_estimate_bytes"] <= budget
        # paged: blocks of kv_block_size positions, one more than the pool (the scratch block)
        assert s["kv_cache_bytes"] == (s["kv_blocks_total"] + 1) * s["kv_block_size"] * eng.kv_bytes_per_token
        assert s["kv_blocks_total"] * s["kv_block_size"] >= 1024  # one request of max_seq_len fits
        assert s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


def test_closed_engine_refuses(model, tokenizer):
    eng = Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=2, max_seq_len=64)
    eng.close()
    with pytest.raises(RuntimeError):
        eng.submit(greedy([5, 6], "x"))


def test_model_spread_over_devices_uses_the_models_own_forward(tiny_dir):
    """device_map='auto' over a worker's devices: the native path reads weights from one device, so it stands
    aside for the model's forward, which moves activations between devices itself."""
    from worker.engine.model_runner import native_unsupported_reason

    model = load(tiny_dir)
    assert native_unsupported_reason(model) is None
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "lm_head": 0}
    assert "several devices" in native_unsupported_reason(model)


def test_requests_with_the_same_prompt_start_share_its_blocks(model, tokenizer):
    """A shared prompt start (a system prompt) is computed once: later requests take its cache blocks, and get
    the same tokens as generate."""
    rng = random.Random(15)
    system = [rng.randrange(5, 300) for _ in range(40)]
    ps = [system + [rng.randrange(5, 300) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    refs = [reference(model, p) for p in ps]
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=8, max_seq_len=128) as eng:
        first = eng.generate([greedy(ps[0], 0)])
        rest = eng.generate([greedy(p, i) for i, p in enumerate(ps[1:], 1)])
        assert eng.stats["prefix_shared_tokens"] == 5 * 32  # two full blocks of 16 for each later request
        assert eng.stats["prefill_tokens"] == sum(len(p) for p in ps) - 5 * 32
    for r, ref in zip(first + rest, refs):
        assert r.output_ids == ref


def test_fused_projections_view_the_models_own_weights(tiny_dir, tokenizer):
    """q/k/v and gate/up run as one matmul each: the modules' weights become row views of the fused tensor (same
    values, no second copy), and a second engine on the same base views them again instead of copying."""
    model = load(tiny_dir)
    att, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    before = [p.detach().clone() for p in (att.q_proj.weight, att.k_proj.weight, att.v_proj.weight)]
    with Engine(model, tokenizer, device="cpu", native=True, memory_budget_bytes=1 << 28, max_batch_size=4):
        pass
    ws = [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]
    assert all(torch.equal(a, b) for a, b in zip(ws, before))
    assert len({w.untyped_storage().data_ptr() for w in ws}) == 1
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    ptrs = [w.data_ptr() for w in ws]
    with Engine(model, tokenizer, device="cpu", native=True, memory_budget_bytes=1 << 28, max_batch_size=4) as eng:
        got = eng.generate([greedy(p, i) for i, p in enumerate(prompts(2))])
    assert [w.data_ptr() for w in ws] == ptrs
    assert [r.output_ids for r in got] == [reference(model, p) for p in prompts(2)]
