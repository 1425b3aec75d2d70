"""Training throughput: a fine-tuning job's training (the service's trainer, events and checkpoints included) against
a plain HF Trainer + PEFT script on the same model, data, LoRA shape, batch size, steps and seed, and the job with
packing, on examples of very uneven length.

    PYTHONPATH=$PWD python -m bench.training --model small --device cpu --out docs/results/cpu-training.json
    python -m bench.training --model qwen3-0.6b --device cuda --steps 40 --out docs/results/h200-training.json

Models: `tiny` (the demo model), `small` (the demo architecture at hidden 256, 4 layers), or a bench.generation
architecture with random weights (bench/service.py writes it with a word-level tokenizer). The job runs in this
process through worker.training.trainer.train, against an embedded Redis, exactly as its training process does.
Both paths train in the worker's compute dtype (bf16 autocast on a GPU, float32 on cpu), with sdpa attention and
gradient checkpointing off. Tokens are the batches' non-padding tokens; tokens/s is their sum over the timed steps
(all but the first `--warmup`) divided by those steps' time, from the job's metrics events and, for the plain
script, from the same clock (one step's log to the next). The variants run interleaved for `--rounds` rounds and
each one's best round is reported (all rounds are listed), so that load from other processes on the machine
weighs on the ratios as little as it can.
"""

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from worker.node import devices

LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}


def write_model(name: str, root: Path) -> Path:
    from worker.demo_model import build_demo_model

    if name == "tiny":
        return build_demo_model(root / "demo-tiny")
    if name == "small":
        return build_demo_model(root / "demo-small", hidden_size=256, layers=4)
    from bench.service import write_model as write_bench_model

    return write_bench_model(name, root)


def uneven_examples(tokenizer, count: int, longest: int, seed: int) -> list[dict]:
    """Prompt/completion pairs whose lengths are spread log-uniformly from 8 tokens to `longest`: most are short,
    a few long, as real chat data is (a padded batch is as wide as its longest)."""
    rng = random.Random(seed)
    vocab = tokenizer.get_vocab()
    if "<t1>" in vocab:  # bench.service's word-level tokenizer: one token a word
        words = [f"<t{i}>" for i in range(1, 5000)]
    else:
        from worker.demo_model import _CORPUS

        words = " ".join(_CORPUS).split()
    lines = []
    for _ in range(count):
        length = int(round(8 * (longest / 8) ** rng.random()))
        text = [rng.choice(words) for _ in range(max(length // 2, 2))]
        half = len(text) // 2
        lines.append({"prompt": " ".join(text[:half]), "completion": " ".join(text[half:])})
    return lines


def timed_rate(steps: list[tuple[float, int]], warmup: int) -> dict:
    """[(seconds, tokens)] of each step -> tokens/s over the steps after the warmup."""
    timed = steps[warmup:]
    seconds, tokens = sum(s for s, _ in timed), sum(t for _, t in timed)
    return {"tokens_per_second": tokens / seconds, "steps_timed": len(timed), "tokens_timed": tokens,
            "seconds_timed": seconds, "median_step_seconds": statistics.median(s for s, _ in timed)}


def run_plain(model_dir: Path, lines: list[dict], args, backend: str) -> dict:
    """What a user writes without the service: Trainer + PEFT, the chat template, a padding collator."""
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for line in lines:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": line["prompt"]}],
                                               add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template([{"role": "user", "content": line["prompt"]},
                                              {"role": "assistant", "content": line["completion"]}], tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                     "labels": [-100] * len(prompt_ids) + ids[len(prompt_ids):]})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=devices.compute_dtype(backend), use_cache=False,
                                                 attn_implementation="sdpa",
                                                 device_map={"": devices.rank_device(backend)})
    model = get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                             target_modules=LORA["target_modules"], task_type="CAUSAL_LM"))
    clock: list[tuple[float, int]] = []

    class StepClock(TrainerCallback):
        """The job's clock (worker.training.trainer's on_log): time and tokens from one step's log to the next
        (a log reads the loss, which waits for the device)."""

        last: tuple[float, int] | None = None

        def on_log(self, a, state, control, logs=None, **kwargs):
            if "loss" not in (logs or {}):  # the summary at the end of training is no step
                return
            now, seen = time.monotonic(), int(state.num_input_tokens_seen or 0)
            if self.last:
                clock.append((now - self.last[0], seen - self.last[1]))
            self.last = (now, seen)

    training_args = TrainingArguments(
        output_dir=str(args.root / "plain"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=1e-4, seed=1, data_seed=1, logging_steps=1, save_strategy="no", report_to=[],
        bf16=backend != "cpu", use_cpu=backend == "cpu", disable_tqdm=True, remove_unused_columns=False,
        include_num_input_tokens_seen="non_padding")
    Trainer(model=model, args=training_args, train_dataset=rows, callbacks=[StepClock()],
            data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True)).train()
    return timed_rate(clock, max(args.warmup - 1, 0))


