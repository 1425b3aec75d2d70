"""Time to first token (TTFT) of live chats through the whole service, against the engine called directly.

The service: `xpu-jobs up` at its shipped settings (bench/service.py's Stack), each chat streamed (stream=true)
and timed from the client's POST to its first chunk, which the API sends once the engine has produced the first
token. The engine: the same model directory loaded in this process as a worker loads it, an Engine at the shipped
settings (bench/generation.py's shipped_engine), timed from submit to its first delta. Both see the same prompts
(the chat template applied) and are measured

  idle        one request at a time,
  loaded      N requests at once,
  batch       (service only) one at a time while a batch job of B lines runs on the same worker,

and the report gives p50 and p99 for each, and what the service adds to the engine's TTFT at p50 (the target is
at most 30 ms). The stack runs first and is stopped before the engine loads, so they never share the device.

    python -m bench.ttft --model tiny --requests 32 --out ttft.json                 # CPU, the demo model
    python -m bench.ttft --model qwen3-0.6b --requests 64 --out ttft.json           # GPU (xpu or cuda: auto)
"""

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.service import Stack, percentiles


def contents(model: str, n: int) -> list[str]:
    """Chat messages of about 24 tokens (token words for the random-weight models' word-level tokenizer)."""
    if model == "tiny":
        return [f"Count to {i} and then tell me about the quick brown fox." for i in range(n)]
    return [" ".join(f"<t{10 + (i * 7 + j) % 500}>" for j in range(24)) for i in range(n)]


