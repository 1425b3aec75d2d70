"""What constrained decoding costs inside the engine's batch: the same batch with no grammar, with one request
under a JSON schema (the rest unconstrained), with every request constrained, with one forced tool call, and with
one request offered tools under tool_choice auto (constrained for its whole length: text is free, a call once begun
must be well-formed).
The question is whether one constrained request slows the others: its mask is applied to its own logits row,
but a step that holds one reads the previous step's tokens before picking (the grammar needs them).

Every request produces exactly --new-tokens tokens (EOS ignored), greedy; the variants run in turn --repeats times
(3) and each one's fastest run counts (the first also warms the grammar cache). Ratios are against the plain batch
of the same run.

    python -m bench.constrained --model tiny --device cpu --out constrained-cpu.json
    python -m bench.constrained --model qwen3-0.6b --device cuda --out constrained-h200.json

Workloads (--workloads): small = 16 requests, prompts of 32-128 tokens, 64 new tokens; wide = 128 requests,
prompts of 32-256 tokens, 128 new tokens (--new-tokens, --prompts override both).

Models: tiny is the demo model with its own small tokenizer (320 tokens); the 0.6B configurations of
bench/generation.py get a 32,000-token byte-level BPE trained here on the Python standard library's sources, so
the grammar works on a vocabulary of a real model's order (random weights, nothing downloaded).

--grammar-libs measures a JSON-schema mask per token with xgrammar and, where installed, llguidance (the
measurement that picked xgrammar; llguidance is not a dependency)."""

from __future__ import annotations

import argparse
import glob
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generation import MODELS, build_model, make_prompts, shipped_engine  # noqa: E402
from worker.engine.requests import GenerationRequest, SamplingParams  # noqa: E402

WORKLOADS = {"small": dict(prompts=16, min_prompt=32, max_prompt=128, new_tokens=64),
             "wide": dict(prompts=128, min_prompt=32, max_prompt=256, new_tokens=128)}
# Free-form strings keep the grammar active for the whole output (the worst case for its cost).
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "tags": {"type": "array",
                                                                                  "items": {"type": "string"}},
                                           "score": {"type": "number"}, "ok": {"type": "boolean"}},
          "required": ["title", "tags", "score", "ok"], "additionalProperties": False}
TOOL = {"type": "tool_calls", "choice": "lookup", "parallel": False,
        "tools": [{"name": "lookup", "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                    "required": ["query"]}}]}
AUTO = {**TOOL, "choice": "auto"}
VARIANTS = ("plain", "one-json", "all-json", "one-tool", "one-auto")


def trained_tokenizer(vocab: int = 32000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))[:1500]
    raw = Tokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|pad|>", "<|end|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<|pad|>", eos_token="<|end|>")


def run(engine, prompts: list[list[int]], new_tokens: int, constrained: set[int], spec: dict) -> dict:
    compiled = engine.grammars().compile(spec) if constrained else None
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                                                         ignore_eos=True),
                              grammar=compiled if i in constrained else None) for i, p in enumerate(prompts)]
    before = dict(engine.stats)
    t0 = time.perf_counter()
    done_at: dict[str, float] = {}
    futures = [engine.submit(r) for r in reqs]
    for r, f in zip(reqs, futures):
        f.add_done_callback(lambda _, rid=r.request_id: done_at.setdefault(rid, time.perf_counter()))
    results = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    assert all(len(r.output_ids) == new_tokens for r in results), [r.error for r in results if r.error]
    free = [i for i in range(len(prompts)) if i not in constrained]
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    return {"wall_s": wall, "tokens_per_s": len(prompts) * new_tokens / wall,
            "unconstrained_done_s": max(done_at[f"r{i}"] for i in free) - t0 if free else None,
            "decode_ms_per_step": 1000 * (engine.stats["decode_seconds"] - before["decode_seconds"]) / max(steps, 1),
            "decode_steps": steps}


def grammar_libs(tokenizer) -> dict:
    """Mask time per token of one JSON-schema output, xgrammar vs llguidance."""
    text = json.dumps({"title": "Intel GPUs run PyTorch", "tags": ["xpu", "import os"], "score": 4.5, "ok": True})
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = {}
    import xgrammar as xgr

    t = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))
    setup = time.perf_counter() - t
    t = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(SCHEMA))
    compile_s = time.perf_counter() - t
    mask = xgr.allocate_token_bitmask(1, len(tokenizer))
    times = []
    for tok in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t)
        matcher.accept_token(tok)
    out["xgrammar"] = _stats(times, setup, compile_s)
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as llt
    except ImportError:
        out["llguidance"] = "not installed"
        return out
    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": True})
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t
    mask = llt.allocate_token_bitmask(1, len(tokenizer))
    times = []
    for tok in ids:
        t = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - t)
        matcher.consume_token(tok)
    out["llguidance"] = _stats(times, setup, compile_s)
    return out


def _stats(times: list[float], setup: float, compile_s: float) -> dict:
    times = sorted(times)
    return {"tokenizer_setup_s": setup, "compile_s": compile_s, "mask_us_p50": 1e6 * times[len(times) // 2],
            "mask_us_max": 1e6 * times[-1], "tokens": len(times)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="tiny")
    ap.add_argument("--device", default="auto", help="cuda, xpu, cpu or auto")
    ap.add_argument("--workloads", default="small,wide")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--grammar-libs", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "xpu" if hasattr(torch, "xpu") and \
            torch.xpu.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, tokenizer = build_model(args.model, device, dtype)
    if tokenizer is None:
        tokenizer = trained_tokenizer()
        tokenizer.save_pretrained(tempfile.mkdtemp(prefix="bench-tok-"))
    report = {"model": args.model, "device": device, "torch": torch.__version__, "vocab": len(tokenizer),
              "logits_width": model.config.vocab_size, "workloads": {}}
    if args.grammar_libs:
        report["grammar_libs"] = grammar_libs(tokenizer)
        print(json.dumps(report["grammar_libs"], indent=1), flush=True)
    engine = shipped_engine(model, tokenizer, device)
    for name in args.workloads.split(","):
        w = dict(WORKLOADS[name])
        if args.prompts:
            w["prompts"] = args.prompts
        if args.new_tokens:
            w["new_tokens"] = args.new_tokens
        prompts = make_prompts(w["prompts"], w["min_prompt"], w["max_prompt"], len(tokenizer))
        block = report["workloads"][name] = {"workload": w}
        variants = args.variants.split(",")
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.repeats):  # interleaved, so a noisy moment does not land on one variant only
            for variant in variants:
                constrained = {"plain": set(), "one-json": {0}, "one-tool": {0}, "one-auto": {0},
                               "all-json": set(range(len(prompts)))}[variant]
                spec = {"one-tool": TOOL, "one-auto": AUTO}.get(variant) or {"type": "json_schema", "schema": SCHEMA,
                                                                              "strict": True}
                runs[variant].append(run(engine, prompts, w["new_tokens"], constrained, spec))
        for variant in variants:
            block[variant] = min(runs[variant], key=lambda r: r["wall_s"])
            print(name, variant, json.dumps(block[variant]), flush=True)
        for variant in variants:
            block[variant]["vs_plain"] = block["plain"]["wall_s"] / block[variant]["wall_s"] if "plain" in block \
                else None
    engine.close()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
