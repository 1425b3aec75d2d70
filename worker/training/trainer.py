"""The training process of one fine-tuning job: `python -m worker.training.trainer <job id>`, started by its node.

LoRA with PEFT on the HF Trainer; QLoRA loads the base in bitsandbytes 4-bit nf4 first. Checkpoints every N
steps under the job's directory; a retried job resumes from the newest. Writes its attempt's outcome file for the
node.

An attempt that is no longer the job's (the reconciler requeued it while this one still ran: its node missed the
lease) stops at its next check without saving anything, so two attempts never write the same checkpoints or
adapter; the adapter is written whole into a directory of its own and then renamed into place.
"""

import csv
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from redis.exceptions import RedisError

from contract import events
from contract.layout import (
    adapter_dir,
    checkpoint_dir,
    checkpoint_model_id,
    checkpoints_dir,
    file_path,
    fine_tuned_model_id,
    training_outcome_path,
)
from contract.records import RecordStore, new_id, now
from contract.redis_conn import durable_client
from contract.registry import live_workers
from contract.settings import Settings
from contract.training_data import read_examples
from worker.models import ModelLoadError, load_model_and_tokenizer
from worker.node import devices

CANCEL_CHECK_SECONDS = 1.0
# Set by SIGTERM (the node's warm shutdown): save a checkpoint and stop, to be resumed elsewhere.
preempted = threading.Event()


class JobFailed(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    plain = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    return tokenizer.apply_chat_template(plain, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)


def trained_spans(tokenizer, example: dict) -> list[tuple[str, list[tuple[int, int]]]]:
    """Texts to train on, each with the character spans of its trained assistant turns (weight 1).

    A turn's span runs from the end of the conversation before it (rendered with the generation prompt, as at
    inference) to the end of the turn rendered by the chat template. When the template renders each trained turn
    as a prefix of the whole conversation, the whole conversation is one text with all its spans; a template
    that renders earlier turns differently (one that drops the reasoning of earlier turns) gives one text per
    trained turn, so no turn is learned in a form the model never produces.
    """
    messages, tools = example["messages"], example.get("tools")
    full = _render(tokenizer, messages, tools)
    turns = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not m.get("weight", 1):
            continue
        before = _render(tokenizer, messages[:i], tools, generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], tools)
        if not through.startswith(before):
            raise JobFailed("chat_template_mismatch", "The model's chat template renders an assistant turn "
                                                      "differently from its generation prompt; cannot tell which "
                                                      "tokens to train")
        turns.append((through, (len(before), len(through))))
    if all(full.startswith(through) for through, _ in turns):
        return [(turns[-1][0], [span for _, span in turns])]
    return [(through, [span]) for through, span in turns]


def tokenize_examples(tokenizer, examples: list[dict], max_length: int) -> tuple[list[dict], dict]:
    """Chat-templated examples with the loss on every trained assistant turn (other tokens are -100), and how
    many were cut to max_length (`truncated`) or dropped because nothing trained was left (`skipped`).

    Segments are tokenized one by one, so a turn's tokens are the ones the model generates after the prompt."""
    rows, report = [], {"truncated": 0, "skipped": 0}
    for example in examples:
        for text, spans in trained_spans(tokenizer, example):
            input_ids, labels, at = [], [], 0
            for start, end in spans:
                for piece, trained in ((text[at:start], False), (text[start:end], True)):
                    ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
                    input_ids += ids
                    labels += ids if trained else [-100] * len(ids)
                at = end
            if len(input_ids) > max_length:
                report["truncated"] += 1
                input_ids, labels = input_ids[:max_length], labels[:max_length]
                if all(label == -100 for label in labels):
                    report["skipped"] += 1
                    continue
            rows.append({"input_ids": input_ids, "labels": labels})
    return rows, report


def packing_collator():
    """Packing: the batch's examples concatenated into one row without padding, each with its own position ids
    from 0 and without an attention mask. From those position ids, transformers builds a block-diagonal causal mask
    for sdpa and eager attention and variable-length kernels for flash attention, so no token attends across
    examples. The first label of each example is dropped (-100): it would be predicted from the previous example."""
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)


