"""GET /v1/workers (extension): the live worker nodes and their devices. A tenant sees only its own jobs and
adapters on them; an admin key (settings.admin_api_keys) sees everything."""

from fastapi import APIRouter

from api.deps import StoreDep, ViewerDep
from contract.records import ID_PREFIX
from contract.registry import live_workers

router = APIRouter(prefix="/v1/workers", tags=["workers"])

ADAPTER_JOB_LENGTH = len(ID_PREFIX["ftjob"]) + 24  # an adapter is named by its job id (plus "-step-N")


def _record_of(job_id: str) -> tuple[str, str]:
    """(kind, record id) of the record whose tenant owns a running job or adapter: a batch chunk belongs to its
    batch, a checkpoint's adapter to its fine-tuning job."""
    if job_id.startswith(ID_PREFIX["batch"]):
        return "batch", job_id.split(".")[0]
    if job_id.startswith(ID_PREFIX["ftjob"]):
        return "ftjob", job_id[:ADAPTER_JOB_LENGTH]
    kind = next((k for k, prefix in ID_PREFIX.items() if job_id.startswith(prefix)), "unknown")
    return kind, job_id


def _own_part(worker: dict, tenant: str, owners: dict[str, str | None]) -> dict:
    jobs = [j for j in worker.get("current_jobs", []) if owners.get(j) == tenant]
    own = {**worker, "current_jobs": jobs, "current_job": jobs[0] if jobs else None}
    if "models" in worker:
        own["models"] = [{**m, "adapters": [a for a in m.get("adapters", []) if owners.get(a) == tenant]}
                         for m in worker["models"]]
    return own


@router.get("")
def list_workers(viewer: ViewerDep, store: StoreDep):
    """The live worker nodes as their heartbeats report them. Each device has `total_memory`, `free_memory` (free
    now, other processes' use counted) and `reclaimable_memory` (what the node's engine process would give back by
    evicting its idle models: their weights, KV cache and, on a GPU, their engines' workspace; a model serving
    requests counts nothing); the node's `reclaimable_memory` is their sum, and routing judges a node by free plus
    reclaimable. On cpu these are host memory: free is the host's available memory, and reclaimable the idle
    models' weights and KV cache. Each loaded model has `running_requests` and `held_memory` (device index ->
    bytes evicting it gives back)."""
    workers = live_workers(store.redis)
    if viewer is not None:
        names = {j for w in workers for j in w.get("current_jobs", [])} | \
            {a for w in workers for m in w.get("models", []) for a in m.get("adapters", [])}
        names = sorted(names)
        owners = dict(zip(names, store.tenants([_record_of(n) for n in names])))
        workers = [_own_part(w, viewer, owners) for w in workers]
    return {"object": "list", "data": [{"object": "worker", **w} for w in workers]}
