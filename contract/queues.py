"""Task and queue names, and the Celery configuration both sides share.

The API only publishes by name (send_task); it never imports worker code.
"""

from celery import Celery

from contract import live
from contract.records import RecordStore, now
from contract.settings import Settings

TASK_FINE_TUNE = "xpujobs.fine_tune"
TASK_BATCH_CHUNK = "xpujobs.batch_chunk"
# The task that runs each kind of record that goes through Celery (live inference does not: contract.live).
TASK_OF = {"ftjob": TASK_FINE_TUNE, "chunk": TASK_BATCH_CHUNK}


def backend_queue(backend: str) -> str:
    """Jobs any worker of this device type may take."""
    return f"xpujobs.{backend}"


def node_queue(node: str) -> str:
    """Jobs for one worker node only (when not every worker of the type could run them)."""
    return f"xpujobs.node.{node}"


def make_celery(settings: Settings, main: str = "xpujobs") -> Celery:
    app = Celery(main, broker=settings.redis_url)
    # Fine-tuning tasks are acked when they start and guarded by the job record's lease instead:
    # a late ack with Redis' visibility timeout would run an hours-long job twice.
    app.conf.update(
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 12 * 3600},
        task_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=False,
        worker_send_task_events=True,
        task_send_sent_event=True,
    )
    return app


def record_of(task_name: str, args: list) -> tuple[str, str] | None:
    """(kind, record id) of a task message: publish's arguments read back."""
    kind = {TASK_FINE_TUNE: "ftjob", TASK_BATCH_CHUNK: "chunk"}.get(task_name)
    return (kind, args[0]) if kind else None


def publish(celery: Celery, store: RecordStore, kind: str, record_id: str, queue: str, *,
            countdown: float | None = None) -> None:
    """Put a record's task on a queue, then note that it got there: the reconciler re-publishes a queued record
    whose publisher died in between. A second delivery is harmless, since a task claims its record by
    compare-and-set."""
    if kind in live.LIVE_KINDS:
        live.push(store.redis, queue, kind, record_id)
    else:
        celery.send_task(TASK_OF[kind], args=[record_id], queue=queue, countdown=countdown)
    store.update(kind, record_id, {"published_at": now()})
