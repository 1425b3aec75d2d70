"""Webhook endpoints of the caller's tenant (extension): create (the answer holds the signing secret, shown once),
list, delete. Deliveries: contract/webhooks.py and the worker nodes' dispatchers."""

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, HttpUrl

from api.deps import SettingsDep, StoreDep, TenantDep
from api.errors import not_found
from contract import webhooks

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])

EventType = Literal[tuple(sorted(set(webhooks.EVENT_TYPES.values())))]


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: HttpUrl
    # None: every ending event.
    event_types: list[EventType] | None = None


def to_openai(record: dict, *, with_secret: bool = False) -> dict:
    endpoint = {"id": record["id"], "object": "webhook_endpoint", "url": record["url"],
                "event_types": record["event_types"], "created_at": record["created_at"]}
    return endpoint | ({"secret": record["secret"]} if with_secret else {})


@router.post("")
def create_webhook(body: WebhookCreate, tenant: TenantDep, store: StoreDep):
    record = webhooks.create_endpoint(store, tenant, str(body.url), body.event_types)
    return to_openai(record, with_secret=True)


@router.get("")
def list_webhooks(tenant: TenantDep, store: StoreDep, settings: SettingsDep):
    records, _ = store.page("webhook", tenant, None, 10**6)
    configured = [{"id": f"settings-{i}", "object": "webhook_endpoint", "url": e.url, "event_types": e.event_types,
                   "created_at": None, "configured_in_settings": True}
                  for i, e in enumerate(settings.webhooks.get(tenant, []))]
    return {"object": "list", "data": configured + [to_openai(r) for r in records], "has_more": False}


@router.delete("/{webhook_id}")
def delete_webhook(webhook_id: str, tenant: TenantDep, store: StoreDep):
    if store.get("webhook", webhook_id, tenant) is None:
        raise not_found("webhook endpoint", webhook_id)
    store.delete("webhook", webhook_id, tenant)
    return {"id": webhook_id, "object": "webhook_endpoint", "deleted": True}
