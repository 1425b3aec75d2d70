"""Where the engine's time goes on a device: the shipped engine runs a workload twice (the first run captures its
graphs), the second under torch.profiler; device kernel time is summed per kernel and per kind (matmuls, decode
attention, prefill attention, fused elementwise, LoRA's row mask, cache writes, the rest) and set against the run's
wall time, so a step bound by host time (device idle between kernels) is told apart from one bound by its kernels.

    python -m bench.profile_decode --model qwen3-0.6b --device cuda --adapters 0,4 --out report.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.generation import WORKLOADS, build_model, make_prompts, shipped_engine
from worker.engine.requests import GenerationRequest, SamplingParams

KINDS = [  # first match wins; names as the CUDA/XPU runtime reports them
    ("decode attention", ("_paged_decode",)),
    ("prefill attention", ("flash", "fmha", "attention")),
    ("rmsnorm (fused)", ("_rms_kernel",)),
    ("q/k norm + rope (fused)", ("_norm_rope",)),
    ("silu*up (fused)", ("_silu_mul",)),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90", "sm80", "cublas", "splitk", "matmul")),
    ("cache write (index_copy)", ("index_copy", "indexcopy", "index_put")),
    ("argmax / sampling", ("argmax", "reduce", "sort", "topk", "softmax")),
    ("elementwise (mul/add/copy)", ("elementwise", "vectorized", "copy", "fill", "cat")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def profile_run(eng, prompts, new_tokens, adapters) -> dict:
    from torch.profiler import ProfilerActivity, profile

    def reqs(tag):
        return [GenerationRequest(f"{tag}{i}", p, SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                                                                 ignore_eos=True),
                                  adapter=adapters[i % len(adapters)] if adapters else None)
                for i, p in enumerate(prompts)]

    eng.generate(reqs("warm"))
    before = dict(eng.stats)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if hasattr(ProfilerActivity, "XPU") and hasattr(torch, "xpu") and torch.xpu.is_available():
        acts.append(ProfilerActivity.XPU)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        results = eng.generate(reqs("r"))
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        wall = time.perf_counter() - t
    steps = eng.stats["decode_steps"] - before["decode_steps"]
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if dt is None or "CPU" in str(dt):
            continue
        us = e.device_time if hasattr(e, "device_time") else e.cuda_time
        per_kernel[e.name][0] += us
        per_kernel[e.name][1] += 1
    total_us = sum(v[0] for v in per_kernel.values())
    kinds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for name, (us, n) in per_kernel.items():
        kinds[kind_of(name)] += us
        counts[kind_of(name)] += n
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:30]
    return {
        "wall_seconds": wall, "decode_steps": steps, "tokens": sum(r.completion_tokens for r in results),
        "wall_ms_per_step": wall / max(1, steps) * 1e3,
        "kernel_seconds": total_us / 1e6, "device_busy_fraction": total_us / 1e6 / wall,
        "kernel_launches_per_step": sum(counts.values()) / max(1, steps),
        "mean_decode_batch": (eng.stats["decode_rows"] - before["decode_rows"]) / max(1, steps),
        "by_kind_ms_per_step": {k: kinds[k] / 1e3 / max(1, steps) for k in sorted(kinds, key=lambda k: -kinds[k])},
        "launches_per_step_by_kind": {k: counts[k] / max(1, steps) for k in sorted(counts, key=lambda k: -counts[k])},
        "top_kernels": [{"name": n[:160], "ms_total": us / 1e3, "calls": c, "kind": kind_of(n)} for n, (us, c) in top],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workload", default="current", choices=list(WORKLOADS))
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--adapters", default="0,4", help="comma-separated adapter counts to profile (0: the base)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from bench.generation import Device

    dev = Device(args.device if args.device == "cpu" else f"{args.device}:0")
    if dev.mod:
        dev.mod.set_device(dev.device)
    if dev.backend == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.bfloat16 if dev.backend != "cpu" else torch.float32
    model, tok = build_model(args.model, str(dev.device), dtype)
    w = WORKLOADS[args.workload]
    prompts = make_prompts(args.prompts, w["min_prompt"], w["max_prompt"], model.config.vocab_size)
    report = {"model": args.model, "device": dev.name(), "torch": torch.__version__, "workload": args.workload,
              "prompts": len(prompts), "new_tokens": w["new_tokens"], "runs": {}}
    for n in [int(x) for x in args.adapters.split(",")]:
        names = None
        target = model
        if n:
            from peft import LoraConfig, get_peft_model

            present = {m.rsplit(".", 1)[-1] for m, _ in model.named_modules()}
            targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
            cfg = LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                             target_modules=[t for t in targets if t in present])
            torch.manual_seed(1)
            names = [f"a{i}" for i in range(n)]
            target = get_peft_model(model, cfg, adapter_name=names[0])
            for name in names[1:]:
                target.add_adapter(name, cfg)
            target.eval()
            names = [*names, None]
        eng = shipped_engine(target, tok, str(dev.device))
        try:
            r = profile_run(eng, prompts, w["new_tokens"], names)
            r["path"] = eng.path
            r["kernels"] = eng.stats.get("kernels")
        finally:
            eng.close()
        if n:
            model = target.unload()
        gc.collect()
        report["runs"][f"adapters={n}"] = r
        kernel_ms = r['kernel_seconds'] / max(1, r['decode_steps']) * 1e3
        print(f"== adapters={n}: {r['wall_ms_per_step']:.2f} ms/step wall, kernels {kernel_ms:.2f} "
              f"ms/step, busy {r['device_busy_fraction']:.0%}, {r['kernel_launches_per_step']:.0f} launches/step, "
              f"mean batch {r['mean_decode_batch']:.0f}", flush=True)
        for k, v in r["by_kind_ms_per_step"].items():
            print(f"   {k:28s} {v:7.3f} ms/step  {r['launches_per_step_by_kind'][k]:6.0f} launches/step")
        for t in r["top_kernels"][:12]:
            print(f"   {t['ms_total']:9.1f} ms {t['calls']:7d}x  {t['name'][:100]}")
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
