"""A worker node's own Prometheus endpoint (http://<node>:<worker_metrics_port>/metrics): what only the node sees
of each request it serves. Everything else about the node (devices, engines, adapters, liveness) is in its
heartbeat report, which the API exposes at its /metrics."""

from prometheus_client import Counter, Histogram, start_http_server

REQUESTS = Counter("xpujobs_worker_requests_total", "Inference requests and batch lines a node finished",
                   ["kind", "status"])
LATENCY = Histogram("xpujobs_worker_request_duration_seconds",
                    "From claiming a live request to its generated result", ["kind"],
                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
PER_TOKEN = Histogram("xpujobs_worker_time_per_output_token_seconds",
                      "Generation time of a request over its output tokens", ["kind"],
                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
FIRST_TOKEN = Histogram("xpujobs_worker_time_to_first_token_seconds",
                        "From the API receiving a streaming request to its first output leaving the engine", ["kind"],
                        buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
TOKENS = Counter("xpujobs_worker_generated_tokens_total", "Output tokens generated", ["kind"])
PROMPT_TOKENS = Counter("xpujobs_worker_prompt_tokens_total", "Prompt tokens read", ["kind"])


def serve(port: int) -> int:
    """Start the endpoint in a daemon thread; returns the port it bound (port 0: any free one)."""
    server, _thread = start_http_server(port)
    return server.server_port


def observe(kind: str, status: str, result: dict | None = None, timings: dict[str, float] | None = None) -> None:
    """One finished request: its status, tokens (result: prompt_tokens, completion_tokens) and, for a live request,
    its wall-clock stamps (received by the API, claimed, submitted, first_output when it streamed, generated)."""
    REQUESTS.labels(kind, status).inc()
    result, timings = result or {}, timings or {}
    completion = result.get("completion_tokens") or 0
    TOKENS.labels(kind).inc(completion)
    PROMPT_TOKENS.labels(kind).inc(result.get("prompt_tokens") or 0)
    if "first_output" in timings:
        FIRST_TOKEN.labels(kind).observe(timings["first_output"] - timings.get("received", timings["claimed"]))
    if "generated" in timings:
        LATENCY.labels(kind).observe(timings["generated"] - timings["claimed"])
        if completion:
            PER_TOKEN.labels(kind).observe((timings["generated"] - timings["submitted"]) / completion)
