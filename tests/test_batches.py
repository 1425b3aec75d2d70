"""The Batch API end to end through the official openai client."""

import json
import time

import pytest
from conftest import StoppedEngines, _wait, _workers, wait_for_job
from test_fine_tune_e2e import ANSWER, QUESTION, training_jsonl

TERMINAL = ("completed", "failed", "cancelled", "expired")


def chat_line(custom_id: str, model: str, content: str = QUESTION, max_tokens: int = 16, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "user", "content": content}],
                                "max_tokens": max_tokens, "temperature": 0, **extra}})


def run_batch(client, lines: list[str], endpoint: str = "/v1/chat/completions"):
    upload = client.files.create(file=("batch.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h",
                                  metadata={"purpose": "test"})
    return batch, _wait(lambda: (b := client.batches.retrieve(batch.id)).status in TERMINAL and b, 300,
                        f"batch {batch.id}")


def read_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def two_adapters(client_a):
    """Two fine-tuned models of the same base that answer differently."""
    other = "\n".join(json.dumps({"prompt": QUESTION, "completion": "Bananas are yellow."}) for _ in range(8))
    models = []
    for data, suffix in ((training_jsonl(), "pine"), (other.encode(), "banana")):
        upload = client_a.files.create(file=(f"{suffix}.jsonl", data), purpose="fine-tune")
        # a fixed seed, so each run trains the same adapters (with a random one, one full run got noise from "pine")
        job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id, suffix=suffix, seed=7,
                                               hyperparameters={"n_epochs": 40, "batch_size": 8,
                                                                "learning_rate_multiplier": 10})
        models.append(job.id)
    return [wait_for_job(client_a, job_id).fine_tuned_model for job_id in models]


def test_batch_with_two_adapters_base_and_a_bad_line(client_a, two_adapters):
    pine, banana = two_adapters
    lines = [chat_line("pine-1", pine), chat_line("base-1", "demo-tiny"), chat_line("banana-1", banana),
             "{this is not json", chat_line("unknown-model", "no-such-model"),
             json.dumps({"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "demo-tiny", "messages": [], "max_tokens": -1}}),
             chat_line("pine-2", pine), chat_line("banana-2", banana)]
    batch, done = run_batch(client_a, lines)
    assert batch.status in ("validating", "in_progress")
    assert done.status == "completed", done.errors
    assert done.request_counts.total == 8
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 3)
    assert done.usage.output_tokens > 0
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(done, stamp) >= done.created_at

    output = read_lines(client_a, done.output_file_id)
    assert [o["custom_id"] for o in output] == ["pine-1", "base-1", "banana-1", "pine-2", "banana-2"]
    text = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in output}
    # (a full run once got noise here from a well-trained adapter: its job's story goes with a failure)
    pine_job = pine.rsplit(":", 1)[-1]
    assert ANSWER in text["pine-1"] and ANSWER in text["pine-2"], (
        text, client_a.fine_tuning.jobs.retrieve(pine_job),
        [e.message for e in client_a.fine_tuning.jobs.list_events(pine_job, limit=100).data])
    assert "Bananas are yellow." in text["banana-1"] and "Bananas are yellow." in text["banana-2"]
    assert ANSWER not in text["base-1"] and "Bananas" not in text["base-1"]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)

    errors = read_lines(client_a, done.error_file_id)
    assert [e["custom_id"] for e in errors] == [None, "unknown-model", "bad-body"]
    assert "line 4" in errors[0]["error"]["message"]
    assert errors[1]["error"]["code"] == "model_not_found"


def test_responses_and_completions_endpoints(client_a):
    line = json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/responses",
                       "body": {"model": "demo-tiny", "input": "Hi", "max_output_tokens": 4}})
    _, done = run_batch(client_a, [line], "/v1/responses")
    [out] = read_lines(client_a, done.output_file_id)
    assert out["response"]["body"]["object"] == "response"
    assert out["response"]["body"]["usage"]["output_tokens"] <= 4
    line = json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "demo-tiny", "prompt": "The quick brown", "max_tokens": 3}})
    _, done = run_batch(client_a, [line], "/v1/completions")
    [out] = read_lines(client_a, done.output_file_id)
    assert out["response"]["body"]["object"] == "text_completion"


