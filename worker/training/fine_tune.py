"""Runs a fine-tuning job on this node: claims the record, trains in a child process, settles the outcome.

The child (worker.training.trainer) holds all device memory of the job, so its exit frees it all, whether the job
succeeded, failed, was cancelled or was killed. The node refreshes the job's lease while the child runs; if
the node dies, the lease lapses and the reconciler requeues the job. A child killed without a result (the OOM
killer's SIGKILL) is requeued here, resuming from its checkpoint, until the attempt limit.
"""

import json
import os
import signal
import subprocess
import sys
import time

from celery import Celery

from contract import events
from contract.layout import training_outcome_path
from contract.queues import publish
from contract.records import now
from contract.registry import live_workers
from contract.routing import NoCapableWorker, Requirement, choose_queue
from worker.node.node import Node


def run_fine_tune(node: Node, celery: Celery, job_id: str) -> None:
    store, redis = node.store, node.redis
    record = store.get("ftjob", job_id)
    if record is None or record["status"] != "queued":
        return  # cancelled while queued, or already claimed by another delivery
    if not node.training_slot.acquire(blocking=False):
        # This node is training already: hand the job back to the queue for a free worker.
        publish(celery, node.store, "ftjob", job_id, record["queue"], countdown=2)
        return
    claimed = None
    try:
        claimed = node.claim("ftjob", job_id, {"status": "running", "node": node.name})
        if claimed is None:
            return
        events.emit(redis, job_id, f"Fine-tuning job started on {node.name} (attempt {claimed['attempts']})",
                    data={"status": "running", "node": node.name})
        _settle(node, celery, claimed, _train_in_child(node, claimed))
    finally:
        # The slot first: it is local and cannot fail, while the lease release waits for Redis if it is away.
        node.training_slot.release()
        if claimed is not None:
            node.job_finished(job_id)


def _train_in_child(node: Node, record: dict) -> dict:
    job_id = record["id"]
    result = training_outcome_path(node.settings.artifact_root, record["tenant"], job_id, record["attempts"])
    result.unlink(missing_ok=True)
    processes = node.settings.training_processes or (len(node.devices) if node.backend != "cpu" else 1)
    if node.backend != "cpu":  # idle inference engines hold most of the device's free memory: give it back
        from worker.serving.inference import host_for

        host_for(node).release_idle()
    child = subprocess.Popen(training_command(job_id, processes),
                             env={**os.environ, "XPUJOBS_NODE_PID": str(os.getpid())})
    asked_to_stop = False
    while child.poll() is None:  # the node's heartbeat keeps the lease fresh however long the job runs
        if node.stopping.is_set() and not asked_to_stop:
            child.send_signal(signal.SIGTERM)  # checkpoint now and stop; torchrun passes it to every rank
            asked_to_stop = True
        time.sleep(0.5)
    if result.exists():
        return json.loads(result.read_text())
    return {"status": "died", "error": {"code": "training_process_died",
                                        "message": f"The training process exited with code {child.returncode} "
                                                   "without a result (out of memory?)."}}


def training_command(job_id: str, processes: int) -> list[str]:
    """One process, or one per device through torchrun (data parallel, the guide's one process per XPU)."""
    if processes <= 1:
        return [sys.executable, "-m", "worker.training.trainer", job_id]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
            "-m", "worker.training.trainer", job_id]


def _settle(node: Node, celery: Celery, record: dict, outcome: dict) -> None:
    store, redis, job_id = node.store, node.redis, record["id"]
    status = outcome["status"]
    current = store.get("ftjob", job_id) or {}
    if status == "superseded" or int(current.get("attempts") or 0) != record["attempts"]:
        # Requeued while this attempt still ran (its lease lapsed): the job is another attempt's now.
        events.emit(redis, job_id, f"Attempt {record['attempts']} on {node.name} stopped: the job was requeued "
                                   "while it ran, and goes on from its last checkpoint", level="warn",
                    data={"attempt": record["attempts"]})
        return
    if status == "preempted":
        _requeue(node, celery, record, f"Worker {node.name} is shutting down", count_attempt=False)
        return
    if status == "paused":
        if store.transition("ftjob", job_id, ["running"], {"status": "paused", "estimated_finish": None}):
            store.untrack("ftjob", job_id)
            step = max((c["step_number"] for c in store.get("ftjob", job_id).get("checkpoints", [])), default=0)
            events.emit(redis, job_id, f"The job was paused at step {step}; its device is free",
                        data={"status": "paused", "step": step})
        return
    if status == "died":
        if record["attempts"] < node.settings.max_attempts:
            _requeue(node, celery, record, outcome["error"]["message"], count_attempt=True)
            return
        status, outcome = "failed", {**outcome, "error": {**outcome["error"], "message": (
            f"{outcome['error']['message']} It happened on each of {record['attempts']} attempts.")}}
    fields = {"status": status, "finished_at": now(), "estimated_finish": None}
    for key in ("fine_tuned_model", "trained_tokens", "result_files", "error"):
        if key in outcome:
            fields[key] = outcome[key]
    if store.transition("ftjob", job_id, ["running"], fields):
        store.untrack("ftjob", job_id)
        level = "error" if status == "failed" else "info"
        message = {"succeeded": "The job has successfully completed", "cancelled": "The job was cancelled",
                   "failed": f"The job failed: {(outcome.get('error') or {}).get('message')}"}[status]
        events.emit(redis, job_id, message, level=level, data={"status": status})


def _requeue(node: Node, celery: Celery, record: dict, why: str, *, count_attempt: bool) -> None:
    """Back on a queue at once, resuming from the job's last checkpoint. A node shutting down hands the job on
    without counting the attempt, since the job did not fail; a training process that died counts one."""
    job_id = record["id"]
    try:
        queue = choose_queue([w for w in live_workers(node.redis) if w["node"] != node.name],
                             Requirement(bf16=bool(record.get("bf16"))))
    except NoCapableWorker:
        queue = record["queue"]  # no other worker now: wait on the queue for this one (or its replacement)
    attempts = record["attempts"] - (0 if count_attempt else 1)
    if node.store.transition("ftjob", job_id, ["running"], {"status": "queued", "queue": queue,
                                                            "attempts": attempts, "reserved_by": None}):
        step = max((c["step_number"] for c in node.store.get("ftjob", job_id).get("checkpoints", [])), default=0)
        message = (f"{why}: checkpoint saved at step {step}, job requeued" if not count_attempt else
                   f"Requeued (attempt {attempts + 1}): {why} Resuming from checkpoint step {step}")
        events.emit(node.redis, job_id, message, level="warn", data={"status": "queued", "step": step})
        publish(celery, node.store, "ftjob", job_id, queue)
