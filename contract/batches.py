"""Batches: a batch record, its chunks (ranges of input lines that one worker task runs), and finalisation,
which joins the chunks' output and error files in input order.

Counts live on the chunks (a redone chunk resets its own), so the batch's request_counts are their sum and
every line counts exactly once.

Finalisation is idempotent and one process at a time: the node settling the last chunk runs it, and the reconciler
runs it again for a batch whose chunks have all settled but that never finished (that node died first, or midway).
"""

import hashlib
import json
import os
from pathlib import Path

from contract import events, retention
from contract.layout import file_path, job_dir
from contract.records import ID_PREFIX, RecordStore, new_id, now

DEFAULT_OUTPUT_SECONDS = 30 * 86400
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
CHUNK_SETTLED = ("completed", "cancelled", "failed")
UNFINISHED = ("in_progress", "cancelling", "finalizing")
FINALIZE_LOCK_SECONDS = 30


def chunk_id(batch_id: str, index: int) -> str:
    return f"{batch_id}.{index:05d}"


def chunk_files(root: Path, tenant: str, batch_id: str, index: int) -> tuple[Path, Path]:
    base = job_dir(root, tenant, batch_id) / f"chunk-{index:05d}"
    return base.with_suffix(".out.jsonl"), base.with_suffix(".err.jsonl")


def _chunk_input(root: Path, tenant: str, batch_id: str, index: int) -> Path:
    return job_dir(root, tenant, batch_id) / f"chunk-{index:05d}.in.jsonl"


def write_chunk_input(root: Path, tenant: str, batch_id: str, index: int, lines: list[tuple[int, str]]) -> None:
    """A chunk's own lines with their numbers in the input file, so its task reads only those."""
    write_atomically(_chunk_input(root, tenant, batch_id, index), [json.dumps(entry) for entry in lines])


def read_chunk_input(root: Path, tenant: str, batch_id: str, index: int) -> list[tuple[int, str]]:
    return [tuple(json.loads(entry)) for entry in
            _chunk_input(root, tenant, batch_id, index).read_text(encoding="utf-8").splitlines()]


