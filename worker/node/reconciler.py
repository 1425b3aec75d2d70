"""Requeues work whose worker died: a running job whose lease lapsed goes back on a queue (a fine-tune then
resumes from its last checkpoint), up to an attempt limit; a queued job routed to a dead node is re-routed;
a queued record whose task never reached the broker is published; a queued record whose task a node fetched and
then died with (prefetched, or waiting for its countdown: the message sits unacked in Redis for the visibility
timeout) is published again, whatever name the node came back under, since each run of a node is its own instance.

Every worker node runs one; a short Redis lock makes one of them act at a time, and every change is a
compare-and-set on the record, so two reconcilers can never requeue the same job twice. It also offers to run the
retention sweep each period, as API processes do, so a deployment of workers without an API stays bounded too.
"""

import base64
import json
import threading
import time

from celery import Celery

from contract import batches, events, retention
from contract.queues import publish
from contract.records import RecordStore, now
from contract.redis_conn import sync_client
from contract.registry import live_workers
from contract.routing import NoCapableWorker, Requirement, choose_queue
from contract.settings import Settings

# kombu's Redis transport: messages delivered to a consumer and not yet acked, and when each was delivered.
UNACKED, UNACKED_INDEX = "unacked", "unacked_index"
SEEN_INSTANCES = "reconciler:instances"  # node instances seen alive, until the reconciler notices each one gone
RUNNING = {"ftjob": "running", "response": "in_progress", "chat": "in_progress", "completion": "in_progress",
           "chunk": "in_progress"}