def check_packing_keeps_examples_apart(model, rows: list[dict]) -> None:
    """Two of the job's examples, packed and apart, must give the same logits; a model whose attention ignores
    the position-id boundaries (remote code with its own masks) would mix them, and the job fails before training."""
    import torch

    pair = rows[:2] if len(rows) > 1 else rows * 2
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        apart = [model(input_ids=torch.tensor([r["input_ids"]], device=device)).logits[0] for r in pair]
        packed = packing_collator()(pair)
        joined = model(input_ids=packed["input_ids"].to(device),
                       position_ids=packed["position_ids"].to(device)).logits[0]
    model.train(was_training)
    # Relative to the logits' scale: bf16 weights on a GPU round packed and apart rows differently (~1e-2), while
    # attending across examples changes the second one's logits by far more.
    want = torch.cat(apart).float()
    err = (joined.float() - want).abs().mean() / want.abs().mean().clamp_min(1e-6)
    if err > (1e-3 if joined.dtype == torch.float32 else 3e-2):
        raise JobFailed("packing_unsupported", "packing was requested but this model's attention mixes packed "
                                               "examples (it ignores the position-id boundaries); submit with "
                                               "packing false")


def shard_report(model) -> dict:
    """Bytes of parameters in the whole model and on this rank (a DTensor holds its local shard only)."""
    total = local = 0
    for parameter in model.parameters():
        size = parameter.element_size()
        total += parameter.numel() * size
        local += (parameter.to_local() if hasattr(parameter, "to_local") else parameter).numel() * size
    return {"parameter_bytes": total, "local_parameter_bytes": local}


def _report_sharding(model, store: RecordStore, job_id: str) -> None:
    """An event with each rank's bytes of parameters, gathered on the main process."""
    import torch.distributed as dist

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, shard_report(model))
    if dist.get_rank() == 0:
        total, local = per_rank[0]["parameter_bytes"], [r["local_parameter_bytes"] for r in per_rank]
        events.emit(store.redis, job_id, f"Base sharded over {len(local)} processes (FSDP2): at most "
                                         f"{max(local) / 2**20:.2f} of {total / 2**20:.2f} MiB of parameters on each",
                    data={"strategy": "fsdp", "world_size": len(local), "parameter_bytes": total,
                          "local_parameter_bytes": local})


def _start_process_group(backend: str) -> None:
    """The node's collective backend (gloo on cpu, nccl on cuda, xccl on xpu), started before the sharded load."""
    import torch
    import torch.distributed as dist

    if backend != "cpu":
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend=devices.DISTRIBUTED_BACKEND[backend])


class Collator:
    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows):
        import torch

        width = max(len(r["input_ids"]) for r in rows)
        pad = lambda seq, value: seq + [value] * (width - len(seq))  # noqa: E731
        return {
            "input_ids": torch.tensor([pad(r["input_ids"], self.pad_id) for r in rows]),
            "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in rows]),
            "labels": torch.tensor([pad(r["labels"], -100) for r in rows]),
        }


def node_alive() -> bool:
    try:
        os.kill(int(os.environ["XPUJOBS_NODE_PID"]), 0)
    except (KeyError, ValueError):
        return True  # run by hand, without a node
    except ProcessLookupError:
        return False
    return True


def superseded(store: RecordStore, job_id: str, attempt: int | None) -> bool:
    """Whether this attempt is no longer the job's: the job left `running` (requeued, or settled by another
    attempt) or a later attempt claimed it. Redis away counts as not (the check is made again)."""
    try:
        record = store.get("ftjob", job_id)
    except RedisError:
        return False
    return record is None or record["status"] != "running" or (
        attempt is not None and int(record.get("attempts") or 0) != attempt)


