"""Model resolution for the API: contract.catalog, with its failure as an OpenAI-shaped 404."""

from api.errors import APIError
from contract import catalog
from contract.layout import FineTunedRef
from contract.records import RecordStore
from contract.settings import Settings


def resolve(model: str, tenant: str, settings: Settings, store: RecordStore) -> tuple[str, FineTunedRef | None]:
    try:
        return catalog.resolve(model, tenant, settings, store)
    except catalog.UnknownModel as exc:
        raise APIError(404, str(exc), param="model", code="model_not_found") from None
