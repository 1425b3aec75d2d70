"""The paged engine on one GPU (E1, issue 9): greedy equality with generate (fp32 demo model; bf16 Qwen3-0.6B
shape, random weights) with preemption and chunked prefill in play, the paged decode kernel's error, and
throughput at the shipped defaults. Result: docs/results/h200-paged-engine.json."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from bench.generation import build_model, make_prompts  # noqa: E402
from worker.engine.engine import Engine  # noqa: E402
from worker.engine.requests import GenerationRequest, SamplingParams  # noqa: E402

dev = os.environ.get("DEV", "cuda")
out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}


def refs_for(model, prompts, new):
    with torch.no_grad():
        return [model.generate(torch.tensor([p], device=dev), attention_mask=torch.ones(1, len(p), device=dev,
                dtype=torch.int64), do_sample=False, max_new_tokens=new)[0, len(p):].tolist() for p in prompts]


def greedy(prompts, new):
    return [GenerationRequest(str(i), p, SamplingParams(max_new_tokens=new, temperature=0)) for i, p in
            enumerate(prompts)]


def tight_budget(model, tok, blocks, **kw):
    with Engine(model, tok, device=dev, memory_budget_bytes=4 << 30, **kw) as probe:
        ws, per = probe.stats["workspace_estimate_bytes"], probe.kv_bytes_per_token * probe.block_size
    return ws + (blocks + 1) * per + per // 2


def check(tag, model, tok, prompts, new, refs, **kw):
    t = time.perf_counter()
    try:
        with Engine(model, tok, device=dev, **kw) as eng:
            res = eng.generate(greedy(prompts, new))
            s = eng.stats
            out[tag] = {"match": sum(r.output_ids == f for r, f in zip(res, refs)), "of": len(prompts),
                        "first_token_match": sum(r.output_ids[:1] == f[:1] for r, f in zip(res, refs)),
                        **{k: s.get(k) for k in ("kernels", "preemptions", "prefill_chunks", "graphs_captured",
                                                 "kv_blocks_total", "packed_prefill", "kernels_error",
                                                 "graphs_error")}, "s": round(time.perf_counter() - t, 1)}
    except Exception as e:
        out[tag] = f"{type(e).__name__}: {e}"
    print(tag, out[tag], flush=True)


# 1. fp32 tiny: paged Triton kernel and torch path, tight cache (preemption) and a 64-token prefill budget (chunks)
model, tok = build_model("tiny", dev, torch.float32)
prompts = make_prompts(24, 3, 200, len(tok), seed=5)
refs = refs_for(model, prompts, 40)
kw = dict(max_batch_size=16, max_seq_len=256, prefill_tokens=64)
for kernels in ("triton",):
    check(f"tiny_fp32_{kernels}_tight", model, tok, prompts, 40, refs, kernels=kernels,
          memory_budget_bytes=tight_budget(model, tok, 40, kernels=kernels, **kw), **kw)
if os.environ.get("ONLY_TINY"):
    print(json.dumps(out, indent=1))
    sys.exit(0)
# 2. bf16 Qwen3-0.6B shape: packed prefill + Triton, roomy and tight
model, _ = build_model("qwen3-0.6b", dev, torch.bfloat16)
model.eval()
vocab = model.config.vocab_size
prompts = make_prompts(16, 8, 600, vocab, seed=6)
refs = refs_for(model, prompts, 32)
check("qwen_bf16_default", model, None, prompts, 32, refs, max_batch_size=16, max_seq_len=1024)
kw = dict(max_batch_size=16, max_seq_len=1024, prefill_tokens=512)
check("qwen_bf16_tight_chunked", model, None, prompts, 32, refs,
      memory_budget_bytes=tight_budget(model, None, 100, **kw), **kw)
# 3. throughput at the shipped defaults (build_engine, Settings with no env), two workloads, EOS ignored
t = time.perf_counter()
# build_engine's call with the shipped settings (the device image has no pydantic): fraction 0.85, 256 rows, 4096
eng = Engine(model, None, device=dev, memory_fraction=0.85, max_batch_size=256, max_seq_len=4096)
eng.warmup()
out["shipped_init_s"] = round(time.perf_counter() - t, 1)
out["shipped_stats"] = {k: eng.stats.get(k) for k in ("budget_bytes", "kv_blocks_total", "kv_block_size", "num_slots",
                                                       "max_seq_len", "kv_cache_bytes", "graphs_captured")}
for name, n, lo, hi, new in (("current", 512, 32, 511, 128), ("long", 1024, 16, 1500, 256)):
    prompts = make_prompts(n, lo, hi, vocab, seed=1)
    for rep in range(2 if name == "current" else 1):
        before = dict(eng.stats)
        t = time.perf_counter()
        res = eng.generate([GenerationRequest(f"{name}{i}", p, SamplingParams(max_new_tokens=new, temperature=0,
                                                                              ignore_eos=True))
                            for i, p in enumerate(prompts)])
        torch.cuda.synchronize()
        secs = time.perf_counter() - t
        toks = sum(len(r.output_ids) for r in res)
        d = {k: eng.stats[k] - before[k] for k in ("decode_steps", "decode_rows", "preemptions", "prefill_chunks",
                                                    "prefill_seconds", "decode_seconds")}
        out[f"shipped_{name}_{rep}"] = {"tokens": toks, "seconds": round(secs, 2), "tok_per_s": round(toks / secs),
                                        "mean_batch": round(d["decode_rows"] / max(1, d["decode_steps"]), 1),
                                        "max_running": eng.stats["max_running"], **d,
                                        "errors": sum(r.finish_reason == "error" for r in res)}
        print(name, rep, out[f"shipped_{name}_{rep}"], flush=True)
eng.close()
# 4. the paged kernel against a float32 reference
from worker.engine.triton_kernels import paged_decode_attention  # noqa: E402

torch.manual_seed(0)
q = torch.randn(64, 8, 2, 128, device=dev, dtype=torch.bfloat16)
kc = torch.randn(3000, 16, 8, 128, device=dev, dtype=torch.bfloat16)
vc = torch.randn_like(kc)
lens = torch.randint(1, 700, (64,), device=dev, dtype=torch.int32)
tables = torch.randperm(3000, device=dev)[:64 * 44].view(64, 44).to(torch.int32)
o = paged_decode_attention(q, kc, vc, tables, lens, 128 ** -0.5).float()
err = 0.0
for b in range(64):
    L = int(lens[b])
    k = kc[tables[b].long()].reshape(-1, 8, 128)[:L].transpose(0, 1).float()
    v = vc[tables[b].long()].reshape(-1, 8, 128)[:L].transpose(0, 1).float()
    r = torch.softmax(q[b].float() @ k.transpose(-1, -2) * 128 ** -0.5, -1) @ v
    err = max(err, ((o[b] - r).norm() / r.norm()).item())
out["paged_kernel_bf16_max_rel_err"] = err
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "e1_gpu_check.json"), "w"), indent=1)
