"""Dependencies shared by the routers: settings, the record store, Redis, Celery, and the caller's tenant."""

from typing import Annotated

import redis
from celery import Celery
from fastapi import Depends, Header, Request

from api.errors import APIError
from api.tenant_limits import TenantLimiter
from contract.records import RecordStore
from contract.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_store(request: Request) -> RecordStore:
    return request.app.state.store


def get_redis(request: Request) -> redis.Redis:
    return request.app.state.store.redis


def get_celery(request: Request) -> Celery:
    return request.app.state.celery


def get_limiter(request: Request) -> TenantLimiter:
    return request.app.state.limiter


def get_tenant(request: Request, settings: Annotated[Settings, Depends(get_settings)],
               authorization: Annotated[str | None, Header()] = None) -> str:
    tenant = _authenticate(settings, authorization)
    request.app.state.limiter.check_rate(tenant)  # every call of the tenant counts
    return tenant


def _authenticate(settings: Settings, authorization: str | None) -> str:
    if settings.open_mode and not settings.api_keys:
        return "local"
    if not authorization or not authorization.lower().startswith("bearer "):
        raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                       code="missing_api_key")
    tenant = settings.api_keys.get(authorization[7:].strip())
    if tenant is None:
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return tenant


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[RecordStore, Depends(get_store)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
CeleryDep = Annotated[Celery, Depends(get_celery)]
TenantDep = Annotated[str, Depends(get_tenant)]
LimiterDep = Annotated[TenantLimiter, Depends(get_limiter)]
