"""GET /v1/models: the configured base models and the caller's fine-tuned models."""

from fastapi import APIRouter

from api.catalog import resolve
from api.deps import SettingsDep, StoreDep, TenantDep

router = APIRouter(prefix="/v1/models", tags=["models"])


def _model(model_id: str, created: int, owned_by: str) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


def _fine_tuned(store, tenant: str) -> list[dict]:
    jobs, _ = store.page("ftjob", tenant, None, 10**6)
    return [_model(j["fine_tuned_model"], j["finished_at"], tenant) for j in jobs if j.get("fine_tuned_model")]


@router.get("")
def list_models(tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    data = [_model(m, 0, "xpu-jobs") for m in settings.base_models] + _fine_tuned(store, tenant)
    return {"object": "list", "data": data}


@router.get("/{model_id:path}")
def retrieve_model(model_id: str, tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    _, ref = resolve(model_id, tenant, settings, store)
    if ref is None:
        return _model(model_id, 0, "xpu-jobs")
    job = store.get("ftjob", ref.job_id, tenant)
    return _model(model_id, job["finished_at"], tenant)
