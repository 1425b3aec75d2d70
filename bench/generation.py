"""Generation throughput: plain `generate` vs transformers' continuous batching vs the xpu-jobs engine vs the whole
service, on one or more workloads, in one run.

One run, one model, the same prompts and the same output length for every variant of a workload (EOS is disabled
everywhere, so each request produces exactly its new-token count; the script counts what each variant returned).

    python -m bench.generation --model qwen3-0.6b --device cuda --workloads current,long --chats 64 --out r.json
    python -m bench.generation --model phi2-0.6b --device cuda --variants generate-bs128,generate-bs256,engine
    python -m bench.generation --model tiny --device cpu --prompts 128 --out tiny.json

Workloads (--workloads; --prompts, --min-prompt, --max-prompt, --new-tokens override each one's numbers):
  current   512 prompts of 32-511 tokens, 128 new tokens each
  long      1,024 prompts of 16-1,500 tokens, 256 new tokens each

Variants (run in this order for each workload; --variants picks a subset, and an entry "WORKLOAD:VARIANT" runs
that variant for that workload only):
  generate-bs<N>          plain model.generate, static batches of N in input order, left padding, dynamic cache
  generate-static-bs<N>   the same with cache_implementation="static", every batch padded to one shape (the
                          workload's longest prompt, N rows) so the forward is compiled once (transformers compiles
                          it by itself on cuda/xpu with a static cache); the first batch runs once untimed
  generate_batch          transformers continuous batching (generate_batch; ContinuousBatchingConfig(
                          auto_switch_to_flash=False): the image has no flash-attn package), timed as called
  generate_batch-warm     the same again on its persistent manager (graphs already captured)
  engine-cold             worker.engine's Engine built as the worker builds it (shipped settings), first call
  engine                  the same engine again, warm
  engine-stop             the same engine, every request with a stop string that no output writes (searched for
                          at every token)
  engine-stream           the same engine, every request streamed (the engine's deltas at its shipped interval,
                          to a callback that drops them)
  engine-sample           the same engine, every request sampled at temperature 1.0 (what a request that leaves
                          temperature out gets; seeded)
  engine-adapters         a fresh engine on the model wrapped with 4 random LoRA adapters (rank 16, every decoder
                          projection); the requests cycle through the 4 adapters and the base
  engine-live             the shipped engine runs the workload as batch requests (all submitted at once) while
                          live requests (--live-requests of 24-96 tokens, --live-tokens new, streamed) are
                          submitted one every --live-interval seconds until the batch ends: their time to first
                          token and time per output token (p50, p99), and the batch's throughput; run twice, the
                          live requests at live priority, then at batch priority (one arrival-ordered queue, as
                          before priorities)
  service                 the whole service at its shipped settings: the same prompts as one batch job through the
                          API, Redis, Celery and a worker started by `xpu-jobs up` (bench/service.py); run after
                          every in-process variant of every workload, in one stack

--chats N then measures N live chat completions through the same stack: sent one after another, then all at once,
with time to first token and time per output token (p50/p99) where the API streams.

Models (--model), random weights, nothing downloaded:
  tiny         worker.demo_model (Qwen3 architecture, 2 layers, hidden 64)
  qwen3-0.6b   Qwen3-0.6B's architecture (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128)
  phi3-0.6b    Phi-3's layout (fused qkv_proj / gate_up_proj) at the same size as qwen3-0.6b, vocab 32064
  phi2-0.6b    Phi-2's layout (model_type "phi": LayerNorm, parallel attention and MLP, GELU, rotary over 32 of
               64 head dims as Phi-2's 32 of 80), hidden 1024, 24 layers: outside the engine's native list, so the
               engine takes its fallback path
  phi2-tiny    the same layout at hidden 128, 4 layers, vocabulary 2,048: the fallback path on cpu in seconds, where
               the eager forward's host time dominates as it does on a GPU
The GPU ceiling is FLOPs per token (2 x parameters) over a measured bf16 matrix-product rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine.engine import Engine  # noqa: E402
from worker.engine.requests import GenerationRequest, Priority, SamplingParams  # noqa: E402

GiB = 1 << 30
WORKLOADS = {"current": dict(prompts=512, min_prompt=32, max_prompt=511, new_tokens=128),
             "long": dict(prompts=1024, min_prompt=16, max_prompt=1500, new_tokens=256)}


# ---------------------------------------------------------------------------------------------- the model


def qwen3_06b_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu",
                       attention_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def phi3_06b_config():
    from transformers import Phi3Config

    return Phi3Config(vocab_size=32064, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                      original_max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      hidden_act="silu", bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      sliding_window=None)


def phi2_06b_config():
    from transformers import PhiConfig

    return PhiConfig(vocab_size=51200, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                     partial_rotary_factor=0.5, hidden_act="gelu_new", tie_word_embeddings=False,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)


def phi2_tiny_config():
    from transformers import PhiConfig

    return PhiConfig(vocab_size=2048, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                     partial_rotary_factor=0.5, hidden_act="gelu_new", tie_word_embeddings=False,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)


CONFIGS = {"qwen3-0.6b": qwen3_06b_config, "phi3-0.6b": phi3_06b_config, "phi2-0.6b": phi2_06b_config,
           "phi2-tiny": phi2_tiny_config}
MODELS = ["tiny", *CONFIGS]


def build_model(name: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    if name == "tiny":
        from worker.demo_model import build_demo_model

        path = build_demo_model(Path(tempfile.mkdtemp(prefix="bench-tiny-")) / "tiny")
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    else:
        tok = None
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=dtype)
    model.eval()
    # No EOS anywhere: every variant must produce exactly its number of new tokens per request.
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model, tok


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# --------------------------------------------------------------------------------------------- measuring


class Device:
    def __init__(self, device: str):
        self.device = torch.device(device)
        self.backend = self.device.type
        self.mod = getattr(torch, self.backend) if self.backend != "cpu" else None

    def sync(self):
        if self.mod:
            self.mod.synchronize()

    def allocated(self) -> int:
        return int(self.mod.memory_allocated()) if self.mod else 0

    def reset_peak(self):
        if self.mod:
            self.mod.empty_cache()
            self.mod.reset_peak_memory_stats()

    def peak(self) -> int:
        return int(self.mod.max_memory_allocated()) if self.mod else 0

    def peak_reserved(self) -> int:
        return int(self.mod.max_memory_reserved()) if self.mod else 0

    def name(self) -> str:
        return self.mod.get_device_name() if self.mod else platform.processor() or "cpu"


def matmul_rate(dev: Device, dtype: torch.dtype) -> float:
    """FLOP/s of one large matrix product on random data (median of 10 after 3 warm-ups)."""
    n = 8192 if dev.backend != "cpu" else 1024
    a = torch.randn(n, n, device=dev.device, dtype=dtype)
    b = torch.randn(n, n, device=dev.device, dtype=dtype)
    times = []
    for i in range(13):
        dev.sync()
        t = time.perf_counter()
        a @ b
        dev.sync()
        if i >= 3:
            times.append(time.perf_counter() - t)
    del a, b
    times.sort()
    return 2 * n ** 3 / times[len(times) // 2]


# ---------------------------------------------------------------------------------------------- variants


def run_generate(ctx, batch_size: int, static: bool) -> dict:
    from transformers import GenerationConfig

    model, new, dev = ctx["model"], ctx["new_tokens"], ctx["dev"]
    # --generate-prompts: the first N prompts only (its tokens/s is per batch; fewer batches, same shapes)
    prompts = ctx["prompts"][:ctx["args"].generate_prompts or None]
    extra = {"cache_implementation": "static"} if static else {}
    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0, **extra)
    # A static cache is compiled per shape: pad every batch to one (the workload's longest prompt, full rows).
    width = max(map(len, prompts)) if static else None

    def batches(ps):
        for i in range(0, len(ps), batch_size):
            chunk = ps[i:i + batch_size]
            rows = batch_size if static else len(chunk)
            L = width or max(len(p) for p in chunk)
            ids = torch.zeros(rows, L, dtype=torch.long)
            mask = torch.zeros(rows, L, dtype=torch.long)
            mask[:, -1] = 1  # filler rows (static shape only) are one pad token; their output is not counted
            for j, p in enumerate(chunk):  # left padding
                ids[j, L - len(p):] = torch.tensor(p)
                mask[j, L - len(p):] = 1
            yield ids.to(dev.device), mask.to(dev.device), len(chunk)

    with torch.no_grad():
        # warm-up: a small call; for the static cache the first batch itself (its compilation is not timed)
        for ids, mask, _ in batches(prompts[:batch_size] if static else prompts[:2]):
            model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg if static else GenerationConfig(
                max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0))
        dev.sync()
        dev.reset_peak()
        t = time.perf_counter()
        tokens = steps = 0
        for ids, mask, real in batches(prompts):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            tokens += (out.shape[1] - ids.shape[1]) * real
            steps += out.shape[1] - ids.shape[1]
        dev.sync()
        secs = time.perf_counter() - t
    return {"tokens": tokens, "seconds": secs, "steps": steps, "peak_memory_bytes": dev.peak(),
            "peak_reserved_bytes": dev.peak_reserved(),
            "config": f"batch {batch_size}, " + (f"static cache, every batch padded to {width} tokens"
                                                 if static else "dynamic cache")
            + (f"; the first {len(prompts)} prompts" if len(prompts) < len(ctx["prompts"]) else "")}


def run_generate_batch(ctx, warm: bool) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, prompts, new, dev = ctx["model"], ctx["prompts"], ctx["new_tokens"], ctx["dev"]
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(auto_switch_to_flash=False)
    with torch.no_grad():
        if warm and not ctx.get("cb_persistent"):
            raise RuntimeError("generate_batch-warm needs generate_batch to run first")
        dev.sync()
        dev.reset_peak()
        t = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                   persistent_manager=True, progress_bar=False)
        dev.sync()
        secs = time.perf_counter() - t
    ctx["cb_persistent"] = True
    if warm:
        release_cb(ctx)
    counts = [len(o.generated_tokens) for o in out.values()]
    errors = [o.error for o in out.values() if o.error]
    res = {"tokens": sum(counts), "seconds": secs, "steps": None, "peak_memory_bytes": dev.peak(),
           "peak_reserved_bytes": dev.peak_reserved(), "requests_done": len(counts),
           "config": "ContinuousBatchingConfig(auto_switch_to_flash=False), otherwise its defaults"}
    if errors:
        res["errors"] = errors[:3]
    return res


def release_cb(ctx) -> None:
    """Free the continuous-batching manager (it holds most of the card) before other variants run."""
    if ctx.pop("cb_persistent", False):
        ctx["model"].destroy_cached_continuous_batching_manager()
        gc.collect()
        ctx["dev"].reset_peak()


def shipped_engine(model, tokenizer, device: str) -> Engine:
    """The engine as a worker builds it for a loaded model (worker/engine/model_cache.py), from the shipped
    settings (no XPUJOBS_* variable, no .env), its graphs captured at load."""
    from contract.settings import Settings
    from worker.engine.model_cache import build_engine

    return build_engine(model, tokenizer, Settings(_env_file=None), device)


def close_engine(ctx) -> None:
    if ctx.get("engine") is not None:
        ctx.pop("engine").close()
        gc.collect()
        ctx["dev"].reset_peak()


def _engine(ctx) -> Engine:
    if ctx.get("engine") is None:
        t = time.perf_counter()
        ctx["engine"] = shipped_engine(ctx["model"], ctx["tokenizer"], str(ctx["dev"].device))
        ctx["engine_init_seconds"] = time.perf_counter() - t
    return ctx["engine"]


# A stop string no output of these random-weight models writes: each token is searched for it, nothing is cut.
UNWRITTEN_STOP = "<never written>"


def run_engine(ctx, cold: bool, eng: Engine | None = None, adapters: list[str | None] | None = None,
               stop: bool = False, stream: bool = False, temperature: float = 0.0) -> dict:
    prompts, new, dev = ctx["prompts"], ctx["new_tokens"], ctx["dev"]
    dev.sync()
    dev.reset_peak()
    eng = eng or _engine(ctx)
    before = dict(eng.stats)
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=new, temperature=temperature, seed=i,
                                                         ignore_eos=True, stop=[UNWRITTEN_STOP] if stop else None),
                              adapter=adapters[i % len(adapters)] if adapters else None, stream=stream)
            for i, p in enumerate(prompts)]
    t = time.perf_counter()
    results = [f.result() for f in [eng.submit(r, (lambda delta: None) if stream else None) for r in reqs]]
    dev.sync()
    secs = time.perf_counter() - t
    s = eng.stats
    steps = s["decode_steps"] - before["decode_steps"]
    errors = [r.error for r in results if r.error]
    res = {"tokens": sum(r.completion_tokens for r in results), "seconds": secs, "steps": steps,
           "peak_memory_bytes": dev.peak(), "peak_reserved_bytes": dev.peak_reserved(),
           "path": eng.path, "fallback_reason": s.get("fallback_reason"),
           # on the fallback path: how its decode steps ran (graphs / static uncaptured / dynamic), and why not graphs
           "fallback_decode": s.get("fallback_decode"), "fallback_graphs": s.get("fallback_graphs"),
           "fallback_graph_steps": s.get("fallback_graph_steps", 0) - before.get("fallback_graph_steps", 0),
           "engine_init_seconds": ctx.get("engine_init_seconds"),
           "mean_batch": (s["decode_rows"] - before["decode_rows"]) / max(1, steps),
           "prefill_seconds_host": s["prefill_seconds"] - before["prefill_seconds"],
           "graphs_captured": s["graphs_captured"] - before["graphs_captured"],
           "engine_stats": {k: v for k, v in s.items() if isinstance(v, (int, float, str, type(None)))}}
    if errors:
        res["errors"] = errors[:3]
    return res


def run_engine_adapters(ctx) -> dict:
    """The shipped engine on the model wrapped with 4 random LoRA adapters; requests cycle adapters and the base."""
    from peft import LoraConfig, get_peft_model

    close_engine(ctx)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
               "gate_up_proj", "dense", "fc1", "fc2"]
    present = {n.rsplit(".", 1)[-1] for n, _ in ctx["model"].named_modules()}
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules=[t for t in targets if t in present],
                     init_lora_weights=False)
    torch.manual_seed(1)
    names = [f"a{i}" for i in range(4)]
    peft = get_peft_model(ctx["model"], cfg, adapter_name=names[0])
    for name in names[1:]:
        peft.add_adapter(name, cfg)
    peft.eval()
    eng = shipped_engine(peft, ctx["tokenizer"], str(ctx["dev"].device))
    try:
        res = run_engine(ctx, cold=False, eng=eng, adapters=[*names, None])
    finally:
        eng.close()
        ctx["model"] = peft.unload()
        gc.collect()
        ctx["dev"].reset_peak()
    res["config"] = "4 LoRA adapters r=16 on every decoder projection; requests cycle a0..a3 and the base"
    return res


def live_during_batch(eng: Engine, prompts: list[list[int]], new: int, live_prompts: list[list[int]], live_new: int,
                      interval: float, priority: Priority) -> dict:
    """The prompts as one batch (batch priority, all at once); once it decodes, live requests at `priority`, one
    every `interval` seconds until the batch ends. TTFT: submit to first delta; TPOT: first to last delta over
    the tokens after the first."""
    from bench.service import percentiles

    before = dict(eng.stats)
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    ended: list[float] = []
    t0 = time.perf_counter()
    batch = [eng.submit(GenerationRequest(f"b{i}", p, params, priority=Priority.BATCH)) for i, p in enumerate(prompts)]
    for future in batch:
        future.add_done_callback(lambda _: ended.append(time.perf_counter()))
    while eng.stats["decode_steps"] == before["decode_steps"]:  # live requests come once the batch decodes
        time.sleep(0.001)
    live_params = SamplingParams(max_new_tokens=live_new, temperature=0.0, ignore_eos=True)
    stamps: dict[str, list[float]] = {}  # request id -> [submitted, first delta, last delta]

    def on_delta(delta) -> None:
        t, mine = time.perf_counter(), stamps[delta.request_id]
        mine[1:] = [mine[1] if len(mine) > 1 else t, t]

    live = []
    for i, p in enumerate(live_prompts):
        if len(ended) == len(batch):
            break
        stamps[f"live{i}"] = [time.perf_counter()]
        live.append(eng.submit(GenerationRequest(f"live{i}", p, live_params, stream=True, priority=priority),
                               on_delta))
        time.sleep(interval)
    results = [f.result() for f in batch]
    live_results = [f.result() for f in live]
    ttft = [stamps[r.request_id][1] - stamps[r.request_id][0] for r in live_results]
    tpot = [(stamps[r.request_id][2] - stamps[r.request_id][1]) / (r.completion_tokens - 1)
            for r in live_results if r.completion_tokens > 1]
    ms = lambda values: {k: round(v * 1e3, 2) for k, v in (percentiles(values) or {}).items()}  # noqa: E731
    return {"tokens": sum(r.completion_tokens for r in results), "seconds": max(ended) - t0,
            "live_sent": len(live), "live_ttft_ms": ms(ttft), "live_tpot_ms": ms(tpot),
            "live_errors": sum(r.error is not None for r in live_results),
            "preemptions_for_live": eng.stats["preemptions_for_live"] - before["preemptions_for_live"],
            "preemptions": eng.stats["preemptions"] - before["preemptions"]}


def run_engine_live(ctx) -> dict:
    args, dev = ctx["args"], ctx["dev"]
    eng = _engine(ctx)
    live_prompts = make_prompts(args.live_requests, 24, 96, ctx["model"].config.vocab_size, seed=1)
    runs = {}
    dev.sync()
    dev.reset_peak()
    for mode, priority in (("live_priority", Priority.LIVE), ("batch_priority", Priority.BATCH)):
        runs[mode] = live_during_batch(eng, ctx["prompts"], ctx["new_tokens"], live_prompts, args.live_tokens,
                                       args.live_interval, priority)
        runs[mode]["tokens_per_s"] = runs[mode]["tokens"] / runs[mode]["seconds"]
        print(mode, json.dumps(runs[mode]), flush=True)
    return {**{k: runs["live_priority"][k] for k in ("tokens", "seconds")}, "steps": None,
            "peak_memory_bytes": dev.peak(), "peak_reserved_bytes": dev.peak_reserved(), "path": eng.path,
            **runs, "config": f"{args.live_requests} live requests at most, {args.live_tokens} new tokens, one every "
                              f"{args.live_interval} s; tokens/s is the batch's with live priority"}


def run_variant(name: str, ctx) -> dict:
    if m := re.fullmatch(r"generate-(static-)?bs(\d+)", name):
        close_engine(ctx)  # the engine's cache takes most of the device's free memory
        return run_generate(ctx, int(m.group(2)), static=bool(m.group(1)))
    if name.startswith("generate_batch"):
        close_engine(ctx)
        return run_generate_batch(ctx, warm=name.endswith("-warm"))
    if name == "engine-cold":
        close_engine(ctx)
        return run_engine(ctx, cold=True)
    if name == "engine":
        return run_engine(ctx, cold=False)
    if name == "engine-stop":
        return run_engine(ctx, cold=False, stop=True)
    if name == "engine-stream":
        return run_engine(ctx, cold=False, stream=True)
    if name == "engine-sample":
        return run_engine(ctx, cold=False, temperature=1.0)
    if name == "engine-adapters":
        return run_engine_adapters(ctx)
    if name == "engine-live":
        return run_engine_live(ctx)
    raise ValueError(f"unknown variant {name!r}")


DEFAULT_VARIANTS = ["generate-bs32", "generate-bs64", "generate-bs128", "generate-bs256", "generate-static-bs128",
                    "generate-static-bs256", "generate_batch", "engine-cold", "engine", "engine-adapters",
                    "service"]


# ------------------------------------------------------------------------------------------ correctness


def gpu_check(device: str) -> dict:
    """On the benchmark device: the engine's greedy tokens vs `generate` (tiny model, float32, graphs on), for
    each decode-attention implementation; and the Triton kernel against a float32 reference in bf16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.demo_model import build_demo_model

    out: dict = {}
    path = build_demo_model(Path(tempfile.mkdtemp(prefix="bench-check-")) / "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    prompts = make_prompts(12, 3, 200, len(tok), seed=3)
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
            refs.append(g[0, len(p):].tolist())
    for attention in ("torch", "triton"):
        try:
            with Engine(model, tok, device=device, memory_budget_bytes=2 * GiB, max_batch_size=8,
                        max_seq_len=256, kernels=attention) as eng:
                res = eng.generate([GenerationRequest(str(i), p, SamplingParams(max_new_tokens=24, temperature=0))
                                    for i, p in enumerate(prompts)])
                out[f"engine_{attention}_matches_generate"] = sum(r.output_ids == ref for r, ref in zip(res, refs))
                out[f"engine_{attention}_graphs"] = eng.stats["graphs_captured"]
                out[f"engine_{attention}_kernels_used"] = eng.stats["kernels"]
        except Exception as e:
            out[f"engine_{attention}_error"] = f"{type(e).__name__}: {e}"
    out["requests"] = len(prompts)
    # Packed prefill needs flash attention, which has no float32: in bf16, greedy tokens from packed and from
    # padded prefill (the private switch below) against bf16 `generate`, where near-ties may differ either way.
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        refs = [model.generate(torch.tensor([p], device=device), attention_mask=torch.ones(1, len(p), device=device,
                               dtype=torch.int64), do_sample=False, max_new_tokens=24)[0, len(p):].tolist()
                for p in prompts]
    for prefill in ("packed", "padded"):
        try:
            with Engine(model, tok, device=device, memory_budget_bytes=2 * GiB, max_batch_size=8,
                        max_seq_len=256) as eng:
                if prefill == "padded":
                    eng._packed = None
                res = eng.generate([GenerationRequest(str(i), p, SamplingParams(max_new_tokens=24, temperature=0))
                                    for i, p in enumerate(prompts)])
                out[f"bf16_{prefill}_matches_generate"] = sum(r.output_ids == ref for r, ref in zip(res, refs))
                out[f"bf16_{prefill}_first_token_matches"] = sum(r.output_ids[:1] == ref[:1]
                                                                 for r, ref in zip(res, refs))
                if prefill == "packed":
                    out["bf16_packed_prefill_available"] = eng.stats.get("packed_prefill")
        except Exception as e:
            out[f"bf16_{prefill}_error"] = f"{type(e).__name__}: {e}"
    try:
        from worker.engine.triton_kernels import paged_decode_attention

        torch.manual_seed(0)
        q = torch.randn(64, 8, 2, 128, device=device, dtype=torch.bfloat16)
        kc = torch.randn(3000, 16, 8, 128, device=device, dtype=torch.bfloat16)  # 3000 blocks of 16 positions
        vc = torch.randn_like(kc)
        lens = torch.randint(1, 700, (64,), device=device, dtype=torch.int32)
        tables = torch.randperm(3000, device=device)[:64 * 44].view(64, 44).to(torch.int32)  # 44 x 16 >= 700
        o = paged_decode_attention(q, kc, vc, tables, lens, 128 ** -0.5).float()
        err = 0.0
        for b in range(64):
            L = int(lens[b])
            k = kc[tables[b].long()].reshape(-1, 8, 128)[:L].transpose(0, 1).float()
            v = vc[tables[b].long()].reshape(-1, 8, 128)[:L].transpose(0, 1).float()
            s = q[b].float() @ k.transpose(-1, -2) * 128 ** -0.5
            r = torch.softmax(s, -1) @ v
            err = max(err, ((o[b] - r).norm() / r.norm()).item())
        out["triton_kernel_bf16_max_rel_err"] = err
    except Exception as e:
        out["triton_kernel_error"] = f"{type(e).__name__}: {e}"
    try:  # the fused sampling kernel draws what the torch ops draw, and its time against theirs
        from worker.engine import sampling
        from worker.engine.triton_kernels import gumbel_argmax

        logits = torch.randn(256, 151936, device=device) * 4
        temps = torch.rand(256, device=device) + 0.5
        keys = torch.randint(0, 2 ** 32, (256,), device=device, dtype=torch.int64)
        out["sampling_kernel_matches_torch"] = int((gumbel_argmax(logits, temps, keys)
                                                    == sampling.gumbel_argmax(logits, temps, keys)).sum())
        for name, draw in (("triton", gumbel_argmax), ("torch", sampling.gumbel_argmax)):
            torch.accelerator.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                draw(logits, temps, keys)
            torch.accelerator.synchronize()
            out[f"sampling_{name}_ms_256_rows"] = (time.perf_counter() - t) / 10 * 1e3
    except Exception as e:
        out["sampling_kernel_error"] = f"{type(e).__name__}: {e}"
    return out


# ------------------------------------------------------------------------------------------------- main


def workload_numbers(name: str, args) -> dict:
    w = dict(WORKLOADS[name])
    for key in w:
        if getattr(args, key) is not None:
            w[key] = getattr(args, key)
    return w


def finish(r: dict, expected: int, weights: int) -> dict:
    r["tokens_per_s"] = r["tokens"] / r["seconds"]
    r["ms_per_step"] = r["seconds"] / r["steps"] * 1e3 if r.get("steps") else None
    r["peak_above_weights_bytes"] = r["peak_memory_bytes"] - weights if r.get("peak_memory_bytes") else None
    if r["tokens"] != expected:
        r["warning"] = f"produced {r['tokens']} tokens, expected {expected}"
    return r


def summarize(block: dict) -> None:
    ok = {k: v for k, v in block["variants"].items() if "tokens_per_s" in v}
    plain = {k: v["tokens_per_s"] for k, v in ok.items() if k.startswith("generate-")}
    if plain:
        best = max(plain, key=plain.get)
        block["best_plain_generate"] = {"variant": best, "tokens_per_s": plain[best]}
        for v in ok.values():
            v["vs_best_generate"] = v["tokens_per_s"] / plain[best]
    for other in ("service", "engine-stop", "engine-stream", "engine-sample"):
        if "engine" in ok and other in ok:
            block[f"{other.replace('-', '_')}_vs_engine"] = ok[other]["tokens_per_s"] / ok["engine"]["tokens_per_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="qwen3-0.6b")
    ap.add_argument("--device", default="auto", help="cuda, xpu, cpu or auto")
    ap.add_argument("--workloads", default="current", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--min-prompt", type=int)
    ap.add_argument("--max-prompt", type=int)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--generate-prompts", type=int, default=0,
                    help="plain generate variants run the first N prompts only (0: all); tokens/s is per batch")
    ap.add_argument("--service-first", action="store_true", help="the service and chats before the in-process variants")
    ap.add_argument("--chats", type=int, default=0, help="live chats through the service's stack (0: none)")
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--live-requests", type=int, default=64, help="engine-live: live requests at most")
    ap.add_argument("--live-tokens", type=int, default=32, help="engine-live: new tokens per live request")
    ap.add_argument("--live-interval", type=float, default=0.05, help="engine-live: seconds between live requests")
    ap.add_argument("--check", action="store_true", help="first compare the engine with generate on this device")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    if args.device == "auto":
        from worker.node.devices import detect_backend

        args.device = detect_backend()
    dev = Device(args.device if args.device != "cuda" and args.device != "xpu" else f"{args.device}:0")
    if dev.mod:
        dev.mod.set_device(dev.device)
    dtype = torch.bfloat16 if dev.backend != "cpu" else torch.float32
    if dev.backend == "cuda":
        # For every variant, as the engine does for itself: cuDNN attention (torch's first choice on Hopper) builds
        # a plan per new shape, and a dynamic cache is a new shape every step (plain generate: ~195 ms a step).
        torch.backends.cuda.enable_cudnn_sdp(False)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]

    import transformers

    report: dict = {"model": args.model, "device": dev.name(), "backend": dev.backend, "dtype": str(dtype),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "python": platform.python_version(), "argv": sys.argv[1:], "workloads": {}}

    def save():
        if args.out:
            args.out.write_text(json.dumps(report, indent=1, default=str))

    if args.check:
        t = time.perf_counter()
        report["check"] = gpu_check(str(dev.device))
        report["check"]["seconds"] = time.perf_counter() - t
        print("check:", json.dumps(report["check"]), flush=True)

    model, tok = build_model(args.model, str(dev.device), dtype)
    params = sum(p.numel() for p in model.parameters())
    weights = dev.allocated()
    report.update(parameters=params, weights_bytes=weights)
    gc.collect()
    gc.freeze()  # as the worker does after a model load: no full collection pauses a timed run
    rate = matmul_rate(dev, dtype)
    report["ceiling"] = {"matmul_flops_per_s": rate, "flops_per_token": 2 * params,
                         "tokens_per_s": rate / (2 * params)}
    print(f"{dev.name()}: {params / 1e6:.4g}M parameters, matmul {rate / 1e12:.4g} TFLOP/s -> ceiling "
          f"{rate / (2 * params):,.0f} tokens/s", flush=True)

    ctx = {"model": model, "tokenizer": tok, "dev": dev, "args": args}
    prompts_of = {}
    for wname in workloads:
        w = workload_numbers(wname, args)
        prompts_of[wname] = (make_prompts(w["prompts"], w["min_prompt"], w["max_prompt"], model.config.vocab_size),
                             w["new_tokens"])
        report["workloads"][wname] = {**w, "variants": {}}

    def in_process(wname: str) -> None:
        w, block = workload_numbers(wname, args), report["workloads"][wname]
        ctx.update(prompts=prompts_of[wname][0], new_tokens=w["new_tokens"])
        close_engine(ctx)
        for name in [v.split(":")[-1] for v in variants if v.split(":")[0] in (wname, v)]:
            if name == "service":
                continue
            print(f"--- {wname}: {name}", flush=True)
            if not name.startswith("generate_batch"):
                release_cb(ctx)
            try:
                r = run_variant(name, ctx)
                r = finish(r, (min(w["prompts"], args.generate_prompts or w["prompts"]) if name.startswith("generate-")
                               else w["prompts"]) * w["new_tokens"], weights)
            except Exception as e:
                traceback.print_exc()
                r = {"error": f"{type(e).__name__}: {e}"}
            block["variants"][name] = r
            print(json.dumps({k: v for k, v in r.items() if k != "engine_stats"}, default=str), flush=True)
            summarize(block)
            save()
        release_cb(ctx)
        close_engine(ctx)

    def through_service() -> None:
        if not (any(v.split(":")[-1] == "service" for v in variants) or args.chats):
            return
        from bench.service import Stack, concurrency

        print("--- service (shipped settings)", flush=True)
        gc.collect()
        dev.reset_peak()
        stack = Stack(args.model, dev.backend)
        try:
            for wname in [w for w in workloads if {"service", f"{w}:service"} & set(variants)]:
                prompts, new = prompts_of[wname]
                block = report["workloads"][wname]
                try:
                    cold = stack.batch(prompts, new)
                    r = finish({**stack.batch(prompts, new), "cold_seconds": cold["seconds"]},
                               len(prompts) * new, weights)
                except Exception as e:
                    traceback.print_exc()
                    r = {"error": f"{type(e).__name__}: {e}"}
                block["variants"]["service"] = r
                print(wname, json.dumps(r, default=str), flush=True)
                summarize(block)
                save()
            if args.chats:
                try:
                    report["chats"] = concurrency(stack, args.chats, args.chat_tokens)
                except Exception as e:
                    traceback.print_exc()
                    report["chats"] = {"error": f"{type(e).__name__}: {e}"}
                print("chats", json.dumps(report["chats"], default=str), flush=True)
        finally:
            stack.close()

    # the service's stack holds most of the device while it runs, so it runs before or after every in-process
    # variant, never between them; --service-first keeps its figures when a slow variant later runs out of time
    if args.service_first:
        through_service()
    for wname in workloads:
        in_process(wname)
    if not args.service_first:
        through_service()
    best = max((v["tokens_per_s"] for b in report["workloads"].values() for v in b["variants"].values()
                if "tokens_per_s" in v), default=None)
    if best:
        report["ceiling"]["best_fraction"] = best / report["ceiling"]["tokens_per_s"]
    save()
    for wname, block in report["workloads"].items():
        print_table(report, wname, block)
    if "chats" in report and "error" not in report["chats"]:
        c = report["chats"]
        print(f"chats: {c['requests']} x {c['new_tokens']} tokens; sequential {c['sequential_seconds']:.2f} s, "
              f"concurrent {c['concurrent_seconds']:.2f} s = {c['speedup']:.2f}x; latency {c.get('latency')}")
    return 0


def print_table(report: dict, wname: str, block: dict) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        Console = Table = None
    rows = []
    for name, v in block["variants"].items():
        if "error" in v:
            rows.append([name, "error", "", "", "", v["error"][:60]])
            continue
        above = v.get("peak_above_weights_bytes")
        rows.append([name, f"{v['tokens_per_s']:,.0f}",
                     f"{v['vs_best_generate']:.2f}x" if "vs_best_generate" in v else "",
                     f"{v['peak_memory_bytes'] / GiB:.2f} ({above / GiB:.2f})" if v.get("peak_memory_bytes") else "-",
                     f"{v['ms_per_step']:.2f}" if v.get("ms_per_step") else "n/a",
                     f"{v['seconds']:.2f} s, {v['tokens']} tokens" + (f"; {v['warning']}" if "warning" in v else "")])
    head = ["variant", "output tok/s", "vs best generate", "peak GiB (above weights)", "ms/step", "notes"]
    c = report["ceiling"]
    title = (f"{report['model']} on {report['device']} ({report['dtype']}), workload {wname}: {block['prompts']} "
             f"prompts of {block['min_prompt']}-{block['max_prompt']} tokens x {block['new_tokens']} new; "
             f"torch {report['torch']}, transformers {report['transformers']}")
    if Table is None:
        print(title)
        for r in [head] + rows:
            print(" | ".join(r))
    else:
        t = Table(title=title)
        for h in head:
            t.add_column(h)
        for r in rows:
            t.add_row(*r)
        Console(width=160).print(t)
    print(f"ceiling: {c['flops_per_token'] / 1e9:.4g} GFLOP/token at {c['matmul_flops_per_s'] / 1e12:.4g} TFLOP/s = "
          f"{c['tokens_per_s']:,.0f} tokens/s; best measured = {100 * c.get('best_fraction', 0):.1f}% of it")


if __name__ == "__main__":
    raise SystemExit(main())
