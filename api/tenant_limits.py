"""Limits per tenant: API calls per minute, jobs not yet ended, bytes of stored files (settings: requests_per_minute,
max_active_jobs, max_stored_bytes, tenant_limits). Over one, the call gets OpenAI's 429 shape; the rate limit's
says when to retry (retry-after). Counted in Redis, so every API process sees the same numbers."""

import math
import time

from limits import RateLimitItemPerMinute
from limits.storage import RedisStorage
from limits.strategies import MovingWindowRateLimiter

from api.errors import APIError
from contract.records import RecordStore
from contract.settings import Settings

# Statuses of fine-tuning jobs and batches that have not ended.
ACTIVE = {"ftjob": {"validating_files", "queued", "running"},
          "batch": {"validating", "in_progress", "finalizing", "cancelling"}}
# A job takes minutes: when to look again after a refusal for too many of them.
ACTIVE_RETRY_SECONDS = 30


class TenantLimiter:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.rate = MovingWindowRateLimiter(RedisStorage(settings.redis_url, key_prefix="xpujobs-ratelimit"))

    def limits_rate(self, tenant: str) -> bool:
        return bool(self.settings.limit(tenant, "requests_per_minute"))

    def check_rate(self, tenant: str) -> None:
        per_minute = self.settings.limit(tenant, "requests_per_minute")
        if not per_minute:
            return
        item = RateLimitItemPerMinute(per_minute)
        if self.rate.hit(item, tenant):
            return
        reset = self.rate.get_window_stats(item, tenant).reset_time
        retry = max(1, math.ceil(reset - time.time()))
        raise APIError(429, f"Rate limit reached for requests: limit {per_minute} per minute. "
                            f"Please try again in {retry}s.", code="rate_limit_exceeded",
                       headers={"retry-after": str(retry), "x-ratelimit-limit-requests": str(per_minute),
                                "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": f"{retry}s"})

    def check_active_jobs(self, store: RecordStore, tenant: str) -> None:
        """Fine-tuning jobs and batches of the tenant that have not ended, against max_active_jobs."""
        limit = self.settings.limit(tenant, "max_active_jobs")
        if not limit:
            return
        active = 0
        for kind, statuses in ACTIVE.items():
            ids = list(store.tracked(kind))
            active += sum(1 for r in store.get_many(kind, ids)
                          if r and r.get("tenant") == tenant and r.get("status") in statuses)
        if active >= limit:
            raise APIError(429, f"You have {active} fine-tuning jobs and batches running or queued, the limit is "
                                f"{limit}. Wait for one to end (or cancel one) and try again.",
                           code="concurrent_jobs_limit_exceeded",
                           headers={"retry-after": str(ACTIVE_RETRY_SECONDS)})

    def storage_left(self, store: RecordStore, tenant: str) -> int | None:
        """Bytes the tenant may still store (None: no limit)."""
        limit = self.settings.limit(tenant, "max_stored_bytes")
        if not limit:
            return None
        return max(0, limit - store.stored_bytes(tenant))


def storage_refused(limit: int) -> APIError:
    return APIError(429, f"Storing this file would exceed your storage limit of {limit} bytes. Delete files "
                         "you no longer need and try again.", param="file", code="storage_limit_exceeded")
