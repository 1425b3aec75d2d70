"""A QLoRA adapter (trained on the 4-bit base) is served on the plain base through the native path by default, and
on the 4-bit base (the model's own forward) when the request says quantization "4bit" or the worker's
XPUJOBS_QLORA_SERVE_ON is "quantized"; each answer equals a plain PeftModel on the base it names."""

from pathlib import Path

import pytest
from conftest import wait_for_job
from test_fine_tune_e2e import QUESTION, training_jsonl

from contract.layout import adapter_dir
from contract.settings import Settings
from worker.serving.inference import base_quantization

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def qlora_job(client_a):
    data = client_a.files.create(file=("qlora.jsonl", training_jsonl()), purpose="fine-tune")
    job = client_a.fine_tuning.jobs.create(
        model="demo-tiny", training_file=data.id, seed=11, suffix="qlora",
        hyperparameters={"n_epochs": 20, "batch_size": 8, "learning_rate_multiplier": 10},
        extra_body={"quantization": "4bit", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}})
    job = wait_for_job(client_a, job.id)
    assert job.status == "succeeded", job.error
    return job


def peft_greedy(stack_env, job, prompt: list[int], quantization: str) -> list[int]:
    """The reference: PEFT's own model on the named base (float32 on cpu), greedy, no engine."""
    import torch
    from peft import PeftModel

    from worker.models import load_model_and_tokenizer

    settings = Settings(models_root=Path(stack_env["XPUJOBS_MODELS_ROOT"]), _env_file=None)
    base, _ = load_model_and_tokenizer("demo-tiny", settings, "cpu", quantization=quantization)
    assert base.dtype == torch.float32
    model = PeftModel.from_pretrained(base, adapter_dir(Path(stack_env["XPUJOBS_ARTIFACT_ROOT"]), "tenant-a",
                                                       job.id)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def chat_prompt(stack_env) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(stack_env["XPUJOBS_MODELS_ROOT"]) / "demo-tiny")
    return tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def completion(client, model: str, prompt: list[int], **extra):
    return client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})


def test_a_qlora_model_is_served_natively_unless_the_request_names_its_4bit_base(client_a, qlora_job, stack_env):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(stack_env["XPUJOBS_MODELS_ROOT"]) / "demo-tiny")
    prompt = chat_prompt(stack_env)
    model = qlora_job.fine_tuned_model
    trained_on = completion(client_a, model, prompt, quantization="4bit")
    assert trained_on.system_fingerprint == "xpu-jobs-hf-sdpa-bnb-4bit"  # the fallback path, what it trained on
    assert trained_on.choices[0].text == tokenizer.decode(peft_greedy(stack_env, qlora_job, prompt, "4bit"),
                                                          skip_special_tokens=True)
    plain = completion(client_a, model, prompt)
    assert plain.system_fingerprint.startswith("xpu-jobs-native-")
    expected = peft_greedy(stack_env, qlora_job, prompt, "none")
    assert plain.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert completion(client_a, "demo-tiny", prompt).choices[0].text != plain.choices[0].text  # the adapter acts


def test_qlora_serve_on_unquantized_serves_natively_beside_the_base(qlora_job, stack_env, redis_url, monkeypatch):
    """The worker's side with the setting: prepare() picks the plain base for the QLoRA model, and the engine
    process's model cache serves it on the native path, on the same engine as a request for the base itself."""
    from worker.engine.model_cache import ModelCache, submit
    from worker.engine.requests import Priority
    from worker.node.node import Node
    from worker.serving.inference import prepare

    for name, value in stack_env.items():
        monkeypatch.setenv(name, value)
    node = Node(Settings(qlora_serve_on="unquantized", _env_file=None))
    assert node.settings.redis_url == redis_url
    prompt = chat_prompt(stack_env)
    params = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    submissions = [prepare(node, "qlora", "tenant-a", {"model": qlora_job.fine_tuned_model, **params}, Priority.LIVE),
                   prepare(node, "base", "tenant-a", {"model": "demo-tiny", **params}, Priority.LIVE)]
    assert submissions[0].model == submissions[1].model  # one loaded base, one engine, the adapter chosen per row
    cache = ModelCache(node.settings, node.backend)
    try:
        cache.attach_adapter(cache.get(submissions[0].model), submissions[0].adapter)  # so both start in one step
        futures = [submit(cache, s)[1] for s in submissions]
        qlora, base = [f.result(timeout=180) for f in futures]
    finally:
        cache.close()
    assert qlora.served_by.startswith("xpu-jobs-native-") and base.served_by == qlora.served_by
    assert qlora.output_ids == peft_greedy(stack_env, qlora_job, prompt, "none")
    assert base.output_ids != qlora.output_ids


def test_which_base_a_request_runs_on():
    quantized, unquantized = Settings(qlora_serve_on="quantized", _env_file=None), Settings(_env_file=None)
    assert unquantized.qlora_serve_on == "unquantized"  # the default: the plain base, on the native path
    assert base_quantization({}, "4bit", quantized) == "4bit"
    assert base_quantization({}, "8bit", quantized) == "8bit"
    assert base_quantization({}, "4bit", unquantized) == "none"
    assert base_quantization({"quantization": "none"}, "4bit", quantized) == "none"  # the request's choice wins
    assert base_quantization({"quantization": "4bit"}, "4bit", unquantized) == "4bit"
    assert base_quantization({"quantization": None}, "none", quantized) == "none"  # plain LoRA, or a base model
    assert base_quantization({"quantization": "8bit"}, "none", unquantized) == "8bit"


def test_the_setting_is_checked(monkeypatch):
    from pydantic import ValidationError

    monkeypatch.setenv("XPUJOBS_QLORA_SERVE_ON", "bf16")
    with pytest.raises(ValidationError, match="qlora_serve_on"):
        Settings(_env_file=None)
