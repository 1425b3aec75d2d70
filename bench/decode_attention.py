"""The paged decode-attention kernel (worker/engine/triton_kernels.py) alone, at the engine's shapes, for launch
configurations (positions per iteration, warps, pipeline stages): microseconds a call and the KV bytes it reads per
second, on two length spreads (the generation benchmark's current and long workloads, mid-decode).

    python -m bench.decode_attention --device cuda --out report.json
"""

import argparse
import itertools
import json
from pathlib import Path

import torch

from worker.engine.triton_kernels import paged_decode_attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=247)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    hkv, G, D, bs = 8, 2, 128, 16  # Qwen3-0.6B: 8 KV heads, 16 query heads
    report = {"device": torch.cuda.get_device_name(dev), "rows": args.rows, "spreads": {}}
    gen = torch.Generator().manual_seed(0)
    for name, (lo, hi) in {"current (96-575 cached)": (96, 575), "long (80-1756 cached)": (80, 1756)}.items():
        lens = torch.randint(lo, hi + 1, (args.rows,), generator=gen, dtype=torch.int32)
        nb = -(-int(lens.max()) // bs)
        blocks = args.rows * nb + 1
        kc = torch.randn(blocks, bs, hkv, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        tables = torch.randperm(blocks - 1, generator=gen)[:args.rows * nb].view(args.rows, nb).to(dev, torch.int32)
        q = torch.randn(args.rows, hkv, G, D, device=dev, dtype=torch.bfloat16)
        lens_d = lens.to(dev)
        kv_bytes = int(lens.sum()) * hkv * D * 2 * 2
        ref = paged_decode_attention(q, kc, vc, tables, lens_d, D ** -0.5).float()
        rows = []
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
            try:
                def fn(cfg=(block_n, warps, stages), q=q, kc=kc, vc=vc, tables=tables, lens=lens_d):
                    return paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, *cfg)

                out = fn().float()
                err = ((out - ref).norm() / ref.norm()).item()
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(50):
                    fn()
                end.record()
                torch.cuda.synchronize()
                us = start.elapsed_time(end) / 50 * 1e3
                rows.append({"block_n": block_n, "warps": warps, "stages": stages, "us": us,
                             "TB_per_s": kv_bytes / us / 1e6, "rel_err_vs_default": err})
            except Exception as e:  # a configuration that does not compile (shared memory)
                rows.append({"block_n": block_n, "warps": warps, "stages": stages, "error": f"{type(e).__name__}"})
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        default = next(r for r in rows if (r["block_n"], r["warps"], r["stages"]) == (64, 4, 2))
        report["spreads"][name] = {"kv_bytes": kv_bytes, "default": default, "best": ok[:5], "all": rows}
        print(f"{name}: default {default['us']:.1f} us ({default['TB_per_s']:.2f} TB/s); best:")
        for r in ok[:5]:
            print(f"   block_n {r['block_n']:3d} warps {r['warps']} stages {r['stages']}: {r['us']:.1f} us "
                  f"({r['TB_per_s']:.2f} TB/s)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
