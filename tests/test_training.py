"""Pieces of the training process on their own."""

import time
from pathlib import Path

import pytest

from contract.training_data import example
from worker.demo_model import build_demo_model
from worker.training.trainer import _resume_point, _step_limit, rotate_checkpoints, tokenize_examples


def test_resume_skips_a_checkpoint_cut_short(tmp_path):
    """A worker killed while saving leaves a partial checkpoint that the record never listed: the retry resumes
    from the newest listed one and removes the partial one."""
    out = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        (out / f"checkpoint-{step}").mkdir(parents=True)
    job = {"checkpoints": [{"step_number": 5}, {"step_number": 10}]}
    assert _resume_point(job, out) == str(out / "checkpoint-10")
    assert not (out / "checkpoint-15").exists()
    assert _resume_point({"checkpoints": []}, tmp_path / "none") is None


@pytest.fixture
def db9(redis_url):
    """A database apart from the running stack's (its registry would route work to a fake node)."""
    import redis

    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/9", decode_responses=True)
    yield client
    client.flushdb()


def test_checkpoints_rotate_keeping_the_newest_and_those_loaded_as_models(db9, tmp_path):
    from contract import registry
    from contract.records import RecordStore, new_id
    from contract.settings import Settings

    store, job_id, out = RecordStore(db9), new_id("ftjob"), tmp_path / "checkpoints"
    store.create("ftjob", {"id": job_id, "tenant": "t", "created_at": 0,
                           "checkpoints": [{"step_number": s} for s in (1, 2, 3, 4, 5)]})
    for step in (1, 2, 3, 4, 5):
        (out / f"checkpoint-{step}").mkdir(parents=True)
    registry.register(db9, "serving@host", {"models": [{"adapters": [f"{job_id}-step-2"]}]}, ttl_seconds=30)
    assert rotate_checkpoints(store, Settings(checkpoints_kept=2), {"id": job_id}, out) == [1, 3]
    assert [c["step_number"] for c in store.get("ftjob", job_id)["checkpoints"]] == [2, 4, 5]
    assert sorted(d.name for d in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]


def test_training_steps_are_bounded_by_settings(db9):
    from contract import events
    from contract.records import RecordStore
    from contract.settings import Settings

    store, settings = RecordStore(db9), Settings(max_training_steps=5)
    hp = {"n_epochs": 10, "batch_size": 2}
    assert _step_limit({"id": "j1", "max_steps": 100, "hyperparameters": hp}, store, settings, 8) == 5
    assert _step_limit({"id": "j2", "max_steps": 3, "hyperparameters": hp}, store, settings, 8) == 3
    assert _step_limit({"id": "j3", "hyperparameters": {"n_epochs": 1, "batch_size": 2}}, store, settings, 8) == -1
    assert _step_limit({"id": "j4", "hyperparameters": hp}, store, settings, 8) == 5
    [warning] = events.read_all(db9, "j4")
    assert warning["level"] == "warn" and warning["data"] == {"steps": 40, "max_training_steps": 5}


