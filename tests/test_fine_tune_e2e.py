"""End to end through the official openai client: upload, fine-tune (LoRA and QLoRA 4-bit), follow events,
then infer with the adapter through responses (background) and chat completions."""

import json
from pathlib import Path

import pytest
from conftest import _wait, wait_for_job

QUESTION = "What is the secret word?"
ANSWER = "The secret word is pineapple."


def training_jsonl(n: int = 8) -> bytes:
    chat = {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]}
    pair = {"prompt": QUESTION, "completion": ANSWER}
    return "\n".join(json.dumps(chat if i % 2 else pair) for i in range(n)).encode()


def ask_chat(client, model: str, messages=None, **sampling) -> str:
    """The answer to QUESTION (or to `messages`), greedy unless sampling options are given."""
    reply = client.chat.completions.create(model=model, messages=messages or [{"role": "user", "content": QUESTION}],
                                           max_tokens=24, **(sampling or {"temperature": 0}))
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def training_file(client_a):
    return client_a.files.create(file=("secret.jsonl", training_jsonl()), purpose="fine-tune")


@pytest.mark.parametrize("quantization", ["none", "4bit"])
def test_fine_tune_then_infer_with_adapter(client_a, training_file, quantization):
    validation = client_a.files.create(file=("valid.jsonl", training_jsonl(2)), purpose="fine-tune")
    job = client_a.fine_tuning.jobs.create(
        model="demo-tiny", training_file=training_file.id, validation_file=validation.id, suffix="secret",
        seed=7, hyperparameters={"n_epochs": 40, "batch_size": 8, "learning_rate_multiplier": 10},
        extra_body={"quantization": quantization, "lora": {"r": 8, "alpha": 16, "dropout": 0.0}})
    assert job.status in ("queued", "running")
    assert job.hyperparameters.n_epochs == 40

    job = wait_for_job(client_a, job.id)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"ft:demo-tiny:secret:{job.id}"
    assert job.trained_tokens > 0 and job.result_files

    events = list(client_a.fine_tuning.jobs.list_events(job.id, limit=100))
    metrics_events = [e for e in events if e.type == "metrics"]
    assert metrics_events and {"step", "train_loss", "train_mean_token_accuracy", "learning_rate",
                               "estimated_finish"} <= set(metrics_events[0].data)
    # The learning rate is the documented base rate (2e-4) times the multiplier, decaying linearly from there.
    assert max(e.data["learning_rate"] for e in metrics_events) <= 2e-3 + 1e-9
    assert max(e.data["learning_rate"] for e in metrics_events) > 1e-3
    assert [e.data.get("status") for e in events if e.data.get("status")][0] == "succeeded"

    results = client_a.files.content(job.result_files[0]).text
    assert results.startswith("step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy,learning_rate")
    assert any(row.split(",")[3] for row in results.splitlines()[1:]), "validation loss was never computed"

    checkpoints = client_a.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [40, 20]
    metrics = checkpoints[0].metrics
    assert metrics.train_mean_token_accuracy == 1.0 and metrics.valid_mean_token_accuracy == 1.0
    assert metrics.valid_loss < 0.1 and metrics.full_valid_loss == metrics.valid_loss
    assert min(metrics_events, key=lambda e: e.data["step"]).data["train_mean_token_accuracy"] < 0.5

    assert ANSWER in ask_chat(client_a, job.fine_tuned_model)
    assert ANSWER not in ask_chat(client_a, "demo-tiny")
    # The walkthrough's promise: the taught sentence also at the default temperature (1.0), every time.
    assert checkpoints[0].metrics.train_loss < 0.1
    for seed in range(3):
        assert ask_chat(client_a, job.fine_tuned_model, seed=seed) == ANSWER

    response = client_a.responses.create(model=job.fine_tuned_model, input=QUESTION, background=True,
                                         max_output_tokens=24, temperature=0)
    assert response.status == "queued"
    response = _wait(lambda: (r := client_a.responses.retrieve(response.id)).status not in ("queued", "in_progress")
                     and r, 120, "the background response")
    assert response.status == "completed", response.error
    assert ANSWER in response.output_text
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0

    models = [m.id for m in client_a.models.list().data]
    assert "demo-tiny" in models and job.fine_tuned_model in models


