"""Device helpers shared by the engine's parts: the backend's torch module, small host lists on the device, and
tokens copied back to the host without waiting for the device."""

from __future__ import annotations

import torch


def device_module(backend: str):
    return getattr(torch, backend, None)


def graphs_available(backend: str) -> bool:
    mod = device_module(backend)
    if backend == "cuda":
        return mod is not None and hasattr(mod, "CUDAGraph")
    if backend == "xpu":
        return mod is not None and hasattr(mod, "XPUGraph") and hasattr(mod, "graph")
    return False


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a pageable copy (which would wait for all queued device work)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    try:
        t = t.pin_memory()
    except Exception:
        pass
    return t.to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        device_module(device.type).synchronize(device)


class HostTokens:
    """Tokens on their way to the host: one tensor, copied without blocking, read one step later. `rows` pairs an
    index into the tensor with whatever the caller wants back (its sequence)."""

    def __init__(self, tokens: torch.Tensor, rows: list, backend: str):
        self.rows = rows
        self.event = None
        if backend == "cpu":
            self.host = tokens.clone()
            return
        try:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = device_module(backend).Event()
            self.event.record()
        except Exception:  # no pinned memory: a blocking copy
            self.host = tokens.to("cpu")
            self.event = None

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
