"""Limits per tenant through an API of their own (two processes: the counts live in Redis) over the session's
Redis and workers: requests per minute, jobs not yet ended, bytes stored; each refusal is OpenAI's 429."""

import json

import httpx
import openai
import pytest
from conftest import running_api, wait_for_job
from test_fine_tune_e2e import training_jsonl

KEY_C, KEY_D = "key-tenant-c", "key-tenant-d"


@pytest.fixture(scope="module")
def limited_api(stack_env, stack_dir, workers):
    env = {**stack_env,
           "XPUJOBS_API_KEYS": json.dumps({KEY_C: "tenant-c", KEY_D: "tenant-d"}),
           "XPUJOBS_TENANT_LIMITS": json.dumps({"tenant-c": {"requests_per_minute": 5},
                                                "tenant-d": {"max_active_jobs": 1, "max_stored_bytes": 3000}})}
    with running_api(env, stack_dir / "api-limited.log") as url:
        yield url


def test_requests_per_minute(limited_api):
    with httpx.Client(base_url=limited_api, headers={"Authorization": f"Bearer {KEY_C}"}) as c:
        assert [c.get("/v1/models").status_code for _ in range(5)] == [200] * 5
        refused = c.get("/v1/files")
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "5 per minute" in error["message"]
    # The official client sees its RateLimitError; another tenant is not held back.
    client = openai.OpenAI(base_url=limited_api + "/v1", api_key=KEY_C, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.models.list()
    with httpx.Client(base_url=limited_api, headers={"Authorization": f"Bearer {KEY_D}"}) as d:
        assert all(d.get("/v1/models").status_code == 200 for _ in range(8))


def test_stored_bytes_and_active_jobs(limited_api):
    client = openai.OpenAI(base_url=limited_api + "/v1", api_key=KEY_D, max_retries=0, timeout=120)
    data = training_jsonl(16)[:1400].rsplit(b"\n", 1)[0]
    first = client.files.create(file=("one.jsonl", data), purpose="fine-tune")
    second = client.files.create(file=("two.jsonl", data), purpose="fine-tune")
    with pytest.raises(openai.RateLimitError) as refused:
        client.files.create(file=("three.jsonl", data), purpose="fine-tune")
    assert refused.value.body["code"] == "storage_limit_exceeded"
    assert [f.id for f in client.files.list().data] == [second.id, first.id]  # nothing half-stored
    client.files.delete(second.id)

    job = client.fine_tuning.jobs.create(model="demo-tiny", training_file=first.id,
                                         hyperparameters={"n_epochs": 50, "batch_size": 1},
                                         extra_body={"max_steps": 400})
    with pytest.raises(openai.RateLimitError) as refused:
        client.fine_tuning.jobs.create(model="demo-tiny", training_file=first.id)
    assert refused.value.body["code"] == "concurrent_jobs_limit_exceeded"
    assert refused.value.response.headers["retry-after"] == "30"
    assert len(client.fine_tuning.jobs.list().data) == 1
    client.fine_tuning.jobs.cancel(job.id)
    assert wait_for_job(client, job.id).status == "cancelled"
    again = client.fine_tuning.jobs.create(model="demo-tiny", training_file=first.id)  # the slot is free again
    client.fine_tuning.jobs.cancel(again.id)
    assert wait_for_job(client, again.id).status == "cancelled"