def agreed(flags: list[bool], device) -> list[bool]:
    """Each flag true on every rank if it is true on any: ranks must stop at the same step or collectives hang."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flags
    values = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]


def checkpoint_metrics(step: int, last_log: dict, last_eval: dict) -> dict:
    """OpenAI's checkpoint metrics. Evaluation runs on the whole validation file, so valid_* and full_valid_* are
    the same numbers (from the newest evaluation); without a validation file they are absent."""
    metrics = {"step": step, "train_loss": last_log.get("train_loss"),
               "train_mean_token_accuracy": last_log.get("train_mean_token_accuracy")}
    if last_eval:
        metrics.update(last_eval, full_valid_loss=last_eval["valid_loss"],
                       full_valid_mean_token_accuracy=last_eval["valid_mean_token_accuracy"])
    return metrics


def job_trainer_class():
    """The HF Trainer, adding the mean token accuracy (the share of trained tokens predicted right) to the
    training and evaluation logs, as OpenAI's metrics have it."""
    from transformers import Trainer

    class JobTrainer(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.accuracy = {True: [], False: []}  # by model.training

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            labels = inputs["labels"][:, 1:]
            trained = labels != -100
            right = (outputs.logits[:, :-1].argmax(-1) == labels) & trained
            self.accuracy[model.training].append((int(right.sum()), int(trained.sum())))
            return (loss, outputs) if return_outputs else loss

        def log(self, logs, *args, **kwargs):
            evaluation = "eval_loss" in logs
            counts = self.accuracy[not evaluation]
            if counts and ("loss" in logs or evaluation):
                key = "eval_mean_token_accuracy" if evaluation else "mean_token_accuracy"
                logs[key] = sum(r for r, _ in counts) / max(sum(t for _, t in counts), 1)
                counts.clear()
            super().log(logs, *args, **kwargs)

    return JobTrainer


def make_callback(job: dict, store: RecordStore, settings: Settings):
    from transformers import TrainerCallback

    redis = store.redis
    job_id = job["id"]

    class JobCallback(TrainerCallback):
        """Progress events and checkpoints in the record (from the main process), cooperative cancel agreed by
        all processes, and a stop if the node died."""

        def __init__(self):
            self.cancelled = False
            self.paused = False
            self.preempted = False
            self.superseded = False
            self.last_check = 0.0
            self.started = time.monotonic()
            self.first_step = None
            self.metrics: list[dict] = []
            self.last_eval: dict = {}
            self.last_log: tuple[float, int, int] | None = None  # (time, step, tokens seen) at the previous log

        def on_train_begin(self, args, state, control, **kwargs):
            self.first_step = state.global_step
            if state.is_world_process_zero and args.world_size > 1:
                events.emit(redis, job_id, f"Training with {args.world_size} processes "
                                           f"({args.ddp_backend or 'default'} collectives)",
                            data={"world_size": args.world_size})
            if state.global_step and state.is_world_process_zero:
                events.emit(redis, job_id, f"Resumed from checkpoint at step {state.global_step}",
                            data={"step": state.global_step})

        def on_log(self, args, state, control, logs=None, **kwargs):
            # TRL's DPO logs a mean_token_accuracy of 0 that measures nothing there: DPO reports its reward
            # accuracy (the share of pairs whose preferred answer gained over the other) instead.
            if logs and "eval_loss" in logs:
                self.last_eval = {"valid_loss": logs["eval_loss"], "valid_mean_token_accuracy":
                                  None if "eval_rewards/accuracies" in logs else logs.get("eval_mean_token_accuracy")}
            if not logs or "loss" not in logs or not state.is_world_process_zero:
                return
            done = state.global_step - (self.first_step or 0)
            per_step = (time.monotonic() - self.started) / max(done, 1)
            eta = now() + int(per_step * (state.max_steps - state.global_step))
            data = {"step": state.global_step, "total_steps": state.max_steps, "train_loss": logs["loss"],
                    "train_mean_token_accuracy": None if "rewards/accuracies" in logs
                    else logs.get("mean_token_accuracy"),
                    "learning_rate": logs.get("learning_rate"), "epoch": logs.get("epoch"),
                    "estimated_finish": eta}
            # Speed since the previous log (for /metrics and the progress views).
            clock, tokens = time.monotonic(), int(state.num_input_tokens_seen or 0)
            if self.last_log and clock > self.last_log[0]:
                elapsed = clock - self.last_log[0]
                data["steps_per_second"] = (state.global_step - self.last_log[1]) / elapsed
                data["tokens_per_second"] = (tokens - self.last_log[2]) / elapsed
            self.last_log = (clock, state.global_step, tokens)
            if "rewards/accuracies" in logs:
                data.update(reward_accuracy=logs["rewards/accuracies"], reward_margin=logs.get("rewards/margins"))
            self.metrics.append(data)
            store.update("ftjob", job_id, {"estimated_finish": eta})
            events.emit(redis, job_id, f"Step {state.global_step}/{state.max_steps}: training loss={logs['loss']:.4f}",
                        type_="metrics", data=data)

        def on_step_end(self, args, state, control, **kwargs):
            if not node_alive():
                sys.exit(3)  # the node died; the reconciler requeues the job from its last checkpoint
            asked_cancel = asked_pause = replaced = False
            # Checked every second, and before each checkpoint: an attempt that was requeued must not save (nor
            # rotate away the checkpoint the next attempt resumes from).
            due = control.should_save or time.monotonic() - self.last_check >= CANCEL_CHECK_SECONDS
            if state.is_world_process_zero and due:
                self.last_check = time.monotonic()
                asked_cancel = events.cancel_requested(redis, job_id)
                asked_pause = events.pause_requested(redis, job_id)
                replaced = superseded(store, job_id, job.get("attempts"))
            cancel, pause, preempt, replaced = agreed([asked_cancel, asked_pause, preempted.is_set(), replaced],
                                                      args.device)
            if replaced:  # another attempt owns the job's files now: stop, and write nothing
                self.superseded = True
                control.should_training_stop = True
                control.should_save = False
            elif cancel or pause or preempt:
                self.cancelled = cancel
                self.paused = pause and not cancel
                self.preempted = preempt and not (cancel or pause)
                control.should_training_stop = True
                control.should_save = True

        def on_save(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            step = state.global_step
            last = self.metrics[-1] if self.metrics else {}
            checkpoint = {
                "id": new_id("ftjob").replace("ftjob-", "ftckpt-"), "object": "fine_tuning.job.checkpoint",
                "created_at": now(), "fine_tuning_job_id": job_id, "step_number": step,
                "fine_tuned_model_checkpoint": checkpoint_model_id(job["model"], job.get("suffix"), job_id, step),
                "metrics": checkpoint_metrics(step, last, self.last_eval),
            }
            record = store.get("ftjob", job_id)
            kept = [c for c in record.get("checkpoints", []) if c["step_number"] != step]
            store.update("ftjob", job_id, {"checkpoints": kept + [checkpoint]})
            events.emit(redis, job_id, f"Checkpoint saved at step {step}", data={"step": step})
            rotate_checkpoints(store, settings, job, Path(args.output_dir))

    return JobCallback()


def train(job: dict, store: RecordStore, settings: Settings, backend: str) -> dict:
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
    from transformers import TrainingArguments

    tenant, job_id = job["tenant"], job["id"]
    bf16 = devices.bf16_supported(backend)
    if job.get("bf16") and not bf16:
        # The guide's TrainingArguments check, made before any work and said plainly.
        raise JobFailed("bf16_unsupported", f"bf16 was requested but this worker's {backend} device does not "
                                            "support it; submit with bf16 false or unset")
    use_bf16 = bf16 if job.get("bf16") is None else bool(job["bf16"])
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    # FSDP2: the base is sharded at load (transformers' DistributedConfig, which the HF Trainer drives without
    # wrapping it again); the LoRA parameters, added after, stay replicated and the Trainer averages their
    # gradients. Accelerate's own FSDP plugin is not used: its state keeps FSDP for accelerator devices only and
    # falls back to DDP without a word on CPU (accelerate/state.py: MULTI_CPU is not in the FSDP branch's list).
    sharded = job.get("strategy") == "fsdp" and world > 1
    if sharded:
        _start_process_group(backend)
    elif job.get("strategy") == "fsdp" and rank == 0:
        events.emit(store.redis, job_id, "strategy fsdp with one training process on this worker: nothing to "
                                         "shard, the model is trained whole", level="warn",
                    data={"strategy": "fsdp", "world_size": world})
    try:
        model, tokenizer = load_model_and_tokenizer(
            job["model"], settings, backend, attn_implementation=job.get("attn_implementation", "sdpa"),
            quantization=job.get("quantization", "none"), use_kernels=bool(job.get("use_kernels")),
            for_training=True, shard_over=world if sharded else 1)
    except ModelLoadError as exc:
        raise JobFailed(exc.code, str(exc)) from None
    # Gradient checkpointing trades compute for activation memory: on by default where memory is the limit (GPUs).
    checkpointing = backend != "cpu" if job.get("gradient_checkpointing") is None else job["gradient_checkpointing"]
    if job.get("quantization", "none") != "none":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    lora = job["lora"]
    if job.get("init_adapter"):  # fine-tuning an ft: model: its adapter trains on
        model = PeftModel.from_pretrained(model, str(_init_adapter_path(job, settings)), is_trainable=True)
    else:
        model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                                 target_modules=lora["target_modules"], task_type="CAUSAL_LM"))
    if sharded:
        _report_sharding(model, store, job_id)

    max_length = min(getattr(model.config, "max_position_embeddings", None) or 2048, settings.training_max_seq_len)
    dpo = (job.get("method") or {}).get("type") == "dpo"
    rows = _preference_rows if dpo else _rows
    train_rows = rows(job, store, settings, tokenizer, "training_file", max_length)
    eval_rows = rows(job, store, settings, tokenizer, "validation_file", max_length) \
        if job.get("validation_file") else None
    hp = job["hyperparameters"]
    max_steps = _step_limit(job, store, settings, len(train_rows))
    out = checkpoints_dir(settings.artifact_root, tenant, job_id)
    common = dict(
        output_dir=str(out), num_train_epochs=hp["n_epochs"], per_device_train_batch_size=hp["batch_size"],
        per_device_eval_batch_size=hp["batch_size"], learning_rate=hp["learning_rate"],
        max_steps=max_steps, save_strategy="steps", save_steps=job["checkpoint_steps"],
        logging_steps=1, eval_strategy="steps" if eval_rows else "no", eval_steps=job["checkpoint_steps"],
        bf16=use_bf16, use_cpu=backend == "cpu", seed=job["seed"], data_seed=job["seed"], report_to=[],
        ddp_backend=devices.DISTRIBUTED_BACKEND[backend] if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None,
        disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0,
        include_num_input_tokens_seen="non_padding",  # tokens/s in the metrics events
        gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
        # The Trainer cannot checkpoint the optimizer of a base sharded at load: a resumed sharded job restarts
        # AdamW's moments from its checkpoint's adapter weights (step and schedule go on).
        save_only_model=sharded,
    )
    if checkpointing and int(os.environ.get("RANK", 0)) == 0:
        events.emit(store.redis, job_id, "Gradient checkpointing is on (activations recomputed in the backward pass)",
                    data={"gradient_checkpointing": True})
    callback = make_callback(job, store, settings)
    if dpo:
        # TRL's DPOTrainer; with a PEFT model and no reference model, the reference is the model with its
        # adapter disabled (the base, or the ft: model's base when an ft: model trains on).
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, beta=hp["beta"], max_length=max_length)
        trainer = DPOTrainer(model=model, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                             processing_class=tokenizer, callbacks=[callback])
    else:
        if job.get("packing"):
            check_packing_keeps_examples_apart(model, train_rows)
        collator = packing_collator() if job.get("packing") else Collator(tokenizer.pad_token_id)
        trainer = job_trainer_class()(model=model, args=TrainingArguments(**common), train_dataset=train_rows,
                                      eval_dataset=eval_rows, data_collator=collator, callbacks=[callback])
    trainer.train(resume_from_checkpoint=_resume_point(job, out))
    if callback.superseded:
        return {"status": "superseded"}
    if callback.cancelled:
        return {"status": "cancelled"}
    if callback.paused:
        return {"status": "paused"}
    if callback.preempted:
        return {"status": "preempted"}
    adapter, main_process = adapter_dir(settings.artifact_root, tenant, job_id), trainer.is_world_process_zero()
    written = adapter.with_name(f"{adapter.name}.attempt-{job.get('attempts') or 0}")
    if main_process or sharded:  # a sharded model's state dict is gathered by a collective: every rank takes part
        model.save_pretrained(written, safe_serialization=True, is_main_process=main_process)
    if not main_process:
        return {"status": "succeeded"}  # the main process writes and reports
    tokenizer.save_pretrained(written)
    if superseded(store, job_id, job.get("attempts")):
        shutil.rmtree(written, ignore_errors=True)
        return {"status": "superseded"}
    shutil.rmtree(adapter, ignore_errors=True)  # a copy of an earlier attempt that died before reporting
    os.replace(written, adapter)
    trained_tokens = trainer.state.num_input_tokens_seen
    results_file = _write_results_file(store, settings, job, trainer)
    return {"status": "succeeded", "fine_tuned_model": fine_tuned_model_id(job["model"], job.get("suffix"), job_id),
            "trained_tokens": trained_tokens, "result_files": [results_file]}


