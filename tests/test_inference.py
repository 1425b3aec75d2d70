"""Live inference through the service: concurrent requests share one engine batch; background responses
can be cancelled; the registry shows what each worker has loaded."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import KEY_A, _wait, wait_for_job


def loaded_models(api_url: str) -> list[dict]:
    """Every worker's loaded models, as the registry shows them."""
    workers = httpx.get(api_url + "/v1/workers", headers={"Authorization": f"Bearer {KEY_A}"}).json()["data"]
    return [m for w in workers for m in w.get("models", []) if m["model"] == "demo-tiny"]


def engine_of(api_url: str, attn: str) -> list[dict]:
    return [m["engine"] for m in loaded_models(api_url) if m["attn_implementation"] == attn]


def test_concurrent_requests_are_decoded_together(client_a, api_url):
    def ask(i: int) -> int:
        # Long enough to overlap in the engine even when the requests arrive spread out on a busy machine.
        reply = client_a.chat.completions.create(
            model="demo-tiny", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=200,
            temperature=0, extra_body={"attn_implementation": "eager", "ignore_eos": True})
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(ask, range(16))) == [200] * 16
    # The registry is refreshed on each heartbeat (every second in the tests).
    _wait(lambda: max((e["max_running"] for e in engine_of(api_url, "eager")), default=0) >= 4, 10,
          f"an engine to report 4 or more requests decoded together: {engine_of(api_url, 'eager')}")


def test_background_response_cancel(client_a):
    response = client_a.responses.create(model="demo-tiny", input="Go on and on.", background=True,
                                         max_output_tokens=1000, extra_body={"ignore_eos": True})
    cancelled = client_a.responses.cancel(response.id)
    assert cancelled.status in ("cancelled", "in_progress")
    final = _wait(lambda: (r := client_a.responses.retrieve(response.id)).status != "in_progress" and r, 60,
                  "the cancel")
    assert final.status == "cancelled"
    assert final.usage is None or final.usage.output_tokens < 1000


def test_quantized_base_for_inference(client_a, api_url):
    reply = client_a.chat.completions.create(
        model="demo-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
        extra_body={"quantization": "4bit", "ignore_eos": True})
    assert reply.usage.completion_tokens == 6
    # Quantized weights run through the model's own forward (the engine's fallback path).
    _wait(lambda: any(m["quantization"] == "4bit" and m["engine"]["path"] == "hf" for m in loaded_models(api_url)),
          10, f"a 4-bit model in the registry: {loaded_models(api_url)}")


def test_unavailable_hub_kernels_fail_clearly(client_a):
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=2, extra_body={"use_kernels": True})
    assert exc.value.code == "kernels_unavailable" and "Kernels" in exc.value.message
    upload = client_a.files.create(file=("k.jsonl", b'{"prompt": "a", "completion": "b"}'), purpose="fine-tune")
    job = client_a.fine_tuning.jobs.create(model="demo-tiny", training_file=upload.id,
                                           hyperparameters={"n_epochs": 1}, extra_body={"use_kernels": True})
    job = wait_for_job(client_a, job.id)
    assert job.status == "failed" and job.error.code == "kernels_unavailable"


def test_kernel_choices_are_honoured_and_named_in_the_response(client_a):
    """By default the engine's own kernels serve a request; an explicit attn_implementation runs the model's own
    forward with that attention instead (never accepted and ignored), and system_fingerprint says which."""
    messages = [{"role": "user", "content": "Hi"}]
    native = client_a.chat.completions.create(model="demo-tiny", messages=messages, max_tokens=3, temperature=0)
    assert native.system_fingerprint.startswith("xpu-jobs-native-")
    eager = client_a.chat.completions.create(model="demo-tiny", messages=messages, max_tokens=3, temperature=0,
                                             extra_body={"attn_implementation": "eager"})
    assert eager.system_fingerprint == "xpu-jobs-hf-eager"
    assert eager.choices[0].message.content == native.choices[0].message.content  # the same model, greedy
