"""The webhook dispatcher of a worker node (one thread, plus a few for slow endpoints).

Every node runs one; they share the outbox through a Redis consumer group, so each ending event is fanned out
once into one delivery per endpoint. A delivery is claimed for a while before it is sent, and only removed once
an endpoint answered 2xx: a node that dies mid-send leaves it to be sent again (at least once; the webhook-id
header stays the same, so a receiver can drop repeats). Failures wait webhook_retry_seconds[attempt] each.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import httpx
import redis
from standardwebhooks import Webhook

from contract import webhooks
from contract.records import RecordStore
from contract.settings import Settings

DUE = "webhooks:due"  # delivery id -> when it is due (or, while one node sends it, when its claim lapses)
CLAIM_SECONDS = 120
_CLAIM = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) <= tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
  return 1
end
return 0
"""


def _delivery_key(delivery_id: str) -> str:
    return f"webhooks:delivery:{delivery_id}"


class WebhookDispatcher:
    def __init__(self, settings: Settings, store: RecordStore, consumer: str):
        self.settings, self.store, self.redis, self.consumer = settings, store, store.redis, consumer
        self._claim = self.redis.register_script(_CLAIM)
        self._senders = ThreadPoolExecutor(4, thread_name_prefix="xpujobs-webhook")
        self._http = httpx.Client(timeout=settings.webhook_timeout_seconds, follow_redirects=False)
        self._stop = threading.Event()

    def start(self) -> None:
        try:
            self.redis.xgroup_create(webhooks.OUTBOX, webhooks.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        threading.Thread(target=self._run, name="xpujobs-webhooks", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._senders.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._intake()
                self._send_due()
            except Exception as exc:  # a Redis blip: the outbox and the due set keep everything for the next turn
                print(f"xpu-jobs webhooks: {exc}", flush=True)
                self._stop.wait(1)

    def _intake(self) -> None:
        # Entries a dead node read but never fanned out, then new ones.
        _, stale, _ = self.redis.xautoclaim(webhooks.OUTBOX, webhooks.GROUP, self.consumer, min_idle_time=60_000,
                                            start_id="0-0", count=20)
        fresh = self.redis.xreadgroup(webhooks.GROUP, self.consumer, {webhooks.OUTBOX: ">"}, count=20, block=500)
        for entry_id, fields in stale + [e for _, entries in fresh or [] for e in entries]:
            if fields:
                self._fan_out(entry_id, fields)

    def _fan_out(self, entry_id: str, fields: dict) -> None:
        event = json.loads(fields["event"])
        record = self.store.get(fields["kind"], event["data"]["id"])
        endpoints = webhooks.endpoints_for(self.store, record["tenant"], self.settings) if record else []
        pipe = self.redis.pipeline()  # the deliveries and the ack together: an event is never half fanned out
        for endpoint in endpoints:
            if webhooks.wants(endpoint, event["type"]):
                delivery_id = f"{event['id']}:{endpoint['id']}"
                pipe.hset(_delivery_key(delivery_id), mapping={
                    "url": endpoint["url"], "secret": endpoint["secret"], "msg_id": event["id"],
                    "body": json.dumps(event), "attempt": 0})
                pipe.zadd(DUE, {delivery_id: time.time()})
        pipe.xack(webhooks.OUTBOX, webhooks.GROUP, entry_id)
        pipe.xdel(webhooks.OUTBOX, entry_id)
        pipe.execute()

    def _send_due(self) -> None:
        now = time.time()
        for delivery_id in self.redis.zrangebyscore(DUE, 0, now, start=0, num=20):
            if self._claim(keys=[DUE], args=[delivery_id, now, now + CLAIM_SECONDS]):
                self._senders.submit(self._send, delivery_id)

    def _send(self, delivery_id: str) -> None:
        delivery = self.redis.hgetall(_delivery_key(delivery_id))
        if not delivery:
            self.redis.zrem(DUE, delivery_id)
            return
        stamp = datetime.now(timezone.utc)
        headers = {"content-type": "application/json", "user-agent": "xpu-jobs-webhooks",
                   "webhook-id": delivery["msg_id"], "webhook-timestamp": str(int(stamp.timestamp())),
                   "webhook-signature": Webhook(delivery["secret"]).sign(delivery["msg_id"], stamp, delivery["body"])}
        try:
            status = self._http.post(delivery["url"], content=delivery["body"], headers=headers).status_code
            failure = None if 200 <= status < 300 else f"HTTP {status}"
        except httpx.HTTPError as exc:
            failure = f"{type(exc).__name__}: {exc}"
        attempt = int(delivery["attempt"])
        schedule = self.settings.webhook_retry_seconds
        if failure is None or attempt >= len(schedule):
            if failure:
                print(f"xpu-jobs webhooks: giving up on {delivery['url']} for {delivery['msg_id']} after "
                      f"{attempt + 1} attempts ({failure})", flush=True)
            pipe = self.redis.pipeline()
            pipe.delete(_delivery_key(delivery_id))
            pipe.zrem(DUE, delivery_id)
            pipe.execute()
            return
        pipe = self.redis.pipeline()
        pipe.hset(_delivery_key(delivery_id), "attempt", attempt + 1)
        pipe.zadd(DUE, {delivery_id: time.time() + schedule[attempt]})
        pipe.execute()
