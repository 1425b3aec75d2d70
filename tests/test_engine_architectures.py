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
