"""Generation throughput: plain `generate` vs transformers' continuous batching vs the xpu-jobs engine.

One run, one model, the same prompts and the same output length for every variant (EOS is disabled everywhere,
so each request produces exactly --new-tokens tokens; the script counts what each variant really produced).

    python -m bench.generation --model qwen3-0.6b --device cuda --out results.json
    python -m bench.generation --model tiny --device cpu --prompts 128 --out tiny.json

Variants (run in this order; --variants picks a subset):
  generate-bs32, generate-bs128   plain model.generate, static batches of 32 / 128 in input order, left padding
  generate_batch                  transformers continuous batching (auto_switch_to_flash=False), timed as called
  generate_batch-warm             the same again on its persistent manager (graphs already captured)
  engine-cold                     worker.engine.Engine, first run: includes capturing its graphs
  engine                          the same engine again, warm
  service                         (d) the whole service: one batch job through API, queue, worker (bench/service.py)

The qwen3-0.6b model is Qwen3-0.6B's architecture written out by hand (hidden 1024, 28 layers, 16 heads, 8 KV
heads, head_dim 128, intermediate 3072, vocab 151936, tied embeddings) with random bf16 weights: nothing is
downloaded. The GPU ceiling is FLOPs per token (2 x parameters) over a measured bf16 matrix-product rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine.engine import Engine, GenerationRequest, SamplingParams  # noqa: E402

GiB = 1 << 30


# ---------------------------------------------------------------------------------------------- the model


def qwen3_06b_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu",
                       attention_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


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
            model = AutoModelForCausalLM.from_config(qwen3_06b_config(), dtype=dtype)
    model.eval()
    # No EOS anywhere: every variant must produce exactly --new-tokens tokens per request.
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


def run_generate(ctx, batch_size: int) -> dict:
    from transformers import GenerationConfig

    model, prompts, new = ctx["model"], ctx["prompts"], ctx["new_tokens"]
    dev = ctx["dev"]
    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)

    def batches(ps):
        for i in range(0, len(ps), batch_size):
            chunk = ps[i:i + batch_size]
            L = max(len(p) for p in chunk)
            ids = torch.zeros(len(chunk), L, dtype=torch.long)
            mask = torch.zeros(len(chunk), L, dtype=torch.long)
            for j, p in enumerate(chunk):  # left padding
                ids[j, L - len(p):] = torch.tensor(p)
                mask[j, L - len(p):] = 1
            yield ids.to(dev.device), mask.to(dev.device)

    with torch.no_grad():
        for ids, mask in batches(prompts[:2]):  # warm-up
            model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
                max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0))
        dev.sync()
        dev.reset_peak()
        t = time.perf_counter()
        tokens = steps = 0
        for ids, mask in batches(prompts):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            tokens += (out.shape[1] - ids.shape[1]) * out.shape[0]
            steps += out.shape[1] - ids.shape[1]
        dev.sync()
        secs = time.perf_counter() - t
    return {"tokens": tokens, "seconds": secs, "steps": steps, "peak_memory_bytes": dev.peak(),
            "peak_reserved_bytes": dev.peak_reserved()}


def run_generate_batch(ctx, warm: bool) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, prompts, new, dev = ctx["model"], ctx["prompts"], ctx["new_tokens"], ctx["dev"]
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(auto_switch_to_flash=False)
    with torch.no_grad():
        if warm:
            if not ctx.get("cb_persistent"):
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
           "peak_reserved_bytes": dev.peak_reserved(), "requests_done": len(counts)}
    if errors:
        res["errors"] = errors[:3]
    return res


def release_cb(ctx) -> None:
    """Free the continuous-batching manager (it holds most of the card) before other variants run."""
    if ctx.pop("cb_persistent", False):
        ctx["model"].destroy_cached_continuous_batching_manager()
        gc.collect()
        ctx["dev"].reset_peak()


def _engine(ctx) -> Engine:
    if ctx.get("engine") is None:
        a = ctx["args"]
        max_len = max(len(p) for p in ctx["prompts"]) + ctx["new_tokens"]
        t = time.perf_counter()
        ctx["engine"] = Engine(ctx["model"], ctx["tokenizer"], device=str(ctx["dev"].device),
                               memory_budget_bytes=int(a.engine_memory_gib * GiB), max_batch_size=a.engine_batch,
                               max_seq_len=max_len, kernels=a.engine_kernels)
        ctx["engine_init_seconds"] = time.perf_counter() - t
    return ctx["engine"]


def run_engine(ctx, cold: bool) -> dict:
    prompts, new, dev = ctx["prompts"], ctx["new_tokens"], ctx["dev"]
    dev.sync()
    dev.reset_peak()
    eng = _engine(ctx)
    before = dict(eng.stats)
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    t = time.perf_counter()
    results = eng.generate(reqs)
    dev.sync()
    secs = time.perf_counter() - t
    s = eng.stats
    steps = s["decode_steps"] - before["decode_steps"]
    errors = [r.error for r in results if r.error]
    res = {"tokens": sum(r.completion_tokens for r in results), "seconds": secs, "steps": steps,
           "peak_memory_bytes": dev.peak(), "peak_reserved_bytes": dev.peak_reserved(),
           "engine_memory_peak_bytes": s["peak_memory_bytes"], "engine_budget_bytes": s["budget_bytes"],
           "mean_batch": (s["decode_rows"] - before["decode_rows"]) / max(1, steps),
           "prefill_seconds_host": s["prefill_seconds"] - before["prefill_seconds"],
           "graph_capture_seconds": s["graph_capture_seconds"] - before["graph_capture_seconds"],
           "graphs_captured": s["graphs_captured"] - before["graphs_captured"],
           "engine_stats": {k: v for k, v in s.items() if isinstance(v, (int, float, str, type(None)))}}
    if errors:
        res["errors"] = errors[:3]
    if not cold and dev.backend != "cpu" and eng.path == "native":
        res["decode_step_ms_full_batch_mean_len"] = eng.benchmark_step(eng.num_slots, ctx["mean_len"]) * 1e3
        res["decode_step_ms_full_batch_max_len"] = eng.benchmark_step(eng.num_slots, eng.max_seq_len) * 1e3
    return res


def run_service_variant(ctx) -> dict:
    """(d) the whole service (bench/service.py), with the engine configured as in variant (c)."""
    from bench.service import make_run_service

    a = ctx["args"]
    max_len = max(len(p) for p in ctx["prompts"]) + ctx["new_tokens"]
    run_service = make_run_service(a.model, ctx["dev"].backend, int(a.engine_memory_gib * GiB), a.engine_batch,
                                   max_len)
    if ctx.get("engine") is not None:  # the service's worker needs the device memory this process's engine holds
        ctx.pop("engine").close()
        ctx["dev"].reset_peak()
    return run_service(ctx["prompts"], ctx["new_tokens"])


VARIANTS: dict[str, Callable[[dict], dict]] = {
    "generate-bs32": lambda ctx: run_generate(ctx, 32),
    "generate-bs128": lambda ctx: run_generate(ctx, 128),
    "generate_batch": lambda ctx: run_generate_batch(ctx, warm=False),
    "generate_batch-warm": lambda ctx: run_generate_batch(ctx, warm=True),
    "engine-cold": lambda ctx: run_engine(ctx, cold=True),
    "engine": lambda ctx: run_engine(ctx, cold=False),
    "service": run_service_variant,
}
DEFAULT_VARIANTS = list(VARIANTS)


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
        from worker.engine.triton_kernels import decode_attention

        torch.manual_seed(0)
        q = torch.randn(64, 8, 2, 128, device=device, dtype=torch.bfloat16)
        kc = torch.randn(80, 8, 700, 128, device=device, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.randint(1, 700, (64,), device=device)
        o = decode_attention(q, kc, vc, lens, 128 ** -0.5).float()
        err = 0.0
        for b in range(64):
            L = int(lens[b])
            s = q[b].float() @ kc[b, :, :L].float().transpose(-1, -2) * 128 ** -0.5
            r = torch.softmax(s, -1) @ vc[b, :, :L].float()
            err = max(err, ((o[b] - r).norm() / r.norm()).item())
        out["triton_kernel_bf16_max_rel_err"] = err
    except Exception as e:
        out["triton_kernel_error"] = f"{type(e).__name__}: {e}"
    return out


# ------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "qwen3-0.6b"], default="qwen3-0.6b")
    ap.add_argument("--device", default="auto", help="cuda, xpu, cpu or auto")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=511)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--engine-memory-gib", type=float, default=24.0, help="the engine's KV cache + workspace budget")
    ap.add_argument("--engine-batch", type=int, default=256)
    ap.add_argument("--engine-kernels", default="auto", choices=["auto", "torch", "triton"],
                    help="the engine's decode attention + fused norms: triton (default on cuda/xpu) or torch ops")
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

    import transformers

    report: dict = {"model": args.model, "device": dev.name(), "backend": dev.backend, "dtype": str(dtype),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "python": platform.python_version(), "prompts": args.prompts, "new_tokens": args.new_tokens,
                    "prompt_lengths": [args.min_prompt, args.max_prompt], "argv": sys.argv[1:], "variants": {}}
    if args.check:
        t = time.perf_counter()
        report["check"] = gpu_check(str(dev.device))
        report["check"]["seconds"] = time.perf_counter() - t
        print("check:", json.dumps(report["check"]), flush=True)

    model, tok = build_model(args.model, str(dev.device), dtype)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    prompts = make_prompts(args.prompts, args.min_prompt, args.max_prompt, vocab)
    weights = dev.allocated()
    report.update(parameters=params, weights_bytes=weights)
    gc.collect()
    gc.freeze()  # as the worker does after a model load: no full collection pauses a timed run
    ctx = {"model": model, "tokenizer": tok, "prompts": prompts, "new_tokens": args.new_tokens, "dev": dev,
           "args": args, "mean_len": int(sum(map(len, prompts)) / len(prompts) + args.new_tokens / 2)}

    rate = matmul_rate(dev, dtype)
    flops_per_token = 2 * params
    report["ceiling"] = {"matmul_flops_per_s": rate, "flops_per_token": flops_per_token,
                         "tokens_per_s": rate / flops_per_token}
    print(f"{dev.name()}: {params / 1e6:.4g}M parameters, matmul {rate / 1e12:.4g} TFLOP/s -> ceiling "
          f"{rate / flops_per_token:,.0f} tokens/s", flush=True)

    expected = args.prompts * args.new_tokens
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        print(f"--- {name}", flush=True)
        if not name.startswith("generate_batch"):
            release_cb(ctx)
        try:
            r = VARIANTS[name](ctx)
            r["tokens_per_s"] = r["tokens"] / r["seconds"]
            r["ms_per_step"] = r["seconds"] / r["steps"] * 1e3 if r.get("steps") else None
            r["peak_above_weights_bytes"] = r["peak_memory_bytes"] - weights if r.get("peak_memory_bytes") else None
            if r["tokens"] != expected:
                r["warning"] = f"produced {r['tokens']} tokens, expected {expected}"
        except Exception as e:
            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {e}"}
        report["variants"][name] = r
        print(json.dumps({k: v for k, v in r.items() if k != "engine_stats"}, default=str), flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1, default=str))
    if ctx.get("engine") is not None:
        ctx["engine"].close()

    ok = {k: v for k, v in report["variants"].items() if "tokens_per_s" in v}
    plain = [v["tokens_per_s"] for k, v in ok.items() if k.startswith("generate-bs")]
    best_plain = max(plain) if plain else None
    best = max((v["tokens_per_s"] for v in ok.values()), default=None)
    report["best_plain_generate_tokens_per_s"] = best_plain
    if best:
        report["ceiling"]["best_fraction"] = best / report["ceiling"]["tokens_per_s"]
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    print_table(report, best_plain)
    return 0


def print_table(report: dict, best_plain: float | None) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        Console = Table = None
    rows = []
    for name, v in report["variants"].items():
        if "error" in v:
            rows.append([name, "error", "", "", "", v["error"][:60]])
            continue
        above = v.get("peak_above_weights_bytes")
        rows.append([name, f"{v['tokens_per_s']:,.0f}",
                     f"{v['tokens_per_s'] / best_plain:.2f}x" if best_plain else "",
                     f"{v['peak_memory_bytes'] / GiB:.2f} ({above / GiB:.2f})" if v.get("peak_memory_bytes") else "-",
                     f"{v['ms_per_step']:.2f}" if v.get("ms_per_step") else "n/a",
                     f"{v['seconds']:.2f} s, {v['tokens']} tokens" + (f"; {v['warning']}" if "warning" in v else "")])
    head = ["variant", "output tok/s", "vs best generate", "peak GiB (above weights)", "ms/step", "notes"]
    c = report["ceiling"]
    title = (f"{report['model']} on {report['device']} ({report['dtype']}), {report['prompts']} prompts x "
             f"{report['new_tokens']} new tokens; torch {report['torch']}, transformers {report['transformers']}")
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
