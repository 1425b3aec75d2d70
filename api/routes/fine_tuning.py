"""Fine-tuning jobs: create (validated before queueing), list, retrieve, cancel, events, checkpoints."""

import secrets
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from api import adapter_archive, event_stream
from api.catalog import resolve
from api.deps import CeleryDep, LimiterDep, RedisDep, SettingsDep, StoreDep, TenantDep
from api.errors import APIError, invalid, not_found
from api.placement import route
from api.protocol.fine_tuning import FineTuningJobCreate, Hyperparameters
from api.routes.files import get_file
from contract import events
from contract.layout import SUFFIX_PATTERN, adapter_dir, checkpoint_dir, file_path
from contract.queues import publish
from contract.records import after_cursor, new_id, now
from contract.registry import live_workers
from contract.routing import NoCapableWorker, choose_queue, training_requirement
from contract.training_data import validate_training_bytes

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])

TERMINAL = {"succeeded", "failed", "cancelled"}
PUBLIC_FIELDS = ("id", "created_at", "finished_at", "estimated_finish", "model", "fine_tuned_model",
                 "hyperparameters", "method", "seed", "metadata", "training_file", "validation_file",
                 "result_files", "trained_tokens", "status", "error", "suffix", "lora", "quantization",
                 "bf16", "attn_implementation", "use_kernels", "max_steps", "checkpoint_steps", "attempts",
                 "gradient_checkpointing", "strategy", "packing")


def to_openai(record: dict) -> dict:
    job = {k: record.get(k) for k in PUBLIC_FIELDS}
    if record.get("init_adapter"):
        job["model"] = record["init_adapter"]["model"]  # the fine-tuned model this job continues
    job.update(object="fine_tuning.job", organization_id=record["tenant"], integrations=[],
               user_provided_suffix=record.get("suffix"))
    return job


def get_job(store, job_id: str, tenant: str) -> dict:
    job = store.get("ftjob", job_id, tenant)
    if job is None:
        raise not_found("fine-tuning job", job_id)
    return job


def _method_type(body: FineTuningJobCreate) -> str:
    method = body.method.type if body.method else "supervised"
    other = "dpo" if method == "supervised" else "supervised"
    if body.method and getattr(body.method, other) is not None:
        raise invalid(f"method.{other} does not go with method.type '{method}'.", param=f"method.{other}")
    return method


def _resolved_hyperparameters(body: FineTuningJobCreate, settings) -> dict:
    given = body.hyperparameters or Hyperparameters()
    section = getattr(body.method, _method_type(body)) if body.method else None
    if section and section.hyperparameters:
        given = section.hyperparameters
    n_epochs = settings.default_n_epochs if given.n_epochs == "auto" else given.n_epochs
    batch_size = settings.default_batch_size if given.batch_size == "auto" else given.batch_size
    multiplier = 1.0 if given.learning_rate_multiplier == "auto" else given.learning_rate_multiplier
    if not 1 <= n_epochs <= 50:
        raise invalid("n_epochs must be between 1 and 50.", param="hyperparameters.n_epochs")
    if not 1 <= batch_size <= 256:
        raise invalid("batch_size must be between 1 and 256.", param="hyperparameters.batch_size")
    if not 0 < multiplier <= 100:
        raise invalid("learning_rate_multiplier must be above 0 and at most 100.",
                      param="hyperparameters.learning_rate_multiplier")
    resolved = {"n_epochs": n_epochs, "batch_size": batch_size, "learning_rate_multiplier": multiplier,
                "learning_rate": settings.base_learning_rate * multiplier}
    if _method_type(body) == "dpo":
        beta = getattr(given, "beta", "auto")
        beta = 0.1 if beta == "auto" else beta
        if not 0 < beta <= 2:
            raise invalid("beta must be above 0 and at most 2.", param="method.dpo.hyperparameters.beta")
        resolved["beta"] = beta
    return resolved


