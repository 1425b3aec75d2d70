"""The worker side's durable Redis client under more concurrent callers than it has connections (a node runs up
to XPUJOBS_LIVE_MAX_REQUESTS request threads): each call waits for a free connection. Was: redis-py's default pool
(100 connections) refused the excess with MaxConnectionsError, outside the retry, and the node dropped those
requests (a burst of 300 chats on a cold model: 86 of them answered 504 after the request timeout)."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from contract.redis_conn import async_client, durable_client, open_connections, open_connections_async, sync_client
from contract.settings import Settings
from worker.node.redis_server import free_port

CALLERS = 150  # more than the 100 connections of a process


def test_more_callers_than_connections_wait_for_one(redis_url):
    client = durable_client(Settings(redis_url=redis_url))

    def call(n: int):  # holds its connection for a moment, as a request thread's bookkeeping can
        return client.blpop([f"test:durable-pool:{n}"], timeout=0.5)

    with ThreadPoolExecutor(CALLERS) as pool:
        assert list(pool.map(call, range(CALLERS))) == [None] * CALLERS
    assert client.connection_pool.max_connections == Settings(redis_url=redis_url).redis_max_connections


def test_connections_opened_ahead_serve_calls_and_redis_away_is_no_error(redis_url):
    """What the API and a node open before their first burst: kept in the pool for the calls that follow; with
    Redis away (the API may start first) it opens none and raises nothing."""
    client = sync_client(Settings(redis_url=redis_url))
    open_connections(client, 4)
    assert client.ping()

    async def ahead(url: str) -> bool:
        client = async_client(Settings(redis_url=url))
        await open_connections_async(client, 4)
        return url != redis_url or await client.ping()

    assert asyncio.run(ahead(redis_url))
    away = f"redis://127.0.0.1:{free_port()}/0"
    open_connections(sync_client(Settings(redis_url=away)), 4)
    assert asyncio.run(ahead(away))