def _rows(job: dict, store: RecordStore, settings: Settings, tokenizer, param: str, max_length: int) -> list[dict]:
    """The tokenized examples of the job's training or validation file. Examples longer than the context are
    truncated, with a warning event; one with no trained token left is dropped (it would train at loss 0)."""
    examples = read_examples(file_path(settings.artifact_root, job["tenant"], job[param]))
    rows, report = tokenize_examples(tokenizer, examples, max_length)
    if report["truncated"] and int(os.environ.get("RANK", 0)) == 0:
        events.emit(store.redis, job["id"],
                    f"{param}: {report['truncated']} example(s) longer than the context ({max_length} tokens) were "
                    f"truncated; {report['skipped']} of them had no trained token left and were skipped",
                    level="warn", data={"file": param, **report, "max_length": max_length})
    if not rows:
        raise JobFailed("examples_too_long", f"Every example of the {param} is longer than the context "
                                             f"({max_length} tokens) before its first trained token")
    return rows


def _preference_rows(job: dict, store: RecordStore, settings: Settings, tokenizer, param: str, max_length: int):
    """DPO pairs in TRL's conversational preference format (TRL applies the chat template, with the line's tools,
    and truncates to max_length). The tools go as JSON text, which TRL parses back: as a column of objects, Arrow
    would merge every line's tool schemas into one type."""
    from datasets import Dataset

    plain = lambda messages: [{k: v for k, v in m.items() if k != "weight"} for m in messages]  # noqa: E731
    examples = read_examples(file_path(settings.artifact_root, job["tenant"], job[param]), "dpo")
    return Dataset.from_list([{"prompt": plain(e["messages"]), "chosen": [e["chosen"]], "rejected": [e["rejected"]],
                               "tools": json.dumps(e["tools"]) if e["tools"] else None} for e in examples])