def _check_strategy_and_packing(body: FineTuningJobCreate) -> None:
    method = _method_type(body)
    if body.strategy == "fsdp" and body.quantization != "none":
        # Sharding a bitsandbytes base needs its quantized storage in the compute dtype (bnb_4bit_quant_storage),
        # which the service's 4-bit loading does not set, and 8-bit weights cannot be sharded at all.
        raise invalid("strategy 'fsdp' does not go with quantization: a quantized base is not sharded. Use "
                      "strategy 'ddp' or quantization 'none'.", param="strategy")
    if body.strategy == "fsdp" and method == "dpo":
        raise invalid("strategy 'fsdp' is supported for method 'supervised' only.", param="strategy")
    if body.packing and method == "dpo":
        raise invalid("packing is supported for method 'supervised' only (DPO batches pair their answers).",
                      param="packing")


def _check_training_file(store, settings, tenant: str, file_id: str, param: str,
                         method: str = "supervised") -> list[str]:
    record = get_file(store, file_id, tenant, param)
    if record["purpose"] != "fine-tune":
        raise invalid(f"File '{file_id}' has purpose '{record['purpose']}', not 'fine-tune'.", param=param)
    count, errors = validate_training_bytes(file_path(settings.artifact_root, tenant, file_id).read_bytes(), method)
    if not errors and count == 0:
        errors = ["the file holds no usable examples"]
    return [f"{param} {file_id}: {e}" for e in errors]


@router.post("")
def create_job(body: FineTuningJobCreate, tenant: TenantDep, settings: SettingsDep, store: StoreDep,
               celery: CeleryDep, redis: RedisDep, limiter: LimiterDep,
               idempotency_key: Annotated[str | None, Header(max_length=256)] = None):
    limiter.check_active_jobs(store, tenant)
    base, ref = resolve(body.model, tenant, settings, store)
    lora, init_adapter = body.lora.model_dump(), None
    if ref is not None:  # training continues from that adapter (or checkpoint), in its shape
        if "lora" in body.model_fields_set:
            raise invalid("lora cannot be set when fine-tuning a fine-tuned model: its adapter keeps its shape.",
                          param="lora")
        lora = store.get("ftjob", ref.job_id, tenant)["lora"]
        init_adapter = {"model": body.model, "job_id": ref.job_id, "step": ref.checkpoint_step}
    if body.suffix is not None and not SUFFIX_PATTERN.match(body.suffix):
        raise invalid("suffix may hold only letters, digits, '-' and '_' (at most 64).", param="suffix")
    hyperparameters = _resolved_hyperparameters(body, settings)
    _check_strategy_and_packing(body)
    for name in ("max_steps", "checkpoint_steps"):
        if (getattr(body, name) or 0) > settings.max_training_steps:
            raise invalid(f"{name} must be at most {settings.max_training_steps}.", param=name)
    # Files are checked for existence before anything is created; their contents are validated below.
    get_file(store, body.training_file, tenant, "training_file")
    if body.validation_file:
        get_file(store, body.validation_file, tenant, "validation_file")
    queue, _ = route(redis, training_requirement(settings.models_root, base, body.quantization, bool(body.bf16)),
                     settings)

    # The files' contents are validated before anything is created: a rejected job leaves no record.
    method = _method_type(body)
    errors = _check_training_file(store, settings, tenant, body.training_file, "training_file", method)
    if body.validation_file:
        errors += _check_training_file(store, settings, tenant, body.validation_file, "validation_file", method)
    if errors:
        raise invalid("The training data is invalid: " + "; ".join(errors),
                      param="validation_file" if errors[0].startswith("validation_file") else "training_file",
                      code="invalid_training_file")

    job_id = new_id("ftjob")
    record = {
        "id": job_id, "tenant": tenant, "status": "queued", "created_at": now(), "model": base,
        "training_file": body.training_file, "validation_file": body.validation_file, "suffix": body.suffix,
        "seed": body.seed if body.seed is not None else secrets.randbelow(2**31),
        "metadata": body.metadata, "hyperparameters": hyperparameters,
        "method": {"type": method, method: {"hyperparameters": hyperparameters}},
        "lora": lora, "init_adapter": init_adapter, "quantization": body.quantization, "bf16": body.bf16,
        "attn_implementation": body.attn_implementation, "use_kernels": body.use_kernels,
        "max_steps": body.max_steps,
        "checkpoint_steps": body.checkpoint_steps or settings.checkpoint_steps,
        "gradient_checkpointing": body.gradient_checkpointing, "strategy": body.strategy, "packing": body.packing,
        "fine_tuned_model": None, "finished_at": None, "estimated_finish": None, "trained_tokens": None,
        "result_files": [], "error": None, "queue": queue, "attempts": 0, "checkpoints": [],
    }
    # Tracked before it exists: if this process dies before publishing, the reconciler publishes it.
    store.track("ftjob", job_id)
    record, created = store.create("ftjob", record, idempotency_key)
    if not created:
        store.untrack("ftjob", job_id)
        return to_openai(record)
    events.emit(redis, job_id, f"Files validated: {body.training_file}" +
                (f", {body.validation_file}" if body.validation_file else ""))
    events.emit(redis, job_id, "Job queued", data={"status": "queued"})
    publish(celery, store, "ftjob", job_id, queue)
    return to_openai(store.get("ftjob", job_id))


