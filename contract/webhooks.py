"""Webhooks: when a fine-tuning job, a batch or a response ends, an event in OpenAI's webhook shape goes into a Redis
stream (the outbox), from which the worker nodes' dispatchers deliver it to each of the tenant's endpoints, signed
the Standard Webhooks way, retried with backoff until one answers 2xx (at least once).

Endpoints come from settings (`webhooks`) and from the API (`POST /v1/webhooks`, stored as records here).
"""

import base64
import json
import secrets
import time

import redis

from contract.records import RecordStore, new_id
from contract.settings import Settings

OUTBOX = "webhooks:outbox"
GROUP = "dispatchers"

# Record kind and status -> OpenAI's event type.
EVENT_TYPES = {
    ("ftjob", "succeeded"): "fine_tuning.job.succeeded",
    ("ftjob", "failed"): "fine_tuning.job.failed",
    ("ftjob", "cancelled"): "fine_tuning.job.cancelled",
    ("batch", "completed"): "batch.completed",
    ("batch", "failed"): "batch.failed",
    ("batch", "cancelled"): "batch.cancelled",
    ("batch", "expired"): "batch.expired",
    ("response", "completed"): "response.completed",
    ("response", "failed"): "response.failed",
    ("response", "cancelled"): "response.cancelled",
    ("response", "incomplete"): "response.incomplete",
}
KIND_OF_PREFIX = {"ftjob-": "ftjob", "batch_": "batch", "resp_": "response"}


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def kind_of(record_id: str) -> str | None:
    return next((kind for prefix, kind in KIND_OF_PREFIX.items() if record_id.startswith(prefix)), None)


def job_ended(client: redis.Redis, record_id: str, status: str) -> None:
    """Queue the ending event of a job (once per job, however many times its end is reported)."""
    kind = kind_of(record_id)
    event_type = EVENT_TYPES.get((kind, status))
    if event_type is None or not client.set(f"webhooks:ended:{record_id}", status, nx=True, ex=7 * 24 * 3600):
        return
    event = {"id": "evt_" + secrets.token_hex(12), "object": "event", "created_at": int(time.time()),
             "type": event_type, "data": {"id": record_id}}
    client.xadd(OUTBOX, {"kind": kind, "event": json.dumps(event)}, maxlen=100_000, approximate=True)


def create_endpoint(store: RecordStore, tenant: str, url: str, event_types: list[str] | None) -> dict:
    record = {"id": new_id("webhook"), "tenant": tenant, "url": url, "secret": new_secret(),
              "event_types": event_types, "created_at": int(time.time())}
    store.create("webhook", record)
    return record


def endpoints_for(store: RecordStore, tenant: str, settings: Settings) -> list[dict]:
    """The tenant's endpoints: those in settings, then those created through the API."""
    records, _ = store.page("webhook", tenant, None, 10**6)
    configured = [{"id": f"settings-{i}", **e.model_dump()} for i, e in enumerate(settings.webhooks.get(tenant, []))]
    return configured + records


def wants(endpoint: dict, event_type: str) -> bool:
    return not endpoint.get("event_types") or event_type in endpoint["event_types"]
