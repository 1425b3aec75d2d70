"""The FastAPI application (wrapped in the body-size guard). It never imports torch or any model library."""

import asyncio
import gc
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI

from api import errors, metrics
from api.routes import batches, chat, completions, files, fine_tuning, models, responses, storage, ui, webhooks, workers
from api.tenant_limits import TenantLimiter
from contract import retention
from contract.queues import make_celery
from contract.records import RecordStore
from contract.redis_conn import async_client, open_connections, open_connections_async, sync_client
from contract.settings import Settings


def create_app(settings: Settings | None = None) -> errors.BodyLimits:
    settings = settings or Settings()
    if not settings.redis_url:
        raise RuntimeError("XPUJOBS_REDIS_URL is not set (`xpu-jobs up` starts an embedded Redis and sets it)")
    if not settings.api_keys and not settings.open_mode:
        raise RuntimeError("No API keys configured: set XPUJOBS_API_KEYS='{\"<key>\": \"<tenant>\"}', "
                           "or XPUJOBS_OPEN_MODE=true for local use without keys")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.ensure_dirs()
        app.state.settings = settings
        app.state.store = RecordStore(sync_client(settings))
        app.state.aioredis = async_client(settings)
        app.state.celery = make_celery(settings)
        app.state.limiter = TenantLimiter(settings)
        # What startup loaded stays for good: exempt it from the cyclic collector's full passes.
        gc.collect()
        gc.freeze()
        sweeper = asyncio.create_task(_sweep_forever(app.state.store, settings))
        # In the background: a Redis still starting must not hold up the API's start.
        warming = [asyncio.create_task(open_connections_async(app.state.aioredis)),
                   asyncio.create_task(asyncio.to_thread(open_connections, app.state.store.redis))]
        yield
        for task in (sweeper, *warming):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        await app.state.aioredis.aclose()

    # Bodies are cut off as they stream in, before anything is spooled to disk; the slack is multipart's framing
    # (the upload route checks the file's own size exactly).
    body_limit = settings.max_upload_bytes + 1024 * 1024
    app = FastAPI(title="xpu-jobs", version="0.1.0", lifespan=lifespan, max_body_size=body_limit)
    errors.install(app)
    metrics.install(app)
    app.add_middleware(metrics.RequestMetrics)
    for module in (files, fine_tuning, batches, responses, chat, completions, models, workers, storage, webhooks, ui):
        app.include_router(module.router)

    @app.get("/health", include_in_schema=False)
    def health():
        try:
            app.state.store.redis.ping()
        except errors.OUTAGES:
            return errors.outage_response()
        return {"status": "ok", "redis": "ok"}

    # Outermost, so an oversize body gets OpenAI's error shape before FastAPI's own limit answers.
    return errors.BodyLimits(app, body_limit, settings.max_json_body_bytes)


async def _sweep_forever(store: RecordStore, settings: Settings) -> None:
    """Retention: every retention_sweep_seconds one process (an API process or a worker node, whichever takes the
    lock) removes what expired."""
    while True:
        await asyncio.sleep(settings.retention_sweep_seconds)
        await asyncio.to_thread(retention.sweep_when_due, store, settings.artifact_root, settings)
