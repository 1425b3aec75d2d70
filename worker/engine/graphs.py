"""Device graphs (CUDA/XPU): the decode step for each batch size bucket, and packed prefill for each row count,
captured once and replayed, so a step costs a handful of host calls instead of hundreds of kernel launches."""

from __future__ import annotations

from typing import Callable

import torch

from worker.engine.device import device_module


def batch_buckets(slots: int) -> list[int]:
    """Batch sizes a decode step is captured for: a running batch is padded up to the next."""
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, 129, 16)) + list(range(160, slots + 32, 32))
    return sorted({min(s, slots) for s in sizes if s < slots} | {slots})


def length_bucket(n: int, max_len: int) -> int:
    """The cache length a torch-path decode step attends over (the Triton kernel reads each row's own length)."""
    step = 128 if n <= 1024 else 512 if n <= 4096 else 2048
    return min(max_len, -(-n // step) * step)


def capture(body: Callable[[], None], device: torch.device, pool):
    """`body` as a device graph in the shared pool `pool` (graphs never run at once, so they share temporaries).
    body runs twice eagerly first (on a side stream), so lazy initialisation and autotuning happen outside."""
    backend = device.type
    mod = device_module(backend)
    stream = mod.Stream(device=device)
    stream.wait_stream(mod.current_stream(device))
    with mod.stream(stream):
        for _ in range(2):
            body()
    mod.current_stream(device).wait_stream(stream)
    g = mod.CUDAGraph() if backend == "cuda" else mod.XPUGraph()
    kwargs = {"pool": pool}
    if backend == "cuda":
        kwargs["capture_error_mode"] = "thread_local"
    with mod.graph(g, **kwargs):
        body()
    return g


def new_pool(backend: str):
    return device_module(backend).graph_pool_handle()