def _init_adapter_path(job: dict, settings: Settings) -> Path:
    init = job["init_adapter"]
    path = adapter_dir(settings.artifact_root, job["tenant"], init["job_id"]) if init["step"] is None else \
        checkpoint_dir(settings.artifact_root, job["tenant"], init["job_id"], init["step"])
    if not (path / "adapter_config.json").exists():
        raise JobFailed("model_not_found", f"The model {init['model']} was deleted before this job started")
    return path


def _step_limit(job: dict, store: RecordStore, settings: Settings, examples: int) -> int:
    """The job's max_steps, or -1 (its epochs); never beyond settings.max_training_steps (with a warn event when
    the epochs would run longer)."""
    if job.get("max_steps"):
        return min(job["max_steps"], settings.max_training_steps)
    hp, world = job["hyperparameters"], int(os.environ.get("WORLD_SIZE", 1))
    steps = math.ceil(examples / (hp["batch_size"] * world)) * hp["n_epochs"]
    if steps <= settings.max_training_steps:
        return -1
    if int(os.environ.get("RANK", 0)) == 0:
        events.emit(store.redis, job["id"], f"{hp['n_epochs']} epochs would take {steps} steps: training stops at "
                                            f"the limit of {settings.max_training_steps}", level="warn",
                    data={"steps": steps, "max_training_steps": settings.max_training_steps})
    return settings.max_training_steps