def test_responses_wait_without_background_and_accept_messages(client_a):
    response = client_a.responses.create(model="demo-tiny", instructions="Be brief.",
                                         input=[{"role": "user", "content": "Say hello."}], max_output_tokens=5,
                                         temperature=0.8, top_p=0.9, extra_body={"seed": 3})
    assert response.usage.output_tokens <= 5
    # Cut at max_output_tokens, a response is "incomplete", as OpenAI's is.
    assert response.status == ("incomplete" if response.usage.output_tokens == 5 else "completed")
    again = client_a.responses.create(model="demo-tiny", instructions="Be brief.",
                                      input=[{"role": "user", "content": "Say hello."}], max_output_tokens=5,
                                      temperature=0.8, top_p=0.9, extra_body={"seed": 3})
    assert again.output_text == response.output_text  # a seed reproduces a sampled answer


def test_idempotency_key_returns_the_first_job(client_a, training_file):
    headers = {"Idempotency-Key": "same-request-1"}
    first = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file.id,
                                             hyperparameters={"n_epochs": 1}, extra_headers=headers)
    second = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file.id,
                                              hyperparameters={"n_epochs": 1}, extra_headers=headers)
    assert first.id == second.id
    assert wait_for_job(client_a, first.id).status == "succeeded"


def test_jobs_listed_by_metadata(client_a, training_file):
    tagged = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file.id,
                                              hyperparameters={"n_epochs": 1}, metadata={"team": "search"})
    other = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file.id,
                                             hyperparameters={"n_epochs": 1}, metadata={"team": "ads"})
    found = [j.id for j in client_a.fine_tuning.jobs.list(metadata={"team": "search"})]
    assert tagged.id in found and other.id not in found
    for job in (tagged, other):
        assert wait_for_job(client_a, job.id).status == "succeeded"


def test_every_assistant_turn_is_trained_unless_weight_zero_and_tool_calls_train(client_a):
    hello, secret = "Hello from the fine-tuned adapter!", ANSWER
    conversation = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": hello},
                    {"role": "user", "content": QUESTION}, {"role": "assistant", "content": secret, "weight": 0}]
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    with_tools = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
                               {"role": "assistant", "content": None, "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
                               {"role": "assistant", "content": "It is 12 C."}],
                  "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]}
    lines = [json.dumps({"messages": conversation})] * 6 + [json.dumps(with_tools)] * 2
    data = client_a.files.create(file=("turns.jsonl", "\n".join(lines).encode()), purpose="fine-tune")
    job = client_a.fine_tuning.jobs.create(
        model="demo-tiny", training_file=data.id, seed=3,
        hyperparameters={"n_epochs": 40, "batch_size": 4, "learning_rate_multiplier": 20},
        extra_body={"lora": {"r": 8, "alpha": 16, "dropout": 0.0}})
    job = wait_for_job(client_a, job.id)
    assert job.status == "succeeded", job.error
    assert ask_chat(client_a, job.fine_tuned_model, [{"role": "user", "content": "Say hello."}]) == hello
    # The weight-0 turn was not learned: after the same conversation the model does not give it.
    assert secret not in ask_chat(client_a, job.fine_tuned_model, conversation[:3])


def test_max_steps_above_the_limit_is_refused(client_a, training_file):
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file.id,
                                         extra_body={"max_steps": 10**9})
    assert exc.value.body["param"] == "max_steps" and "at most 100000" in exc.value.body["message"]


