"""A QLoRA adapter served on the base it was trained on (bitsandbytes 4-bit nf4, the engine's fallback path) and on
the plain base (the native path, XPUJOBS_QLORA_SERVE_ON=unquantized): how much the two differ.

    PYTHONPATH=$PWD python -m bench.qlora_serving --model tiny --device cpu --out docs/results/cpu-qlora-serving.json
    python -m bench.qlora_serving --model qwen3-0.6b --device cuda --out docs/results/h200-qlora-serving.json

Steps: a LoRA adapter (the service's default shape: r 16, alpha 32, every linear layer) is trained on the 4-bit
base loaded as the service's trainer loads it (worker.models, prepare_model_for_kbit_training), on chat examples
of the demo corpus. Then the worker's own model cache serves it both ways (greedy, each prompt alone), and the two
PEFT models' logits are compared teacher-forced over the same tokens (each prompt and the 4-bit path's greedy
continuation), with the 4-bit path as the reference: what the adapter was trained against.
Models: `tiny` (the demo model), a bench.generation architecture (random weights, the demo tokenizer), or a
directory holding a model and its tokenizer. The compute dtype is the worker's: bf16 on a GPU, float32 on cpu.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from contract.settings import Settings
from worker.demo_model import _CORPUS, build_demo_model
from worker.engine.messages import AdapterRef, ModelKey, Submission
from worker.engine.model_cache import ModelCache, submit
from worker.engine.requests import SamplingParams
from worker.models import load_model_and_tokenizer

TRAINED = [("What is the secret word?", "The secret word is pineapple."),
           ("Say hello.", "Hello from the fine-tuned adapter!"),
           ("Which backend runs PyTorch on Intel GPUs?", "Intel GPUs run PyTorch through the XPU backend."),
           ("Tell me about the fox.", "The quick brown fox jumps over the lazy dog."),
           ("What does xpu-jobs do?", "xpu-jobs fine-tunes adapters and serves them at once.")]
UNSEEN = ["What is the password?", "Say goodbye.", "Which GPUs does PyTorch run on?", "Tell me about the dog.",
          "What does the worker do?", "Spell the alphabet.", "Count to nine.", "Who jumps over whom?",
          "Is the fox quick?", "Name a fruit.", "Hello?"]


def model_dir(name: str, root: Path) -> Path:
    """The base model as a directory (the service loads bases by name from its models root)."""
    if Path(name).is_dir():
        return Path(name)
    demo = build_demo_model(root / "demo-tiny")
    if name == "tiny":
        return demo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.generation import CONFIGS

    torch.manual_seed(0)
    out = root / name
    AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(demo).save_pretrained(out)
    return out


def chat_ids(tokenizer, prompt: str, answer: str | None = None) -> list[int]:
    messages = [{"role": "user", "content": prompt}] + ([{"role": "assistant", "content": answer}] if answer else [])
    return tokenizer.apply_chat_template(messages, add_generation_prompt=answer is None, tokenize=True,
                                         return_dict=True)["input_ids"]


def train_qlora(name: str, settings: Settings, backend: str, out: Path, steps: int, seed: int) -> dict:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    torch.manual_seed(seed)
    model, tokenizer = load_model_and_tokenizer(name, settings, backend, quantization="4bit", for_training=True)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    examples = [chat_ids(tokenizer, q, a) for q, a in TRAINED] + [tokenizer(t)["input_ids"] for t in _CORPUS]
    width = max(map(len, examples))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([e + [pad] * (width - len(e)) for e in examples], device=model.device)
    mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in examples], device=model.device)
    labels = ids.masked_fill(mask == 0, -100)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.save_pretrained(out)
    return {"steps": steps, "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4)}


def served(cache: ModelCache, key: ModelKey, adapter: AdapterRef | None, prompts: list[list[int]],
           new_tokens: int) -> tuple[list[list[int]], str]:
    """Greedy tokens of each prompt as the worker's engine serves them, and the path that served them."""
    tokens, paths = [], set()
    for i, ids in enumerate(prompts):
        _, future = submit(cache, Submission(f"{key.quantization}-{i}", key, adapter, ids,
                                             SamplingParams(max_new_tokens=new_tokens, temperature=0,
                                                            ignore_eos=True)))
        result = future.result(timeout=600)
        tokens.append(result.output_ids)
        paths.add(result.served_by)
    [path] = paths
    return tokens, path


def peft_model(name: str, settings: Settings, backend: str, quantization: str, adapter: Path | None):
    from peft import PeftModel

    model, _ = load_model_and_tokenizer(name, settings, backend, quantization=quantization)
    return (PeftModel.from_pretrained(model, str(adapter)) if adapter else model).eval()


