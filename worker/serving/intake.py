"""A node's intake of live inference requests (contract.live): it pulls a request from the live lists whenever
it has room for one more and runs it in a thread of its own (the threads only wait: the engine batches every
running request together). Requests beyond its room stay in Redis for the next node with room."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from contract import live
from contract.queues import backend_queue, node_queue
from contract.redis_conn import sync_client
from worker.node.node import Node
from worker.serving.inference import run_request

# How long one wait on the backend's list lasts before this node's own list is looked at again (requests routed
# to this node alone are rare: only when not every node of the backend can hold the model).
POLL_SECONDS = 0.05
# The most requests one pull takes from the backend's list when many wait (a burst), so that the other nodes of
# the backend still get their share of it.
PULL_AT_ONCE = 16


class Intake:
    def __init__(self, node: Node):
        self.node = node
        self.redis = sync_client(node.settings)  # its own connection: it blocks on it
        room = node.settings.live_max_requests
        self.room = threading.BoundedSemaphore(room)
        self.pool = ThreadPoolExecutor(room, thread_name_prefix="xpujobs-live")
        self.shared = live.live_list(backend_queue(node.backend))
        self.own = live.live_list(node_queue(node.name))
        self.taken = live.taken_list(node.name)
        self._stop = threading.Event()

    def start(self) -> None:
        # What an earlier run of this node pulled and never finished comes back to it (claimed ones are skipped:
        # their lease lapses and the reconciler requeues them).
        while self.redis.lmove(self.taken, self.own, "RIGHT", "LEFT"):
            pass
        threading.Thread(target=self._loop, name="xpujobs-intake", daemon=True).start()

    def stop(self, wait: bool) -> None:
        """Pull nothing more; with wait, return when the running requests have finished."""
        self._stop.set()
        if wait:
            self.pool.shutdown(wait=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.room.acquire()
            try:
                item = self.redis.lmove(self.own, self.taken, "RIGHT", "LEFT") or \
                    self.redis.blmove(self.shared, self.taken, POLL_SECONDS, "RIGHT", "LEFT")
                # A burst: what else waits, as far as there is room, comes in the same round trip.
                items = [item, *self._more()] if item is not None else []
            except Exception as exc:  # a Redis blip: try again shortly
                print(f"xpu-jobs intake: {exc}", flush=True)
                items = []
                time.sleep(1)
            if not items or self._stop.is_set():
                for _ in items:  # stopping: leave them for another node
                    self.redis.lmove(self.taken, self.shared, "LEFT", "RIGHT")
                self.room.release()
                continue
            self._reserve(items)
            for item in items:
                self.pool.submit(self._run, item)

    def _more(self) -> list[str]:
        """Up to the room left (at most PULL_AT_ONCE - 1) further requests from the backend's list, in one round
        trip; the room of each one not there is given back."""
        slots = 0
        while slots < PULL_AT_ONCE - 1 and self.room.acquire(blocking=False):
            slots += 1
        if not slots:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for _ in range(slots):
            pipe.lmove(self.shared, self.taken, "RIGHT", "LEFT")
        items = [item for item in pipe.execute() if item is not None]
        for _ in range(slots - len(items)):
            self.room.release()
        return items

    def _reserve(self, items: list[str]) -> None:
        """As a Celery task's arrival does: a node gone before claiming them leaves them to the reconciler."""
        by_kind: dict[str, list[str]] = {}
        for item in items:
            kind, record_id = item.split(":", 1)
            by_kind.setdefault(kind, []).append(record_id)
        for kind, record_ids in by_kind.items():
            try:
                self.node.reserve_many(kind, record_ids)
            except Exception as exc:
                print(f"xpu-jobs intake: could not note the reservation of {kind} {record_ids}: {exc}", flush=True)

    def _run(self, item: str) -> None:
        try:
            kind, record_id = item.split(":", 1)
            run_request(self.node, kind, record_id)
        except Exception as exc:  # run_request records its own failures; this is Redis failing under it
            print(f"xpu-jobs intake: {item}: {exc!r}", flush=True)
        finally:
            self.room.release()
            try:
                self.redis.lrem(self.taken, 1, item)
            except Exception as exc:  # left there, a restart of this node pulls it again and finds it claimed
                print(f"xpu-jobs intake: {item}: {exc!r}", flush=True)
