"""Routing a new job to a queue from the live-worker registry, allowing for a registry that Redis is rebuilding.

Registry entries expire with the lease. After a Redis restart the registry is empty or partial (entries expired
while Redis was down, or were lost with its last second of writes) until each node's next heartbeat, which a node
sends at once when it reaches Redis again. So a job that no listed worker can run, while Redis has been up for
less than a lease, waits briefly for the nodes to come back; if they have not, it is a 503 to retry (a
server-side condition), not the client's 400.
"""

import time

import redis

from api.errors import RETRY_AFTER_SECONDS, APIError
from contract.registry import live_workers
from contract.routing import NoCapableWorker, Requirement, choose_queue
from contract.settings import Settings

POLL_SECONDS = 0.2


def _rebuilding(client: redis.Redis, settings: Settings) -> bool:
    return int(client.info("server")["uptime_in_seconds"]) < settings.lease_seconds


def route(client: redis.Redis, need: Requirement, settings: Settings, param: str | None = "model"
          ) -> tuple[str, list[dict]]:
    """The queue for a job (and the live workers it was chosen from). Raises a 400 no_capable_worker, or while the
    registry is being rebuilt and the wait was not enough, a 503 service_unavailable."""
    # Every live node writes its entry each heartbeat: two of them is long enough to hear from all of them.
    deadline = time.monotonic() + 2 * settings.heartbeat_seconds
    while True:
        workers = live_workers(client)
        try:
            return choose_queue(workers, need), workers
        except NoCapableWorker as exc:
            if not _rebuilding(client, settings):
                raise APIError(400, str(exc), param=param, code="no_capable_worker") from None
            if time.monotonic() >= deadline:
                raise APIError(503, f"Redis restarted moments ago and the worker registry is still being rebuilt "
                                    f"({exc}); retry shortly.", code="service_unavailable",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        time.sleep(POLL_SECONDS)
