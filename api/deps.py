"""Dependencies shared by the routers: settings, the record store, Redis, Celery, and the caller's tenant."""

import asyncio
import hmac
from typing import Annotated

import redis
from celery import Celery
from fastapi import Depends, Header, Request

from api.errors import APIError
from api.tenant_limits import TenantLimiter
from contract.records import RecordStore
from contract.settings import Settings


# Dependencies are coroutines: a plain function would be run in the thread pool, a hand-off per dependency and
# request, which a burst of requests queues for behind each other's Redis calls.
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> RecordStore:
    return request.app.state.store


async def get_redis(request: Request) -> redis.Redis:
    return request.app.state.store.redis


async def get_celery(request: Request) -> Celery:
    return request.app.state.celery


async def get_limiter(request: Request) -> TenantLimiter:
    return request.app.state.limiter


def _matching(given: str, keys) -> str | None:
    """The key equal to `given`, compared in constant time against every key (no early exit), so the time
    taken says nothing about how much of a key was right."""
    found = None
    for key in keys:
        if hmac.compare_digest(given.encode(), key.encode()):
            found = key
    return found


def _bearer(authorization: str | None) -> str:
    if not authorization or not authorization.lower().startswith("bearer "):
        raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                       code="missing_api_key")
    return authorization[7:].strip()


async def get_tenant(request: Request, settings: Annotated[Settings, Depends(get_settings)],
                     authorization: Annotated[str | None, Header()] = None) -> str:
    tenant = _authenticate(settings, authorization)
    limiter = request.app.state.limiter
    if limiter.limits_rate(tenant):  # every call of the tenant counts (in Redis: off the event loop)
        await asyncio.to_thread(limiter.check_rate, tenant)
    return tenant


def _authenticate(settings: Settings, authorization: str | None) -> str:
    if settings.open_mode and not settings.api_keys:
        return "local"
    key = _matching(_bearer(authorization), settings.api_keys)
    if key is None:
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return settings.api_keys[key]


async def get_viewer(request: Request, settings: Annotated[Settings, Depends(get_settings)],
                     authorization: Annotated[str | None, Header()] = None) -> str | None:
    """For operator views: None for an admin key (everything), else the caller's tenant (its own part)."""
    if authorization and settings.admin_api_keys and \
            _matching(_bearer(authorization), settings.admin_api_keys) is not None:
        return None
    return await get_tenant(request, settings, authorization)


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[RecordStore, Depends(get_store)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
CeleryDep = Annotated[Celery, Depends(get_celery)]
TenantDep = Annotated[str, Depends(get_tenant)]
LimiterDep = Annotated[TenantLimiter, Depends(get_limiter)]
ViewerDep = Annotated[str | None, Depends(get_viewer)]