def write_atomically(path: Path, lines: list[str]) -> None:
    """A redone chunk replaces its files whole, so no line is ever written twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text("".join(line + "\n" for line in lines))
    os.replace(partial, path)


def chunks(store: RecordStore, batch: dict) -> list[dict]:
    return [store.get("chunk", chunk_id(batch["id"], i)) or {} for i in range(batch["n_chunks"])]


def tally(store: RecordStore, batch: dict) -> tuple[dict, dict, bool]:
    """(request_counts, usage, whether a chunk found the window expired), from one read of the chunks."""
    parts = chunks(store, batch)

    def total(field: str) -> int:
        return sum(int(c.get(field) or 0) for c in parts)

    counts = {"total": batch.get("total", 0), "completed": total("completed"), "failed": total("failed")}
    inp, out = total("input_tokens"), total("output_tokens")
    usage = {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    return counts, usage, any(c.get("expired") for c in parts)


def all_chunks_settled(store: RecordStore, batch: dict) -> bool:
    return all(c.get("status") in CHUNK_SETTLED for c in chunks(store, batch))


def _store_file(store: RecordStore, root: Path, tenant: str, name: str, parts: list[Path],
                expires_after: int) -> str | None:
    data = b"".join(p.read_bytes() for p in parts if p.exists())
    if not data:
        return None
    # Named after the batch and the part, so a finalisation run again writes the same file, never a second one.
    file_id = ID_PREFIX["file"] + hashlib.sha256(name.encode()).hexdigest()[:24]
    path = file_path(root, tenant, file_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
    expires_at = now() + expires_after
    store.create("file", {"id": file_id, "tenant": tenant, "bytes": len(data), "created_at": now(),
                          "filename": name, "purpose": "batch_output", "expires_at": expires_at})
    retention.expire_file_at(store, tenant, file_id, expires_at)
    return file_id


def chunk_settled(store: RecordStore, root: Path, batch_id: str) -> None:
    """Called once per chunk that reaches a settled state; the last one finalises the batch."""
    settled = store.incr("batch", batch_id, "chunks_settled")
    batch = store.get("batch", batch_id)
    if settled >= batch["n_chunks"]:
        finalize(store, root, batch)


def fail_chunk(store: RecordStore, root: Path, chunk: dict, code: str, message: str) -> None:
    """A chunk given up on (it lost its worker on every attempt): each of its lines goes to the error file, and
    the chunk counts as settled, so its batch still finalises."""
    batch = store.get("batch", chunk["batch_id"])
    tenant, batch_id, index = batch["tenant"], batch["id"], chunk["index"]
    lines = read_chunk_input(root, tenant, batch_id, index)
    errors = [json.dumps({"id": new_id("batch_request"), "custom_id": parse_line(line, number, batch["endpoint"])[0],
                          "response": None, "error": {"code": code, "message": f"line {number}: {message}"}})
              for number, line in lines]
    out, err = chunk_files(root, tenant, batch_id, index)
    write_atomically(out, [])
    write_atomically(err, errors)
    store.update("chunk", chunk["id"], {"completed": 0, "failed": len(lines), "input_tokens": 0, "output_tokens": 0})
    chunk_settled(store, root, batch_id)


def finalize(store: RecordStore, root: Path, batch: dict) -> None:
    """Join the chunks' files into the batch's output and error files and settle it (completed, expired or
    cancelled). Does nothing while another process finalises the same batch."""
    batch_id = batch["id"]
    with events.exclusive(store.redis, f"finalize:{batch_id}", FINALIZE_LOCK_SECONDS) as mine:
        if mine:
            _finalize(store, root, store.get("batch", batch_id))


def _finalize(store: RecordStore, root: Path, batch: dict) -> None:
    batch_id, tenant = batch["id"], batch["tenant"]
    cancelling = batch["status"] == "cancelling"
    if batch["status"] == "in_progress":
        if not store.transition("batch", batch_id, ["in_progress"], {"status": "finalizing", "finalizing_at": now()}):
            return
        events.emit(store.redis, batch_id, "Batch finalizing", data={"status": "finalizing"})
    elif batch["status"] not in ("cancelling", "finalizing"):
        return
    files = [chunk_files(root, tenant, batch_id, i) for i in range(batch["n_chunks"])]
    # Output files expire as OpenAI's do (the retention the batch was created under).
    keep = int(batch.get("output_expires_after") or DEFAULT_OUTPUT_SECONDS)
    output = _store_file(store, root, tenant, f"{batch_id}_output.jsonl", [out for out, _ in files], keep)
    errors = _store_file(store, root, tenant, f"{batch_id}_error.jsonl", [err for _, err in files], keep)
    counts, usage, expired = tally(store, batch)
    status = "cancelled" if cancelling else ("expired" if expired else "completed")
    fields = {"status": status, f"{status}_at": now(), "output_file_id": output, "error_file_id": errors,
              "request_counts_final": counts, "usage": usage}
    if store.transition("batch", batch_id, ["cancelling", "finalizing"], fields):
        events.emit(store.redis, batch_id, f"Batch {status}", data={"status": status})
        store.untrack("batch", batch_id)


def parse_line(line: str, number: int, endpoint: str) -> tuple[str | None, dict | None, str | None]:
    """(custom_id, body, error) of one input line; error is None for a line that can be run."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, None, f"line {number}: not valid JSON ({exc.msg})"
    if not isinstance(obj, dict):
        return None, None, f"line {number}: expected a JSON object"
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, None, f"line {number}: custom_id must be a non-empty string"
    if obj.get("method") != "POST":
        return custom_id, None, f"line {number}: method must be POST"
    if obj.get("url") != endpoint:
        return custom_id, None, f"line {number}: url must be the batch's endpoint {endpoint}"
    if not isinstance(obj.get("body"), dict):
        return custom_id, None, f"line {number}: body must be an object"
    return custom_id, obj["body"], None
