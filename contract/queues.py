"""Task and queue names, and the Celery configuration both sides share.

The API only publishes by name (send_task); it never imports worker code.
"""

from celery import Celery

from contract.settings import Settings

TASK_FINE_TUNE = "xpujobs.fine_tune"
TASK_INFERENCE = "xpujobs.inference"
TASK_BATCH_CHUNK = "xpujobs.batch_chunk"


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