def test_large_batch_in_chunks_keeps_order_and_counts_move(client_a):
    n = 150  # three chunks of the suite's 64 lines
    # Lengths differ, so requests finish one after another and the counts can be seen moving.
    lines = [chat_line(f"req-{i}", "demo-tiny", content=f"Count {i}", max_tokens=8 + 2 * i, ignore_eos=True)
             for i in range(n)]
    upload = client_a.files.create(file=("big.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    seen_counts = set()
    deadline = time.monotonic() + 300
    while (current := client_a.batches.retrieve(batch.id)).status not in TERMINAL and time.monotonic() < deadline:
        seen_counts.add(current.request_counts.completed)
        time.sleep(0.05)
    assert current.status == "completed"
    assert current.request_counts.completed == n
    assert len(seen_counts) > 1, "request_counts did not move while the batch ran"
    output = read_lines(client_a, current.output_file_id)
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(n)]
    events = client_a.get(f"/batches/{batch.id}/events?limit=100", cast_to=dict)["data"]
    messages = [e["message"] for e in events]
    assert any(m.startswith("Batch in progress") for m in messages) and "Batch completed" in messages
    assert len({e["data"]["node"] for e in events if "chunk" in e["data"]}) == 2, "chunks ran on one worker only"


def test_chunk_of_a_killed_worker_is_redone_exactly_once(client_a, api_url, workers, start_worker, redis_client):
    n = 192
    lines = [chat_line(f"k-{i}", "demo-tiny", content=f"Item {i}", max_tokens=400, ignore_eos=True)
             for i in range(n)]
    upload = client_a.files.create(file=("kill.jsonl", "\n".join(lines).encode()), purpose="batch")

    def busy_node():
        for index in range(3):
            chunk = redis_client.hgetall(f"rec:chunk:{batch.id}.{index:05d}")
            if chunk and json.loads(chunk["status"]) == "in_progress":
                return json.loads(chunk["node"])
    # the engine processes stopped: the chunk found in progress is still running when its node is killed, however
    # fast the device (the node's own goes with it; the other resumes, for the redo)
    with StoppedEngines(api_url):
        batch = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        node = _wait(busy_node, 120, "a chunk in progress")
        victim = next(w for w in workers if node.startswith(w.name + "@"))
        victim.kill()
    try:
        done = _wait(lambda: (b := client_a.batches.retrieve(batch.id)).status in TERMINAL and b, 300, "batch")
        assert done.status == "completed"
        assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
        output = read_lines(client_a, done.output_file_id)
        assert [o["custom_id"] for o in output] == [f"k-{i}" for i in range(n)]
    finally:
        workers[workers.index(victim)] = start_worker(victim.name)


def test_unreadable_file_fails_in_validating(client_a):
    _, done = run_batch(client_a, ["{nope", "still not json"])
    assert done.status == "failed"
    assert [e.line for e in done.errors.data] == [1, 2]
    upload = client_a.files.create(file=("dup.jsonl", "\n".join([chat_line("x", "demo-tiny")] * 2).encode()),
                                   purpose="batch")
    dup = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert dup.status == "failed" and "repeats line 1" in dup.errors.data[0].message


def test_cancel_keeps_finished_lines(client_a, api_url, redis_client):
    # Lengths spread over hundreds of steps, so the first results come long before the last. The engine processes
    # run in stretches of 50 ms until the first results show, and stay stopped until the cancel reaches them: on a
    # fast device, the time the results take to show could otherwise be enough to finish every line.
    lines = [chat_line(f"slow-{i}", "demo-tiny", max_tokens=2 + 4 * i, ignore_eos=True) for i in range(200)]
    upload = client_a.files.create(file=("slow.jsonl", "\n".join(lines).encode()), purpose="batch")
    with StoppedEngines(api_url) as engines:
        batch = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")

        def first_results():
            engines.stop_new()
            engines.run_for(0.05)
            return client_a.batches.retrieve(batch.id).request_counts.completed > 0
        _wait(first_results, 120, "first results")
        cancelling = client_a.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        _wait(lambda: redis_client.exists(f"cancel:{batch.id}"), 30, "the cancel to be asked for")
        time.sleep(1)  # ten ticks of the nodes' cancel watch (0.1 s), which hands the cancels to the engines
    done = _wait(lambda: (b := client_a.batches.retrieve(batch.id)).status in TERMINAL and b, 60, "cancel")
    assert done.status == "cancelled" and done.cancelled_at
    output = read_lines(client_a, done.output_file_id)
    assert 0 < len(output) < 200
    assert len(output) == done.request_counts.completed
    assert len({o["custom_id"] for o in output}) == len(output)


def test_a_dead_engine_process_is_replaced_and_its_lines_run_again(client_a, api_url):
    """A node's models run in a child process. If it dies, the worker stays up, starts a new one, and the batch
    lines the dead one held run there: every line completes, once."""
    lines = [chat_line(f"e-{i}", "demo-tiny", max_tokens=2 + 4 * i, ignore_eos=True) for i in range(200)]
    upload = client_a.files.create(file=("engine.jsonl", "\n".join(lines).encode()), purpose="batch")
    before = _workers(api_url)
    with StoppedEngines(api_url) as engines:
        batch = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        killed = engines.kill_holding(200)
    done = _wait(lambda: (b := client_a.batches.retrieve(batch.id)).status in TERMINAL and b, 120, "batch")
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (200, 0)
    assert sorted(line["custom_id"] for line in read_lines(client_a, done.output_file_id)) == \
        sorted(f"e-{i}" for i in range(200))

    reply = client_a.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4
    after = _workers(api_url)
    assert {n: w["pid"] for n, w in after.items()} == {n: w["pid"] for n, w in before.items()}
    assert not killed & {w.get("engine_pid") for w in after.values()}


def test_a_line_whose_engine_process_dies_twice_goes_to_the_error_file(client_a, api_url):
    """A line is given to the engines twice: when the second engine process also dies under it, it goes to the
    error file and the batch completes; the node answers the next request from a third one."""
    lines = [chat_line(f"d-{i}", "demo-tiny", max_tokens=16, ignore_eos=True) for i in range(64)]  # one chunk
    upload = client_a.files.create(file=("twice.jsonl", "\n".join(lines).encode()), purpose="batch")
    with StoppedEngines(api_url) as engines:
        batch = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        first = engines.kill_holding(64)
        # the lines go to a new engine process, stopped as it appears: killed holding them too
        second = engines.kill_holding(64)
    assert first and second and not first & second
    done = _wait(lambda: (b := client_a.batches.retrieve(batch.id)).status in TERMINAL and b, 120, "batch")
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 64)
    errors = read_lines(client_a, done.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == sorted(f"d-{i}" for i in range(64))
    assert {e["error"]["code"] for e in errors} == {"server_error"}
    assert all("engine process exited" in e["error"]["message"] for e in errors)
    reply = client_a.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4
