"""Files: upload (multipart), list, retrieve, content, delete."""

import os
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse

from api.deps import LimiterDep, SettingsDep, StoreDep, TenantDep
from api.errors import APIError, invalid, not_found
from api.tenant_limits import storage_refused
from contract import retention
from contract.layout import file_path, safe_name
from contract.records import RecordStore, new_id, now
from contract.training_data import parse_jsonl

router = APIRouter(prefix="/v1/files", tags=["files"])

# "adapter" (an extension): a zip of a PEFT LoRA directory, registered as a model through POST /v1/models.
UPLOAD_PURPOSES = {"fine-tune", "batch", "adapter"}
CHUNK = 1024 * 1024


def to_openai(record: dict) -> dict:
    return {"id": record["id"], "object": "file", "bytes": record["bytes"], "created_at": record["created_at"],
            "filename": record["filename"], "purpose": record["purpose"], "expires_at": record.get("expires_at"),
            "status": "processed", "status_details": None}


def get_file(store: RecordStore, file_id: str, tenant: str, param: str | None = None) -> dict:
    record = store.get("file", file_id, tenant)
    if record is None:
        raise not_found("file", file_id, param)
    return record


FORM_FIELDS = {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"}


async def _known_form_fields(request: Request) -> None:
    """A multipart field the upload does not define is refused, as unknown JSON fields are (the form is parsed
    once: Starlette keeps it for the route's own parameters)."""
    unknown = sorted(set((await request.form()).keys()) - FORM_FIELDS)
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0],
                       code="unknown_parameter")


@router.post("", dependencies=[Depends(_known_form_fields)])
def upload_file(file: UploadFile, purpose: Annotated[str, Form()], tenant: TenantDep, settings: SettingsDep,
                store: StoreDep, limiter: LimiterDep,
                anchor: Annotated[Literal["created_at"] | None, Form(alias="expires_after[anchor]")] = None,
                seconds: Annotated[int | None, Form(alias="expires_after[seconds]", ge=3600, le=30 * 86400)] = None):
    # A plain def: FastAPI runs it in its thread pool, so copying and parsing a large upload never blocks the
    # event loop (the multipart parser has already spooled the body to a temporary file).
    if purpose not in UPLOAD_PURPOSES:
        raise invalid(f"purpose must be one of {sorted(UPLOAD_PURPOSES)}, not '{purpose}'.", param="purpose")
    if (anchor is None) != (seconds is None):
        raise invalid("expires_after needs both anchor ('created_at') and seconds.", param="expires_after")
    storage_left = limiter.storage_left(store, tenant)
    file_id = new_id("file")
    path = file_path(settings.artifact_root, tenant, file_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    # Stream to a temporary name and count, so an oversize or bad upload leaves nothing behind.
    partial = path.with_suffix(".partial")
    try:
        with partial.open("wb") as out:
            while chunk := file.file.read(CHUNK):
                size += len(chunk)
                if size > settings.max_upload_bytes:
                    raise APIError(413, f"The file is larger than the limit of {settings.max_upload_bytes} bytes.",
                                   param="file", code="file_too_large")
                if storage_left is not None and size > storage_left:
                    raise storage_refused(settings.limit(tenant, "max_stored_bytes"))
                out.write(chunk)
        if size == 0:
            raise invalid("The file is empty.", param="file")
        # Training files must be clean JSONL; a batch file's bad lines go to the batch's error file instead.
        errors = parse_jsonl(partial.read_bytes())[1] if purpose == "fine-tune" else []
        if errors:
            raise invalid("The file is not valid JSONL: " + "; ".join(errors[:10]), param="file",
                          code="invalid_file_format")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    created = now()
    record = {"id": file_id, "tenant": tenant, "bytes": size, "created_at": created,
              "filename": safe_name(file.filename or "upload.jsonl"), "purpose": purpose,
              "expires_at": created + seconds if seconds else None}
    store.create("file", record)
    if seconds:
        retention.expire_file_at(store, tenant, file_id, created + seconds)
    return to_openai(record)


@router.get("")
def list_files(tenant: TenantDep, store: StoreDep, purpose: str | None = None,
               after: str | None = None, limit: Annotated[int, Query(ge=1, le=10000)] = 10000):
    records, has_more = store.page("file", tenant, after, limit)
    data = [to_openai(r) for r in records if purpose is None or r["purpose"] == purpose]
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@router.get("/{file_id}")
def retrieve_file(file_id: str, tenant: TenantDep, store: StoreDep):
    return to_openai(get_file(store, file_id, tenant))


@router.get("/{file_id}/content")
def file_content(file_id: str, tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    record = get_file(store, file_id, tenant)
    return FileResponse(file_path(settings.artifact_root, tenant, file_id), media_type="application/octet-stream",
                        filename=record["filename"])


@router.delete("/{file_id}")
def delete_file(file_id: str, tenant: TenantDep, settings: SettingsDep, store: StoreDep):
    get_file(store, file_id, tenant)
    store.delete("file", file_id, tenant)
    file_path(settings.artifact_root, tenant, file_id).unlink(missing_ok=True)
    return {"id": file_id, "object": "file", "deleted": True}