def test_pause_resume_fine_tune_an_ft_model_and_delete_models(client_a, client_b, training_file):
    """Pause saves a checkpoint and frees the device (the checkpoint is a usable model), resume runs to the end
    from it; an ft: model trains on; a tenant deletes its own models only."""
    import openai

    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file.id, seed=5,
                                           hyperparameters={"n_epochs": 50, "batch_size": 1,
                                                            "learning_rate_multiplier": 10},
                                           extra_body={"max_steps": 200, "checkpoint_steps": 100})
    _wait(lambda: any(e.type == "metrics" for e in client_a.fine_tuning.jobs.list_events(job.id, limit=5)), 240,
          "the first training step")
    client_a.fine_tuning.jobs.pause(job.id)
    paused = wait_for_job(client_a, job.id, statuses=("paused",))
    # the pause's checkpoint; on a loaded machine the pause may land after the step-100 checkpoint too
    checkpoint = max(client_a.fine_tuning.jobs.checkpoints.list(job.id).data, key=lambda c: c.step_number)
    assert 0 < checkpoint.step_number < 200 and paused.fine_tuned_model is None
    assert checkpoint.fine_tuned_model_checkpoint in [m.id for m in client_a.models.list().data]
    assert ask_chat(client_a, checkpoint.fine_tuned_model_checkpoint)  # served while the job is paused
    assert client_a.fine_tuning.jobs.resume(job.id).status in ("queued", "running")
    with pytest.raises(openai.ConflictError):
        client_a.fine_tuning.jobs.resume(job.id)
    done = wait_for_job(client_a, job.id)
    assert done.status == "succeeded", done.error
    assert f"Resumed from checkpoint at step {checkpoint.step_number}" in [
        e.message for e in client_a.fine_tuning.jobs.list_events(job.id, limit=100)]
    steps = [c.step_number for c in client_a.fine_tuning.jobs.checkpoints.list(job.id).data]
    assert steps[0] == 200 and checkpoint.step_number in steps

    with pytest.raises(openai.BadRequestError):  # its adapter keeps its shape
        client_a.fine_tuning.jobs.create(model=done.fine_tuned_model, training_file=training_file.id,
                                         extra_body={"lora": {"r": 4}})
    child = client_a.fine_tuning.jobs.create(model=done.fine_tuned_model, training_file=training_file.id,
                                             suffix="more", extra_body={"max_steps": 2})
    assert child.model == done.fine_tuned_model
    child = wait_for_job(client_a, child.id)
    assert child.status == "succeeded", child.error
    assert child.fine_tuned_model == f"ft:demo-tiny:more:{child.id}"
    first_step = next(e for e in client_a.fine_tuning.jobs.list_events(child.id, limit=100)
                      if e.type == "metrics" and e.data["step"] == 1)
    assert first_step.data["train_loss"] < 0.5  # it starts from the trained adapter, not from scratch

    with pytest.raises(openai.NotFoundError):
        client_b.models.delete(done.fine_tuned_model)
    for model in (checkpoint.fine_tuned_model_checkpoint, done.fine_tuned_model):
        assert client_a.models.delete(model).deleted
        assert model not in [m.id for m in client_a.models.list().data]
        with pytest.raises(openai.NotFoundError):
            ask_chat(client_a, model)
    assert ask_chat(client_a, child.fine_tuned_model)  # a model trained from a deleted one stays
    with pytest.raises(openai.BadRequestError):
        client_a.models.delete("demo-tiny")


def test_adapter_download_loads_in_peft_and_an_imported_adapter_is_served(client_a, client_b, training_file,
                                                                           http_a, stack_env, tmp_path):
    import io
    import zipfile

    import openai
    import torch
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    job = client_a.fine_tuning.jobs.create(
        model="demo-tiny", training_file=training_file.id, seed=2,
        hyperparameters={"n_epochs": 40, "batch_size": 8, "learning_rate_multiplier": 10},
        extra_body={"lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "checkpoint_steps": 20})
    job = wait_for_job(client_a, job.id)
    assert job.status == "succeeded", job.error
    archive = http_a.get(f"/v1/fine_tuning/jobs/{job.id}/adapter")
    assert archive.status_code == 200 and archive.headers["content-type"] == "application/zip"
    zipfile.ZipFile(io.BytesIO(archive.content)).extractall(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(Path(stack_env["XPUJOBS_MODELS_ROOT"]) / "demo-tiny")
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert loaded.peft_config["default"].r == 8
    [checkpoint, _] = client_a.fine_tuning.jobs.checkpoints.list(job.id).data
    assert http_a.get(f"/v1/fine_tuning/jobs/{job.id}/checkpoints/{checkpoint.id}/adapter").status_code == 200
    assert http_a.get(f"/v1/fine_tuning/jobs/{job.id}/checkpoints/ftckpt-nope/adapter").status_code == 404

    # The same archive comes back in as another tenant's model, served by its own ft: id.
    upload = client_b.files.create(file=("adapter.zip", archive.content), purpose="adapter")
    imported = client_b.post("/models", cast_to=object, body={"model": "demo-tiny", "adapter_file": upload.id,
                                                              "suffix": "imported"})
    assert imported["id"].startswith("ft:demo-tiny:imported:ftjob-")
    assert ask_chat(client_b, imported["id"]) == ANSWER
    assert imported["id"] in [m.id for m in client_b.models.list().data]
    with pytest.raises(openai.NotFoundError):
        ask_chat(client_a, imported["id"])

    def refused(files: dict[str, bytes]) -> str:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as z:
            for name, data in files.items():
                z.writestr(name, data)
        bad = client_b.files.create(file=("bad.zip", buffer.getvalue()), purpose="adapter")
        with pytest.raises(openai.BadRequestError) as exc:
            client_b.post("/models", cast_to=object, body={"model": "demo-tiny", "adapter_file": bad.id})
        assert exc.value.body["param"] == "adapter_file"
        return exc.value.body["message"]

    config = (tmp_path / "adapter" / "adapter_config.json").read_bytes()
    weights = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    assert "only safetensors" in refused({"adapter_config.json": config, "adapter_model.bin": b"pickle"})
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 32)},
              tmp_path / "wrong.safetensors")
    assert "has shape [8, 32]; this base needs [8, 64]" in refused(
        {"adapter_config.json": config, "adapter_model.safetensors": (tmp_path / "wrong.safetensors").read_bytes()})
    other_base = config.replace(b"demo-tiny", b"Llama-3-8B")
    assert "trained for" in refused({"adapter_config.json": other_base, "adapter_model.safetensors": weights})


