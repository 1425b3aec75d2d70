"""Which models a tenant may name: the configured base models and the tenant's own fine-tuned models."""

from contract.layout import FineTunedRef, parse_fine_tuned
from contract.records import RecordStore
from contract.settings import Settings


class UnknownModel(LookupError):
    def __init__(self, model: str):
        super().__init__(f"The model '{model}' does not exist or you do not have access to it.")


def resolve(model: str, tenant: str, settings: Settings, store: RecordStore) -> tuple[str, FineTunedRef | None]:
    """(base model, fine-tuned reference or None); UnknownModel for a model this tenant cannot use."""
    ref = parse_fine_tuned(model)
    if ref is None:
        if model in settings.base_models:
            return model, None
        raise UnknownModel(model)
    job = store.get("ftjob", ref.job_id, tenant)
    usable = job is not None and job.get("status") == "succeeded" and ref.base == job["model"]
    if usable and ref.checkpoint_step is not None:
        usable = any(c["step_number"] == ref.checkpoint_step for c in job.get("checkpoints", []))
    if not usable:
        raise UnknownModel(model)
    return ref.base, ref
