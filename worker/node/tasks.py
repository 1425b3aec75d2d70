"""Celery tasks (fine-tunes and batch chunks; live inference comes through worker/serving/intake.py). Each reads
its job record, claims it by compare-and-set, and writes the outcome back.

Tasks are acked when they start (see contract.queues); the record and its lease keep them safe instead.
"""

from celery.utils.log import get_task_logger

from contract.queues import TASK_BATCH_CHUNK, TASK_FINE_TUNE
from worker.node.app import app, node

log = get_task_logger(__name__)


@app.task(name=TASK_FINE_TUNE)
def fine_tune(job_id: str) -> None:
    from worker.training.fine_tune import run_fine_tune

    run_fine_tune(node(), app, job_id)


@app.task(name=TASK_BATCH_CHUNK)
def batch_chunk(chunk_id: str) -> None:
    from worker.serving.batch import run_chunk

    try:
        run_chunk(node(), chunk_id)
    finally:  # a chunk that raised must not stay in the node's jobs with its lease renewed for ever
        node().job_finished(chunk_id)