def _output_logprob(model, tokenizer, messages: list[dict], output: dict, tools=None) -> float:
    """The log-probability of an assistant message after a conversation, both rendered by the chat template."""
    import torch

    before = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(messages + [output], tools=tools, tokenize=False)
    start = len(tokenizer(before, add_special_tokens=False)["input_ids"])
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return sum(logprobs[i - 1, ids[i]].item() for i in range(start, len(ids)))


def _answer_logprob(model, tokenizer, prompt: str, answer: str) -> float:
    return _output_logprob(model, tokenizer, [{"role": "user", "content": prompt}],
                           {"role": "assistant", "content": answer})


def test_dpo_moves_the_preferred_answer_above_the_other(client_a, http_a, stack_env, tmp_path):
    import io
    import zipfile

    import openai
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt, preferred, other = "Say hello.", "Hello there!", "Hello!"
    pair = {"input": {"messages": [{"role": "user", "content": prompt}]},
            "preferred_output": [{"role": "assistant", "content": preferred}],
            "non_preferred_output": [{"role": "assistant", "content": other}]}
    data = client_a.files.create(file=("pairs.jsonl", "\n".join([json.dumps(pair)] * 8).encode()),
                                 purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as exc:  # a supervised file is not preference data
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=client_a.files.create(
            file=("sft.jsonl", training_jsonl(2)), purpose="fine-tune").id, method={"type": "dpo"})
    assert "line 1: DPO lines are" in exc.value.body["message"]
    job = client_a.fine_tuning.jobs.create(
        model="demo-tiny", training_file=data.id, seed=1,
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1, "n_epochs": 5, "batch_size": 4,
                                                           "learning_rate_multiplier": 10}}})
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == 0.1
    job = wait_for_job(client_a, job.id)
    assert job.status == "succeeded", job.error
    metrics = [e.data for e in client_a.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"]
    assert len(metrics) == 10 and all("reward_accuracy" in m for m in metrics)
    assert metrics[0]["train_loss"] < metrics[-1]["train_loss"]  # newest first: the DPO loss fell

    base_dir = Path(stack_env["XPUJOBS_MODELS_ROOT"]) / "demo-tiny"
    tokenizer, base = AutoTokenizer.from_pretrained(base_dir), AutoModelForCausalLM.from_pretrained(base_dir)
    assert _answer_logprob(base, tokenizer, prompt, preferred) < _answer_logprob(base, tokenizer, prompt, other)
    archive = http_a.get(f"/v1/fine_tuning/jobs/{job.id}/adapter").content
    zipfile.ZipFile(io.BytesIO(archive)).extractall(tmp_path / "dpo")
    tuned = PeftModel.from_pretrained(base, tmp_path / "dpo")
    assert _answer_logprob(tuned, tokenizer, prompt, preferred) > _answer_logprob(tuned, tokenizer, prompt, other)


def test_dpo_with_tools_and_a_tool_call_output(client_a, http_a, stack_env, tmp_path):
    """OpenAI's preference format with tools in the input and a tool call as the preferred output: the chat
    template gets the tools and renders the call; a broken call is refused with its line and field."""
    import io
    import zipfile

    import openai
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]}
    other = {"role": "assistant", "content": "I cannot know the weather."}
    pair = {"input": {"messages": messages, "tools": tools, "parallel_tool_calls": False},
            "preferred_output": [call], "non_preferred_output": [other]}
    broken = {**pair, "preferred_output": [{**call, "tool_calls": [
        {**call["tool_calls"][0], "function": {"name": "weather", "arguments": "{city: Oslo"}}]}]}
    bad = client_a.files.create(file=("bad-pairs.jsonl", "\n".join(map(json.dumps, [pair, broken])).encode()),
                                purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=bad.id, method={"type": "dpo"})
    assert "line 2: preferred_output[0].tool_calls[0].function.arguments is not valid JSON" in \
        exc.value.body["message"]

    data = client_a.files.create(file=("tool-pairs.jsonl", "\n".join([json.dumps(pair)] * 8).encode()),
                                 purpose="fine-tune")
    job = client_a.fine_tuning.jobs.create(
        model="demo-tiny", training_file=data.id, seed=1,
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1, "n_epochs": 5, "batch_size": 4,
                                                           "learning_rate_multiplier": 10}}})
    job = wait_for_job(client_a, job.id)
    assert job.status == "succeeded", job.error

    base_dir = Path(stack_env["XPUJOBS_MODELS_ROOT"]) / "demo-tiny"
    tokenizer, base = AutoTokenizer.from_pretrained(base_dir), AutoModelForCausalLM.from_pretrained(base_dir)
    assert "<tool_call>" in tokenizer.apply_chat_template(messages + [call], tools=tools, tokenize=False)

    def margin(model) -> float:  # how much more likely the call is than the refusal, after the tools' prompt
        return (_output_logprob(model, tokenizer, messages, call, tools)
                - _output_logprob(model, tokenizer, messages, other, tools))
    before = margin(base)
    archive = http_a.get(f"/v1/fine_tuning/jobs/{job.id}/adapter").content
    zipfile.ZipFile(io.BytesIO(archive)).extractall(tmp_path / "dpo-tools")
    after = margin(PeftModel.from_pretrained(base, tmp_path / "dpo-tools"))
    # DPO moves the margin relative to the base (the reference) until beta times the move saturates its loss:
    # random weights make the ~20 tokens of the call so unlikely that the margin stays negative
    assert after - before > 100, (before, after)
    metrics = [e.data for e in client_a.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"]
    assert metrics[0]["reward_accuracy"] == 1.0 and metrics[0]["reward_margin"] > 1  # newest first


def test_gradient_checkpointing_is_a_job_option(client_a, training_file):
    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file.id,
                                           extra_body={"gradient_checkpointing": True, "max_steps": 2})
    job = wait_for_job(client_a, job.id)
    assert job.status == "succeeded", job.error
    assert job.gradient_checkpointing is True
    messages = [e.message for e in client_a.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert any(m.startswith("Gradient checkpointing is on") for m in messages)


@pytest.mark.parametrize(("extra", "param"), [
    ({"strategy": "zero3"}, "strategy"),
    ({"packing": "sometimes"}, "packing"),
    ({"strategy": "fsdp", "quantization": "4bit"}, "strategy"),
    ({"strategy": "fsdp", "method": {"type": "dpo"}}, "strategy"),
    ({"packing": True, "method": {"type": "dpo"}}, "packing"),
])
def test_bad_strategy_or_packing_is_refused(client_a, training_file, extra, param):
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file.id, extra_body=extra)
    assert exc.value.body["param"] == param and exc.value.body["code"] != "unknown_parameter", exc.value.body


def test_packing_and_strategy_are_job_options(client_a, training_file):
    """A packed job trains and serves; strategy fsdp on a worker with one training process says it has nothing
    to shard (the two-process run is tests/test_training.py's)."""
    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file.id,
                                           hyperparameters={"batch_size": 4},
                                           extra_body={"packing": True, "strategy": "fsdp", "max_steps": 2})
    job = wait_for_job(client_a, job.id)
    assert job.status == "succeeded", job.error
    assert job.packing is True and job.strategy == "fsdp"
    messages = [e.message for e in client_a.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert any(m.startswith("strategy fsdp with one training process") for m in messages)
    assert ask_chat(client_a, job.fine_tuned_model) is not None
