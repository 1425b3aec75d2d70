"""Property-based API testing: schemathesis generates requests (valid and invalid) for every operation of the
running stack's OpenAPI schema and checks that none gets a server error; the shapes it does not generate
(multipart uploads, JSONL content) are written by hand below."""

import json
import time

import hypothesis
import pytest
import schemathesis
from conftest import KEY_A
from schemathesis.checks import not_a_server_error

EXAMPLES_PER_OPERATION = 10  # bounded: the whole run takes a few minutes on 2 cores


def _short(case) -> None:
    """Short outputs: the point is how the input is handled, not generating long text on a CPU."""
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if type(case.body.get(field)) is int and case.body[field] > 4:
                case.body[field] = 4


@pytest.mark.faults
def test_no_generated_request_gets_a_server_error(api_url):
    schema = schemathesis.openapi.from_url(api_url + "/openapi.json")
    failures: list[str] = []
    statuses: dict[int, int] = {}  # status class -> requests
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 20
    for operation in operations:
        @hypothesis.given(case=operation.as_strategy())
        @hypothesis.settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        def run(case):
            _short(case)
            response = case.call(base_url=api_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120)
            statuses[response.status_code // 100] = statuses.get(response.status_code // 100, 0) + 1
            case.validate_response(response, checks=[not_a_server_error])

        try:
            run()
        except Exception as exc:  # noqa: BLE001 (each operation's failure is collected, then all are reported)
            failures.append(f"{operation.label}: {str(exc)[:2000]}")
    print(f"schemathesis: {len(operations)} operations, responses by status class {sorted(statuses.items())}")
    assert not failures, "\n\n".join(failures)
    assert statuses.get(2, 0) > 50 and statuses.get(4, 0) > 50  # the calls got past authentication, both ways


GOOD = b'{"prompt": "Hi", "completion": "Hello."}'
BATCH = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "demo-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}})


@pytest.mark.parametrize("content, purpose, status", [
    (GOOD, "fine-tune", 200),
    (b"\xef\xbb\xbf" + GOOD, "fine-tune", 400),                      # a byte-order mark is not JSON
    (GOOD.replace(b"\n", b"") + b"\r\n" + GOOD + b"\r\n", "fine-tune", 200),  # CRLF lines
    (b"\xff\xfe\x00garbage", "fine-tune", 400),                        # not UTF-8
    (b"[1, 2, 3]\n", "fine-tune", 400),                                # JSON, not an object
    (b'{"prompt": "' + b"a" * 100_000 + b'", "completion": "b"}', "fine-tune", 200),  # one long line
    (b"\n\n\n", "fine-tune", 400),                                     # only blank lines
    (b"", "batch", 400),                                               # empty
    (b"\x00" * 64, "batch", 200),                                      # a batch file's bad lines fail at create
    (BATCH.encode() + b"\n{not json\n", "batch", 200),
])
def test_multipart_uploads_and_jsonl_content(http_a, content, purpose, status):
    reply = http_a.post("/v1/files", files={"file": ("f.jsonl", content)}, data={"purpose": purpose})
    assert reply.status_code == status, reply.text
    if status != 200:
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("fields, param", [
    ({"data": {"purpose": "batch"}}, "file"),                             # no file part
    ({"files": {"file": ("f.jsonl", GOOD)}}, "purpose"),                  # no purpose
    ({"files": {"file": ("f.jsonl", GOOD)}, "data": {"purpose": "batch", "expires_after[anchor]": "created_at"}},
     "expires_after"),
    ({"files": {"file": ("f.jsonl", GOOD)}, "data": {"purpose": "batch", "expires_after[anchor]": "now",
                                                     "expires_after[seconds]": "3600"}}, "expires_after.anchor"),
    ({"files": {"file": ("f.jsonl", GOOD)}, "data": {"purpose": "batch", "expires_in": "3600"}}, "expires_in"),
    ({"files": {"file": ("f.jsonl", GOOD), "extra": ("g.jsonl", GOOD)}, "data": {"purpose": "batch"}}, "extra"),
])
def test_malformed_multipart_is_a_400_naming_the_field(http_a, fields, param):
    reply = http_a.post("/v1/files", **fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_batch_lines_of_every_wrong_shape_end_in_the_error_file(client_a):
    lines = [BATCH, "{not json", "[1]", json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/chat/completions",
                                                   "body": {}}),
             json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"model": 5}}),
             json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/embeddings", "body": {}})]
    upload = client_a.files.create(file=("mixed.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    deadline = time.monotonic() + 180
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client_a.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 1, batch
    errors = client_a.files.content(batch.error_file_id).text
    assert batch.request_counts.failed == len(errors.splitlines()) == 5
