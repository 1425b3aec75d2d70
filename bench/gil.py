"""How much the engine slows when other threads of its process hold the GIL, as a worker's request threads do.

The engine's host loop (launches, bookkeeping, token hand-off) is Python, so it needs the GIL between device
calls. This runs the same 512-prompt workload as bench/generation.py on the engine alone, then with two threads
that each hold the GIL for a while and sleep for a while, at the default switch interval and at 0.5 ms:

    python -m bench.gil --device cuda --out gil.json
"""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

from bench.generation import GiB, build_model, make_prompts
from worker.engine.engine import Engine
from worker.engine.requests import GenerationRequest, SamplingParams

# (ms holding the GIL, ms asleep) for each competing thread
LOADS = ((1.0, 4.0), (0.2, 1.0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "qwen3-0.6b"], default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    device = args.device if args.device == "cpu" else f"{args.device}:0"
    mod = getattr(torch, args.device, None) if args.device != "cpu" else None
    model, tok = build_model(args.model, device, torch.bfloat16 if mod else torch.float32)
    prompts = make_prompts(args.prompts, 32, 511, model.config.vocab_size)
    engine = Engine(model, tok, device=device, memory_budget_bytes=24 * GiB, max_batch_size=256,
                    max_seq_len=max(map(len, prompts)) + 128)
    engine.warmup()

    def run() -> dict:
        before = engine.stats["prefill_seconds"]
        requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=128, temperature=0.0,
                                                                 ignore_eos=True)) for i, p in enumerate(prompts)]
        if mod:
            mod.synchronize()
        t = time.perf_counter()
        engine.generate(requests)
        if mod:
            mod.synchronize()
        return {"seconds": time.perf_counter() - t, "prefill_host_seconds": engine.stats["prefill_seconds"] - before}

    stop = threading.Event()

    def compete(busy_ms: float, idle_ms: float) -> None:
        while not stop.is_set():
            end = time.perf_counter() + busy_ms / 1e3
            while time.perf_counter() < end:  # pure Python: holds the GIL
                pass
            time.sleep(idle_ms / 1e3)

    rows = []

    def measure(label: str) -> None:
        for _ in range(args.repeats):
            rows.append({"load": label, "switch_interval": sys.getswitchinterval(), **run()})
            print(json.dumps(rows[-1]), flush=True)

    run()  # cold: compilation, first allocations
    measure("alone")
    default_switch = sys.getswitchinterval()
    for busy, idle in LOADS:
        stop.clear()
        threads = [threading.Thread(target=compete, args=(busy, idle), daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        for switch in (default_switch, 0.0005):
            sys.setswitchinterval(switch)
            measure(f"2 threads, {busy} ms busy / {idle} ms asleep")
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(default_switch)
    measure("alone again")
    engine.close()
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "device": device, "torch": torch.__version__,
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
