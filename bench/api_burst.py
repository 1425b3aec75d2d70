"""The API's own share of a burst's time to first token: N streamed chats sent at once to the API alone (uvicorn
as `xpu-jobs api` starts it, with Redis), a stand-in node answering each live request with one output entry as
soon as it is pushed, so what is measured is the client, uvicorn/FastAPI, the record's creation and routing, and
the way back from the Redis stream to the first server-sent event, with no engine behind it.

    python -m bench.api_burst --requests 32 --api-workers 4 --client threads

--client threads is bench/ttft.py's client (httpx, one thread per chat, connections opened as the burst needs
them); --client raw sends the same bytes from one asyncio loop over connections opened before the clock starts,
so its figures have next to no client in them.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis

from worker.node.redis_server import free_port, start_redis


def stand_in_node(port: int, stop, entries: int, step: float) -> None:
    """Takes each live request off the cpu list and writes its first output at once, then (like an engine's
    steps) one more entry every `step` seconds for all the running requests together, up to `entries`, then the
    end. A process of its own, so the client's GIL does not slow it; when it pulled each request goes to the hash
    bench:pulled."""
    client = redis.Redis(port=port, decode_responses=True)
    running: dict[str, int] = {}
    next_step = time.monotonic()
    while not stop.is_set():
        item = client.blmove("live:xpujobs.cpu", "live-taken:bench", 0.002 if running else 0.05, "RIGHT", "LEFT")
        pipe = client.pipeline(transaction=False)
        if item is not None:
            record_id = item.split(":", 1)[1]
            pipe.hset("bench:pulled", record_id, time.time())
            running[record_id] = 0
        if time.monotonic() >= next_step or item is not None:
            if time.monotonic() >= next_step:
                next_step = time.monotonic() + step
                due = list(running)
            else:
                due = [record_id]
            for record_id in due:
                running[record_id] += 1
                pipe.xadd(f"output:{record_id}", {"c": 0, "t": "x"})
                if running[record_id] >= entries:
                    pipe.xadd(f"output:{record_id}", {"end": 1})
                    del running[record_id]
        pipe.execute()


def body(i: int) -> bytes:
    return json.dumps({"model": "bench-model", "messages": [{"role": "user", "content": f"Count to {i}."}],
                       "max_tokens": 8, "stream": True}).encode()


def threads_client(url: str, n: int) -> list[tuple[str, float, float]]:
    http = httpx.Client(base_url=url, timeout=60)

    def one(i: int):
        sent = time.time()
        with http.stream("POST", "/v1/chat/completions", content=body(i),
                         headers={"content-type": "application/json"}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data:"):
                    return json.loads(line[5:])["id"], sent, time.time()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


async def raw_client(port: int, n: int) -> list[tuple[str, float, float]]:
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]

    async def one(i: int, reader, writer):
        payload = body(i)
        sent = time.time()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        buffer = b""
        while b"data:" not in buffer or not buffer.split(b"data:", 1)[1].split(b"\r\n", 1)[1:]:
            buffer += await reader.read(65536)
        first = time.time()
        while b"[DONE]" not in buffer and (more := await reader.read(65536)):  # the rest, as a client reads it
            buffer += more
        writer.close()
        return json.loads(buffer.split(b"data:", 1)[1].split(b"\r\n", 1)[0])["id"], sent, first

    return await asyncio.gather(*(one(i, r, w) for i, (r, w) in enumerate(connections)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--api-workers", type=int, default=4)
    ap.add_argument("--client", choices=("threads", "raw"), default="threads")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--entries", type=int, default=1, help="output entries per request (one per step)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="time between a stand-in engine's steps")
    ap.add_argument("--profile", type=Path, help="(with --api-workers 1) cProfile the API process into this file")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="xpujobs-api-burst-"))
    redis_port, port = free_port(), free_port()
    redis_proc = start_redis(redis_port, root / "redis", appendonly=True)
    client = redis.Redis(port=redis_port, decode_responses=True)
    (root / "models" / "bench-model").mkdir(parents=True)
    client.set("worker:bench", json.dumps({"node": "bench", "backend": "cpu", "devices": [], "memory_free": 2**40,
                                           "bf16": True, "current_jobs": [], "heartbeat_at": int(time.time())}))
    client.sadd("workers", "bench")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XPUJOBS_")}
    env.update({"XPUJOBS_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0", "XPUJOBS_OPEN_MODE": "true",
                "XPUJOBS_MODELS_ROOT": str(root / "models"), "XPUJOBS_ARTIFACT_ROOT": str(root / "artifacts"),
                "XPUJOBS_BASE_MODELS": '["bench-model"]'})
    argv = ["api", "--port", str(port), "--workers", str(args.api_workers)]
    if args.profile:  # uvicorn re-raises SIGTERM once shut down: exit through SystemExit, so the profile is written
        command = [sys.executable, "-c", "import cProfile, signal, sys; from worker.cli import main; "
                   "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
                   f"cProfile.run({f'main({argv!r})'!r}, {str(args.profile)!r})"]
    else:
        command = [sys.executable, "-m", "worker.cli", *argv]
    api = subprocess.Popen(command, env=env, stdout=(root / "api.log").open("wb"), stderr=subprocess.STDOUT,
                           start_new_session=True)
    stop = multiprocessing.Event()
    node = multiprocessing.Process(target=stand_in_node, args=(redis_port, stop, args.entries, args.step_ms / 1e3),
                                   daemon=True)
    node.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError((root / "api.log").read_text()[-2000:])
            time.sleep(0.2)
        import psutil

        def api_cpu() -> float:
            procs = [psutil.Process(api.pid), *psutil.Process(api.pid).children(recursive=True)]
            return sum(sum(p.cpu_times()[:2]) for p in procs)

        for _ in range(3):  # warm code paths; the pools' connections stay as few as one request needs
            asyncio.run(raw_client(port, 1)) if args.client == "raw" else threads_client(url, 1)
        rounds = []
        for _ in range(args.rounds + 1):  # the first finds the API's connection pools as a quiet period left them
            cpu = api_cpu()
            if args.client == "threads":
                moments = threads_client(url, args.requests)
            else:
                moments = asyncio.run(raw_client(port, args.requests))
            t0 = min(sent for _, sent, _ in moments)
            received = [json.loads(client.hget(f"rec:chat:{rid}", "timings"))["received"] for rid, _, _ in moments]
            time.sleep(0.3)  # the streams' ends are sent and closed
            rounds.append({"api_cpu_ms_per_request": 1e3 * (api_cpu() - cpu) / args.requests,
                "ttft_p50_ms": 1e3 * statistics.median(first - sent for _, sent, first in moments),
                "ttft_max_ms": 1e3 * max(first - sent for _, sent, first in moments),
                "sent_spread_ms": 1e3 * (max(sent for _, sent, _ in moments) - t0),
                "received_p50_ms": 1e3 * statistics.median(r - t0 for r in received),
                "received_spread_ms": 1e3 * (max(received) - min(received)),
                "pulled_p50_ms": 1e3 * statistics.median(float(client.hget("bench:pulled", rid)) - t0
                                                         for rid, _, _ in moments),
                "first_event_p50_ms": 1e3 * statistics.median(first - t0 for _, _, first in moments)})
        if args.api_workers == 1:  # CPU seconds by thread: the event loop's (the first) and the pool threads'
            threads = sorted(psutil.Process(api.pid).threads(), key=lambda t: t.id)
            print(json.dumps({"event_loop": round(threads[0].user_time + threads[0].system_time, 3),
                              "other_threads": round(sum(t.user_time + t.system_time for t in threads[1:]), 3)}))
        out = {"requests": args.requests, "api_workers": args.api_workers, "client": args.client,
               "first_burst": {k: round(v, 1) for k, v in rounds[0].items()},
               "later_bursts": {k: round(statistics.median(r[k] for r in rounds[1:]), 1) for k in rounds[1]}}
        print(json.dumps(out))
    finally:
        stop.set()
        node.join(5)
        api.send_signal(15)
        api.wait(30)
        redis_proc.terminate()
        redis_proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
