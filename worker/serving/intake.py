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
            except Exception as exc:  # a Redis blip: try again shortly
                print(f"xpu-jobs intake: {exc}", flush=True)
                item = None
                time.sleep(1)
            if item is None or self._stop.is_set():
                if item is not None:  # stopping: leave it for another node
                    self.redis.lmove(self.taken, self.shared, "LEFT", "RIGHT")
                self.room.release()
                continue
            try:  # as a Celery task's arrival does: a node gone before claiming it leaves it to the reconciler
                self.node.reserve(*item.split(":", 1))
            except Exception as exc:
                print(f"xpu-jobs intake: could not note the reservation of {item}: {exc}", flush=True)
            self.pool.submit(self._run, item, time.time())

    def _run(self, item: str, pulled: float) -> None:
        try:
            kind, record_id = item.split(":", 1)
            run_request(self.node, kind, record_id, pulled)
        except Exception as exc:  # run_request records its own failures; this is Redis failing under it
            print(f"xpu-jobs intake: {item}: {exc!r}", flush=True)
        finally:
            self.room.release()
            try:
                self.redis.lrem(self.taken, 1, item)
            except Exception as exc:  # left there, a restart of this node pulls it again and finds it claimed
                print(f"xpu-jobs intake: {item}: {exc!r}", flush=True)
