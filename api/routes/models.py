"""Models: the configured base models and the caller's fine-tuned models and checkpoints; deleting one of them."""

import json
import shutil
from pathlib import Path

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api import adapter_archive
from api.catalog import resolve
from api.deps import SettingsDep, StoreDep, TenantDep
from api.errors import invalid
from api.routes.files import get_file
from contract.catalog import models_of
from contract.layout import SUFFIX_PATTERN, adapter_dir, checkpoint_dir, file_path, fine_tuned_model_id
from contract.records import new_id, now

router = APIRouter(prefix="/v1/models", tags=["models"])


def _model(model_id: str, created: int, owned_by: str) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


def _fine_tuned(store, tenant: str) -> list[dict]:
    jobs, _ = store.page("ftjob", tenant, None, 10**6)
    created = {c["fine_tuned_model_checkpoint"]: c["created_at"] for j in jobs for c in j.get("checkpoints", [])}
    return [_model(m, created.get(m) or j.get("finished_at") or j.get("created_at") or 0, tenant)
            for j in jobs for m in models_of(j)]


@router.get("")
def list_models(tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    data = [_model(m, 0, "xpu-jobs") for m in settings.base_models] + _fine_tuned(store, tenant)
    return {"object": "list", "data": data}


class AdapterImport(BaseModel):
    """Extension: register a LoRA adapter trained elsewhere (a file of purpose "adapter") for a base model."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(description="the base model the adapter was trained for")
    adapter_file: str
    suffix: str | None = Field(None, max_length=64)


def _base_config(settings, base: str) -> dict:
    local = settings.models_root / base / "config.json"
    if local.exists():
        return json.loads(local.read_text())
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(base, "config.json")
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text())
    raise invalid(f"The config of base '{base}' is not available to the API to check the adapter against.",
                  param="model")


@router.post("")
def import_adapter(body: AdapterImport, tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    """The adapter is checked (safetensors only, a LoRA config for this base, every tensor's shape) and then
    served by an ft: id like a fine-tuned model; it is recorded as a succeeded job of method "import"."""
    base, ref = resolve(body.model, tenant, settings, store)
    if ref is not None:
        raise invalid("model must be a base model.", param="model")
    if body.suffix is not None and not SUFFIX_PATTERN.match(body.suffix):
        raise invalid("suffix may hold only letters, digits, '-' and '_' (at most 64).", param="suffix")
    upload = get_file(store, body.adapter_file, tenant, "adapter_file")
    if upload["purpose"] != "adapter":
        raise invalid(f"File '{body.adapter_file}' has purpose '{upload['purpose']}', not 'adapter'.",
                      param="adapter_file")
    files, config = adapter_archive.unpack(file_path(settings.artifact_root, tenant, body.adapter_file).read_bytes(),
                                           base, _base_config(settings, base))
    job_id = new_id("ftjob")
    directory = adapter_dir(settings.artifact_root, tenant, job_id)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    model_id, created = fine_tuned_model_id(base, body.suffix, job_id), now()
    store.create("ftjob", {
        "id": job_id, "tenant": tenant, "status": "succeeded", "created_at": created, "finished_at": created,
        "model": base, "suffix": body.suffix, "fine_tuned_model": model_id, "training_file": None,
        "method": {"type": "import", "import": {"adapter_file": body.adapter_file}},
        "lora": {"r": config.get("r"), "alpha": config.get("lora_alpha"), "dropout": config.get("lora_dropout"),
                 "target_modules": config.get("target_modules")},
        "checkpoints": [], "result_files": [], "error": None})
    return _model(model_id, created, tenant)


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