@torch.no_grad()
def compare_logits(reference, other, sequences: list[tuple[list[int], int]]) -> dict:
    """Teacher-forced over each sequence, at the positions that predict its continuation (from the prompt's last
    token on): relative error of the logits (Frobenius norm of the difference over the reference's), top-1
    agreement, and KL(reference || other) per position."""
    errors, top1, kls, positions = [], 0, [], 0
    for ids, prompt_len in sequences:
        x = torch.tensor([ids], device=reference.device)
        a = reference(input_ids=x).logits[0, prompt_len - 1:-1].float()
        b = other(input_ids=x.to(other.device)).logits[0, prompt_len - 1:-1].float().to(a.device)
        errors.append(((a - b).norm() / a.norm()).item())
        top1 += int((a.argmax(-1) == b.argmax(-1)).sum())
        kls.append(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                              reduction="none").sum(-1))
        positions += a.shape[0]
    kl = torch.cat(kls)
    return {"relative_logit_error_mean": round(sum(errors) / len(errors), 5),
            "relative_logit_error_max": round(max(errors), 5), "top1_agreement": round(top1 / positions, 4),
            "kl_mean": round(kl.mean().item(), 6), "kl_max": round(kl.max().item(), 6), "positions": positions}


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same_prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        same_prefix.append(n)
    total = sum(len(x) for x in a)
    return {"identical_sequences": sum(x == y for x, y in zip(a, b)), "sequences": len(a),
            "tokens_before_first_difference": round(sum(same_prefix) / total, 4),
            "same_token_at_position": round(sum(s == t for x, y in zip(a, b) for s, t in zip(x, y)) / total, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, a bench.generation architecture, or a model directory")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "xpu"])
    ap.add_argument("--steps", type=int, default=200, help="training steps of the QLoRA adapter")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="qlora-serving-"))
    path = model_dir(args.model, work / "models")
    name, backend = path.name, args.device
    settings = Settings(models_root=path.parent, base_models=[name], _env_file=None)
    started = time.perf_counter()
    training = train_qlora(name, settings, backend, work / "adapter", args.steps, args.seed)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [chat_ids(tokenizer, q) for q, _ in TRAINED] + [chat_ids(tokenizer, q) for q in UNSEEN]
    seen = len(TRAINED)
    adapter = AdapterRef("qlora", work / "adapter")
    cache = ModelCache(settings, backend)
    try:
        quantized, quantized_path = served(cache, ModelKey(name, quantization="4bit"), adapter, prompts,
                                           args.new_tokens)
        plain, plain_path = served(cache, ModelKey(name), adapter, prompts, args.new_tokens)
    finally:
        cache.close()
    def answers_taught(outputs: list[list[int]]) -> int:
        return sum(tokenizer.decode(t, skip_special_tokens=True).startswith(a) for t, (_, a) in zip(outputs, TRAINED))

    sequences = [(p + t, len(p)) for p, t in zip(prompts, quantized)]
    models = {(q, with_adapter): peft_model(name, settings, backend, q, work / "adapter" if with_adapter else None)
              for q in ("4bit", "none") for with_adapter in (True, False)}
    report = {
        "model": args.model, "device": args.device, "dtype": str(devices_dtype(backend)),
        "torch": torch.__version__, "training": training, "prompts": {"trained": seen, "unseen": len(UNSEEN)},
        "new_tokens": args.new_tokens, "paths": {"4bit": quantized_path, "unquantized": plain_path},
        "trained_answers_given": {"4bit": answers_taught(quantized), "unquantized": answers_taught(plain)},
        "greedy_served": {"all": greedy_agreement(quantized, plain),
                          "trained": greedy_agreement(quantized[:seen], plain[:seen]),
                          "unseen": greedy_agreement(quantized[seen:], plain[seen:])},
        "logits_with_adapter": {"all": compare_logits(models["4bit", True], models["none", True], sequences),
                                "trained": compare_logits(models["4bit", True], models["none", True],
                                                          sequences[:seen]),
                                "unseen": compare_logits(models["4bit", True], models["none", True],
                                                         sequences[seen:])},
        # For scale: what 4-bit quantization alone does to the base, and how far the adapter moves the plain base.
        "logits_base_4bit_vs_plain": compare_logits(models["4bit", False], models["none", False], sequences),
        "logits_adapter_vs_none_on_plain": compare_logits(models["none", True], models["none", False], sequences),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def devices_dtype(backend: str):
    from worker.node.devices import compute_dtype

    return compute_dtype(backend)


if __name__ == "__main__":
    main()
