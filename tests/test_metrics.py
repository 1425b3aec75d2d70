"""Prometheus: real scrapes of the API's /metrics (summed over its two processes) and of a worker node's own
endpoint, during a fine-tune and a batch, with values that move."""

import json

import httpx
from conftest import _wait, wait_for_job
from prometheus_client.parser import text_string_to_metric_families
from test_fine_tune_e2e import training_jsonl


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    text = httpx.get(url + "/metrics", timeout=60).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def test_api_requests_are_counted_across_its_processes(api_url, http_a):
    before = value(scrape(api_url), "xpujobs_api_requests_total", route="/v1/models", status="200")
    for _ in range(6):  # spread over both API processes
        assert http_a.get("/v1/models").status_code == 200
    assert http_a.get("/v1/files/file-nope").status_code == 404
    after = scrape(api_url)
    assert value(after, "xpujobs_api_requests_total", route="/v1/models", status="200") - before == 6
    assert value(after, "xpujobs_api_requests_total", route="/v1/files/{file_id}", status="404") >= 1
    assert value(after, "xpujobs_api_request_duration_seconds_count", route="/v1/models") >= 6


def test_workers_devices_and_queues(api_url, workers):
    samples = scrape(api_url)
    for node in workers:
        assert value(samples, "xpujobs_worker_up", node=f"{node.name}@" + _host(samples, node.name)) == 1
    assert value(samples, "xpujobs_device_memory_total_bytes") > 0
    assert value(samples, "xpujobs_device_memory_used_bytes") > 0
    assert ("xpujobs_queue_depth", (("queue", "xpujobs.cpu"),)) in samples


def _host(samples: dict, name: str) -> str:
    nodes = [dict(ls)["node"] for n, ls in samples if n == "xpujobs_worker_up"]
    return next(n for n in nodes if n.startswith(name + "@")).split("@", 1)[1]


def test_a_running_fine_tune_shows_its_progress(api_url, client_a):
    # long enough to be still running at the cancel however fast the device trains (400 steps could end first)
    upload = client_a.files.create(file=("metrics.jsonl", training_jsonl(40)), purpose="fine-tune")
    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id,
                                           hyperparameters={"n_epochs": 50, "batch_size": 1},
                                           extra_body={"max_steps": 2000})
    first = _wait(lambda: (s := scrape(api_url)) and value(s, "xpujobs_finetune_step", job=job.id) >= 2 and s,
                  240, "the fine-tune's first steps in /metrics")
    assert value(first, "xpujobs_jobs", kind="ftjob", status="running") >= 1
    assert value(first, "xpujobs_finetune_total_steps", job=job.id) == 2000
    step = value(first, "xpujobs_finetune_step", job=job.id)
    later = _wait(lambda: (s := scrape(api_url)) and value(s, "xpujobs_finetune_step", job=job.id) > step and s,
                  120, "the step to move")
    assert value(later, "xpujobs_finetune_steps_per_second", job=job.id) > 0
    assert value(later, "xpujobs_finetune_tokens_per_second", job=job.id) > 0
    assert value(later, "xpujobs_finetune_train_loss", job=job.id) > 0
    cancelled_before = value(later, "xpujobs_jobs", kind="ftjob", status="cancelled")
    client_a.fine_tuning.jobs.cancel(job.id)
    assert wait_for_job(client_a, job.id).status == "cancelled"
    done = scrape(api_url)
    assert value(done, "xpujobs_jobs", kind="ftjob", status="cancelled") == cancelled_before + 1
    assert value(done, "xpujobs_finetune_step", job=job.id) == 0  # no longer running: its series is gone


def _worker_endpoints(http_a) -> list[str]:
    return [f"http://127.0.0.1:{w['metrics_port']}" for w in http_a.get("/v1/workers").json()["data"]]


def test_a_batch_moves_worker_and_engine_counters(api_url, client_a, http_a):
    endpoints = _worker_endpoints(http_a)
    assert len(endpoints) >= 2

    def lines_done():
        return sum(value(scrape(e), "xpujobs_worker_requests_total", kind="batch_line", status="completed")
                   for e in endpoints)

    def tokens():
        return sum(value(scrape(e), "xpujobs_worker_generated_tokens_total", kind="batch_line") for e in endpoints)

    lines_before, tokens_before = lines_done(), tokens()
    steps_before = value(scrape(api_url), "xpujobs_engine_stat", stat="decode_steps")
    body = "\n".join(json.dumps({"custom_id": f"m{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "demo-tiny", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": f"count {i}"}]}})
                     for i in range(10))
    upload = client_a.files.create(file=("metrics-batch.jsonl", body.encode()), purpose="batch")
    batch = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    in_progress = value(scrape(api_url), "xpujobs_jobs", kind="batch", status="in_progress")
    assert in_progress >= 1 or client_a.batches.retrieve(batch.id).status == "completed"
    _wait(lambda: client_a.batches.retrieve(batch.id).status == "completed", 180, "the batch")
    assert lines_done() - lines_before == 10
    assert tokens() - tokens_before > 0
    # The engines' counters come through the heartbeats: wait for one after the batch.
    _wait(lambda: value(scrape(api_url), "xpujobs_engine_stat", stat="decode_steps") > steps_before, 30,
          "the engines' decode steps to move")
    samples = scrape(api_url)
    assert value(samples, "xpujobs_jobs", kind="batch", status="completed") >= 1
    assert any(n == "xpujobs_engine_batch_occupancy" for n, _ in samples)

    def chat_latency():
        return sum(value(scrape(e), "xpujobs_worker_request_duration_seconds_count", kind="chat") for e in endpoints)

    chats = chat_latency()
    client_a.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat_latency() == chats + 1

    def first_tokens():
        return sum(value(scrape(e), "xpujobs_worker_time_to_first_token_seconds_count", kind="chat")
                   for e in endpoints)

    streamed = first_tokens()
    chunks = list(client_a.chat.completions.create(model="demo-tiny", max_tokens=3, stream=True,
                                                   messages=[{"role": "user", "content": "hi"}]))
    assert chunks
    _wait(lambda: first_tokens() == streamed + 1, 30, "the streamed request's time to first token")


def test_the_metrics_key_guards_the_endpoint(redis_url, stack_dir):
    from fastapi.testclient import TestClient

    from api.main import create_app
    from contract.settings import Settings

    settings = Settings(_env_file=None, redis_url=redis_url, api_keys={"k": "t"}, metrics_key="scrape-key",
                        artifact_root=stack_dir / "artifacts", models_root=stack_dir / "models")
    with TestClient(create_app(settings)) as client:
        refused = client.get("/metrics")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 401
        scraped = client.get("/metrics", headers={"Authorization": "Bearer scrape-key"})
        assert scraped.status_code == 200 and "xpujobs_queue_depth" in scraped.text
