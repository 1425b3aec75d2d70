"""The whole service under load: a batch job through the API, the queue and a worker, and 64 concurrent chat
completions against the same 64 sent one after another.

The stack is started the way a user starts it (`xpu-jobs up`: embedded Redis, the API, one worker per device)
on a model directory written here with random weights, so nothing is downloaded. `make_run_service` gives
the variant "service" of bench/generation.py (same prompts, same output length as the other variants); run on its own,
this script also measures the concurrency ratio:

    python -m bench.service --model qwen3-0.6b --out service.json
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

MODEL_NAME = {"tiny": "bench-tiny", "qwen3-0.6b": "bench-qwen3-0.6b"}


def write_model(name: str, root: Path) -> Path:
    """A model directory the worker can load: the demo model, or Qwen3-0.6B's architecture with random bf16
    weights and a word-level tokenizer over its whole vocabulary (prompts are token ids)."""
    directory = root / MODEL_NAME[name]
    if name == "tiny":
        from worker.demo_model import build_demo_model

        return build_demo_model(directory)
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from bench.generation import qwen3_06b_config
    from worker.demo_model import CHAT_TEMPLATE, SPECIAL_TOKENS

    config = qwen3_06b_config()
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
    """`xpu-jobs up` in a temporary directory, serving one model."""

    def __init__(self, model: str, backend: str, engine_memory_bytes: int, engine_batch: int, max_seq_len: int):
        self.dir = Path(tempfile.mkdtemp(prefix="xpujobs-bench-"))
        self.model = MODEL_NAME[model]
        write_model(model, self.dir / "models")
        port, self.redis_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("XPUJOBS_")}
        env.update({
            "XPUJOBS_MODELS_ROOT": str(self.dir / "models"), "XPUJOBS_ARTIFACT_ROOT": str(self.dir / "artifacts"),
            "XPUJOBS_BASE_MODELS": json.dumps([self.model]), "XPUJOBS_OPEN_MODE": "true",
            "XPUJOBS_DEVICE_BACKEND": backend, "XPUJOBS_ENGINE_MEMORY_BYTES": str(engine_memory_bytes),
            "XPUJOBS_ENGINE_MAX_BATCH_SIZE": str(engine_batch), "XPUJOBS_ENGINE_MAX_SEQ_LEN": str(max_seq_len),
            "XPUJOBS_WORKER_CONCURRENCY": "96", "XPUJOBS_REQUEST_TIMEOUT_SECONDS": "900",
            "XPUJOBS_HEARTBEAT_SECONDS": "1",  # fresh engine counters in the registry (batch_phases)
        })
        self.log = (self.dir / "stack.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "up", "--port", str(port),
                                      "--redis-port", str(self.redis_port), "--data-dir", str(self.dir)],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
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

    def chat(self, content: str, new_tokens: int) -> int:
        reply = self.http.post("/chat/completions", json={
            "model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": new_tokens,
            "temperature": 0, "ignore_eos": True})
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]


def make_run_service(model: str, backend: str, engine_memory_bytes: int, engine_batch: int, max_seq_len: int):
    """bench/generation.py's variant (d): the same prompts as one batch job through the whole service, with the
    engine configured as in variant (c). The same batch runs once first to load the model and capture the engine's
    graphs, as the engine variant's cold run does for it."""

    def run_service(prompts: list[list[int]], new_tokens: int) -> dict:
        stack = Stack(model, backend, engine_memory_bytes, engine_batch, max_seq_len)
        try:
            cold = stack.batch(prompts, new_tokens)
            return {**stack.batch(prompts, new_tokens), "cold_seconds": cold["seconds"]}
        finally:
            stack.close()

    return run_service


def concurrency(stack: Stack, n: int, new_tokens: int) -> dict:
    contents = [" ".join(f"<t{10 + (i * 7 + j) % 500}>" for j in range(24)) if "qwen" in stack.model
                else f"Count to {i}." for i in range(n)]
    stack.chat(contents[0], new_tokens)  # warm-up: model load and graph capture
    t = time.perf_counter()
    sequential = sum(stack.chat(c, new_tokens) for c in contents)
    sequential_s = time.perf_counter() - t
    sent: list[float] = []

    def send(content: str) -> int:
        sent.append(time.time())
        return stack.chat(content, new_tokens)

    t = time.perf_counter()
    wall = time.time()
    with ThreadPoolExecutor(n) as pool:
        concurrent = sum(pool.map(send, contents))
    concurrent_s = time.perf_counter() - t
    return {"requests": n, "new_tokens": new_tokens, "sequential_seconds": sequential_s,
            "concurrent_seconds": concurrent_s, "sequential_tokens": sequential, "concurrent_tokens": concurrent,
            "speedup": sequential_s / concurrent_s, "concurrent_phases": {"send_spread_seconds": max(sent) - min(sent),
                                                       **phases(stack, since=wall)}}


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
    ap.add_argument("--model", choices=list(MODEL_NAME), default="tiny")
    ap.add_argument("--backend", default="auto", help="cuda, xpu, cpu or auto")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--engine-memory-gib", type=float, default=24.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        from worker.node.devices import probe_backend

        backend = probe_backend()[0]
    stack = Stack(args.model, backend, int(args.engine_memory_gib * (1 << 30)), 256, 1024)
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
