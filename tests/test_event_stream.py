"""Live progress: a fine-tune's and a batch's events consumed as server-sent events until the job ends, and a
reconnect with Last-Event-ID that resumes right after the last event received."""

import json

import httpx
from conftest import KEY_B
from test_fine_tune_e2e import training_jsonl


def read_sse(response: httpx.Response) -> list[tuple[str, dict]]:
    """(id, data) of each event until the server closes the stream; keep-alive comments are skipped."""
    received, event_id, data = [], None, []
    for line in response.iter_lines():
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            received.append((event_id, json.loads("\n".join(data))))
            event_id, data = None, []
    return received


def test_fine_tune_events_stream_live_and_resume(client_a, http_a, api_url):
    upload = client_a.files.create(file=("sse.jsonl", training_jsonl(8)), purpose="fine-tune")
    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id,
                                           hyperparameters={"n_epochs": 4, "batch_size": 2})
    with http_a.stream("GET", f"/v1/fine_tuning/jobs/{job.id}/events", params={"stream": "true"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        received = read_sse(response)
    assert received[-1][1]["data"]["status"] == "succeeded"  # the stream ended with the job
    assert all(event["object"] == "fine_tuning.job.event" and event["id"] == sid for sid, event in received)
    steps = [event["data"]["step"] for _, event in received if event["type"] == "metrics"]
    assert steps == sorted(steps) and len(steps) == 16
    # Oldest first, the same events the list gives newest first.
    listed = client_a.fine_tuning.jobs.list_events(job.id, limit=1000).data
    assert [sid for sid, _ in received] == [e.id for e in reversed(listed)]

    middle = len(received) // 2
    headers = {"Last-Event-ID": received[middle][0], "Accept": "text/event-stream"}
    with http_a.stream("GET", f"/v1/fine_tuning/jobs/{job.id}/events", headers=headers) as response:
        resumed = read_sse(response)
    assert resumed == received[middle + 1:]

    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {KEY_B}"}) as other:
        assert other.get(f"/v1/fine_tuning/jobs/{job.id}/events", params={"stream": "true"}).status_code == 404
    refused = http_a.get(f"/v1/fine_tuning/jobs/{job.id}/events", params={"stream": "true", "limit": 5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "limit"
    bad = http_a.get(f"/v1/fine_tuning/jobs/{job.id}/events", headers={"Last-Event-ID": "nonsense",
                                                                        "Accept": "text/event-stream"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"


def test_batch_events_stream_until_the_batch_ends(client_a, http_a):
    body = "\n".join(json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "demo-tiny", "max_tokens": 3,
                                          "messages": [{"role": "user", "content": f"hi {i}"}]}}) for i in range(3))
    upload = client_a.files.create(file=("sse-batch.jsonl", body.encode()), purpose="batch")
    batch = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    with http_a.stream("GET", f"/v1/batches/{batch.id}/events",
                       headers={"Accept": "text/event-stream"}) as response:
        received = [event for _, event in read_sse(response)]
    statuses = [e["data"]["status"] for e in received if "status" in e["data"]]
    assert statuses[0] == "validating" and statuses[-1] == "completed"
    assert any(e["message"].startswith("Chunk 1/1 done") for e in received)
    assert all(e["object"] == "batch.event" for e in received)
    assert client_a.batches.retrieve(batch.id).status == "completed"
