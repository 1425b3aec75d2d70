"""Redis clients for the shared keyspace.

Both kinds take connections from a blocking pool (a burst waits for a free connection instead of failing once
the pool is spent), check idle connections before use and retry a command briefly on a dropped connection, so
they recover by themselves after a Redis restart. A longer outage surfaces as redis.ConnectionError, except on the
worker side's durable client, which waits for Redis however long it is away.
"""

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.driver_info import DriverInfo
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

from contract.settings import Settings

RETRIES = 3
HEALTH_CHECK_SECONDS = 5
# What each new connection sends in CLIENT SETINFO, read once: left to redis-py, every connection reads the installed
# package's metadata again (~1 ms of CPU each, with the GIL held), which a burst that opens connections pays per
# request.
DRIVER = DriverInfo()


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=0.5, base=0.05)


def sync_client(settings: Settings) -> redis.Redis:
    pool = redis.BlockingConnectionPool.from_url(
        settings.redis_url, decode_responses=True, max_connections=settings.redis_max_connections,
        timeout=settings.redis_pool_timeout_seconds, health_check_interval=HEALTH_CHECK_SECONDS,
        socket_connect_timeout=5, socket_keepalive=True, retry=Retry(_backoff(), RETRIES), driver_info=DRIVER)
    return redis.Redis(connection_pool=pool)


def durable_client(settings: Settings) -> redis.Redis:
    """For the worker side (node, batch chunks, trainer): a call made while Redis is away waits for it to come back,
    however long that takes, so an outage pauses work instead of failing a job halfway through its bookkeeping. A
    call made while every connection is in use waits for one, however long (a node runs up to
    XPUJOBS_LIVE_MAX_REQUESTS request threads, more than its connections; redis-py's default pool would refuse the
    excess, outside the retry, and drop those requests)."""
    pool = redis.BlockingConnectionPool.from_url(
        settings.redis_url, decode_responses=True, max_connections=settings.redis_max_connections, timeout=None,
        health_check_interval=HEALTH_CHECK_SECONDS, socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=-1),
        retry_on_error=[ConnectionError, TimeoutError], driver_info=DRIVER)
    return redis.Redis(connection_pool=pool)


def async_client(settings: Settings) -> aioredis.Redis:
    # The API's waiters (a synchronous chat holds a connection for each short BLPOP) may queue for a connection
    # as long as their request may last: a burst is slower, never refused.
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, decode_responses=True, max_connections=settings.redis_max_connections,
        timeout=max(settings.redis_pool_timeout_seconds, settings.request_timeout_seconds),
        health_check_interval=HEALTH_CHECK_SECONDS,
        socket_connect_timeout=5, socket_keepalive=True, retry=AsyncRetry(_backoff(), RETRIES), driver_info=DRIVER)
    return aioredis.Redis(connection_pool=pool)


# Connections a process opens before its first burst: a live request holds one while it waits (a stream's blocking
# read in the API, a request thread's calls in a node), and one opened during a burst is a connect and a handshake
# that the request waits for, per request.
WARM_CONNECTIONS = 32


def open_connections(client: redis.Redis, n: int = WARM_CONNECTIONS) -> None:
    """Open up to n of the client's pool's connections and leave them in the pool (fewer if Redis is away)."""
    pool, opened = client.connection_pool, []
    try:
        for _ in range(min(n, pool.max_connections)):
            opened.append(pool.get_connection())
    except (ConnectionError, TimeoutError, OSError):
        pass
    finally:
        for connection in opened:
            pool.release(connection)


async def open_connections_async(client: aioredis.Redis, n: int = WARM_CONNECTIONS) -> None:
    """open_connections for an asyncio client."""
    pool = client.connection_pool
    opened = []
    try:
        for _ in range(min(n, pool.max_connections)):
            opened.append(await pool.get_connection())
    except (ConnectionError, TimeoutError, OSError):
        pass
    finally:
        for connection in opened:
            await pool.release(connection)
