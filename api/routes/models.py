"""Models: the configured base models and the caller's fine-tuned models and checkpoints; deleting one of them."""

import shutil

from fastapi import APIRouter

from api.catalog import resolve
from api.deps import SettingsDep, StoreDep, TenantDep
from api.errors import invalid
from contract.catalog import models_of
from contract.layout import adapter_dir, checkpoint_dir

router = APIRouter(prefix="/v1/models", tags=["models"])


def _model(model_id: str, created: int, owned_by: str) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


def _fine_tuned(store, tenant: str) -> list[dict]:
    jobs, _ = store.page("ftjob", tenant, None, 10**6)
    created = {c["fine_tuned_model_checkpoint"]: c["created_at"] for j in jobs for c in j.get("checkpoints", [])}
    return [_model(m, created.get(m) or j["finished_at"] or j["created_at"], tenant)
            for j in jobs for m in models_of(j)]


@router.get("")
def list_models(tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    data = [_model(m, 0, "xpu-jobs") for m in settings.base_models] + _fine_tuned(store, tenant)
    return {"object": "list", "data": data}


@router.get("/{model_id:path}")
def retrieve_model(model_id: str, tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    _, ref = resolve(model_id, tenant, settings, store)
    if ref is None:
        return _model(model_id, 0, "xpu-jobs")
    return next(m for m in _fine_tuned(store, tenant) if m["id"] == model_id)


@router.delete("/{model_id:path}")
def delete_model(model_id: str, tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    """Deletes a fine-tuned model or checkpoint of the caller's (another tenant's is a 404, as if absent): it
    leaves the job's record first, so no new request resolves it, then the disk."""
    _, ref = resolve(model_id, tenant, settings, store)
    if ref is None:
        raise invalid(f"'{model_id}' is a base model; only fine-tuned models can be deleted.", param="model")
    job = store.get("ftjob", ref.job_id, tenant)
    if ref.checkpoint_step is None:
        store.update("ftjob", ref.job_id, {"fine_tuned_model": None})
        shutil.rmtree(adapter_dir(settings.artifact_root, tenant, ref.job_id), ignore_errors=True)
    else:
        kept = [c for c in job["checkpoints"] if c["step_number"] != ref.checkpoint_step]
        store.update("ftjob", ref.job_id, {"checkpoints": kept})
        shutil.rmtree(checkpoint_dir(settings.artifact_root, tenant, ref.job_id, ref.checkpoint_step),
                      ignore_errors=True)
    return {"id": model_id, "object": "model", "deleted": True}
