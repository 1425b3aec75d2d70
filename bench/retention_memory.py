"""Redis memory under retention: a week of records at a steady submission rate, simulated in minutes.

Records of the shapes the service writes (chat completions with their prompt and output, batches with their
chunks, fine-tuning jobs with their events, files) are written hour by simulated hour into a Redis of this run's
own, their index scores set to the simulated creation time; after each hour the retention sweep runs with the
simulated clock, exactly as an API process runs it. Redis's used_memory is read at the end of each day.

    python -m bench.retention_memory --days 7 --chats-per-hour 360 --out docs/results/retention.json
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import redis

from contract import events, retention
from contract.records import RecordStore, index_key, new_id
from contract.settings import Settings
from worker.node.redis_server import free_port, start_redis

HOUR = 3600


def chat_record(tenant: str, created: float) -> dict:
    prompt = "Summarise the following paragraph in two sentences. " + "lorem ipsum dolor sit amet " * 18
    return {"id": new_id("chat"), "tenant": tenant, "status": "completed", "created_at": int(created),
            "timings": {"received": created, "started": created + 0.2, "finished": created + 1.4},
            "model": "demo-tiny", "base_model": "demo-tiny", "adapter_job": None, "adapter_step": None,
            "request": {"model": "demo-tiny", "messages": [{"role": "user", "content": prompt}], "stop": [],
                        "max_tokens": 256, "temperature": 0.7, "top_p": None, "seed": None},
            "queue": "xpujobs.cpu", "published_at": int(created),
            "result": {"text": "consectetur adipiscing elit " * 30, "finish_reason": "stop",
                       "prompt_tokens": 120, "completion_tokens": 180}}


def write_hour(store: RecordStore, start: float, chats: int, tenants: int) -> None:
    pipe = store.redis.pipeline(transaction=False)

    def put(kind: str, record: dict, created: float) -> None:
        pipe.hset(f"rec:{kind}:{record['id']}", mapping={k: json.dumps(v) for k, v in record.items()})
        pipe.zadd(index_key(kind, record["tenant"]), {record["id"]: created})

    for i in range(chats):
        created = start + i * HOUR / chats
        put("chat", chat_record(f"tenant-{i % tenants}", created), created)
    # One batch of 640 lines (10 chunks) and one fine-tune (with 40 events) an hour.
    tenant, batch_id = "tenant-0", new_id("batch")
    put("batch", {"id": batch_id, "tenant": tenant, "status": "completed", "created_at": int(start),
                  "endpoint": "/v1/chat/completions", "input_file_id": "file-x", "n_chunks": 10,
                  "request_counts_final": {"total": 640, "completed": 640, "failed": 0}}, start)
    for index in range(10):
        put("chunk", {"id": f"{batch_id}.{index:05d}", "tenant": tenant, "batch_id": batch_id, "index": index,
                      "status": "completed", "completed": 64, "failed": 0, "input_tokens": 7680,
                      "output_tokens": 11520}, start)
    job_id = new_id("ftjob")
    put("ftjob", {"id": job_id, "tenant": tenant, "status": "cancelled", "created_at": int(start),
                  "model": "demo-tiny", "hyperparameters": {"n_epochs": 3}, "checkpoints": []}, start)
    pipe.execute()
    for n in range(40):
        events.emit(store.redis, job_id, f"Step {n}: training loss 1.234", data={"step": n})
    for n in range(4):
        events.emit(store.redis, batch_id, f"Batch event {n}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--chats-per-hour", type=int, default=360)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--inference-retention-days", type=float, default=1.0)
    parser.add_argument("--retention-days", type=float, default=3.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        port = free_port()
        server = start_redis(port, Path(scratch) / "redis", appendonly=False)
        try:
            client = redis.Redis(port=port, decode_responses=True)
            store = RecordStore(client)
            settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0", artifact_root=Path(scratch) / "artifacts",
                                retention_seconds=int(args.retention_days * 86400),
                                inference_retention_seconds=int(args.inference_retention_days * 86400))
            baseline = client.info("memory")["used_memory"]
            t0, days = time.time() - args.days * 86400, []
            for hour in range(args.days * 24):
                now = t0 + (hour + 1) * HOUR
                write_hour(store, t0 + hour * HOUR, args.chats_per_hour, args.tenants)
                removed = retention.sweep(store, settings.artifact_root, settings, now=now)
                if (hour + 1) % 24 == 0:
                    used = client.info("memory")["used_memory"] - baseline
                    records = {kind: sum(client.zcard(k) for k in client.scan_iter(f"idx:{kind}:*"))
                               for kind in ("chat", "batch", "chunk", "ftjob")}
                    days.append({"day": (hour + 1) // 24, "used_memory_bytes": used, "records": records,
                                 "removed_last_hour": removed})
                    print(f"day {days[-1]['day']}: {used / 2**20:.1f} MiB above an empty Redis, records {records}",
                          flush=True)
        finally:
            server.terminate()
            server.wait(10)
    result = {"settings": vars(args) | {"out": str(args.out) if args.out else None}, "days": days,
              "peak_used_memory_bytes": max(d["used_memory_bytes"] for d in days)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