def first_chunk(stack: Stack, content: str, new_tokens: int, moments: list | None = None) -> float:
    """Seconds from the POST to the first server-sent event of a streamed chat; the rest is read and dropped.
    moments gets (chat id, wall clock at the POST, at the first event)."""
    body = {"model": stack.model, "messages": [{"role": "user", "content": content}], "max_tokens": new_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t, sent = time.perf_counter(), time.time()
    first = None
    with stack.http.stream("POST", "/chat/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - t
                if moments is not None:
                    moments.append((json.loads(line[5:])["id"], sent, sent + first))
    return first


# The stamps a live request's record holds (api/inference_service.py, worker/serving/), in the order they happen.
STAMPS = ("received", "pulled", "claimed", "prepared", "submitted", "first_output", "first_written")


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU time so far of this process (the client) and of the stack's processes, by role."""
    import psutil

    def role(proc) -> str:
        line = " ".join(proc.cmdline())
        if "multiprocessing" in line:  # uvicorn's worker processes and the engine process are both spawned
            return "api" if "worker.cli api" in " ".join(proc.parent().cmdline()) else "engine process"
        for name in ("redis-server", "worker.cli api", "worker.cli up"):
            if name in line:
                return {"worker.cli api": "api"}.get(name, name)
        return "worker node" if "worker" in line else line[:40]

    totals: dict[str, float] = {"client": sum(psutil.Process().cpu_times()[:2])}
    for proc in psutil.Process(stack.proc.pid).children(recursive=True):
        try:
            name = role(proc)
            totals[name] = totals.get(name, 0.0) + sum(proc.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return totals


def phases(stack: Stack, moments: list[tuple[str, float, float]]) -> dict:
    """Where N concurrent chats' time to the first event went, hop by hop: for each stamp, the median time from
    the previous one and the spread (last minus first) of the moments the N reached it, from the POST (client
    "sent") to the first event read (client "first_event")."""
    import redis

    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    rows = []
    for record_id, sent, first in moments:
        timings = json.loads(client.hget(f"rec:chat:{record_id}", "timings") or "{}")
        rows.append({"sent": sent, **{k: timings[k] for k in STAMPS if k in timings}, "first_event": first})
    names = [n for n in ("sent", *STAMPS, "first_event") if all(n in r for r in rows)]

    def median(values):
        return sorted(values)[len(values) // 2]

    out = {}
    for before, name in zip([None, *names], names):
        at = [r[name] for r in rows]
        out[name] = {"spread_ms": round(1e3 * (max(at) - min(at)), 1)}
        if before:
            out[name]["median_from_" + before + "_ms"] = round(1e3 * median([r[name] - r[before] for r in rows]), 1)
    return out


def measure_service(stack: Stack, prompts: list[str], new_tokens: int, batch_lines: int) -> dict:
    first_chunk(stack, prompts[0], new_tokens)  # warm-up: model load and graph capture
    idle = [first_chunk(stack, p, new_tokens) for p in prompts]
    moments: list = []
    before = cpu_seconds(stack)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(first_chunk, stack, p, new_tokens, moments) for p in prompts]
        # the CPU spent until every chat had its first event
        while len(moments) < len(prompts) and not all(f.done() for f in futures):
            time.sleep(0.002)
        after = cpu_seconds(stack)
        loaded = [f.result() for f in futures]
    used = {name: round(after[name] - before.get(name, 0.0), 3) for name in after}
    result = {"idle": idle, "loaded": loaded,
              "concurrent_phases": {**phases(stack, moments), "cpu_seconds": used}}
    if batch_lines:
        done = threading.Event()
        token_prompts = [[10 + (i + j) % 200 for j in range(32)] for i in range(batch_lines)]
        runner = threading.Thread(target=lambda: (stack.batch(token_prompts, 4 * new_tokens), done.set()))
        runner.start()
        time.sleep(1.0)  # the batch's chunks are claimed and in the engine
        during = []
        while not done.is_set() and len(during) < len(prompts):
            during.append(first_chunk(stack, prompts[len(during)], new_tokens))
        runner.join()
        result["batch"] = during
    return result


def measure_engine(stack: Stack, backend: str, prompts: list[str], new_tokens: int) -> dict:
    from bench.generation import shipped_engine
    from contract.settings import Settings
    from worker.engine.requests import GenerationRequest, SamplingParams
    from worker.models import load_model_and_tokenizer

    settings = Settings(_env_file=None, models_root=stack.dir / "models")
    model, tokenizer = load_model_and_tokenizer(stack.model, settings, backend)
    device = {"cpu": "cpu", "cuda": "cuda:0", "xpu": "xpu:0"}[backend]
    engine = shipped_engine(model, tokenizer, device)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"] for p in prompts]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)

    def run(batch: list[list[int]]) -> list[float]:
        firsts: dict[int, float] = {}
        t = time.perf_counter()
        futures = [engine.submit(GenerationRequest(str(i), p, params, stream=True),
                                 on_delta=lambda _, i=i: firsts.setdefault(i, time.perf_counter() - t))
                   for i, p in enumerate(batch)]
        for future in futures:
            future.result()
        return [firsts[i] for i in range(len(batch))]

    run(ids[:1])  # warm-up
    try:
        return {"idle": [run([p])[0] for p in ids], "loaded": run(ids)}
    finally:
        engine.close()


def report(service: dict, engine: dict) -> dict:
    ms = {side: {case: {k: round(v * 1e3, 2) for k, v in percentiles(values).items()}
                 for case, values in cases.items() if values}
          for side, cases in (("service", service), ("engine", engine))}
    added = {case: round(ms["service"][case]["p50"] - ms["engine"][case]["p50"], 2)
             for case in ("idle", "loaded") if case in ms["engine"] and case in ms["service"]}
    return {"ttft_ms": ms, "service_adds_p50_ms": added}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (the demo model) or one of bench/generation.py's models")
    ap.add_argument("--device", default="auto", help="cpu, cuda, xpu or auto")
    ap.add_argument("--requests", type=int, default=32, help="chats per case; 'loaded' sends them all at once")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens each chat generates")
    ap.add_argument("--batch-lines", type=int, default=256, help="lines of the batch job in the 'batch' case")
    ap.add_argument("--stack-env", action="append", default=[], metavar="XPUJOBS_NAME=VALUE",
                    help="a setting changed from the shipped one for the stack (a tuned run: the report names it)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    stack_env = dict(item.split("=", 1) for item in args.stack_env)
    from worker.node.devices import detect_backend

    backend = detect_backend(args.device)
    prompts = contents(args.model, args.requests)
    stack = Stack(args.model, backend, stack_env)
    try:
        service = measure_service(stack, prompts, args.new_tokens, args.batch_lines)
    finally:
        stack.close()
    concurrent_phases = service.pop("concurrent_phases")
    engine = measure_engine(stack, backend, prompts, args.new_tokens)
    out = {"model": args.model, "backend": backend, "requests": args.requests, "new_tokens": args.new_tokens,
           "batch_lines": args.batch_lines, "stack_env": stack_env, **report(service, engine),
           "concurrent_phases": concurrent_phases}
    print(json.dumps(out, indent=2))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