def rotate_checkpoints(store: RecordStore, settings: Settings, job: dict, out: Path) -> list[int]:
    """Keep the newest settings.checkpoints_kept checkpoints and any that a live worker has loaded as a model;
    the others leave the record first (so no one resolves them), then the disk. Returns the steps removed."""
    record = store.get("ftjob", job["id"])
    checkpoints = sorted(record.get("checkpoints", []), key=lambda c: c["step_number"])
    loaded = set()
    for worker in live_workers(store.redis):  # serving names a checkpoint's adapter "<job id>-step-<n>"
        loaded.update(int(n) for n in re.findall(re.escape(job["id"]) + r"-step-(\d+)", json.dumps(worker)))
    newest = checkpoints[-settings.checkpoints_kept:] if settings.checkpoints_kept > 0 else []
    kept = [c for c in checkpoints if c in newest or c["step_number"] in loaded]
    removed = [c["step_number"] for c in checkpoints if c not in kept]
    if removed:
        store.update("ftjob", job["id"], {"checkpoints": kept})
        for step in removed:
            shutil.rmtree(out / f"checkpoint-{step}", ignore_errors=True)
    return removed


def _resume_point(job: dict, out: Path) -> str | None:
    """The newest checkpoint the record lists (a checkpoint is listed only once fully saved); directories of a
    save cut short when an earlier attempt's worker died are removed."""
    listed = {c["step_number"] for c in job.get("checkpoints", [])}
    complete = []
    for directory in out.glob("checkpoint-*") if out.exists() else []:
        step = directory.name.removeprefix("checkpoint-")
        if step.isdigit() and int(step) in listed:
            complete.append((int(step), directory))
        else:
            shutil.rmtree(directory, ignore_errors=True)
    return str(max(complete)[1]) if complete else None


