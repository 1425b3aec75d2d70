"""The API side under hostile or broken input: OpenAI-shaped 4xx for every bad field, nothing half-created, a
batch whose creator died is failed by the reconciler, and a tenant sees only its own part of /v1/workers."""

import json
import time

import httpx
import openai
import pytest
from conftest import KEY_A, KEY_ADMIN, KEY_B

from contract import events
from contract.records import RecordStore, new_id, now
from contract.registry import register, unregister

GOOD = json.dumps({"prompt": "Hi", "completion": "Hello."}).encode()
BATCH_LINE = json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "demo-tiny", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "Hi"}]}}).encode()


def job_ids(client):
    return {j.id for j in client.fine_tuning.jobs.list(limit=100)}


def error_of(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


@pytest.fixture(scope="module")
def training_file(client_a):
    return client_a.files.create(file=("a.jsonl", GOOD), purpose="fine-tune").id


@pytest.fixture(scope="module")
def batch_file(client_a):
    return client_a.files.create(file=("b.jsonl", BATCH_LINE), purpose="batch").id


def test_bad_event_cursor_is_a_400(client_a, http_a, training_file):
    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file,
                                           hyperparameters={"n_epochs": 1})
    client_a.fine_tuning.jobs.cancel(job.id)
    for after in ("null", "ftevent-x", "1-2", "ftevent-1_2_3", ""):
        reply = http_a.get(f"/v1/fine_tuning/jobs/{job.id}/events", params={"after": after})
        if after == "":  # an empty cursor is no cursor
            assert reply.status_code == 200
            continue
        assert error_of(reply, 400)["param"] == "after"
    events_ = client_a.fine_tuning.jobs.list_events(job.id).data
    assert http_a.get(f"/v1/fine_tuning/jobs/{job.id}/events", params={"after": events_[0].id}).status_code == 200


