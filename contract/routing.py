"""Choosing the queue for a job from the live workers, so it only reaches a worker that can run it."""

import functools
from dataclasses import dataclass
from pathlib import Path

from contract.queues import backend_queue, node_queue

BACKEND_PREFERENCE = ("xpu", "cuda", "cpu")


@dataclass(frozen=True)
class Requirement:
    memory_bytes: int = 0  # device memory the job needs in all (0: unknown, any worker)
    bf16: bool = False
    model: str | None = None  # a base model: a worker that has it loaded needs no more memory for it


class NoCapableWorker(Exception):
    pass


def worker_memory(worker: dict) -> int:
    """Device memory a new model or job can have on this worker: what is free on its devices now (other
    processes' use counted) plus what the worker would give back by evicting idle models. A worker that does
    not report what it could give back is judged by its total memory."""
    if "reclaimable_memory" not in worker:
        return sum(d["total_memory"] for d in worker.get("devices", []))
    free = sum(d.get("free_memory", d["total_memory"]) for d in worker.get("devices", []))
    return free + worker["reclaimable_memory"]


def has_loaded(worker: dict, model: str | None) -> bool:
    return model is not None and any(m.get("model") == model for m in worker.get("models", []))


def can_run(worker: dict, need: Requirement) -> bool:
    if need.bf16 and not worker.get("bf16"):
        return False
    return has_loaded(worker, need.model) or need.memory_bytes <= worker_memory(worker)


def choose_queue(workers: list[dict], need: Requirement) -> str:
    """The shared queue of the best backend when every worker of it qualifies, else the least busy
    qualifying node's own queue. Raises NoCapableWorker with a message meant for the user."""
    if not workers:
        raise NoCapableWorker("no worker is running: start one with `xpu-jobs worker`")
    capable = [w for w in workers if can_run(w, need)]
    if not capable:
        biggest = max(worker_memory(w) for w in workers)
        reasons = []
        if need.bf16 and not any(w.get("bf16") for w in workers):
            reasons.append("bf16 was asked for but no live worker's device supports it")
        if need.memory_bytes > biggest:
            reasons.append(f"it needs about {need.memory_bytes / 2**30:.1f} GiB of device memory and the largest "
                           f"live worker has {biggest / 2**30:.1f} GiB")
        raise NoCapableWorker("no live worker can run this job: " + ("; ".join(reasons) or "no match"))
    backend = min((w["backend"] for w in capable), key=BACKEND_PREFERENCE.index)
    of_backend = [w for w in workers if w["backend"] == backend]
    if all(can_run(w, need) for w in of_backend):
        return backend_queue(backend)
    least_busy = min((w for w in capable if w["backend"] == backend), key=lambda w: len(w.get("current_jobs", [])))
    return node_queue(least_busy["node"])


def weights_bytes(models_root: Path, model: str) -> int:
    """Bytes of a local model's weight files (0 for a Hub id we cannot see from here)."""
    directory = models_root / model
    try:
        changed = directory.stat().st_mtime_ns
    except OSError:
        return 0
    return _weights_bytes(directory, changed) if directory.is_dir() else 0


@functools.lru_cache(maxsize=256)
def _weights_bytes(directory: Path, changed: int) -> int:
    """Read once per version of the directory (files added, removed or renamed in it change its mtime): every live
    request is routed by it, and listing a directory of shards per request costs a burst more than a stat."""
    return sum(p.stat().st_size for p in directory.glob("*.safetensors")) or \
        sum(p.stat().st_size for p in directory.glob("*.bin"))


def inference_requirement(models_root: Path, model: str) -> Requirement:
    return Requirement(memory_bytes=int(weights_bytes(models_root, model) * 1.2), model=model)


def training_requirement(models_root: Path, model: str, quantization: str, bf16: bool) -> Requirement:
    scale = {"4bit": 0.5, "8bit": 0.8}.get(quantization, 2.0)  # weights plus activations and LoRA optimizer state
    return Requirement(memory_bytes=int(weights_bytes(models_root, model) * scale), bf16=bf16)
