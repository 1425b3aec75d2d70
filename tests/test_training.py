"""Pieces of the training process on their own."""

from pathlib import Path

from worker.demo_model import build_demo_model
from worker.training.trainer import _resume_point, tokenize_examples


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


def test_loss_covers_only_the_final_answer(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_demo_model(tmp_path / "tiny"))
    [row] = tokenize_examples(tokenizer, [[{"role": "user", "content": "Say hello."},
                                           {"role": "assistant", "content": "Hello!"}]], 1024)
    learned = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != -100]
    assert tokenizer.decode(learned) == "Hello!<|end|>"
    assert len(row["labels"]) == len(row["input_ids"])


def test_data_parallel_training_with_two_processes(stack_env, redis_client, tmp_path):
    """The guide's multi-process training: torchrun starts one process per device (gloo on CPU here; xccl on
    XPU, nccl on CUDA); the main process reports and saves, all stop together."""
    import json
    import os
    import subprocess

    from conftest import TEST_BACKEND

    from contract import events
    from contract.layout import adapter_dir, file_path
    from contract.records import RecordStore, new_id
    from worker.node.devices import DISTRIBUTED_BACKEND
    from worker.training.fine_tune import training_command

    root = Path(stack_env["XPUJOBS_ARTIFACT_ROOT"])
    store = RecordStore(redis_client)
    job_id, file_id = new_id("ftjob"), new_id("file")
    data = file_path(root, "tenant-ddp", file_id)
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("\n".join(json.dumps({"prompt": f"Q{i}", "completion": f"A{i}."}) for i in range(8)))
    hyper = {"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 1.0, "learning_rate": 2e-4}
    store.create("ftjob", {"id": job_id, "tenant": "tenant-ddp", "status": "running", "model": "demo-tiny",
                           "training_file": file_id, "validation_file": None, "suffix": "ddp", "seed": 1,
                           "hyperparameters": hyper, "lora": {"r": 4, "alpha": 8, "dropout": 0.0,
                                                              "target_modules": "all-linear"},
                           "quantization": "none", "bf16": None, "attn_implementation": "sdpa",
                           "use_kernels": False, "max_steps": None, "checkpoint_steps": 2, "checkpoints": []})
    command = training_command(job_id, 2)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    result = subprocess.run(command, env={**stack_env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads((adapter_dir(root, "tenant-ddp", job_id).parent
                          / "outcome.json").read_text())
    assert outcome["status"] == "succeeded", outcome
    assert (adapter_dir(root, "tenant-ddp", job_id) / "adapter_model.safetensors").exists()
    messages = [e["message"] for e in events.read_all(redis_client, job_id)]
    assert f"Training with 2 processes ({DISTRIBUTED_BACKEND[TEST_BACKEND]} collectives)" in messages
    # 8 examples, 2 per process per step, 2 processes: 2 steps an epoch, 4 in all; each step reported once.
    assert [m.split(":")[0] for m in messages if m.startswith("Step ")] == [f"Step {i}/4" for i in (1, 2, 3, 4)]
    assert [c["step_number"] for c in store.get("ftjob", job_id)["checkpoints"]] == [2, 4]
    assert os.environ.get("RANK") is None