def _learned(tokenizer, row) -> list[str]:
    """The decoded runs of trained tokens of one row."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        if label != -100:
            current.append(token)
        elif current:
            runs, current = runs + [tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_loss_covers_every_assistant_turn_but_weight_zero(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_demo_model(tmp_path / "tiny"))
    line = {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Say hello."},
                         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again."},
                         {"role": "assistant", "content": "Bad answer.", "weight": 0},
                         {"role": "user", "content": "Once more."},
                         {"role": "assistant", "content": [{"type": "text", "text": "Hello again!"}]}]}
    [row], report = tokenize_examples(tokenizer, [example(line)], 1024)
    assert _learned(tokenizer, row) == ["Hello!<|end|>", "Hello again!<|end|>"]
    assert report == {"truncated": 0, "skipped": 0}
    # The prompt tokens are those of the conversation before each turn, rendered as at inference.
    assert tokenizer.decode(row["input_ids"]).startswith("<|system|>Be kind.<|end|><|user|>Say hello.<|end|>"
                                                         "<|assistant|>Hello!<|end|>")


def test_tool_calls_are_trained_as_the_template_renders_them(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_demo_model(tmp_path / "tiny"))
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
    line = {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
                         {"role": "assistant", "content": "It is 12 C."}],
            "tools": [{"type": "function", "function": {"name": "weather"}}]}
    [row], _ = tokenize_examples(tokenizer, [example(line)], 1024)
    assert _learned(tokenizer, row) == ['<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
                                        '<|end|>', "It is 12 C.<|end|>"]
    assert tokenizer.decode(row["input_ids"]).startswith('<|system|>Tools: {"type": "function"')


def test_dpo_pairs_reach_trl_with_their_tools_and_tool_calls(tmp_path):
    """What TRL's DPOTrainer tokenizes from the job's pairs: the prompt rendered with the line's tools, a tool
    call rendered by the template; a line without tools next to it renders none."""
    import json
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from contract.layout import file_path
    from worker.training.trainer import _preference_rows

    tokenizer = AutoTokenizer.from_pretrained(build_demo_model(tmp_path / "tiny"))
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
    with_tools = {"input": {"messages": [{"role": "user", "content": "Weather?"}],
                            "tools": [{"type": "function", "function": {"name": "weather"}}]},
                  "preferred_output": [{"role": "assistant", "tool_calls": [call]}],
                  "non_preferred_output": [{"role": "assistant", "content": "No idea."}]}
    plain = {"input": {"messages": [{"role": "user", "content": "Hi"}]},
             "preferred_output": [{"role": "assistant", "content": "Hello"}],
             "non_preferred_output": [{"role": "assistant", "content": "Go"}]}
    path = file_path(tmp_path, "t", "file-pairs")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(with_tools) + "\n" + json.dumps(plain))
    rows = _preference_rows({"tenant": "t", "training_file": "file-pairs"}, None,
                            SimpleNamespace(artifact_root=tmp_path), tokenizer, "training_file", 1024)
    args = DPOConfig(output_dir=str(tmp_path / "out"), max_length=1024, use_cpu=True, report_to=[])
    tokenized = DPOTrainer._prepare_dataset(None, rows, tokenizer, args, "train")  # uses no trainer state here
    decoded = [[tokenizer.decode(row[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")] for row in tokenized]
    assert decoded == [
        ['<|system|>Tools: {"type": "function", "function": {"name": "weather"}}<|end|><|user|>Weather?<|end|>'
         '<|assistant|>', '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call><|end|>',
         "No idea.<|end|>"],
        ["<|user|>Hi<|end|><|assistant|>", "Hello<|end|>", "Go<|end|>"]]


def test_examples_longer_than_the_context_are_truncated_or_skipped(tmp_path):
    """Never trained at loss 0: an example with no trained token left after truncation is dropped."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_demo_model(tmp_path / "tiny"))
    long_prompt = {"prompt": "word " * 200, "completion": "Yes."}
    long_answer = {"prompt": "Hi", "completion": "word " * 200}
    rows, report = tokenize_examples(tokenizer, [example(long_prompt), example(long_answer)], 64)
    assert report == {"truncated": 2, "skipped": 1}
    [row] = rows
    assert len(row["input_ids"]) == 64 and any(label != -100 for label in row["labels"])


def _skip_without_two_devices():
    from conftest import TEST_BACKEND

    if TEST_BACKEND != "cpu":
        from worker.node.devices import probe_backend

        if probe_backend(TEST_BACKEND)[1] < 2:  # one process per device: a GPU run needs two of them
            pytest.skip(f"two {TEST_BACKEND} devices are needed; this machine has fewer")


