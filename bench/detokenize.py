"""Host time the engine thread spends on output text per decode step, for rows with a stop string: the whole output
decoded again at every token (the engine before worker/engine/detokenizer.py) against the incremental
detokenizer, for a batch of rows whose outputs grow to --new-tokens. Both search each stop string where it can
end. The engine overlaps host work with the device's next step, so what exceeds a step's device time (5.35 ms for
256 rows of Qwen3-0.6B on an H200, docs/benchmarks.md) is added to every step.

    python -m bench.detokenize --rows 256 --new-tokens 128,512,1024 --out detokenize.json

Tokenizers: the demo model's byte-level BPE (worker/demo_model.py) and bench/service.py's word-level tokenizer over
Qwen3's vocabulary (the GPU benchmarks' model). The outputs are real text for the first (a sentence corpus,
tokenized) and random token ids for the second; --rows outputs, each from its own offset.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from worker.engine.detokenizer import IncrementalDetokenizer

STOP = "<never written>"


def whole_decode_per_token(tokenizer, outputs: list[list[int]]) -> float:
    """Seconds for every row's every token: decode the output so far, search the stop string."""
    t = time.perf_counter()
    for n in range(1, len(outputs[0]) + 1):
        for out in outputs:
            tokenizer.decode(out[:n], skip_special_tokens=True).find(STOP)
    return time.perf_counter() - t


def incremental_per_token(tokenizer, outputs: list[list[int]]) -> float:
    rows = [IncrementalDetokenizer(tokenizer) for _ in outputs]
    t = time.perf_counter()
    for n in range(1, len(outputs[0]) + 1):
        for out, detok in zip(outputs, rows):
            searched = len(detok.text)
            if detok.update(out[:n]):
                detok.text.find(STOP, max(0, searched - len(STOP) + 1))
    return time.perf_counter() - t


def tokenizers(root: Path) -> dict:
    from transformers import AutoTokenizer

    from bench.service import write_model
    from worker.demo_model import build_demo_model

    return {"demo byte-level BPE": AutoTokenizer.from_pretrained(build_demo_model(root / "demo")),
            "word-level, Qwen3 vocabulary": AutoTokenizer.from_pretrained(write_model("qwen3-0.6b", root))}


def outputs_for(tokenizer, name: str, rows: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    if name.startswith("demo"):
        from worker.demo_model import _CORPUS

        text = tokenizer.encode(" ".join(_CORPUS[:5]) * (length // 8 + 2), add_special_tokens=False)
        return [text[(o := rng.randrange(len(text) - length)):o + length] for _ in range(rows)]
    return [[rng.randrange(len(tokenizer) - 8) for _ in range(length)] for _ in range(rows)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--new-tokens", default="128,512,1024")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    report = {"rows": args.rows, "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tokenizer in tokenizers(Path(tmp)).items():
            for length in [int(n) for n in args.new_tokens.split(",")]:
                outputs = outputs_for(tokenizer, name, args.rows, length)
                whole = whole_decode_per_token(tokenizer, outputs)
                incremental = incremental_per_token(tokenizer, outputs)
                row = {"tokenizer": name, "new_tokens": length,
                       "whole_decode_ms_per_step": whole / length * 1e3,
                       "incremental_ms_per_step": incremental / length * 1e3, "speedup": whole / incremental}
                report["results"].append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
