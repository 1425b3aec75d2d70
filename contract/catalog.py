"""Which models a tenant may name: the configured base models and the tenant's own fine-tuned models."""

from contract.layout import FineTunedRef, parse_fine_tuned
from contract.records import RecordStore
from contract.settings import Settings


class UnknownModel(LookupError):
    def __init__(self, model: str):
        super().__init__(f"The model '{model}' does not exist or you do not have access to it.")


def resolve(model: str, tenant: str, settings: Settings, store: RecordStore) -> tuple[str, FineTunedRef | None]:
    """(base model, fine-tuned reference or None); UnknownModel for a model this tenant cannot use."""
    base, ref, _ = resolve_with_job(model, tenant, settings, store)
    return base, ref


def resolve_with_job(model: str, tenant: str, settings: Settings,
                     store: RecordStore) -> tuple[str, FineTunedRef | None, dict | None]:
    """resolve's answer and the fine-tuning job record behind a fine-tuned model (None for a base model)."""
    ref = parse_fine_tuned(model)
    if ref is None:
        if model in settings.base_models:
            return model, None, None
        raise UnknownModel(model)
    job = store.get("ftjob", ref.job_id, tenant)
    if job is None or (model not in models_of(job)):
        raise UnknownModel(model)
    return ref.base, ref, job


CHECKPOINTS_USABLE = ("succeeded", "cancelled", "paused")


def models_of(job: dict) -> list[str]:
    """The model ids a fine-tuning job offers: its adapter once it succeeded (until deleted), and every
    checkpoint it keeps once it succeeded, was cancelled or is paused."""
    models = [job["fine_tuned_model"]] if job.get("status") == "succeeded" and job.get("fine_tuned_model") else []
    if job.get("status") in CHECKPOINTS_USABLE:
        models += [c["fine_tuned_model_checkpoint"] for c in job.get("checkpoints", [])]
    return models
