"""Every object belongs to one tenant: another tenant gets 404 for it on every endpoint."""

import json

import httpx
import pytest
from conftest import KEY_B, wait_for_job

LINES = "\n".join(json.dumps({"prompt": "Hi", "completion": "Hello there."}) for _ in range(4)).encode()


@pytest.fixture(scope="module")
def objects_of_a(client_a):
    upload = client_a.files.create(file=("a.jsonl", LINES), purpose="fine-tune")
    job = wait_for_job(client_a, client_a.fine_tuning.jobs.create(
        model="demo-tiny", training_file=upload.id, hyperparameters={"n_epochs": 1}).id)
    response = client_a.responses.create(model="demo-tiny", input="Hi", max_output_tokens=2, background=True)
    return upload, job, response


def test_other_tenant_gets_404_everywhere(api_url, objects_of_a):
    upload, job, response = objects_of_a
    assert job.status == "succeeded"
    b = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {KEY_B}"})
    calls = [
        ("GET", f"/v1/files/{upload.id}", None), ("GET", f"/v1/files/{upload.id}/content", None),
        ("DELETE", f"/v1/files/{upload.id}", None),
        ("GET", f"/v1/fine_tuning/jobs/{job.id}", None), ("POST", f"/v1/fine_tuning/jobs/{job.id}/cancel", None),
        ("GET", f"/v1/fine_tuning/jobs/{job.id}/events", None),
        ("GET", f"/v1/fine_tuning/jobs/{job.id}/checkpoints", None),
        ("GET", f"/v1/responses/{response.id}", None), ("POST", f"/v1/responses/{response.id}/cancel", None),
        ("GET", f"/v1/models/{job.fine_tuned_model}", None),
        ("GET", f"/v1/files/{job.result_files[0]}/content", None),
        ("POST", "/v1/chat/completions", {"model": job.fine_tuned_model,
                                           "messages": [{"role": "user", "content": "Hi"}]}),
        ("POST", "/v1/responses", {"model": job.fine_tuned_model, "input": "Hi"}),
        ("POST", "/v1/fine_tuning/jobs", {"model": "demo-tiny", "training_file": upload.id}),
    ]
    for method, path, body in calls:
        reply = b.request(method, path, json=body)
        assert reply.status_code == 404, (method, path, reply.text)
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}

    assert upload.id not in [f["id"] for f in b.get("/v1/files").json()["data"]]
    assert job.id not in [j["id"] for j in b.get("/v1/fine_tuning/jobs").json()["data"]]
    assert job.fine_tuned_model not in [m["id"] for m in b.get("/v1/models").json()["data"]]


def test_keys_are_required(api_url):
    assert httpx.get(api_url + "/v1/files").status_code == 401
    reply = httpx.get(api_url + "/v1/files", headers={"Authorization": "Bearer wrong"})
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
