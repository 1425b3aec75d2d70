"""The messages between a worker node and its engine process (process.py), one dataclass per kind. The worker
sends one message at a time; the engine process sends lists of answers (what it has ready, in one message)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from worker.engine.requests import GenerationDelta, GenerationResult, Priority, SamplingParams


@dataclass(frozen=True)
class ModelKey:
    """How a base is loaded: one loaded model (and engine) per distinct key."""
    base: str
    # None: the engine's own kernels; a value (or use_kernels) runs the model's own forward with that attention
    attn_implementation: str | None = None
    quantization: str = "none"
    use_kernels: bool = False

    @property
    def wants_hf_path(self) -> bool:
        return self.attn_implementation is not None or self.use_kernels


@dataclass(frozen=True)
class AdapterRef:
    name: str  # unique per adapter (job id, or job id and checkpoint step)
    path: Path


@dataclass
class Submission:
    """One request for the engine process: what to load and what to generate."""
    request_id: str
    model: ModelKey
    adapter: AdapterRef | None
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False  # answer with Delta messages as tokens are produced
    priority: Priority = Priority.LIVE  # batch lines say Priority.BATCH


# ------------------------------------------------------------------------------------- worker -> engine process


@dataclass
class Generate:
    submissions: list[Submission]


@dataclass
class Cancel:
    request_id: str


@dataclass
class ReportRequest:
    call_id: int


@dataclass
class ReleaseIdle:
    """Evict every idle model: something else (a fine-tune) is about to need the device's memory."""
    call_id: int


@dataclass
class Close:
    pass


# ------------------------------------------------------------------------------------- engine process -> worker


@dataclass
class Delta:
    delta: GenerationDelta


@dataclass
class Finished:
    result: GenerationResult


@dataclass
class Failed:
    request_id: str
    code: str
    message: str
    param: str | None = None


@dataclass
class Released:
    call_id: int
    models: list[str]  # the bases evicted


@dataclass
class ModelReport:
    """One loaded model as the registry shows it; `engine` holds the engine's counters (numbers and strings)."""
    model: str
    attn_implementation: str | None
    quantization: str
    use_kernels: bool
    adapters: list[str]
    engine: dict[str, int | float | str | None]
    running_requests: int  # submitted and not finished: while any run, the model is never evicted
    held_memory: dict[int, int]  # device index (0: the host on cpu) -> bytes evicting the model gives back


@dataclass
class Report:
    call_id: int
    models: list[ModelReport] = field(default_factory=list)
    # device index -> bytes evicting every idle model would give back now (models serving requests count nothing)
    reclaimable_memory: dict[int, int] = field(default_factory=dict)