def _metadata_filter(request: Request) -> dict[str, str] | None:
    """OpenAI's `metadata[key]=value` query (all must match); `metadata=null` means jobs without metadata."""
    if request.query_params.get("metadata") == "null":
        return {}
    wanted = {k[9:-1]: v for k, v in request.query_params.items() if k.startswith("metadata[") and k.endswith("]")}
    return wanted or None


def _matches(metadata: dict[str, str], wanted: dict[str, str]) -> bool:
    return all(metadata.get(k) == v for k, v in wanted.items()) if wanted else not metadata


@router.get("")
def list_jobs(request: Request, tenant: TenantDep, store: StoreDep, after: str | None = None,
              limit: Annotated[int, Query(ge=1, le=100)] = 20):
    wanted = _metadata_filter(request)
    if wanted is None:
        records, has_more = store.page("ftjob", tenant, after, limit)
    else:
        # Read in batches until the page (and one more, for has_more) is found after the cursor.
        records, seen_cursor = [], not after
        for record in store.scan("ftjob", tenant):
            if not seen_cursor:
                seen_cursor = record["id"] == after
            elif _matches(record.get("metadata") or {}, wanted):
                records.append(record)
                if len(records) > limit:
                    break
        records, has_more = records[:limit], len(records) > limit
    return {"object": "list", "data": [to_openai(r) for r in records], "has_more": has_more}


@router.get("/{job_id}")
def retrieve_job(job_id: str, tenant: TenantDep, store: StoreDep):
    return to_openai(get_job(store, job_id, tenant))


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str, tenant: TenantDep, store: StoreDep, redis: RedisDep, celery: CeleryDep):
    job = get_job(store, job_id, tenant)
    if job["status"] in TERMINAL:
        raise APIError(409, f"Job {job_id} has already {job['status']}.", code="invalid_state")
    events.request_cancel(redis, job_id)
    if store.transition("ftjob", job_id, ["validating_files", "queued", "paused"],
                        {"status": "cancelled", "finished_at": now()}):
        events.emit(redis, job_id, "Job cancelled while not running", data={"status": "cancelled"})
    return to_openai(get_job(store, job_id, tenant))


@router.post("/{job_id}/pause")
def pause_job(job_id: str, tenant: TenantDep, store: StoreDep, redis: RedisDep):
    """A queued job is paused at once; a running one saves a checkpoint, frees its device and then shows
    `paused` (within a few seconds)."""
    job = get_job(store, job_id, tenant)
    if job["status"] not in ("queued", "running"):
        raise APIError(409, f"Job {job_id} is {job['status']}; only a queued or running job can be paused.",
                       code="invalid_state")
    events.request_pause(redis, job_id)
    if store.transition("ftjob", job_id, ["queued"], {"status": "paused"}):
        events.emit(redis, job_id, "The job was paused before it started", data={"status": "paused", "step": 0})
    else:
        events.emit(redis, job_id, "Pausing: the job saves a checkpoint and stops")
    return to_openai(get_job(store, job_id, tenant))


