"""Where artifacts live under the artifact root, by tenant and job, and how model ids map to them.

A fine-tuned model id is `ft:<base>:<suffix>:<job id>`; a checkpoint of it appends `:ckpt-step-<n>`.
"""

import re
from dataclasses import dataclass
from pathlib import Path

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
SUFFIX_PATTERN = re.compile(r"^[A-Za-z0-9_-]{0,64}$")


def safe_name(name: str, fallback: str = "file") -> str:
    """A user-supplied name made safe to show and store: no directories, no control characters."""
    name = name.replace("\\", "/").rsplit("/", 1)[-1]
    name = _SAFE.sub("_", name).strip("._") or fallback
    return name[:200]


def tenant_dir(root: Path, tenant: str) -> Path:
    return root / safe_name(tenant, "tenant")


def file_path(root: Path, tenant: str, file_id: str) -> Path:
    return tenant_dir(root, tenant) / "files" / safe_name(file_id)


def job_dir(root: Path, tenant: str, job_id: str) -> Path:
    return tenant_dir(root, tenant) / "jobs" / safe_name(job_id)


def training_outcome_path(root: Path, tenant: str, job_id: str, attempt: int | None) -> Path:
    """Where an attempt's training process leaves its result for the node (one file per attempt)."""
    return job_dir(root, tenant, job_id) / f"outcome-{attempt or 0}.json"


def adapter_dir(root: Path, tenant: str, job_id: str) -> Path:
    return job_dir(root, tenant, job_id) / "adapter"


def checkpoints_dir(root: Path, tenant: str, job_id: str) -> Path:
    return job_dir(root, tenant, job_id) / "checkpoints"


def checkpoint_dir(root: Path, tenant: str, job_id: str, step: int) -> Path:
    # The HF Trainer's own naming, so resume_from_checkpoint finds them.
    return checkpoints_dir(root, tenant, job_id) / f"checkpoint-{step}"


def fine_tuned_model_id(base: str, suffix: str | None, job_id: str) -> str:
    return f"ft:{base}:{suffix or ''}:{job_id}"


def checkpoint_model_id(base: str, suffix: str | None, job_id: str, step: int) -> str:
    return f"{fine_tuned_model_id(base, suffix, job_id)}:ckpt-step-{step}"


@dataclass(frozen=True)
class FineTunedRef:
    base: str
    suffix: str
    job_id: str
    checkpoint_step: int | None = None


def parse_fine_tuned(model: str) -> FineTunedRef | None:
    """None when `model` is not an ft: id. Base ids hold no ':' (Hub ids and directory names)."""
    if not model.startswith("ft:"):
        return None
    parts = model[3:].split(":")
    step = None
    if len(parts) == 4 and parts[3].startswith("ckpt-step-") and parts[3][10:].isdigit():
        step = int(parts[3][10:])
        parts = parts[:3]
    if len(parts) != 3 or not parts[0] or not parts[2]:
        return None
    return FineTunedRef(base=parts[0], suffix=parts[1], job_id=parts[2], checkpoint_step=step)
