"""Streamed output on its way to the API: each engine delta of a streaming request becomes an entry of the
request's Redis stream (contract.live). One thread per node writes them, as many per round trip as are waiting,
so the engine host's reader thread (which calls on_delta for every request) never waits on Redis."""

import queue
import threading

import redis

from contract.live import OUTPUT_TTL_SECONDS, output_key
from worker.engine.requests import GenerationDelta


class OutputStreams:
    def __init__(self, client: redis.Redis):
        self._redis = client
        self._outbox: queue.SimpleQueue[tuple[str, dict]] = queue.SimpleQueue()
        self._started: set[str] = set()  # requests whose first delta went out
        threading.Thread(target=self._run, name="xpujobs-output-streams", daemon=True).start()

    def delta(self, record_id: str, choice: int, delta: GenerationDelta) -> None:
        # The first goes out even without text (a token still held back, say): the client's stream starts then.
        if delta.text or record_id not in self._started:
            self._started.add(record_id)
            self._outbox.put((record_id, {"c": choice, "t": delta.text}))

    def end(self, record_id: str) -> None:
        """After the record holds the final status and result: the reader reads them then."""
        self._started.discard(record_id)
        self._outbox.put((record_id, {"end": 1}))

    def _run(self) -> None:
        while True:
            entries = [self._outbox.get()]
            while True:
                try:
                    entries.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            pipe = self._redis.pipeline(transaction=False)
            for record_id, fields in entries:
                pipe.xadd(output_key(record_id), fields)
            for record_id in {record_id for record_id, _ in entries}:
                pipe.expire(output_key(record_id), OUTPUT_TTL_SECONDS)
            try:
                pipe.execute()
            except redis.RedisError as exc:  # the API reader times out and the record still has the result
                print(f"xpu-jobs output streams: {exc}", flush=True)
