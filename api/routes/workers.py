"""GET /v1/workers (extension): the live worker nodes and their devices."""

from fastapi import APIRouter

from api.deps import RedisDep, TenantDep
from contract.registry import live_workers

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get("")
def list_workers(_tenant: TenantDep, redis: RedisDep):
    return {"object": "list", "data": [{"object": "worker", **w} for w in live_workers(redis)]}
