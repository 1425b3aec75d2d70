"""State of this worker node: its devices, the jobs it runs, its registry heartbeat and its job leases."""

import os
import secrets
import threading
import time
from typing import Callable

from contract import events, registry
from contract.queues import publish
from contract.records import RecordStore
from contract.redis_conn import durable_client, sync_client
from contract.settings import Settings
from worker.node import devices

# While Redis is away, how often the heartbeat tries again: a restarted Redis lost or expired the registry entry,
# and until the node writes it again the API cannot route to it.
RECONNECT_SECONDS = 0.2


class Node:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.name = os.environ.get("XPUJOBS_NODE_NAME", "worker@local")
        self.backend = devices.detect_backend(os.environ.get("XPUJOBS_DEVICE_BACKEND", settings.device_backend))
        self.devices = devices.describe(self.backend)
        self.mask = os.environ.get(devices.MASK_VARIABLE.get(self.backend, ""), None)
        # This run of the node: a node restarted under the same name is another instance, and what its predecessor
        # had fetched is not delivered to it again.
        self.instance = f"{self.name}/{secrets.token_hex(4)}"
        self.store = RecordStore(durable_client(settings))
        self.redis = self.store.redis
        # The heartbeat's own client fails fast instead of waiting for Redis, so the beat notices it is back at once.
        self._beat_redis = sync_client(settings)
        self.started_at = int(time.time())
        self.current_jobs: set[str] = set()
        self._fetched: set[tuple[str, str]] = set()  # (kind, record id) of tasks received and not started
        self.training_slot = threading.Lock()  # one fine-tune at a time per device group
        self.reporters: list[Callable[[], dict]] = []  # more to publish in the registry (loaded models)
        self._stop = threading.Event()
        # Set when the node begins its warm shutdown: running fine-tunes checkpoint, stop and go back on a queue.
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.metrics_port: int | None = None  # set once its Prometheus endpoint listens

    def info(self) -> dict:
        with self._lock:
            jobs = sorted(self.current_jobs)
        free = devices.free_memory(self.backend)
        reported = {k: v for report in self.reporters for k, v in report().items()}
        # device index -> bytes the engine process would give back by evicting its idle models (none before it runs)
        reclaimable = reported.pop("reclaimable_memory", {})
        described = [{**d, "free_memory": f, "reclaimable_memory": reclaimable.get(d["index"], 0)}
                     for d, f in zip(self.devices, free)]
        return {
            "node": self.name, "backend": self.backend, "device_ids": self.mask, "devices": described,
            "reclaimable_memory": sum(d["reclaimable_memory"] for d in described),  # what routing adds to free
            "bf16": all(d["bf16"] for d in self.devices),
            "current_jobs": jobs, "current_job": jobs[0] if jobs else None, "pid": os.getpid(),
            "started_at": self.started_at, "metrics_port": self.metrics_port, "instance": self.instance,
        } | reported

    def reserve(self, kind: str, record_id: str) -> None:
        """A task of this record reached this node (to run now, after others, or at its countdown): if the node dies
        before claiming it, the message sits unacked in Redis, and the reconciler publishes the record again."""
        with self._lock:
            self._fetched.add((kind, record_id))
        self.store.transition(kind, record_id, ["queued"], {"reserved_by": self.instance})

    def task_started(self, kind: str, record_id: str) -> None:
        with self._lock:
            self._fetched.discard((kind, record_id))

    def publish_fetched_again(self, celery) -> None:
        """After the broker connection was lost: kombu hands the tasks this node had fetched and not started back to
        their queue, which fails while Redis is away (the message then waits out the 12 h visibility timeout, its
        record `queued` and reserved by this live node). Publish each such record again; a second delivery is
        harmless, as a task claims its record by compare-and-set."""
        with self._lock:
            fetched, self._fetched = self._fetched, set()
        for kind, record_id in sorted(fetched):
            record = self.store.get(kind, record_id)
            if record and record["status"] == "queued" and \
                    self.store.transition(kind, record_id, ["queued"], {"reserved_by": None}):
                publish(celery, self.store, kind, record_id, record["queue"])

    def claim_many(self, records: list[tuple[str, str]], fields: dict) -> list[tuple[bool, dict | None]]:
        """claim for several queued (kind, record id) at once, in one round trip (each lease and status set in
        one step, attempts counted, reserved_by this instance): (whether it was taken, the record after) each."""
        ids = [record_id for _, record_id in records]
        with self._lock:  # before the leases exist, so a heartbeat between them renews them
            # Only ids this node is not running already: a second delivery that loses must not drop the first's.
            added = {i for i in ids if i not in self.current_jobs}
            self.current_jobs.update(added)
        try:
            # Held by the instance, not the name: a node restarted under the same name while its old run is
            # frozen must not renew the old run's leases, nor the thawed old run release the new one's.
            claims = self.store.claim_many(records, ["queued"], {**fields, "reserved_by": self.instance},
                                           [events.lease_key(i) for i in ids], self.instance,
                                           self.settings.lease_seconds)
        except Exception:  # what was taken meanwhile is not renewed: its lease lapses and the reconciler requeues it
            with self._lock:
                self.current_jobs.difference_update(added)
            raise
        with self._lock:
            self.current_jobs.difference_update(i for i, (taken, _) in zip(ids, claims) if not taken and i in added)
        return claims

    def claim(self, kind: str, record_id: str, fields: dict) -> dict | None:
        """Take one queued record (claim_many for one): the record as taken, attempts counted, or None when it was
        not queued (another delivery took it, or it was cancelled). The lease and the status change in one step,
        so the reconciler never sees it running without a lease, and a claim that loses leaves the winner's."""
        [(taken, record)] = self.claim_many([(kind, record_id)], fields)
        return record if taken else None

    def job_finished(self, job_id: str) -> None:
        with self._lock:
            self.current_jobs.discard(job_id)
        events.release_lease(self.redis, job_id, self.instance)

    def heartbeat(self, client=None) -> None:
        """Refresh the leases and the registry entry, through `client` (the beat's fail-fast one), by default the
        durable one, which waits for Redis (the first beat, at start)."""
        client = client or self.redis
        # Leases first: they are what keeps running work from being requeued.
        with self._lock:
            jobs = list(self.current_jobs)
        events.renew_leases(client, jobs, self.instance, self.settings.lease_seconds)
        registry.register(client, self.name, self.info(), self.settings.lease_seconds)

    def start(self) -> None:
        from worker.node import metrics

        self.metrics_port = metrics.serve(self.settings.worker_metrics_port)
        self.heartbeat()
        threading.Thread(target=self._beat, name="xpujobs-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(RECONNECT_SECONDS if failing else self.settings.heartbeat_seconds):
            try:
                self.heartbeat(self._beat_redis)
            except Exception as exc:  # Redis blips must not kill the heartbeat; the lease tolerates a miss.
                if not failing:
                    print(f"xpu-jobs heartbeat failed: {exc}; retrying every {RECONNECT_SECONDS} s", flush=True)
                failing = True
            else:
                if failing:
                    print("xpu-jobs heartbeat: Redis is back, registered again", flush=True)
                failing = False

    def stop(self) -> None:
        self._stop.set()
        try:  # without waiting for a Redis that is away: the entry lapses by itself
            registry.unregister(sync_client(self.settings), self.name)
        except Exception as exc:
            print(f"xpu-jobs: could not unregister {self.name}: {exc}", flush=True)
