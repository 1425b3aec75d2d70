"""The live-worker registry: each worker node refreshes its entry; a lapsed entry means a dead worker."""

import json
import time
from typing import Any

import redis

KEY_PREFIX = "worker:"


def register(client: redis.Redis, node: str, info: dict[str, Any], ttl_seconds: float) -> None:
    client.set(KEY_PREFIX + node, json.dumps({**info, "heartbeat_at": int(time.time())}),
               px=int(ttl_seconds * 1000))


def unregister(client: redis.Redis, node: str) -> None:
    client.delete(KEY_PREFIX + node)


def live_workers(client: redis.Redis) -> list[dict[str, Any]]:
    keys = sorted(client.scan_iter(match=KEY_PREFIX + "*", count=500))
    values = client.mget(keys) if keys else []
    return [json.loads(v) for v in values if v]


def is_live(client: redis.Redis, node: str) -> bool:
    return client.exists(KEY_PREFIX + node) == 1
