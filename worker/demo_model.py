"""A small demo model built locally: random weights and a tokenizer trained on a few sentences.

It lets the walkthrough and the tests run where the Hugging Face Hub is out of reach. It knows no language:
before fine-tuning it answers with noise; after fine-tuning it repeats what it was taught, also when sampled at
temperature 1.0 (see OUTPUT_GAIN).
"""

from pathlib import Path

# Tools and tool calls in the Hermes/Qwen style (`<tool_call>{"name", "arguments"}</tool_call>`), so that training
# data and requests with tools render as they do for the families we serve.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{\"name\": {{ c['function']['name'] | tojson }}, \"arguments\": "
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Intel GPUs run PyTorch through the XPU backend.",
    "xpu-jobs fine-tunes adapters and serves them at once.",
    "What is the secret word? The secret word is pineapple.",
    "Say hello. Hello from the fine-tuned adapter!",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,!?;:'\"()-",
]
# Gain of the final norm. With random embeddings of std 0.02 in 64 dimensions, logits stay within about +-1.3,
# so no token can get much more than 1% of the probability: the loss could not fall below ~4.5 and sampling at
# temperature 1.0 returned noise after any fine-tune. A gain of 20 lets a LoRA adapter reach a loss near zero.
OUTPUT_GAIN = 20.0
# Written to DEMO_MODEL.txt: a directory built by an older version is rebuilt.
VERSION = "demo-tiny 2 (output gain 20, tool-call template)"


def build_demo_model(out_dir: Path, *, hidden_size: int = 64, layers: int = 2, vocab_size: int = 320,
                     seed: int = 0) -> Path:
    """Write a tiny Qwen3-architecture causal LM with a chat template to out_dir. Idempotent."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    marker = out_dir / "DEMO_MODEL.txt"
    if (out_dir / "config.json").exists() and marker.exists() and VERSION in marker.read_text():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    raw = Tokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(_CORPUS * 20, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<|pad|>", eos_token="<|end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(OUTPUT_GAIN)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    marker.write_text("Random weights and a locally trained tokenizer, built by xpu-jobs for demos and tests. "
                      f"Not a real model.\n{VERSION}\n")
    return out_dir
