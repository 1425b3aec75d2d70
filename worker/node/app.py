"""The Celery app of a worker node. Started by `xpu-jobs worker`, never directly: the launcher pins devices.

The node runs the threads pool: inference requests share the loaded models and are batched together, and a
fine-tune runs in a child process of its own, so no fork ever follows device initialisation.
"""

import os
import sys

from celery import bootsteps, signals

from contract.queues import make_celery, record_of
from contract.settings import Settings

settings = Settings()
app = make_celery(settings, main="worker")
app.conf.imports = ("worker.node.tasks",)
# A Redis outage pauses the node instead of ending it: the consumer reconnects and publishes (a fine-tune handed back
# to the queue, the reconciler's) wait for Redis for as long as it takes. A task is acked when it starts, so a
# publish that gave up would lose its job.
app.conf.broker_connection_max_retries = None
app.conf.task_publish_retry_policy = {"max_retries": None, "interval_start": 0.2, "interval_step": 0.5,
                                      "interval_max": 2}

_state: dict = {}


def node():
    return _state["node"]


@signals.worker_init.connect
def _start_node(**_):
    from worker.node.node import Node
    from worker.node.reconciler import Reconciler

    try:
        _state["node"] = Node(settings)
    except RuntimeError as exc:
        print(f"xpu-jobs worker: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(78)  # EX_CONFIG: a misconfigured node must not sit on the queue doing nothing
    _state["node"].start()
    from worker.engine.model_cache import freeze_heap
    from worker.serving.inference import host_for
    from worker.serving.intake import Intake

    host_for(_state["node"]).start()  # the engine process imports torch and the model libraries meanwhile
    freeze_heap()  # after the imports
    _state["intake"] = Intake(_state["node"])
    _state["intake"].start()
    _state["reconciler"] = Reconciler(settings, app)
    _state["reconciler"].start()
    from worker.node.webhooks import WebhookDispatcher

    _state["webhooks"] = WebhookDispatcher(settings, _state["node"].store, _state["node"].name)
    _state["webhooks"].start()


@signals.task_received.connect
def _reserved(request=None, **_):
    found = record_of(request.name, list(request.args or ())) if request is not None else None
    if found and "node" in _state:
        try:
            _state["node"].reserve(*found)
        except Exception as exc:  # the task still runs; only a death before it starts would go unnoticed
            print(f"xpu-jobs: could not note the reservation of {found[1]}: {exc}", flush=True)


@signals.task_prerun.connect
def _started(task=None, args=None, **_):
    found = record_of(task.name, list(args or ())) if task is not None else None
    if found and "node" in _state:
        _state["node"].task_started(*found)


class _PublishFetchedAgain(bootsteps.StartStopStep):
    """Runs each time the consumer starts, which it does again once it has reconnected after losing the broker:
    what the node had fetched and not started is published again (Node.publish_fetched_again)."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, consumer, **kwargs):
        super().__init__(consumer, **kwargs)
        self.started_before = False

    def start(self, consumer):
        if self.started_before and "node" in _state:
            _state["node"].publish_fetched_again(app)
        self.started_before = True


app.steps["consumer"].add(_PublishFetchedAgain)


@signals.worker_shutting_down.connect
def _begin_shutdown(**_):
    if "intake" in _state:
        _state["intake"].stop(wait=False)  # no new live requests; the running ones finish below
    if "node" in _state:
        _state["node"].stopping.set()


@signals.worker_shutdown.connect
def _stop_node(**_):
    if "reconciler" in _state:
        _state["reconciler"].stop()
    if "webhooks" in _state:
        _state["webhooks"].stop()
    if "intake" in _state:
        _state["intake"].stop(wait=True)
    if "node" in _state:
        from worker.serving.inference import host_for

        host_for(_state["node"]).close()
        _state["node"].stop()