@router.post("/{job_id}/resume")
def resume_job(job_id: str, tenant: TenantDep, settings: SettingsDep, store: StoreDep, redis: RedisDep,
               celery: CeleryDep):
    """A paused job goes back on a queue and continues from its newest checkpoint."""
    job = get_job(store, job_id, tenant)
    if job["status"] != "paused":
        raise APIError(409, f"Job {job_id} is {job['status']}; only a paused job can be resumed.",
                       code="invalid_state")
    try:
        queue = choose_queue(live_workers(redis), training_requirement(
            settings.models_root, job["model"], job.get("quantization", "none"), bool(job.get("bf16"))))
    except NoCapableWorker as exc:
        raise APIError(503, str(exc), code="no_capable_worker") from None
    events.clear_pause(redis, job_id)
    if store.transition("ftjob", job_id, ["paused"], {"status": "queued", "queue": queue, "reserved_by": None}):
        store.track("ftjob", job_id)
        events.emit(redis, job_id, "The job was resumed and queued", data={"status": "queued"})
        publish(celery, store, "ftjob", job_id, queue)
    return to_openai(get_job(store, job_id, tenant))


@router.get("/{job_id}/events")
def list_events(request: Request, job_id: str, tenant: TenantDep, store: StoreDep, redis: RedisDep,
                after: str | None = None, limit: Annotated[int | None, Query(ge=1, le=1000)] = None,
                stream: bool = False):
    get_job(store, job_id, tenant)
    return event_stream.list_or_stream(request, redis, job_id, "fine_tuning.job.event", after, limit, stream,
                                       lambda: get_job(store, job_id, tenant)["status"])


@router.get("/{job_id}/checkpoints")
def list_checkpoints(job_id: str, tenant: TenantDep, store: StoreDep, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 10):
    checkpoints = after_cursor(list(reversed(get_job(store, job_id, tenant).get("checkpoints", []))), after,
                               key=lambda c: c["id"])
    page = checkpoints[:limit]
    return {"object": "list", "data": page, "has_more": len(checkpoints) > limit,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}


def _archive(directory, name: str) -> Response:
    if not (directory / "adapter_model.safetensors").exists():
        raise APIError(404, f"The adapter of {name} is no longer stored.", code="not_found")
    return Response(adapter_archive.pack(directory), media_type="application/zip",
                    headers={"Content-Disposition": f'attachment; filename="{name}.zip"'})


@router.get("/{job_id}/adapter")
def download_adapter(job_id: str, tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    """Extension: the job's trained adapter as a zip of a PEFT directory (PeftModel.from_pretrained loads it)."""
    job = get_job(store, job_id, tenant)
    if job["status"] != "succeeded" or not job.get("fine_tuned_model"):
        raise APIError(409, f"Job {job_id} has no adapter (status {job['status']}, or its model was deleted).",
                       code="invalid_state")
    return _archive(adapter_dir(settings.artifact_root, tenant, job_id), job_id)


@router.get("/{job_id}/checkpoints/{checkpoint_id}/adapter")
def download_checkpoint_adapter(job_id: str, checkpoint_id: str, tenant: TenantDep, settings: SettingsDep,
                                store: StoreDep):
    """Extension: one kept checkpoint's adapter, as a zip of a PEFT directory."""
    job = get_job(store, job_id, tenant)
    checkpoint = next((c for c in job.get("checkpoints", []) if c["id"] == checkpoint_id), None)
    if checkpoint is None:
        raise not_found("checkpoint", checkpoint_id)
    step = checkpoint["step_number"]
    return _archive(checkpoint_dir(settings.artifact_root, tenant, job_id, step), f"{job_id}-step-{step}")
