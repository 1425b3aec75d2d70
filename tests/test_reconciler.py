"""What the reconciler repairs beyond dead workers: a record whose task never reached the broker."""

import time

from conftest import TEST_BACKEND, _wait

from contract.queues import backend_queue
from contract.records import RecordStore, new_id


def test_record_whose_publisher_died_is_published(client_a, redis_client):
    """The API wrote a queued record and died before publishing its task: a worker's reconciler publishes it."""
    store = RecordStore(redis_client)
    record_id = new_id("response")
    request = {"model": "demo-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
               "temperature": 0, "top_p": None, "seed": None, "stop": [], "attn_implementation": "sdpa"}
    store.create("response", {"id": record_id, "tenant": "tenant-a", "status": "queued",
                              "created_at": int(time.time()) - 60, "model": "demo-tiny", "base_model": "demo-tiny",
                              "adapter_job": None, "adapter_step": None, "request": request,
                              "queue": backend_queue(TEST_BACKEND), "background": True, "metadata": {}})
    store.track("response", record_id)
    # Cut at its 3 tokens, it reads "incomplete" (max_output_tokens), as OpenAI's would.
    response = _wait(lambda: (r := client_a.responses.retrieve(record_id)).status == "incomplete" and r, 30,
                     "the reconciler to publish the record")
    assert response.usage.output_tokens >= 1
    assert store.get("response", record_id)["published_at"]


def test_record_fetched_by_a_node_that_died_before_marking_it_is_published(client_a, redis_client):
    """A node fetched a task's message (kombu holds it in unacked until the task starts) and was killed before it
    marked the record reserved_by: the reconciler takes the message over and publishes the record again."""
    import base64
    import json

    store = RecordStore(redis_client)
    record_id = new_id("response")
    request = {"model": "demo-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
               "temperature": 0, "top_p": None, "seed": None, "stop": [], "attn_implementation": "sdpa"}
    store.create("response", {"id": record_id, "tenant": "tenant-a", "status": "queued",
                              "created_at": int(time.time()) - 60, "published_at": int(time.time()) - 60,
                              "model": "demo-tiny", "base_model": "demo-tiny", "adapter_job": None,
                              "adapter_step": None, "request": request, "queue": backend_queue(TEST_BACKEND),
                              "background": True, "metadata": {}})
    store.track("response", record_id)
    body = base64.b64encode(json.dumps([[record_id], {}, {}]).encode()).decode()
    tag = f"tag-{record_id}"
    redis_client.hset("unacked", tag, json.dumps([{"body": body, "headers": {}}, "", "xpujobs.cpu"]))
    redis_client.zadd("unacked_index", {tag: time.time() - 60})
    response = _wait(lambda: (r := client_a.responses.retrieve(record_id)).status == "incomplete" and r, 30,
                     "the reconciler to publish the record")
    assert response.usage.output_tokens >= 1
    assert not redis_client.hexists("unacked", tag) and redis_client.zscore("unacked_index", tag) is None