def test_bad_batch_event_cursor_is_a_400(client_a, http_a, batch_file):
    batch = client_a.batches.create(input_file_id=batch_file, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    assert error_of(http_a.get(f"/v1/batches/{batch.id}/events", params={"after": "null"}), 400)["param"] == "after"


def test_training_file_of_wrong_shapes_is_a_400_and_no_job(client_a):
    before = job_ids(client_a)
    bad = b"\n".join([json.dumps({"messages": 3}).encode(), json.dumps({"messages": [5]}).encode(),
                      json.dumps({"prompt": 1, "completion": []}).encode()])
    upload = client_a.files.create(file=("shapes.jsonl", bad), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id)
    error = exc.value.response.json()["error"]
    assert error["code"] == "invalid_training_file" and error["param"] == "training_file"
    assert all(f"line {n}" in error["message"] for n in (1, 2, 3))
    assert job_ids(client_a) == before


def test_batch_file_as_validation_file_leaves_no_job(client_a, training_file, batch_file):
    before = job_ids(client_a)
    for files in ({"training_file": batch_file}, {"training_file": training_file, "validation_file": batch_file}):
        with pytest.raises(openai.BadRequestError) as exc:
            client_a.fine_tuning.jobs.create(model="demo-tiny", **files)
        assert exc.value.response.json()["error"]["param"] in files
    assert job_ids(client_a) == before


@pytest.mark.parametrize("extra, param", [
    ({"seed": 10**30}, "seed"), ({"seed": -5}, "seed"), ({"hyperparameters": {"n_epochs": True}},
                                                         "hyperparameters.n_epochs"),
    ({"hyperparameters": {"batch_size": "4"}}, "hyperparameters.batch_size"), ({"bf16": "yes"}, "bf16"),
    ({"max_steps": 1.5}, "max_steps"), ({"max_steps": 10**9}, "max_steps"),
    ({"lora": {"target_modules": ["q"] * 1000}}, "lora.target_modules"),
])
def test_fine_tune_numbers_and_types_are_checked(http_a, client_a, training_file, extra, param):
    before = job_ids(client_a)
    reply = http_a.post("/v1/fine_tuning/jobs", json={"model": "demo-tiny", "training_file": training_file,
                                                      **extra})
    assert error_of(reply, 400)["param"] == param
    assert job_ids(client_a) == before


def test_unknown_fields_are_refused_by_name(http_a, client_a, training_file, batch_file):
    before = job_ids(client_a)
    reply = http_a.post("/v1/fine_tuning/jobs", json={"model": "demo-tiny", "training_file": training_file,
                                                      "n_epochs": 2, "hyperparameters": {"epochs": 1}})
    error = error_of(reply, 400)
    assert error["code"] == "unknown_parameter" and "n_epochs" in error["message"]
    assert "hyperparameters.epochs" in error["message"]
    assert job_ids(client_a) == before
    before_batches = {b.id for b in client_a.batches.list(limit=100)}
    reply = http_a.post("/v1/batches", json={"input_file_id": batch_file, "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h", "priority": "high"})
    assert error_of(reply, 400)["param"] == "priority"
    assert {b.id for b in client_a.batches.list(limit=100)} == before_batches


def test_json_bodies_have_their_own_limit(http_a, api_url):
    """8 MiB by default, far below the upload limit: refused from the declared length, or while a body sent
    without one streams in."""
    big = b'{"model": "demo-tiny", "input": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    reply = http_a.post("/v1/responses", content=big, headers={"Content-Type": "application/json"})
    assert error_of(reply, 413)["code"] == "request_too_large"

    def pieces():
        for start in range(0, len(big), 1024 * 1024):
            yield big[start:start + 1024 * 1024]

    reply = http_a.post("/v1/responses", content=pieces(), headers={"Content-Type": "application/json"})
    assert error_of(reply, 413)["code"] == "request_too_large"
    # A small body sent without a length still works.
    reply = http_a.post("/v1/fine_tuning/jobs", content=iter([b'{"model": "demo-tiny", ', b'"nope": 1}']),
                        headers={"Content-Type": "application/json"})
    assert error_of(reply, 400)["code"] == "unknown_parameter"


def test_unexpected_errors_are_openai_shaped(http_a):
    reply = http_a.post("/v1/fine_tuning/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    error_of(reply, 400)


def test_batch_whose_creator_died_is_failed_and_cancel_works_while_validating(client_a, redis_client, batch_file,
                                                                               workers):
    """What an API process killed inside POST /v1/batches leaves: a tracked batch in `validating` whose creation
    lease has lapsed. The reconciler fails it; a validating batch whose creator lives can be cancelled."""
    store = RecordStore(redis_client)

    def validating(holder: str | None) -> str:
        record = {"id": new_id("batch"), "tenant": "tenant-a", "status": "validating",
                  "endpoint": "/v1/chat/completions", "input_file_id": batch_file, "metadata": None,
                  "created_at": now(), "expires_at": now() + 86400, "queue": "xpujobs.cpu"}
        if holder:
            events.refresh_lease(redis_client, record["id"], holder, 120)
        store.create("batch", record, track=True)
        return record["id"]

    orphan, alive = validating(None), validating("api:12345")
    cancelled = client_a.batches.cancel(alive)
    assert cancelled.status == "cancelled"
    with pytest.raises(openai.ConflictError):  # already cancelled
        client_a.batches.cancel(alive)
    deadline = time.monotonic() + 60
    while client_a.batches.retrieve(orphan).status == "validating" and time.monotonic() < deadline:
        time.sleep(0.5)
    failed = client_a.batches.retrieve(orphan)
    assert failed.status == "failed" and failed.errors.data[0].code == "creation_interrupted"
    assert orphan not in store.tracked("batch") and alive not in store.tracked("batch")


def test_a_tenant_sees_only_its_own_part_of_the_workers(api_url, client_a, redis_client, training_file):
    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=training_file,
                                           hyperparameters={"n_epochs": 1})
    client_a.fine_tuning.jobs.cancel(job.id)
    # A node running A's job, with A's adapter loaded: what a real node publishes in the registry.
    register(redis_client, "spy@host", {"node": "spy@host", "backend": "cpu", "current_jobs": [job.id, "chatcmpl-x"],
                                        "current_job": job.id, "models": [{"model": "demo-tiny", "adapters": [
                                            job.id, f"{job.id}-step-2"]}]}, 60)
    try:
        def view(key):
            reply = httpx.get(api_url + "/v1/workers", headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 200
            return next(w for w in reply.json()["data"] if w["node"] == "spy@host")

        a, b, admin = view(KEY_A), view(KEY_B), view(KEY_ADMIN)
        assert a["current_jobs"] == [job.id] and a["models"][0]["adapters"] == [job.id, f"{job.id}-step-2"]
        assert b["current_jobs"] == [] and b["current_job"] is None and b["models"][0]["adapters"] == []
        assert json.dumps(b).count(job.id) == 0
        assert admin["current_jobs"] == [job.id, "chatcmpl-x"] and len(admin["models"][0]["adapters"]) == 2
        # An admin key is not a tenant key.
        assert httpx.get(api_url + "/v1/files", headers={"Authorization": f"Bearer {KEY_ADMIN}"}).status_code == 401
    finally:
        unregister(redis_client, "spy@host")


def test_an_input_that_cannot_fit_the_context_is_refused_before_queueing(http_a, redis_client):
    """Far over engine_max_seq_len x 64 bytes: refused in the API, no record, nothing tokenized."""
    before = redis_client.zcard("idx:chat:tenant-a"), redis_client.zcard("idx:response:tenant-a")
    huge = "word " * 60_000  # 300 KB, under the JSON body limit
    reply = http_a.post("/v1/chat/completions", json={"model": "demo-tiny", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": huge}]})
    error = error_of(reply, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    reply = http_a.post("/v1/responses", json={"model": "demo-tiny", "input": huge})
    assert error_of(reply, 400)["param"] == "input"
    assert (redis_client.zcard("idx:chat:tenant-a"), redis_client.zcard("idx:response:tenant-a")) == before


def test_a_chat_the_worker_refuses_leaves_no_record(client_a, redis_client):
    before = set(redis_client.zrange("idx:chat:tenant-a", 0, -1))
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "word " * 2000}],
                                         max_tokens=8)
    assert "context" in exc.value.message
    assert set(redis_client.zrange("idx:chat:tenant-a", 0, -1)) == before


@pytest.mark.parametrize("path, body, param", [
    ("/v1/responses", {"model": "demo-tiny", "input": "Hi", "background": "yes"}, "background"),
    ("/v1/responses", {"model": "demo-tiny", "input": "Hi", "max_output_tokens": True}, "max_output_tokens"),
    ("/v1/chat/completions", {"model": "demo-tiny", "messages": [{"role": "user", "content": "Hi"}],
                              "seed": 10**30}, "seed"),
    ("/v1/chat/completions", {"model": "demo-tiny", "messages": [{"role": "user", "content": "Hi"}],
                              "temperature": "0.5"}, "temperature"),
])
def test_inference_values_are_not_coerced(http_a, redis_client, path, body, param):
    before = redis_client.zcard("idx:chat:tenant-a"), redis_client.zcard("idx:response:tenant-a")
    assert error_of(http_a.post(path, json=body), 400)["param"] == param
    assert (redis_client.zcard("idx:chat:tenant-a"), redis_client.zcard("idx:response:tenant-a")) == before
