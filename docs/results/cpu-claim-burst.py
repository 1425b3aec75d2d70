"""The intake's pull -> claim hop alone, against a real Redis: a burst of N queued live records claimed the old
way (the reservation's round trip per group of 16, then a thread per request: get, lease, compare-and-set, 3 round
trips each, as worker/serving/inference.py did before commit 2fdd935) or the new way (RecordStore.claim_many per
group of 16, as worker/serving/intake.py does now). Prints when the requests were claimed, from the start.

    redis-server --port 6391 --save '' --appendonly no &
    PYTHONPATH=$PWD .venv/bin/python docs/results/cpu-claim-burst.py 6391 64 old   # or new
"""

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from contract import events
from contract.records import RecordStore, new_id
from contract.redis_conn import durable_client
from contract.settings import Settings

GROUP = 16  # worker/serving/intake.py's TAKE_AT_ONCE
FIELDS = {"status": "in_progress", "node": "n"}


def main(port: int, n: int, mode: str) -> None:
    client = durable_client(Settings(_env_file=None, redis_url=f"redis://127.0.0.1:{port}/0"))
    store = RecordStore(client)
    ids = [new_id("chat") for _ in range(n)]
    store.create_many("chat", [{"id": i, "tenant": "t", "status": "queued", "created_at": 0,
                                "request": {"stream": True}, "timings": {"received": 0.0}} for i in ids])
    pool = ThreadPoolExecutor(256)
    for future in [pool.submit(client.ping) for _ in range(64)]:  # connections opened before the clock
        future.result()
    done: dict[str, float] = {}
    t0 = time.perf_counter()

    def old_one(record_id: str) -> None:
        record = store.get("chat", record_id)
        events.refresh_lease(client, record_id, "n", 30)
        store.transition("chat", record_id, ["queued"],
                         {**FIELDS, "attempts": int(record.get("attempts") or 0) + 1})
        done[record_id] = time.perf_counter() - t0

    futures = []
    for g in range(0, n, GROUP):
        group = ids[g:g + GROUP]
        if mode == "old":
            pipe = client.pipeline(transaction=False)  # the reservation's round trip
            for record_id in group:
                pipe.hset(f"rec:chat:{record_id}", "reserved_by", '"n/1"')
            pipe.execute()
            futures += [pool.submit(old_one, record_id) for record_id in group]
        else:
            store.claim_many([("chat", i) for i in group], ["queued"], {**FIELDS, "reserved_by": "n/1"},
                             [events.lease_key(i) for i in group], "n", 30)
            done.update(dict.fromkeys(group, time.perf_counter() - t0))
    for future in futures:
        future.result()
    at = sorted(done.values())
    print(f"{mode} n={n}: claimed p50 {1e3 * statistics.median(at):.1f} ms, last {1e3 * at[-1]:.1f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