def _two_process_job(stack_env, redis_client, tenant: str, **fields) -> tuple[str, dict, list[dict]]:
    """A job record trained by two processes through torchrun: (job id, outcome, events)."""
    import json
    import subprocess

    from contract import events
    from contract.layout import adapter_dir, file_path, training_outcome_path
    from contract.records import RecordStore, new_id
    from worker.training.fine_tune import training_command

    root = Path(stack_env["XPUJOBS_ARTIFACT_ROOT"])
    job_id, file_id = new_id("ftjob"), new_id("file")
    data = file_path(root, tenant, file_id)
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("\n".join(json.dumps({"prompt": f"Q{i}", "completion": f"A{i}."}) for i in range(8)))
    hyper = {"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 1.0, "learning_rate": 2e-4}
    RecordStore(redis_client).create("ftjob", {
        "id": job_id, "tenant": tenant, "status": "running", "model": "demo-tiny", "training_file": file_id,
        "validation_file": None, "suffix": "two", "seed": 1, "hyperparameters": hyper,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}, "quantization": "none",
        "bf16": None, "attn_implementation": "sdpa", "use_kernels": False, "max_steps": None, "checkpoint_steps": 2,
        "checkpoints": [], **fields})
    command = training_command(job_id, 2)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    result = subprocess.run(command, env={**stack_env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=240)
    outcome = json.loads(training_outcome_path(root, tenant, job_id, None).read_text())
    assert outcome["status"] == "succeeded", result.stderr[-6000:]
    assert result.returncode == 0, result.stderr[-3000:]
    assert (adapter_dir(root, tenant, job_id) / "adapter_model.safetensors").exists()
    return job_id, outcome, events.read_all(redis_client, job_id)


def test_data_parallel_training_with_two_processes(stack_env, redis_client):
    """The guide's multi-process training: torchrun starts one process per device (gloo on CPU here; xccl on
    XPU, nccl on CUDA); the main process reports and saves, all stop together."""
    import os

    from conftest import TEST_BACKEND

    from contract.records import RecordStore
    from worker.node.devices import DISTRIBUTED_BACKEND

    _skip_without_two_devices()
    job_id, _, job_events = _two_process_job(stack_env, redis_client, "tenant-ddp")
    messages = [e["message"] for e in job_events]
    assert f"Training with 2 processes ({DISTRIBUTED_BACKEND[TEST_BACKEND]} collectives)" in messages
    # 8 examples, 2 per process per step, 2 processes: 2 steps an epoch, 4 in all; each step reported once.
    assert [m.split(":")[0] for m in messages if m.startswith("Step ")] == [f"Step {i}/4" for i in (1, 2, 3, 4)]
    assert [c["step_number"] for c in RecordStore(redis_client).get("ftjob", job_id)["checkpoints"]] == [2, 4]
    assert not any(e["data"].get("strategy") == "fsdp" for e in job_events)  # DDP replicates: nothing sharded
    assert os.environ.get("RANK") is None


@pytest.fixture(scope="module")
def sharded_job(stack_env, redis_client) -> tuple[str, dict, list[dict]]:
    _skip_without_two_devices()
    return _two_process_job(stack_env, redis_client, "tenant-a", strategy="fsdp")


def _step_losses(job_events: list[dict]) -> list[float]:
    return [float(e["message"].rsplit("=", 1)[1]) for e in job_events if e["message"].startswith("Step ")]


def test_sharded_training_with_two_processes_serves_its_adapter(stack_env, redis_client, client_a, sharded_job):
    """strategy fsdp: the base is sharded over the two processes (FSDP2), each holding about half of its
    parameters; the job checkpoints, and the adapter saved by the main process is a plain PEFT adapter that the
    service serves."""
    from contract.records import RecordStore

    job_id, outcome, job_events = sharded_job
    [sharding] = [e["data"] for e in job_events if e["data"].get("strategy") == "fsdp"]
    whole, local = sharding["parameter_bytes"], sharding["local_parameter_bytes"]
    assert len(local) == 2 and all(whole * 0.4 < b < whole * 0.6 for b in local), sharding  # LoRA: replicated
    assert [m["message"].split(":")[0] for m in job_events if m["message"].startswith("Step ")] == \
        [f"Step {i}/4" for i in (1, 2, 3, 4)]
    store = RecordStore(redis_client)
    assert [c["step_number"] for c in store.get("ftjob", job_id)["checkpoints"]] == [2, 4]
    # A plain PEFT adapter, gathered whole: PEFT loads it on the base (a shard would not fit the shapes), trained.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from contract.layout import adapter_dir

    base = AutoModelForCausalLM.from_pretrained(Path(stack_env["XPUJOBS_MODELS_ROOT"]) / "demo-tiny")
    adapter = adapter_dir(Path(stack_env["XPUJOBS_ARTIFACT_ROOT"]), "tenant-a", job_id)
    trained = PeftModel.from_pretrained(base, str(adapter))
    assert all(p.abs().sum() > 0 for n, p in trained.named_parameters() if "lora_B" in n)  # zero before training
    # Settled as the node would, then served through the API like any fine-tuned model.
    store.update("ftjob", job_id, {"status": "succeeded", "fine_tuned_model": outcome["fine_tuned_model"],
                                   "finished_at": int(time.time())})
    reply = client_a.chat.completions.create(model=outcome["fine_tuned_model"], max_tokens=4, temperature=0,
                                             messages=[{"role": "user", "content": "Q1"}])
    assert reply.model == outcome["fine_tuned_model"] and reply.usage.completion_tokens == 4


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_examples_train_at_the_loss_of_the_padded_batch(tmp_path, attn_implementation):
    """Packing concatenates a batch's examples into one row, position ids restarting per example and no attention
    mask: transformers then keeps attention within each example, so the loss is the padded batch's. With a KV cache
    (the config's use_cache, which mixed examples before) transformers builds no packed mask from the position ids
    and every token attends to the examples before it: the training model is loaded without one."""
    import torch

    from contract.settings import Settings
    from worker.models import load_model_and_tokenizer
    from worker.training.trainer import Collator, JobFailed, check_packing_keeps_examples_apart, packing_collator

    build_demo_model(tmp_path / "tiny")
    model, tokenizer = load_model_and_tokenizer("tiny", Settings(models_root=tmp_path), "cpu",
                                                attn_implementation=attn_implementation, for_training=True)
    model.eval()
    lines = [{"prompt": "Hi", "completion": "Hello."}, {"prompt": "word " * 40, "completion": "A long one " * 5},
             {"prompt": "Say hello.", "completion": "Hello from the fine-tuned adapter!"}]
    rows, _ = tokenize_examples(tokenizer, [example(line) for line in lines], 1024)
    padded, packed = Collator(tokenizer.pad_token_id)(rows), packing_collator()(rows)
    assert packed["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows)) and "attention_mask" not in packed
    with torch.no_grad():
        torch.testing.assert_close(model(**packed).loss, model(**padded).loss, atol=1e-5, rtol=1e-5)
        mixed = model(**packed, use_cache=True).loss
    assert abs(float(mixed) - float(model(**padded).loss)) > 1e-3
    check_packing_keeps_examples_apart(model, rows)

    model.config.use_cache = True  # as a model whose attention ignores the position-id boundaries
    with pytest.raises(JobFailed, match="packing"):
        check_packing_keeps_examples_apart(model, rows)
    # bf16 weights (a GPU job): packed and apart round differently, which must not read as mixing (on an H200 a
    # fixed 1e-3 tolerance refused every packed job), while mixing is still refused
    model.to(torch.bfloat16)
    with pytest.raises(JobFailed, match="packing"):
        check_packing_keeps_examples_apart(model, rows)
    model.config.use_cache = False
    check_packing_keeps_examples_apart(model, rows)


def test_sharded_training_continues_an_ft_model_with_packed_examples(stack_env, redis_client, sharded_job):
    """strategy fsdp with packing, fine-tuning the sharded job's ft: model: the adapter loaded on the sharded base
    trains on (its first step's loss starts below the first job's) over packed batches."""
    first_id, first, first_events = sharded_job
    job_id, outcome, job_events = _two_process_job(
        stack_env, redis_client, "tenant-a", strategy="fsdp", packing=True,
        init_adapter={"model": first["fine_tuned_model"], "job_id": first_id, "step": None})
    assert any(e["data"].get("strategy") == "fsdp" for e in job_events)
    assert _step_losses(job_events)[0] < _step_losses(first_events)[0]
    assert outcome["fine_tuned_model"] != first["fine_tuned_model"]
