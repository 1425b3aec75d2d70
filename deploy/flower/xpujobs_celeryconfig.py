"""Celery settings for Flower (docker compose --profile monitoring), loaded with `celery --config`.

Flower consumes from the same Redis broker as the workers, and kombu's Redis transport lets any consumer put
back every unacknowledged message older than *its own* visibility timeout (the shortest one wins). Celery's
default is 1 hour; the workers use contract.queues.make_celery's 12 hours, so Flower must use the same value
(tests/test_deploy.py checks that the two agree).
"""

import os

broker_url = os.environ.get("XPUJOBS_REDIS_URL", "redis://redis:6379/0")
broker_connection_retry_on_startup = True
broker_transport_options = {"visibility_timeout": 12 * 3600}
