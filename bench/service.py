"""The whole service under load, at its shipped settings: a batch job through the API, the queue and a worker, and
N live chat completions sent one after another against the same N sent at once.

The stack is started the way a user starts it (`xpu-jobs up`: embedded Redis, the API, one worker per device)
on a model directory written here with random weights, so nothing is downloaded, and with no engine setting
changed. bench/generation.py runs its variant "service" and its `--chats` on this stack; run on its own, this
script measures the chats:

    python -m bench.service --model qwen3-0.6b --requests 64 --out service.json

Chats stream where the API accepts `stream: true` (server-sent events): each one then gives its time to the first
token (TTFT) and its mean time per output token after that (TPOT); otherwise only its whole latency.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from worker.node.redis_server import free_port


def write_model(name: str, root: Path) -> Path:
    """A model directory the worker can load: the demo model, or one of bench/generation.py's architectures with
    random bf16 weights and a word-level tokenizer over its whole vocabulary (prompts are token ids)."""
    directory = root / f"bench-{name}"
    if name == "tiny":
        from worker.demo_model import build_demo_model

        return build_demo_model(directory)
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from bench.generation import CONFIGS
    from worker.demo_model import CHAT_TEMPLATE, SPECIAL_TOKENS

    config = CONFIGS[name]()
    vocab = {f"<t{i}>": i for i in range(config.vocab_size - len(SPECIAL_TOKENS))}
    vocab.update({tok: len(vocab) + i for i, tok in enumerate(SPECIAL_TOKENS)})
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<|pad|>", eos_token="<|end|>",
                                        additional_special_tokens=SPECIAL_TOKENS[2:])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


class Stack:
    """`xpu-jobs up` in a temporary directory, serving one model, at the shipped settings plus `env` (a tuned run
    names what it changes there)."""

    def __init__(self, model: str, backend: str, env: dict[str, str] | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="xpujobs-bench-"))
        self.model = write_model(model, self.dir / "models").name
        port, self.redis_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("XPUJOBS_")}
        environ.update({
            "XPUJOBS_MODELS_ROOT": str(self.dir / "models"), "XPUJOBS_ARTIFACT_ROOT": str(self.dir / "artifacts"),
            "XPUJOBS_BASE_MODELS": json.dumps([self.model]), "XPUJOBS_OPEN_MODE": "true",
            "XPUJOBS_DEVICE_BACKEND": backend, "XPUJOBS_REQUEST_TIMEOUT_SECONDS": "900",
            "XPUJOBS_HEARTBEAT_SECONDS": "1",  # fresh engine counters in the registry (batch_phases)
            **(env or {}),
        })
        self.env = env or {}
        self.streams: bool | None = None  # learnt from the first chat
        self.log = (self.dir / "stack.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "up", "--port", str(port),
                                      "--redis-port", str(self.redis_port), "--data-dir", str(self.dir)],
                                     env=environ, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.http = httpx.Client(base_url=self.url + "/v1", timeout=900)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if self.http.get("/workers").json()["data"]:
                    # This client's own full collections (torch is loaded here) must not pause the timed requests.
                    gc.collect()
                    gc.freeze()
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self.log.flush()
        tail = (self.dir / "stack.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the stack did not come up; the end of {self.dir / 'stack.log'}:\n{tail}")

    def close(self):
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
        self.log.close()

    def batch(self, prompts: list[list[int]], new_tokens: int) -> dict:
        lines = "\n".join(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
                                      "body": {"model": self.model, "prompt": p, "max_tokens": new_tokens,
                                               "temperature": 0, "ignore_eos": True}})
                          for i, p in enumerate(prompts))
        upload = self.http.post("/files", data={"purpose": "batch"},
                                files={"file": ("bench.jsonl", lines.encode())}).json()
        engine_before = self.engine_stats()
        t, wall = time.perf_counter(), time.time()
        batch = self.http.post("/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/completions",
                                                 "completion_window": "24h"}).json()
        while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.02)  # the resolution of the measured time
            batch = self.http.get(f"/batches/{batch['id']}").json()
        seconds = time.perf_counter() - t
        if batch["status"] != "completed" or batch["request_counts"]["failed"]:
            raise RuntimeError(f"batch ended {batch['status']}: {batch['request_counts']}, {batch.get('errors')}")
        return {"tokens": batch["usage"]["output_tokens"], "seconds": seconds,
                "phases": self.batch_phases(batch, wall, engine_before)}

    def engine_stats(self) -> dict:
        """The counters of the served model's engine, from a registry heartbeat sent after this call began."""
        since = time.time()
        while True:
            workers = self.http.get("/workers").json()["data"]
            # a heartbeat that timed out on the engine process carries its previous report: wait for a fresh one
            if all(w["heartbeat_at"] > since and "engine_process" not in w for w in workers):
                break
            time.sleep(0.2)
        for worker in workers:
            for model in worker.get("models", []):
                if model["model"] == self.model:
                    return model["engine"]
        return {}

    def batch_phases(self, batch: dict, since: float, engine_before: dict) -> dict:
        """Where a batch's time went: the moments its chunks were claimed, had every line in the engine, had every
        result, and were written (seconds after the POST, earliest and latest), and what the engine did meanwhile."""
        import redis

        client = redis.Redis(port=self.redis_port, decode_responses=True)
        n_chunks = int(client.hget(f"rec:batch:{batch['id']}", "n_chunks"))
        stamps = [json.loads(client.hget(f"rec:chunk:{batch['id']}.{i:05d}", "timings") or "{}")
                  for i in range(n_chunks)]
        moments = {name: [s[name] - since for s in stamps if name in s]
                   for name in ("claimed", "submitted", "generated", "written")}
        after = self.engine_stats()
        engine = {k: after[k] - engine_before.get(k, 0) for k in
                  ("decode_steps", "decode_rows", "decode_seconds", "prefill_calls", "prefill_seconds",
                   "busy_seconds", "graphs_captured", "graph_capture_seconds")
                  if isinstance(after.get(k), (int, float))}
        if engine.get("decode_steps"):
            engine["ms_per_step"] = 1e3 * engine["decode_seconds"] / engine["decode_steps"]
            engine["mean_batch"] = engine["decode_rows"] / engine["decode_steps"]
        return {"chunks": n_chunks,
                **{f"{name}_s": [round(min(v), 3), round(max(v), 3)] for name, v in moments.items() if v},
                "engine": engine, "num_slots": after.get("num_slots")}

    def chat(self, content: str, new_tokens: int) -> dict:
        """One chat completion: its tokens and latency, and where the API streams, its time to the first token and
        mean time per output token after it."""
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": new_tokens,
                "temperature": 0, "ignore_eos": True}
        t = time.perf_counter()
        if self.streams is not False:
            for extra in ({"stream": True, "stream_options": {"include_usage": True}}, {"stream": True}):
                with self.http.stream("POST", "/chat/completions", json={**body, **extra}) as reply:
                    if reply.status_code in (400, 422):
                        reply.read()
                        continue
                    reply.raise_for_status()
                    self.streams = True
                    return self._read_stream(reply, t)
            self.streams = False
        reply = self.http.post("/chat/completions", json=body)
        reply.raise_for_status()
        return {"tokens": reply.json()["usage"]["completion_tokens"], "latency": time.perf_counter() - t}

    @staticmethod
    def _read_stream(reply, t: float) -> dict:
        moments, tokens, pieces = [], None, 0
        for line in reply.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                moments.append(time.perf_counter())
                pieces += 1
        tokens = tokens if tokens is not None else pieces
        out = {"tokens": tokens, "latency": time.perf_counter() - t}
        if moments:
            out["ttft"] = moments[0] - t
            if tokens > 1:
                out["tpot"] = (moments[-1] - moments[0]) / (tokens - 1)
        return out


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    values = sorted(values)
    return {"p50": values[len(values) // 2], "p99": values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]}


def concurrency(stack: Stack, n: int, new_tokens: int) -> dict:
    """n chats one after another, then the same n at once; latency, TTFT and TPOT percentiles for each."""
    contents = [" ".join(f"<t{10 + (i * 7 + j) % 500}>" for j in range(24)) if stack.model != "bench-tiny"
                else f"Count to {i}." for i in range(n)]
    stack.chat(contents[0], new_tokens)  # warm-up: model load and graph capture
    t = time.perf_counter()
    sequential = [stack.chat(c, new_tokens) for c in contents]
    sequential_s = time.perf_counter() - t
    sent: list[float] = []

    def send(content: str) -> dict:
        sent.append(time.time())
        return stack.chat(content, new_tokens)

    t = time.perf_counter()
    wall = time.time()
    with ThreadPoolExecutor(n) as pool:
        concurrent = list(pool.map(send, contents))
    concurrent_s = time.perf_counter() - t

    def latency(replies: list[dict]) -> dict:
        return {key: percentiles([r[key] for r in replies if key in r]) for key in ("latency", "ttft", "tpot")}

    return {"requests": n, "new_tokens": new_tokens, "streamed": bool(stack.streams),
            "sequential_seconds": sequential_s, "concurrent_seconds": concurrent_s,
            "sequential_tokens": sum(r["tokens"] for r in sequential),
            "concurrent_tokens": sum(r["tokens"] for r in concurrent), "speedup": sequential_s / concurrent_s,
            "latency": {"sequential": latency(sequential), "concurrent": latency(concurrent)},
            "concurrent_phases": {"send_spread_seconds": max(sent) - min(sent), **phases(stack, since=wall)}}


def phases(stack: Stack, since: float) -> dict:
    """Where the concurrent requests spent their time, from the timings their records hold (medians, and the
    spread of the moments they reached the API and the engine)."""
    import redis

    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    stamps = [json.loads(t) for key in client.scan_iter(match="rec:chat:*", count=1000)
              if (t := client.hget(key, "timings"))]
    stamps = [s for s in stamps if s["received"] >= since and "generated" in s]

    def median(values):
        values = sorted(values)
        return values[len(values) // 2] if values else None

    return {"requests": len(stamps),
            "queue_seconds": median([s["claimed"] - s["received"] for s in stamps]),
            "prepare_seconds": median([s["submitted"] - s["claimed"] for s in stamps]),
            "generate_seconds": median([s["generated"] - s["submitted"] for s in stamps]),
            **{f"{name}_spread_seconds": max(s[stamp] for s in stamps) - min(s[stamp] for s in stamps)
               for name, stamp in (("receive", "received"), ("submit", "submitted")) if stamps}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, qwen3-0.6b, phi3-0.6b or phi2-0.6b")
    ap.add_argument("--backend", default="auto", help="cuda, xpu, cpu or auto")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        from worker.node.devices import probe_backend

        backend = probe_backend()[0]
    stack = Stack(args.model, backend)
    try:
        result = {"model": args.model, "backend": backend, **concurrency(stack, args.requests, args.new_tokens)}
    finally:
        stack.close()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
