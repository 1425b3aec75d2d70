"""The live-worker registry: each worker node refreshes its entry; a lapsed entry means a dead worker.

Entries are keys with a TTL, listed in one set, so reading the registry costs O(workers) rather than a SCAN of
the whole keyspace (which holds every job record too) on each request that routes a job.
"""

import json
import time
from typing import Any

import redis

KEY_PREFIX = "worker:"
INDEX = "workers"  # set of node names that have registered; lapsed ones are dropped when read


def register(client: redis.Redis, node: str, info: dict[str, Any], ttl_seconds: float) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.set(KEY_PREFIX + node, json.dumps({**info, "heartbeat_at": int(time.time())}), px=int(ttl_seconds * 1000))
    pipe.sadd(INDEX, node)
    pipe.execute()


def unregister(client: redis.Redis, node: str) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.delete(KEY_PREFIX + node)
    pipe.srem(INDEX, node)
    pipe.execute()


def live_workers(client: redis.Redis) -> list[dict[str, Any]]:
    nodes = sorted(client.smembers(INDEX))
    values = client.mget([KEY_PREFIX + n for n in nodes]) if nodes else []
    lapsed = [n for n, v in zip(nodes, values) if v is None]
    if lapsed:
        client.srem(INDEX, *lapsed)  # a node that comes back registers itself again
    return [json.loads(v) for v in values if v]
