"""Live inference through the service: concurrent requests share one engine batch; background responses
can be cancelled; the registry shows what each worker has loaded."""

from concurrent.futures import ThreadPoolExecutor

import httpx
from conftest import KEY_A, _wait


def engine_of(api_url: str, attn: str) -> list[dict]:
    workers = httpx.get(api_url + "/v1/workers", headers={"Authorization": f"Bearer {KEY_A}"}).json()["data"]
    return [m["engine"] for w in workers for m in w.get("models", [])
            if m["model"] == "demo-tiny" and m["attn_implementation"] == attn]


def test_concurrent_requests_are_decoded_together(client_a, api_url):
    def ask(i: int) -> int:
        reply = client_a.chat.completions.create(
            model="demo-tiny", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=64,
            temperature=0, extra_body={"attn_implementation": "eager", "ignore_eos": True})
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(ask, range(16))) == [64] * 16
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
