"""Pieces of the training process on their own."""

from worker.demo_model import build_demo_model
from worker.training import _resume_point, tokenize_examples


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
