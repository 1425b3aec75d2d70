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


def _settled_batch(store: RecordStore, root, status: str, chunks: int) -> str:
    """A batch whose chunks have all completed (each with one output line written), left in `status`."""
    from contract import batches

    batch_id = new_id("batch")
    store.create("batch", {"id": batch_id, "tenant": "tenant-a", "status": status, "object": "batch",
                           "endpoint": "/v1/chat/completions", "input_file_id": "file-x", "completion_window": "24h",
                           "created_at": int(time.time()), "expires_at": int(time.time()) + 3600, "total": chunks,
                           "n_chunks": chunks, "chunks_settled": chunks - 1, "metadata": {}}, track=True)
    for index in range(chunks):
        out, err = batches.chunk_files(root, "tenant-a", batch_id, index)
        batches.write_atomically(out, [json.dumps({"custom_id": f"done-{index}", "error": None})])
        batches.write_atomically(err, [])
        store.create("chunk", {"id": batches.chunk_id(batch_id, index), "tenant": "tenant-a", "batch_id": batch_id,
                               "index": index, "status": "completed", "attempts": 1, "completed": 1, "failed": 0,
                               "created_at": int(time.time())})
    return batch_id


def test_a_batch_whose_last_chunk_settled_on_a_node_that_died_is_finalised(client_a, redis_client, stack_env):
    """Was: a node SIGKILLed between settling a chunk and counting it (or between the count and finalising) left
    its batch in_progress for ever, with every chunk done (the fault suite's worker SIGKILL, once in CI)."""
    from pathlib import Path

    store, root = RecordStore(redis_client), Path(stack_env["XPUJOBS_ARTIFACT_ROOT"])
    batch_id = _settled_batch(store, root, "in_progress", 3)
    done = _wait(lambda: (b := store.get("batch", batch_id))["status"] == "completed" and b, 60,
                 "the reconciler to finalise the batch")
    assert done["request_counts_final"] == {"total": 3, "completed": 3, "failed": 0}
    lines = [json.loads(line)["custom_id"] for line in client_a.files.content(done["output_file_id"]).text.splitlines()]
    assert lines == ["done-0", "done-1", "done-2"]


def test_a_batch_left_finalizing_is_finished_once_its_finaliser_is_gone(client_a, redis_client, stack_env):
    """A finaliser that died midway: the batch waits while its lock stands (a live finaliser is never raced), is
    finished once the lock lapses, and finalising again writes the same output file, not a second one."""
    from pathlib import Path

    from contract import batches

    store, root = RecordStore(redis_client), Path(stack_env["XPUJOBS_ARTIFACT_ROOT"])
    batch_id = _settled_batch(store, root, "finalizing", 2)
    redis_client.set(f"lock:finalize:{batch_id}", "a-finaliser-that-died", px=5000)
    time.sleep(3.5)  # more than two reconciler rounds (a third of the 4 s lease each)
    assert store.get("batch", batch_id)["status"] == "finalizing"
    done = _wait(lambda: (b := store.get("batch", batch_id))["status"] == "completed" and b, 60,
                 "the reconciler to finish the batch once the lock lapsed")
    outputs = [f for f in client_a.files.list(purpose="batch_output") if f.filename == f"{batch_id}_output.jsonl"]
    assert [f.id for f in outputs] == [done["output_file_id"]]
    store.update("batch", batch_id, {"status": "finalizing"})
    batches.finalize(store, root, store.get("batch", batch_id))
    again = store.get("batch", batch_id)
    assert again["status"] == "completed" and again["output_file_id"] == done["output_file_id"]
    assert [f.id for f in client_a.files.list(purpose="batch_output")
            if f.filename == f"{batch_id}_output.jsonl"] == [done["output_file_id"]]
