"""Redis clients for the shared keyspace."""

import redis
import redis.asyncio as aioredis

from contract.settings import Settings


def sync_client(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url, decode_responses=True)


def async_client(settings: Settings) -> aioredis.Redis:
    return aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
