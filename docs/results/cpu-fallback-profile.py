"""Where the fallback path's time goes per decode step (a Phi-2-shaped model: bench/generation.py's phi2-tiny, float32,
one thread on cpu): each part timed with perf_counter around it, after one warm request. On a GPU the times are the
host's (the device runs behind it, except where a part waits for it).

    PYTHONPATH=$PWD python docs/results/cpu-fallback-profile.py [rows] [new tokens] [device] [bench model] [prefill]
    PYTHONPATH=$PWD python docs/results/cpu-fallback-profile.py 256 128 cuda phi2-0.6b   # bf16 on a GPU

prefill: the engine's prefill_tokens (the fallback's prefill pieces are at most that many padded tokens; the
engine's default when not given).
"""
import random
import sys
import time
from collections import defaultdict

import torch

from worker.engine import fallback
from worker.engine.engine import Engine
from worker.engine.requests import GenerationRequest, SamplingParams

torch.set_num_threads(1)
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 256
new = int(sys.argv[2]) if len(sys.argv) > 2 else 64
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
model_name = sys.argv[4] if len(sys.argv) > 4 else "phi2-tiny"
prefill_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else None
torch.manual_seed(0)
from transformers import AutoModelForCausalLM, PhiConfig  # noqa: E402

# bench/generation.py's phi2-tiny (written out, so the script also runs on a tree before it)
config = PhiConfig(vocab_size=2048, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=4, max_position_embeddings=2048, partial_rotary_factor=0.5,
                   hidden_act="gelu_new", tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                   pad_token_id=None)
if model_name != "phi2-tiny":
    from bench.generation import CONFIGS

    config = CONFIGS[model_name]()
dtype = torch.float32 if device == "cpu" else torch.bfloat16
model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
rng = random.Random(0)
prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(32, 255))] for _ in range(rows)]
spent = defaultdict(float)  # seconds in each part, not counting the timed parts it calls
calls = defaultdict(int)
inner = [0.0]  # seconds of timed parts inside the part running now


def timed(name, fn):
    def run(*a, **kw):
        outer, inner[0] = inner[0], 0.0
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            took = time.perf_counter() - t
            spent[name] += took - inner[0]
            calls[name] += 1
            inner[0] = outer + took
    return run


eng = Engine(model, None, device=device, memory_budget_bytes=4 << 30 if device == "cpu" else None,
             max_batch_size=rows, prefill_tokens=prefill_tokens)
eng.generate([GenerationRequest("warm", prompts[0], SamplingParams(max_new_tokens=4, temperature=0))])
fb = eng.fallback
forward = fb._forward


def split_forward(cache, **kw):
    name = "forward (decode)" if kw["input_ids"].shape[1] == 1 else "forward (prefill)"
    return timed(name, forward)(cache, **kw)


fb._forward = split_forward
fb.step = timed("step() itself (cancels, dropping rows)", fb.step)
fb._decode = timed("_decode itself (row loops, positions, stats)", fb._decode)
if hasattr(fb, "_decode_static"):  # the static batch (cuda/xpu): its step, the replay (or the uncaptured step)
    fb._decode_static = timed("_decode_static itself (row loops, positions, stats)", fb._decode_static)
    fb._run_static = timed("_run_static (graph replay, capture, or the uncaptured step)", fb._run_static)
    for name in ("join", "compact", "release_finished"):
        setattr(fallback._Static, name, timed(f"_Static.{name}", getattr(fallback._Static, name)))
fb._admit = timed("_admit itself (which requests join)", fb._admit)
fb._prefill = timed("_prefill itself (prompts to tensors)", fb._prefill)
eng.accept = timed("engine.accept", eng.accept)
fallback.pick = timed("sampling.pick", fallback.pick)


class Tokens(fallback.HostTokens):
    __init__ = timed("HostTokens(...)", fallback.HostTokens.__init__)
    tokens = timed("HostTokens.tokens", fallback.HostTokens.tokens)


fallback.HostTokens = Tokens
for name in ("merge", "compact", "grow"):
    if hasattr(fallback._Batch, name):
        setattr(fallback._Batch, name, timed(f"_Batch.{name}", getattr(fallback._Batch, name)))
before = dict(eng.stats)
t = time.perf_counter()
res = eng.generate([GenerationRequest(str(i), p, SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))
                    for i, p in enumerate(prompts)])
wall = time.perf_counter() - t
eng.close()
steps = eng.stats["decode_steps"] - before["decode_steps"]
assert sum(len(r.output_ids) for r in res) == rows * new
print(f"{rows} prompts of 32-255 tokens x {new} new tokens on {device}: wall {wall:.2f} s, {steps} decode steps, "
      f"{eng.stats['prefill_calls'] - before['prefill_calls']} prefill calls")
print("| part (not counting the parts below it) | calls | seconds | ms per decode step |\n| --- | ---: | ---: | ---: |")
for k in sorted(spent, key=lambda k: -spent[k]):
    print(f"| {k} | {calls[k]} | {spent[k]:.3f} | {1e3 * spent[k] / steps:.2f} |")
total = sum(spent.values())
print(f"| all of step() | {calls['step() itself (cancels, dropping rows)']} | {total:.3f} | "
      f"{1e3 * total / steps:.2f} |")
