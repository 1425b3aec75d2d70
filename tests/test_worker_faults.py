"""Worker-side faults that the normal suite can show quickly: a line whose preparation raises ends with an error
line instead of hanging its chunk; an engine failure is a server error, a refused prompt a client error; a task
that a dead node had fetched (but not started) is published again. The slow ones are in tests/faults."""

import json
import time

import openai
import pytest
from conftest import TEST_BACKEND, _wait

from contract.queues import backend_queue
from contract.records import RecordStore, new_id
from contract.registry import live_workers
from worker.engine.requests import GenerationResult
from worker.serving.inference import RequestFailed, outcome

TERMINAL = ("completed", "failed", "cancelled", "expired")
NOT_ALTERNATING = [{"role": "user", "content": "Hi."}, {"role": "user", "content": "Hi again."}]


def _line(custom_id: str, model: str, messages: list[dict]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0}})


def test_a_chat_template_that_raises_ends_its_line_not_the_chunk(client_a):
    """Was: the chunk hung for ever (only ValidationError and RequestFailed were caught around prepare)."""
    lines = [_line("strict", "demo-strict", NOT_ALTERNATING),
             _line("fine", "demo-strict", [{"role": "user", "content": "Hi."}])]
    upload = client_a.files.create(file=("strict.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    done = _wait(lambda: (b := client_a.batches.retrieve(batch.id)).status in TERMINAL and b, 120,
                 f"batch {batch.id}")
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    error = json.loads(client_a.files.content(done.error_file_id).text)
    assert error["custom_id"] == "strict" and error["error"]["code"] == "invalid_prompt"
    assert "alternate" in error["error"]["message"]


def test_a_refused_prompt_is_a_client_error(client_a):
    with pytest.raises(openai.BadRequestError) as caught:
        client_a.chat.completions.create(model="demo-strict", messages=NOT_ALTERNATING, max_tokens=2)
    assert caught.value.code == "invalid_prompt"


def test_an_engine_failure_is_a_server_error():
    """Was: every engine error became invalid_prompt, a 400, even an engine closed by eviction."""
    failed = GenerationResult("r", [], "", "error", prompt_tokens=3, completion_tokens=0, error="engine closed")
    with pytest.raises(RequestFailed) as caught:
        outcome(failed, {}, None)
    assert caught.value.code == "server_error" and "engine closed" in str(caught.value)


def test_a_task_fetched_by_a_node_that_died_is_published_again(client_a, redis_client, workers):
    """A node fetches messages before it runs them (prefetch, countdowns); killed meanwhile, they stay in Redis'
    unacked for the visibility timeout (12 h), and a node restarted under the same name does not get them back.
    Here: a queued record published long ago and reserved by a node instance that is not alive; a worker's
    reconciler must publish it again."""
    store = RecordStore(redis_client)
    record_id = new_id("response")
    request = {"model": "demo-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
               "temperature": 0, "top_p": None, "seed": None, "stop": []}
    dead = f"{workers[0].name}@gone/0000dead"
    store.create("response", {"id": record_id, "tenant": "tenant-a", "status": "queued",
                              "created_at": int(time.time()) - 60, "published_at": int(time.time()) - 60,
                              "model": "demo-tiny", "base_model": "demo-tiny", "adapter_job": None,
                              "adapter_step": None, "request": request, "queue": backend_queue(TEST_BACKEND),
                              "background": True, "metadata": {}, "reserved_by": dead})
    store.track("response", record_id)
    # Published again and claimed by a live node: what the reconciler owes (the generation itself is not at stake).
    claimed = _wait(lambda: (r := store.get("response", record_id))["status"] != "queued" and r, 60,
                    "the reconciler to publish the record again and a node to claim it")
    assert claimed["reserved_by"] in {w["instance"] for w in live_workers(redis_client)}
    assert claimed["published_at"] > int(time.time()) - 60


def test_a_chunk_given_up_on_still_ends_its_lines_and_its_batch(client_a, redis_client, stack_env):
    """A chunk that lost its worker on every attempt (its lines kill the node, say) is failed by the reconciler.
    Was: its batch stayed in_progress for ever, since only a chunk task settles a chunk. Here: a batch of one
    chunk, in progress, whose last attempt's lease has lapsed."""
    from pathlib import Path

    from contract import batches

    store, root = RecordStore(redis_client), Path(stack_env["XPUJOBS_ARTIFACT_ROOT"])
    batch_id = new_id("batch")
    lines = [_line(f"lost-{i}", "demo-tiny", [{"role": "user", "content": "Hi."}]) for i in range(3)]
    batches.write_chunk_input(root, "tenant-a", batch_id, 0, list(enumerate(lines, start=1)))
    store.create("batch", {"id": batch_id, "tenant": "tenant-a", "status": "in_progress", "object": "batch",
                           "endpoint": "/v1/chat/completions", "input_file_id": "file-x", "completion_window": "24h",
                           "created_at": int(time.time()), "expires_at": int(time.time()) + 3600, "total": 3,
                           "n_chunks": 1, "chunks_settled": 0, "metadata": {}})
    chunk = batches.chunk_id(batch_id, 0)
    store.create("chunk", {"id": chunk, "tenant": "tenant-a", "batch_id": batch_id, "index": 0,
                           "status": "in_progress", "queue": backend_queue(TEST_BACKEND), "attempts": 3,
                           "created_at": int(time.time())})
    store.track("chunk", chunk)
    done = _wait(lambda: (b := store.get("batch", batch_id))["status"] == "completed" and b, 60,
                 "the reconciler to fail the chunk and its batch to finalise")
    assert store.get("chunk", chunk)["status"] == "failed"
    assert done["request_counts_final"] == {"total": 3, "completed": 0, "failed": 3}
    errors = [json.loads(line) for line in client_a.files.content(done["error_file_id"]).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["lost-0", "lost-1", "lost-2"]
    assert {e["error"]["code"] for e in errors} == {"worker_lost"}
