"""Bad input gets an OpenAI-shaped 4xx, nothing is half-created, and the workers keep serving."""

import json

import openai
import pytest
from conftest import TEST_BACKEND, wait_for_job

GOOD = json.dumps({"prompt": "Hi", "completion": "Hello."}).encode()


def file_ids(client):
    return {f.id for f in client.files.list()}


def job_ids(client):
    return {j.id for j in client.fine_tuning.jobs.list(limit=100)}


def assert_openai_error(exc: openai.APIStatusError, status: int, param: str | None = None):
    assert exc.status_code == status
    body = exc.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if param:
        assert body["param"] == param


def test_malformed_jsonl_upload(client_a):
    before = file_ids(client_a)
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.files.create(file=("bad.jsonl", b'{"prompt": "a", "completion": "b"}\n{not json\n'),
                              purpose="fine-tune")
    assert_openai_error(exc.value, 400, "file")
    assert "line 2" in exc.value.message
    assert file_ids(client_a) == before


def test_oversize_upload(client_a, stack_dir):
    before = file_ids(client_a)
    with pytest.raises(openai.APIStatusError) as exc:
        client_a.files.create(file=("big.jsonl", (GOOD + b"\n") * 20000), purpose="fine-tune")
    assert_openai_error(exc.value, 413, "file")
    # Far over the limit: refused while the body streams in.
    with pytest.raises(openai.APIStatusError) as exc:
        client_a.files.create(file=("huge.jsonl", (GOOD + b"\n") * 60000), purpose="fine-tune")
    assert_openai_error(exc.value, 413)
    assert file_ids(client_a) == before
    assert not list((stack_dir / "artifacts").rglob("*.partial"))


def test_unknown_purpose(client_a):
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.files.create(file=("a.jsonl", GOOD), purpose="assistants")
    assert_openai_error(exc.value, 400, "purpose")


def test_unknown_model(client_a):
    upload = client_a.files.create(file=("a.jsonl", GOOD), purpose="fine-tune")
    before = job_ids(client_a)
    with pytest.raises(openai.NotFoundError) as exc:
        client_a.fine_tuning.jobs.create(model="no-such-model", training_file=upload.id)
    assert_openai_error(exc.value, 404, "model")
    with pytest.raises(openai.NotFoundError):
        client_a.chat.completions.create(model="ft:demo-tiny:x:ftjob-nope", messages=[{"role": "user",
                                                                                       "content": "Hi"}])
    assert job_ids(client_a) == before


@pytest.mark.parametrize("suffix", ["../../etc", "a/b", "x" * 65, "we ird"])
def test_path_like_suffix(client_a, suffix):
    upload = client_a.files.create(file=("a.jsonl", GOOD), purpose="fine-tune")
    before = job_ids(client_a)
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id, suffix=suffix)
    assert_openai_error(exc.value, 400, "suffix")
    assert job_ids(client_a) == before


def test_negative_token_counts(client_a):
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=-5)
    assert_openai_error(exc.value, 400, "max_tokens")
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.responses.create(model="demo-tiny", input="Hi", max_output_tokens=-1)
    assert_openai_error(exc.value, 400, "max_output_tokens")
    with pytest.raises(openai.BadRequestError):
        client_a.responses.create(model="demo-tiny", input=[])
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file="file-x",
                                         hyperparameters={"n_epochs": -3})
    assert_openai_error(exc.value, 400)


def test_invalid_training_lines_are_refused_with_line_numbers(client_a):
    lines = [GOOD, json.dumps({"messages": [{"role": "user", "content": "no answer"}]}).encode(),
             json.dumps({"text": "wrong shape"}).encode()]
    upload = client_a.files.create(file=("mixed.jsonl", b"\n".join(lines)), purpose="fine-tune")
    before = job_ids(client_a)
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id)
    assert exc.value.response.json()["error"]["code"] == "invalid_training_file"
    assert "line 2" in exc.value.message and "line 3" in exc.value.message
    assert job_ids(client_a) == before


def test_wrong_file_purpose_and_missing_file(client_a):
    batch_file = client_a.files.create(file=("b.jsonl", GOOD), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=batch_file.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file="file-missing")
    assert_openai_error(exc.value, 404, "training_file")


def test_bf16_on_a_worker_without_it_is_refused_at_once(client_a, http_a):
    upload = client_a.files.create(file=("a.jsonl", GOOD), purpose="fine-tune")
    if any(w.get("bf16") for w in http_a.get("/v1/workers").json()["data"]):  # a GPU run: the devices have bf16
        job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id, extra_body={"bf16": True})
        client_a.fine_tuning.jobs.cancel(job.id)
        return
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id, extra_body={"bf16": True})
    assert "bf16" in exc.value.message


def test_unavailable_attention_fails_that_request_only(client_a):
    try:
        client_a.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=2, extra_body={"attn_implementation": "flash_attention_2"})
        assert TEST_BACKEND != "cpu", "flash_attention_2 cannot run on cpu"  # on a GPU the Hub kernel may serve it
    except openai.BadRequestError as exc:
        assert "flash_attention_2" in exc.message
    eager = client_a.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=2, extra_body={"attn_implementation": "eager"})
    assert eager.usage.completion_tokens >= 1


def test_too_long_prompt_fails_cleanly_and_workers_survive(client_a):
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "word " * 2000}],
                                         max_tokens=8)
    assert "context" in exc.value.message
    ok = client_a.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_cancel_finished_job_is_a_conflict(client_a):
    upload = client_a.files.create(file=("a.jsonl", GOOD), purpose="fine-tune")
    job = wait_for_job(client_a, client_a.fine_tuning.jobs.create(
        model="demo-tiny", training_file=upload.id, hyperparameters={"n_epochs": 1}).id)
    with pytest.raises(openai.ConflictError):
        client_a.fine_tuning.jobs.cancel(job.id)


def test_text_that_is_not_unicode(client_a, http_a):
    """JSON can carry a lone surrogate (\\udcff) that no tokenizer can encode: a 400, not a server error."""
    reply = http_a.post("/v1/chat/completions", content=b'{"model": "demo-tiny", "max_tokens": 2, '
                                                         b'"messages": [{"role": "user", "content": "\\udcff"}]}',
                        headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and "Unicode" in reply.json()["error"]["message"]
    lines = GOOD + b'\n{"prompt": "a\\udcff", "completion": "b"}'
    upload = client_a.files.create(file=("surrogate.jsonl", lines), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id)
    assert "line 2" in exc.value.message and "Unicode" in exc.value.message


def test_metadata_limits(client_a):
    upload = client_a.files.create(file=("a.jsonl", GOOD), purpose="fine-tune")
    before = job_ids(client_a)
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(openai.BadRequestError) as exc:
            client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id, metadata=metadata)
        assert_openai_error(exc.value, 400)
    assert job_ids(client_a) == before
