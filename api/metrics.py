"""Prometheus metrics served by the API at /metrics.

Two sources, one scrape:
- the API's own requests (count by route and status, latency), recorded in each API process and summed over all
  of them through PROMETHEUS_MULTIPROC_DIR (`xpu-jobs api` sets it up);
- the cluster as Redis shows it at scrape time: queue depths, jobs by kind and status, each live worker node
  with its devices, engines and adapters (from its heartbeat report), and running fine-tunes' speed (from their
  latest metrics event).
A worker node's own request histograms (latency, time per output token) are on its own port (worker_metrics_port).
"""

import json
import os
import secrets
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import REGISTRY, Collector
from starlette.requests import Request
from starlette.responses import Response

from api.errors import APIError
from contract import events
from contract.live import live_list
from contract.queues import backend_queue, node_queue
from contract.registry import live_workers

REQUESTS = Counter("xpujobs_api_requests_total", "API requests by route template and status code",
                   ["method", "route", "status"])
LATENCY = Histogram("xpujobs_api_request_duration_seconds", "API request latency, to the last byte of the response",
                    ["method", "route"],
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

# Records that are jobs, and the backends whose shared queues always exist.
JOB_KINDS = ("ftjob", "batch", "chunk", "response", "chat", "completion")
BACKENDS = ("xpu", "cuda", "cpu")


class RequestMetrics:
    """ASGI middleware: counts each request under its route template (never the raw path: ids would make a series
    per object) once its response is complete."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def recording_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            REQUESTS.labels(scope["method"], template, str(status)).inc()
            LATENCY.labels(scope["method"], template).observe(time.perf_counter() - start)


class ClusterCollector(Collector):
    """Read at each scrape from Redis; nothing is cached, so two API processes answer alike."""

    def __init__(self, redis):
        self.redis = redis

    def collect(self):
        workers = live_workers(self.redis)
        yield from self._queues(workers)
        yield self._jobs()
        yield from self._workers(workers)
        yield from self._fine_tunes()

    def _queues(self, workers):
        queues = {backend_queue(b) for b in BACKENDS} | {backend_queue(w["backend"]) for w in workers}
        queues |= {node_queue(w["node"]) for w in workers}
        # Live requests wait in lists of their own (contract.live), next to the Celery queues.
        names = sorted(queues) + sorted(live_list(q) for q in queues)
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.llen(name)
        depth = GaugeMetricFamily("xpujobs_queue_depth", "Tasks waiting in a Celery queue, or live requests in their "
                                  "list (live:<queue>)", labels=["queue"])
        for name, length in zip(names, pipe.execute()):
            depth.add_metric([name], length)
        yield depth

    def _jobs(self):
        """Every record of each job kind by its status: one pipelined HGET per record (the per-tenant indexes)."""
        family = GaugeMetricFamily("xpujobs_jobs", "Job records by kind and status", labels=["kind", "status"])
        for kind in JOB_KINDS:
            ids = [i for index in self.redis.scan_iter(match=f"idx:{kind}:*", count=1000)
                   for i in self.redis.zrange(index, 0, -1)]
            counts: dict[str, int] = {}
            for start in range(0, len(ids), 5000):
                pipe = self.redis.pipeline(transaction=False)
                for record_id in ids[start:start + 5000]:
                    pipe.hget(f"rec:{kind}:{record_id}", "status")
                for raw in pipe.execute():
                    if raw is not None:
                        status = json.loads(raw)
                        counts[status] = counts.get(status, 0) + 1
            for status, count in sorted(counts.items()):
                family.add_metric([kind, status], count)
        return family

    def _workers(self, workers):
        now = time.time()
        up = GaugeMetricFamily("xpujobs_worker_up", "1 for each worker node whose heartbeat is live",
                               labels=["node", "backend"])
        age = GaugeMetricFamily("xpujobs_worker_heartbeat_age_seconds", "Seconds since the node's last heartbeat",
                                labels=["node"])
        current = GaugeMetricFamily("xpujobs_worker_current_jobs", "Jobs running on the node", labels=["node"])
        total = GaugeMetricFamily("xpujobs_device_memory_total_bytes", "Memory of each device of a node",
                                  labels=["node", "device", "name"])
        used = GaugeMetricFamily("xpujobs_device_memory_used_bytes", "Memory in use on each device of a node",
                                 labels=["node", "device"])
        adapters = GaugeMetricFamily("xpujobs_adapters_loaded", "LoRA adapters loaded on a base model's engine",
                                     labels=["node", "model"])
        occupancy = GaugeMetricFamily("xpujobs_engine_batch_occupancy",
                                      "Mean decode batch size over the engine's slots (0..1)", labels=["node", "model"])
        kv_used = GaugeMetricFamily("xpujobs_engine_kv_blocks_used", "KV cache blocks in use",
                                    labels=["node", "model"])
        kv_total = GaugeMetricFamily("xpujobs_engine_kv_blocks_total", "KV cache blocks the engine has",
                                     labels=["node", "model"])
        stat = GaugeMetricFamily("xpujobs_engine_stat", "Every numeric counter the engine reports, by name",
                                 labels=["node", "model", "stat"])
        for w in workers:
            node = w["node"]
            up.add_metric([node, w["backend"]], 1)
            age.add_metric([node], max(0.0, now - w.get("heartbeat_at", now)))
            current.add_metric([node], len(w.get("current_jobs", [])))
            for device in w.get("devices", []):
                total.add_metric([node, str(device["index"]), device.get("name", "")], device["total_memory"])
                if "free_memory" in device:
                    used.add_metric([node, str(device["index"])], device["total_memory"] - device["free_memory"])
            for model in w.get("models", []):
                labels = [node, model["model"]]
                adapters.add_metric(labels, len(model.get("adapters", [])))
                engine = {k: v for k, v in (model.get("engine") or {}).items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)}
                for name, value in sorted(engine.items()):
                    stat.add_metric([*labels, name], value)
                slots = engine.get("num_slots")
                if slots and "running" in engine:
                    occupancy.add_metric(labels, engine["running"] / slots)
                elif slots and engine.get("decode_steps"):
                    occupancy.add_metric(labels, engine["decode_rows"] / engine["decode_steps"] / slots)
                if "kv_blocks_used" in engine:
                    kv_used.add_metric(labels, engine["kv_blocks_used"])
                if "kv_blocks_total" in engine:
                    kv_total.add_metric(labels, engine["kv_blocks_total"])
        yield from (up, age, current, total, used, adapters, occupancy, kv_used, kv_total, stat)

    def _fine_tunes(self):
        """Running fine-tunes, from the latest training metrics event each has emitted."""
        labels = ["job", "model"]
        families = {
            "steps_per_second": GaugeMetricFamily("xpujobs_finetune_steps_per_second",
                                                  "Optimizer steps per second", labels=labels),
            "tokens_per_second": GaugeMetricFamily("xpujobs_finetune_tokens_per_second",
                                                   "Training tokens (without padding) per second", labels=labels),
            "step": GaugeMetricFamily("xpujobs_finetune_step", "Latest optimizer step", labels=labels),
            "total_steps": GaugeMetricFamily("xpujobs_finetune_total_steps", "Steps the job will run",
                                             labels=labels),
            "train_loss": GaugeMetricFamily("xpujobs_finetune_train_loss", "Latest training loss", labels=labels),
        }
        ids = sorted(self.redis.smembers("active:ftjob"))
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(f"rec:ftjob:{job_id}", ["status", "model"])
        for job_id, (status, model) in zip(ids, pipe.execute()):
            if status is None or json.loads(status) != "running":
                continue
            latest = events.latest_of_type(self.redis, job_id, "metrics")
            if latest is None:
                continue
            for name, family in families.items():
                value = latest["data"].get(name)
                if isinstance(value, (int, float)):
                    family.add_metric([job_id, json.loads(model)], value)
        yield from families.values()


def _registry(redis) -> CollectorRegistry:
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(registry)
    else:  # a single process (create_app in-process): its own default registry holds the request metrics
        registry.register(REGISTRY)
    registry.register(ClusterCollector(redis))
    return registry


def install(app) -> None:
    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request):
        key = request.app.state.settings.metrics_key
        if key and not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {key}"):
            raise APIError(401, "/metrics asks for the metrics key: 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        # Read on each scrape: Redis is the only state; the API processes keep none but their request counts.
        body = generate_latest(_registry(request.app.state.store.redis))
        return Response(body, media_type=CONTENT_TYPE_LATEST)