def run_job(model_name: str, file_id: str, args, backend: str, settings, store, packing: bool) -> dict:
    from contract import events
    from contract.records import new_id
    from worker.training.trainer import train

    job_id = new_id("ftjob")
    job = {"id": job_id, "tenant": "bench", "status": "running", "model": model_name, "training_file": file_id,
           "validation_file": None, "suffix": None, "seed": 1, "lora": LORA, "quantization": "none",
           "hyperparameters": {"n_epochs": 1, "batch_size": args.batch_size, "learning_rate_multiplier": 1.0,
                               "learning_rate": 1e-4},
           "bf16": None, "attn_implementation": "sdpa", "use_kernels": False, "max_steps": args.steps,
           "checkpoint_steps": args.steps, "checkpoints": [], "gradient_checkpointing": False, "strategy": "ddp",
           "packing": packing}
    store.create("ftjob", job)
    outcome = train(job, store, settings, backend)
    assert outcome["status"] == "succeeded", outcome
    steps = [e["data"] for e in events.read_all(store.redis, job_id) if e["type"] == "metrics"]
    # Each metrics event measures the step since the previous one: the first has no rate (and is warm-up).
    clock = [(1 / s["steps_per_second"], round(s["tokens_per_second"] / s["steps_per_second"]))
             for s in steps if "steps_per_second" in s]
    return timed_rate(clock, max(args.warmup - 1, 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "xpu"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--longest", type=int, default=512, help="tokens of the longest example")
    parser.add_argument("--rounds", type=int, default=2, help="each variant's best round is reported")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.root = Path(tempfile.mkdtemp(prefix="xpujobs-bench-training-"))

    from transformers import AutoTokenizer

    from contract.layout import file_path
    from contract.records import RecordStore
    from contract.redis_conn import durable_client
    from contract.settings import Settings
    from worker.node.redis_server import free_port, start_redis

    model_dir = write_model(args.model, args.root / "models")
    lines = uneven_examples(AutoTokenizer.from_pretrained(model_dir), args.examples, args.longest, seed=0)
    port = free_port()
    redis_server = start_redis(port, args.root / "redis", appendonly=False)
    try:
        settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0", artifact_root=args.root / "artifacts",
                            models_root=args.root / "models", base_models=[model_dir.name])
        store = RecordStore(durable_client(settings))
        data = file_path(settings.artifact_root, "bench", "file-bench")
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("\n".join(json.dumps(line) for line in lines))
        runs = {"plain": [], "job": [], "job_packing": []}
        for _ in range(args.rounds):  # interleaved, so a busy spell on the machine does not fall on one variant
            runs["plain"].append(run_plain(model_dir, lines, args, args.device))
            for packing in (False, True):
                runs["job_packing" if packing else "job"].append(
                    run_job(model_dir.name, "file-bench", args, args.device, settings, store, packing=packing))
        results = {name: max(rounds, key=lambda r: r["tokens_per_second"]) | {
            "rounds_tokens_per_second": [r["tokens_per_second"] for r in rounds]} for name, rounds in runs.items()}
    finally:
        redis_server.terminate()
        redis_server.wait(10)
    plain = results["plain"]["tokens_per_second"]
    report = {"model": args.model, "device": args.device, "steps": args.steps, "warmup": args.warmup,
              "rounds": args.rounds,
              "batch_size": args.batch_size, "examples": args.examples, "longest": args.longest, "lora": LORA,
              "results": results,
              "job_vs_plain": results["job"]["tokens_per_second"] / plain,
              "job_packing_vs_plain": results["job_packing"]["tokens_per_second"] / plain}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
