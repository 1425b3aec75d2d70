"""The worker side's durable Redis client under more concurrent callers than it has connections (a node runs up
to XPUJOBS_LIVE_MAX_REQUESTS request threads): each call waits for a free connection. Was: redis-py's default pool
(100 connections) refused the excess with MaxConnectionsError, outside the retry, and the node dropped those
requests (a burst of 300 chats on a cold model: 86 of them answered 504 after the request timeout)."""

from concurrent.futures import ThreadPoolExecutor

from contract.redis_conn import durable_client
from contract.settings import Settings

CALLERS = 150  # more than the 100 connections of a process


def test_more_callers_than_connections_wait_for_one(redis_url):
    client = durable_client(Settings(redis_url=redis_url))

    def call(n: int):  # holds its connection for a moment, as a request thread's bookkeeping can
        return client.blpop([f"test:durable-pool:{n}"], timeout=0.5)

    with ThreadPoolExecutor(CALLERS) as pool:
        assert list(pool.map(call, range(CALLERS))) == [None] * CALLERS
    assert client.connection_pool.max_connections == Settings(redis_url=redis_url).redis_max_connections
