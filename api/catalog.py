"""Which models a tenant may name: the configured base models and the tenant's own fine-tuned models."""

from api.errors import APIError
from contract.layout import FineTunedRef, parse_fine_tuned
from contract.records import RecordStore
from contract.settings import Settings


def resolve(model: str, tenant: str, settings: Settings, store: RecordStore) -> tuple[str, FineTunedRef | None]:
    """(base model, fine-tuned reference or None); 404 for a model this tenant cannot use."""
    ref = parse_fine_tuned(model)
    if ref is None:
        if model in settings.base_models:
            return model, None
        raise APIError(404, f"The model '{model}' does not exist or you do not have access to it.",
                       param="model", code="model_not_found")
    job = store.get("ftjob", ref.job_id, tenant)
    usable = job is not None and job.get("status") == "succeeded" and ref.base == job["model"]
    if usable and ref.checkpoint_step is not None:
        usable = any(c["step_number"] == ref.checkpoint_step for c in job.get("checkpoints", []))
    if not usable:
        raise APIError(404, f"The model '{model}' does not exist or you do not have access to it.",
                       param="model", code="model_not_found")
    return ref.base, ref
