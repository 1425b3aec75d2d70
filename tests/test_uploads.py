"""A large upload is copied and parsed off the API's event loop: while one is being parsed, another request to the
same API process is answered before the upload's own response (ordering, not timing, is what is checked)."""

import json
import threading
from pathlib import Path

import httpx
from conftest import KEY_A, _wait, running_api

LINE = json.dumps({"prompt": "What is the secret word?", "completion": "The secret word is pineapple."}).encode()
SIZE = 16 * 1024 * 1024  # seconds of JSONL parsing on a shared core, far longer than a /health round trip


def test_health_answers_while_an_upload_is_parsed(stack_env, stack_dir):
    root = stack_dir / "uploads"
    env = {**stack_env, "XPUJOBS_ARTIFACT_ROOT": str(root), "XPUJOBS_MAX_UPLOAD_BYTES": str(2 * SIZE)}
    training = LINE + b"\n"
    training *= SIZE // len(training)
    answered: list[str] = []
    with running_api(env, stack_dir / "api-uploads.log", processes=1) as url:  # one process: one event loop
        def upload():
            reply = httpx.post(url + "/v1/files", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=300,
                               files={"file": ("big.jsonl", training)}, data={"purpose": "fine-tune"})
            answered.append(f"upload {reply.status_code}")

        uploading = threading.Thread(target=upload)
        uploading.start()
        # The route has the whole body and is writing or parsing it: its temporary file exists until it is done.
        partial = _wait(lambda: next(Path(root).glob("*/files/*.partial"), None) or (answered and "ended"), 300,
                        "the upload to reach its route")
        assert partial != "ended", answered
        health = httpx.get(url + "/health", timeout=300)
        answered.append(f"health {health.status_code}")
        uploading.join(300)
    assert answered == ["health 200", "upload 200"]
