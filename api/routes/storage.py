"""GET /v1/storage (extension): what the caller's tenant keeps stored: its files' bytes (uploads and outputs,
what max_stored_bytes limits) and how many records of each kind it has, with the retention that bounds them."""

from fastapi import APIRouter

from api.deps import SettingsDep, StoreDep, TenantDep
from contract import retention

router = APIRouter(prefix="/v1/storage", tags=["storage"])


@router.get("")
def storage_usage(tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    files = list(store.scan("file", tenant))
    return {"object": "storage", "file_count": len(files), "file_bytes": sum(int(f["bytes"]) for f in files),
            "file_bytes_limit": settings.limit(tenant, "max_stored_bytes") or None,
            "records": {kind: store.count(kind, tenant) for kind in ("file", *retention.FINISHED)},
            "retention_seconds": {kind: retention.retention_of(kind, settings) for kind in retention.FINISHED}}
