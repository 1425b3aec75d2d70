"""Prefix sharing on CPU (demo model, float32): the same batch shape with a shared 256-token system prompt and
with every prompt starting differently; prefill tokens computed and wall time, after one warm request."""
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.demo_model import build_demo_model
from worker.engine.engine import Engine
from worker.engine.requests import GenerationRequest, SamplingParams

torch.set_num_threads(1)
path = build_demo_model(Path(tempfile.mkdtemp()) / "tiny")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
rng = random.Random(0)
system = [rng.randrange(5, 300) for _ in range(256)]
n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
for name in ("shared", "distinct"):
    prompts = []
    for _ in range(n):
        head = system if name == "shared" else [rng.randrange(5, 300) for _ in range(256)]
        prompts.append(head + [rng.randrange(5, 300) for _ in range(24)])
    with Engine(model, tok, device="cpu", memory_budget_bytes=256 << 20, max_batch_size=64, max_seq_len=512) as eng:
        eng.generate([GenerationRequest("warm", prompts[0], SamplingParams(max_new_tokens=1, temperature=0))])
        before = dict(eng.stats)
        t = time.perf_counter()
        eng.generate([GenerationRequest(str(i), p, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
                      for i, p in enumerate(prompts[1:])])
        secs = time.perf_counter() - t
        print(name, {"requests": n - 1, "seconds": round(secs, 2),
                     "prefill_tokens": eng.stats["prefill_tokens"] - before["prefill_tokens"],
                     "prefix_shared_tokens": eng.stats["prefix_shared_tokens"] - before["prefix_shared_tokens"],
                     "prefill_seconds": round(eng.stats["prefill_seconds"] - before["prefill_seconds"], 2)},
              flush=True)
