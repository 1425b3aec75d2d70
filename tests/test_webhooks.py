"""Webhooks: a receiver started here gets a batch's and a background response's ending events in OpenAI's shape,
signed the Standard Webhooks way (verified with the standardwebhooks package), and a failed delivery is retried
with the same webhook-id."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import KEY_B, _wait
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from worker.node.redis_server import free_port


class Receiver:
    """Records every delivery; answers 500 to the first `failures` of them."""

    def __init__(self, failures: int):
        self.deliveries: list[tuple[dict, bytes]] = []
        self.failures = failures
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.deliveries.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(500 if len(receiver.deliveries) <= receiver.failures else 200)
                self.end_headers()

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, object_id: str) -> list[tuple[dict, bytes]]:
        return [(h, b) for h, b in self.deliveries if json.loads(b)["data"]["id"] == object_id]


@pytest.fixture
def receiver():
    r = Receiver(failures=1)
    yield r
    r.server.shutdown()


def test_webhooks_are_signed_retried_and_per_tenant(client_a, http_a, api_url, receiver):
    created = http_a.post("/v1/webhooks", json={"url": receiver.url,
                                                "event_types": ["batch.completed", "response.incomplete"]})
    assert created.status_code == 200, created.text
    endpoint = created.json()
    assert endpoint["secret"].startswith("whsec_")
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {KEY_B}"}) as other:
        assert endpoint["id"] not in [e["id"] for e in other.get("/v1/webhooks").json()["data"]]
        assert other.delete(f"/v1/webhooks/{endpoint['id']}").status_code == 404
    listed = http_a.get("/v1/webhooks").json()["data"]
    assert [e for e in listed if e["id"] == endpoint["id"]] and "secret" not in listed[-1]
    for bad, param in (({"url": "not a url"}, "url"), ({"url": receiver.url, "event_types": ["batch.nope"]},
                                                        "event_types.0"), ({"url": receiver.url, "x": 1}, "x")):
        refused = http_a.post("/v1/webhooks", json=bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text

    try:
        body = "\n".join(json.dumps({"custom_id": f"w{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": "demo-tiny", "max_tokens": 3,
                                              "messages": [{"role": "user", "content": f"hi {i}"}]}})
                         for i in range(2))
        upload = client_a.files.create(file=("hook-batch.jsonl", body.encode()), purpose="batch")
        batch = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        # The first delivery gets a 500; the retry (1 s later in the tests' settings) gets through.
        deliveries = _wait(lambda: len(got := receiver.of(batch.id)) >= 2 and got, 180, "the batch's webhook twice")
        assert client_a.batches.retrieve(batch.id).status == "completed"
        verifier = Webhook(endpoint["secret"])
        for headers, payload in deliveries:
            event = verifier.verify(payload, headers)  # raises on a bad signature or a stale timestamp
            assert event["type"] == "batch.completed" and event["object"] == "event"
            assert event["data"] == {"id": batch.id} and event["id"].startswith("evt_")
        assert len({h["webhook-id"] for h, _ in deliveries}) == 1  # the retry is the same message
        with pytest.raises(WebhookVerificationError):
            Webhook("whsec_" + "A" * 32).verify(deliveries[0][1], deliveries[0][0])

        response = client_a.responses.create(model="demo-tiny", input="hello", background=True,
                                             max_output_tokens=3)
        [(headers, payload)] = _wait(lambda: receiver.of(response.id), 180, "the response's webhook")
        # cut at its 3 tokens, it ended "incomplete" (max_output_tokens), as OpenAI's would
        assert verifier.verify(payload, headers)["type"] == "response.incomplete"
    finally:
        assert http_a.delete(f"/v1/webhooks/{endpoint['id']}").json()["deleted"] is True
    assert endpoint["id"] not in [e["id"] for e in http_a.get("/v1/webhooks").json()["data"]]


def test_endpoints_from_settings_and_from_the_api(redis_client):
    from contract import webhooks
    from contract.records import RecordStore
    from contract.settings import Settings

    settings = Settings(_env_file=None, webhooks={"tenant-s": [{"url": "https://hooks.example/s",
                                                                "secret": "whsec_" + "B" * 32,
                                                                "event_types": ["batch.failed"]}]})
    store = RecordStore(redis_client)
    created = webhooks.create_endpoint(store, "tenant-s", "https://hooks.example/api", None)
    endpoints = webhooks.endpoints_for(store, "tenant-s", settings)
    assert [e["url"] for e in endpoints] == ["https://hooks.example/s", "https://hooks.example/api"]
    assert not webhooks.wants(endpoints[0], "batch.completed") and webhooks.wants(endpoints[0], "batch.failed")
    assert webhooks.wants(endpoints[1], "fine_tuning.job.succeeded")  # no filter: every ending event
    assert webhooks.endpoints_for(store, "tenant-t", settings) == []
    store.delete("webhook", created["id"], "tenant-s")