def _blank(value) -> object:
    return "" if value is None else value


def _write_results_file(store: RecordStore, settings: Settings, job: dict, trainer) -> str:
    """OpenAI's result file: a CSV of per-step metrics, stored as a file of purpose fine-tune-results. The steps
    come from the job's event stream, so a resumed job lists the steps of its earlier attempts too (a step
    repeated after a resume keeps its last value)."""
    by_step = {e["data"]["step"]: e["data"] for e in events.read_all(store.redis, job["id"]) if e["type"] == "metrics"}
    metrics = [by_step[step] for step in sorted(by_step)]
    evals = {h["step"]: h for h in trainer.state.log_history if "eval_loss" in h}
    file_id = new_id("file")
    path = file_path(settings.artifact_root, job["tenant"], file_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        # OpenAI's columns, then the learning rate (an extension).
        writer.writerow(["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy",
                         "learning_rate"])
        for m in metrics:
            valid = evals.get(m["step"], {})
            writer.writerow([m["step"], m["train_loss"], _blank(m.get("train_mean_token_accuracy")),
                             _blank(valid.get("eval_loss")), _blank(valid.get("eval_mean_token_accuracy")),
                             m["learning_rate"]])
    store.create("file", {"id": file_id, "tenant": job["tenant"], "bytes": path.stat().st_size,
                          "created_at": now(), "filename": f"{job['id']}-results.csv",
                          "purpose": "fine-tune-results"})
    return file_id


def main(job_id: str) -> int:
    # Ctrl-C in the terminal of `xpu-jobs up` reaches the whole process group: the node decides, not us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: preempted.set())
    settings = Settings()
    store = RecordStore(durable_client(settings))
    job = store.get("ftjob", job_id)
    result = training_outcome_path(settings.artifact_root, job["tenant"], job_id, job.get("attempts"))
    result.parent.mkdir(parents=True, exist_ok=True)
    try:
        backend = devices.detect_backend(os.environ.get("XPUJOBS_DEVICE_BACKEND", settings.device_backend))
        outcome = train(job, store, settings, backend)
    except JobFailed as exc:
        outcome = {"status": "failed", "error": {"code": exc.code, "message": str(exc), "param": None}}
    except Exception as exc:  # the job fails; the node and other jobs go on
        traceback.print_exc()  # into the node's log: only the main process writes the outcome
        outcome = {"status": "failed", "error": {"code": "training_error",
                                                 "message": f"{type(exc).__name__}: {exc}", "param": None}}
    if int(os.environ.get("RANK", 0)) == 0:
        result.write_text(json.dumps(outcome))
    return 0 if outcome["status"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