class Reconciler:
    def __init__(self, settings: Settings, celery: Celery):
        self.settings = settings
        self.celery = celery
        self.store = RecordStore(sync_client(settings))
        self.redis = self.store.redis
        self._stop = threading.Event()
        # After Redis was away, leases and registry entries may have lapsed with nobody dead: wait a lease period
        # for the heartbeats to renew them before taking anything for lost.
        self._quiet_until = 0.0
        self._sweep_at = time.monotonic() + settings.retention_sweep_seconds

    def start(self) -> None:
        threading.Thread(target=self._loop, name="xpujobs-reconciler", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        interval = max(1.0, self.settings.lease_seconds / 3)
        while not self._stop.wait(interval):
            try:
                if time.monotonic() >= self._quiet_until and \
                        self.redis.set("lock:reconciler", "1", nx=True, px=int(interval * 1000)):
                    self.run_once()
            except Exception as exc:  # keep reconciling after a Redis blip
                self._quiet_until = time.monotonic() + self.settings.lease_seconds
                print(f"xpu-jobs reconciler: {exc}", flush=True)
            if time.monotonic() >= self._sweep_at:
                self._sweep_at = time.monotonic() + self.settings.retention_sweep_seconds
                retention.sweep_when_due(self.store, self.settings.artifact_root, self.settings)

    def run_once(self) -> None:
        # A few round trips per kind, whatever the number of jobs in flight: records, leases and live nodes are
        # each read at once.
        workers = live_workers(self.redis)
        live = {w["node"] for w in workers}
        instances = {w.get("instance") for w in workers}
        stranded = self._fetched_long_ago()
        redis_run = f"reconciled:redis-run:{self.redis.info('server')['run_id']}"
        # Every queued record no node holds is published again on the first whole pass, among all nodes, on this
        # Redis server run (Redis restarted, or first started), and when a node instance has died: a message its
        # consumer had popped and not yet noted as unacked (kombu's fetch is two commands) is gone with it.
        gone = self._instances_gone(instances)
        republish = gone or not self.redis.exists(redis_run)
        for kind in RUNNING:
            record_ids = sorted(self.store.tracked(kind))
            records = self.store.get_many(kind, record_ids)
            holders = events.lease_holders(self.redis, record_ids)
            for record_id, record, holder in zip(record_ids, records, holders):
                if record is None or record["status"] not in ("queued", RUNNING[kind]):
                    self.store.untrack(kind, record_id)
                elif record["status"] == RUNNING[kind] and holder is None:
                    self._requeue(kind, record, "its worker stopped answering")
                elif record["status"] == "queued" and record.get("queue", "").startswith("xpujobs.node.") \
                        and record["queue"].removeprefix("xpujobs.node.") not in live:
                    self._requeue(kind, record, "the worker it was routed to is gone", running=False)
                elif record["status"] == "queued" and record.get("reserved_by") \
                        and record["reserved_by"] not in instances:
                    # Fetched by a node that died before running it: its message is stranded in Redis' unacked.
                    if self.store.transition(kind, record_id, ["queued"], {"reserved_by": None}):
                        publish(self.celery, self.store, kind, record_id, record["queue"])
                elif record["status"] == "queued" and not record.get("reserved_by") and record_id in stranded:
                    # Fetched by a node that died before it could mark the record: taken over from unacked.
                    if self._take_over(stranded[record_id]):
                        publish(self.celery, self.store, kind, record_id, record["queue"])
                elif republish and record["status"] == "queued" and not record.get("reserved_by"):
                    # Its message may be gone: published or fetched in Redis' last moments (a reply can precede the
                    # AOF write when an fsync is slow), or popped by a consumer that died before noting it.
                    publish(self.celery, self.store, kind, record_id, record["queue"])
                elif record["status"] == "queued" and not record.get("published_at") \
                        and now() - int(record.get("created_at") or 0) > self.settings.lease_seconds:
                    # Its publisher died between writing the record and publishing the task.
                    publish(self.celery, self.store, kind, record_id, record["queue"])
        if republish:  # every queued record no node holds was published again: a second delivery is harmless
            self.redis.set(redis_run, now())
        self._finish_batches()

    def _instances_gone(self, live_instances: set) -> bool:
        """Whether a node instance seen alive before is gone now (each is reported once, to one reconciler)."""
        pipe = self.redis.pipeline()
        pipe.smembers(SEEN_INSTANCES)
        if live_instances - {None}:
            pipe.sadd(SEEN_INSTANCES, *(live_instances - {None}))
        gone = pipe.execute()[0] - live_instances
        return bool(gone) and self.redis.srem(SEEN_INSTANCES, *gone) > 0

    def _fetched_long_ago(self) -> dict[str, str]:
        """{record id: delivery tag} of the task messages a node fetched (kombu keeps them in its unacked hash until
        they are acked, when they start) more than a lease ago. A live node marks a record reserved_by as soon as it
        fetches its message; one without the mark was fetched by a node that died first."""
        tags = self.redis.zrangebyscore(UNACKED_INDEX, 0, time.time() - self.settings.lease_seconds)
        found = {}
        for tag, raw in zip(tags, self.redis.hmget(UNACKED, tags) if tags else []):
            try:
                args = json.loads(base64.b64decode(json.loads(raw)[0]["body"]))[0]
            except (TypeError, ValueError, KeyError, IndexError):
                continue
            found.update({arg: tag for arg in args if isinstance(arg, str)})
        return found

    def _take_over(self, tag: str) -> bool:
        """Remove a stranded message from unacked (it would come back after the visibility timeout); False when
        another reconciler took it first. A second delivery would be harmless: a task claims its record by CAS."""
        pipe = self.redis.pipeline()
        pipe.zrem(UNACKED_INDEX, tag)
        pipe.hdel(UNACKED, tag)
        return bool(pipe.execute()[1])

    def _finish_batches(self) -> None:
        """A batch still validating whose creator's lease lapsed (the API process died while it validated and
        split the input, before any of it ran) is failed. One whose chunks have all settled and that is still
        unfinished (the node that settled the last chunk died before it finalised the batch, or midway) is
        finalised here."""
        batch_ids = sorted(self.store.tracked("batch"))
        holders = events.lease_holders(self.redis, batch_ids)
        running = {chunk.rsplit(".", 1)[0] for chunk in self.store.tracked("chunk")}
        for batch_id, record, holder in zip(batch_ids, self.store.get_many("batch", batch_ids), holders):
            if record is None:
                self.store.untrack("batch", batch_id)
            elif record["status"] == "validating" and holder is None:
                message = "The batch's creation was interrupted (its API process stopped); nothing of it ran."
                error = {"code": "creation_interrupted", "line": None, "message": message, "param": None}
                if self.store.transition("batch", batch_id, ["validating"], {
                        "status": "failed", "failed_at": now(), "errors": {"object": "list", "data": [error]}}):
                    self.store.untrack("batch", batch_id)
                    events.emit(self.redis, batch_id, message, level="error", data={"status": "failed"})
            elif record["status"] in batches.UNFINISHED and batch_id not in running \
                    and batches.all_chunks_settled(self.store, record):
                batches.finalize(self.store, self.settings.artifact_root, record)

    def _requeue(self, kind: str, record: dict, why: str, running: bool = True) -> None:
        record_id = record["id"]
        attempts = int(record.get("attempts") or 0)
        status = RUNNING[kind] if running else "queued"
        if attempts >= self.settings.max_attempts:
            message = f"Job failed after {attempts} attempts: {why}."
            if self.store.transition(kind, record_id, [status], {
                    "status": "failed", "finished_at": now(),
                    "error": {"code": "worker_lost", "message": message, "param": None}}):
                self.store.untrack(kind, record_id)
                events.emit(self.redis, record_id, message, level="error", data={"status": "failed"})
                events.signal_done(self.redis, record_id)
                if kind == "chunk":  # its lines end in the error file, and the batch still finalises
                    batches.fail_chunk(self.store, self.settings.artifact_root, record, "worker_lost", message)
            return
        try:
            need = Requirement(memory_bytes=0, bf16=bool(record.get("bf16")))
            queue = choose_queue(live_workers(self.redis), need)
        except NoCapableWorker:
            return  # no worker now; try again next round
        if not self.store.transition(kind, record_id, [status], {"status": "queued", "queue": queue,
                                                               "reserved_by": None}):
            return
        step = max((c["step_number"] for c in record.get("checkpoints", [])), default=None)
        resume = f", resuming from checkpoint step {step}" if step else ""
        events.emit(self.redis, record_id, f"Requeued (attempt {attempts + 1}): {why}{resume}", level="warn",
                    data={"status": "queued"})
        publish(self.celery, self.store, kind, record_id, queue)
