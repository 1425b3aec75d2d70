"""A node's intake of live inference requests (contract.live): it pulls requests from the live lists whenever it
has room for one more, claims what one pull brought together, and runs each in a thread of its own (the threads
only wait: the engine batches every running request together). Requests beyond its room stay in Redis for the next
node with room."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from contract import live
from contract.queues import backend_queue, node_queue
from contract.redis_conn import open_connections, sync_client
from worker.node.node import Node
from worker.serving.inference import run_request

# How long one wait on the backend's list lasts before this node's own list is looked at again (requests routed
# to this node alone are rare: only when not every node of the backend can hold the model).
POLL_SECONDS = 0.05
# Requests taken in one round trip at most: a burst is pulled, and reserved, a few round trips for all rather than
# three for each, while several nodes of a backend still share it.
TAKE_AT_ONCE = 16
# Moves up to ARGV[1] requests, this node's own list first, onto its taken list; each move is atomic as LMOVE is.
_TAKE = """
local taken = {}
for _ = 1, tonumber(ARGV[1]) do
  local item = redis.call('LMOVE', KEYS[1], KEYS[3], 'RIGHT', 'LEFT') or
    redis.call('LMOVE', KEYS[2], KEYS[3], 'RIGHT', 'LEFT')
  if not item then break end
  taken[#taken + 1] = item
end
return taken
"""


class Intake:
    def __init__(self, node: Node):
        self.node = node
        self.redis = sync_client(node.settings)  # its own connection: it blocks on it
        room = node.settings.live_max_requests
        self.free = room  # requests this node may still start (guarded by room)
        self.room = threading.Condition()
        self.pool = ThreadPoolExecutor(room, thread_name_prefix="xpujobs-live")
        self._take = self.redis.register_script(_TAKE)
        self.shared = live.live_list(backend_queue(node.backend))
        self.own = live.live_list(node_queue(node.name))
        self.taken = live.taken_list(node.name)
        self._stop = threading.Event()

    def start(self) -> None:
        # What an earlier run of this node pulled and never finished comes back to it (claimed ones are skipped:
        # their lease lapses and the reconciler requeues them).
        while self.redis.lmove(self.taken, self.own, "RIGHT", "LEFT"):
            pass
        # The request threads' connections (node.redis), opened before a burst needs them.
        threading.Thread(target=open_connections, args=(self.node.redis,), name="xpujobs-warm-redis",
                         daemon=True).start()
        threading.Thread(target=self._loop, name="xpujobs-intake", daemon=True).start()

    def stop(self, wait: bool) -> None:
        """Pull nothing more; with wait, return when the running requests have finished."""
        self._stop.set()
        if wait:
            self.pool.shutdown(wait=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.room:
                self.room.wait_for(lambda: self.free > 0)
                wanted = min(self.free, TAKE_AT_ONCE)
            try:
                items = self._take(keys=[self.own, self.shared, self.taken], args=[wanted])
                if not items:
                    item = self.redis.blmove(self.shared, self.taken, POLL_SECONDS, "RIGHT", "LEFT")
                    items = [item] if item is not None else []
            except Exception as exc:  # a Redis blip: try again shortly
                print(f"xpu-jobs intake: {exc}", flush=True)
                items = []
                time.sleep(1)
            if not items:
                continue
            if self._stop.is_set():  # stopping: leave them for another node
                self._give_back(items)
                continue
            pulled = time.time()
            # The whole group claimed in one round trip, here: claimed one by one in the request threads, a burst
            # reached the engine one claim after another (each thread's round trips waiting on the GIL).
            refs = [tuple(item.split(":", 1)) for item in items]
            try:
                claims = self.node.claim_many(refs, {"status": "in_progress", "node": self.node.name})
            except Exception as exc:  # a Redis blip: pulled again (those taken meanwhile: the reconciler's)
                print(f"xpu-jobs intake: could not claim {items}: {exc!r}", flush=True)
                try:
                    self._give_back(items)
                except Exception as again:  # left on the taken list: a restart of this node takes them back
                    print(f"xpu-jobs intake: could not give back {items}: {again!r}", flush=True)
                time.sleep(1)
                continue
            claimed = time.time()
            with self.room:
                self.free -= len(items)
            for item, (kind, record_id), (taken, record) in zip(items, refs, claims):
                self.pool.submit(self._run, item, kind, record_id, record if taken else None, record,
                                 {"pulled": pulled, "claimed": claimed})

    def _give_back(self, items: list[str]) -> None:
        """Back on the backend's list, in their order (the last pulled are at the taken list's left end)."""
        for _ in items:
            self.redis.lmove(self.taken, self.shared, "LEFT", "RIGHT")

    def _run(self, item: str, kind: str, record_id: str, claimed: dict | None, current: dict | None,
             stamps: dict[str, float]) -> None:
        try:
            run_request(self.node, kind, record_id, claimed, current, stamps)
        except Exception as exc:  # run_request records its own failures; this is Redis failing under it
            print(f"xpu-jobs intake: {item}: {exc!r}", flush=True)
        finally:
            with self.room:
                self.free += 1
                self.room.notify()
            try:
                self.redis.lrem(self.taken, 1, item)
            except Exception as exc:  # left there, a restart of this node pulls it again and finds it claimed
                print(f"xpu-jobs intake: {item}: {exc!r}", flush=True)
