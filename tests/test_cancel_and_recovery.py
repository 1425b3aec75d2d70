"""A running fine-tune stops on cancel and keeps its checkpoint; a job whose worker is SIGKILLed mid-run is
requeued and finishes, resumed from its checkpoint."""

import json
import os
import signal
import time

import httpx
from conftest import _wait, wait_for_job

LINES = "\n".join(json.dumps({"messages": [{"role": "user", "content": f"Count {i}."},
                                           {"role": "assistant", "content": f"Number {i} is here."}]})
                  for i in range(20)).encode()


def long_job(client, **extra):
    upload = client.files.create(file=("long.jsonl", LINES), purpose="fine-tune")
    return client.fine_tuning.jobs.create(
        model="demo-tiny", training_file=upload.id, hyperparameters={"n_epochs": 50, "batch_size": 1},
        extra_body={"checkpoint_steps": 5, **extra})


def first_checkpoint(client, job_id):
    return _wait(lambda: client.fine_tuning.jobs.checkpoints.list(job_id).data, 120, "a checkpoint")


def node_running(client, job_id) -> str:
    def find():
        for w in httpx.get(str(client.base_url) + "workers",
                           headers={"Authorization": f"Bearer {client.api_key}"}).json()["data"]:
            if job_id in w["current_jobs"]:
                return w["node"]
    return _wait(find, 30, f"the node running {job_id}")


def test_cancel_running_fine_tune(client_a):
    job = long_job(client_a)
    first_checkpoint(client_a, job.id)
    node = node_running(client_a, job.id)
    asked = time.monotonic()
    client_a.fine_tuning.jobs.cancel(job.id)
    job = wait_for_job(client_a, job.id, timeout=30)
    assert job.status == "cancelled"
    assert time.monotonic() - asked < 15
    assert client_a.fine_tuning.jobs.checkpoints.list(job.id).data

    # The node is free again and takes the next job.
    short = client_a.files.create(file=("short.jsonl", LINES[:400].rsplit(b"\n", 1)[0]), purpose="fine-tune")
    def idle():
        workers = httpx.get(str(client_a.base_url) + "workers",
                            headers={"Authorization": f"Bearer {client_a.api_key}"}).json()["data"]
        return next(w for w in workers if w["node"] == node)["current_jobs"] == []
    _wait(idle, 10, f"{node} to report itself idle")
    nxt = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=short.id,
                                           hyperparameters={"n_epochs": 1})
    assert wait_for_job(client_a, nxt.id).status == "succeeded"


def test_worker_killed_mid_fine_tune_is_requeued_and_resumed(client_a, workers, start_worker):
    job = long_job(client_a, max_steps=40)
    step = first_checkpoint(client_a, job.id)[0].step_number
    node = node_running(client_a, job.id)
    victim = next(w for w in workers if node.startswith(w.name + "@"))
    victim.kill()
    try:
        job = wait_for_job(client_a, job.id, timeout=240)
        assert job.status == "succeeded", job.error
        assert job.attempts == 2
        messages = [e.message for e in client_a.fine_tuning.jobs.list_events(job.id, limit=1000)]
        assert any(m.startswith("Requeued (attempt 2)") for m in messages)
        resumed = [m for m in messages if m.startswith("Resumed from checkpoint at step")]
        assert resumed and int(resumed[0].rsplit(" ", 1)[1]) >= step
        # The result file covers both attempts: every step once.
        rows = client_a.files.content(job.result_files[0]).text.splitlines()[1:]
        assert [int(row.split(",")[0]) for row in rows] == list(range(1, 41))
    finally:
        workers[workers.index(victim)] = start_worker(victim.name)


def test_worker_stopped_mid_fine_tune_checkpoints_and_hands_the_job_on(client_a, workers, start_worker):
    """SIGTERM (a deploy or a scale-down): Celery's warm shutdown; the job saves a checkpoint at once, goes back
    on a queue without counting an attempt, and another worker resumes it from there."""
    job = long_job(client_a, max_steps=400)  # long enough that the stop lands mid-run
    first_checkpoint(client_a, job.id)
    node = node_running(client_a, job.id)
    victim = next(w for w in workers if node.startswith(w.name + "@"))
    os.kill(victim.proc.pid, signal.SIGTERM)  # the node process only, as a container stop does
    try:
        assert victim.proc.wait(60) == 0
        messages = [e.message for e in client_a.fine_tuning.jobs.list_events(job.id, limit=1000)]
        handed_on = [m for m in messages if m.startswith(f"Worker {node} is shutting down: checkpoint saved")]
        assert handed_on, messages
        step = int(handed_on[0].split("step ")[1].split(",")[0])
        job = wait_for_job(client_a, job.id, timeout=240)
        assert job.status == "succeeded", job.error
        assert job.attempts == 1
        messages = [e.message for e in client_a.fine_tuning.jobs.list_events(job.id, limit=1000)]
        assert f"Resumed from checkpoint at step {step}" in messages
    finally:
        workers[workers.index(victim)] = start_worker(victim.name)
