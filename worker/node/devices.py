"""Everything about devices, in one place: pinning a worker to device ids, detecting the backend, and what
the pinned devices are and can do.

Pinning works only through the environment of a process before it initialises the device runtime, so the
launcher computes the environment here without importing torch, and torch is imported inside functions.
"""

import json
import os
import subprocess
import sys
from typing import Any

BACKENDS = ("xpu", "cuda", "cpu")

# What each backend reads to choose and order its devices.
MASK_VARIABLE = {"xpu": "ZE_AFFINITY_MASK", "cuda": "CUDA_VISIBLE_DEVICES"}
ORDER_VARIABLE = {"xpu": ("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "1"), "cuda": ("CUDA_DEVICE_ORDER", "PCI_BUS_ID")}


# Collective backend of multi-process training on each device type (the guide: xccl on XPU).
DISTRIBUTED_BACKEND = {"xpu": "xccl", "cuda": "nccl", "cpu": "gloo"}


class PinningError(ValueError):
    pass


def normalise_mask(devices: str) -> str:
    """'2,0,2' -> '0,2'. Ids are PCI-ordered ordinals, or 'device.tile' on XPU; the order inside a mask
    does not change enumeration order, so a sorted, de-duplicated mask says the same thing more plainly."""
    ids = [d.strip() for d in devices.split(",") if d.strip()]
    if not ids:
        raise PinningError(f"--devices {devices!r} names no device")
    for d in ids:
        parts = d.split(".")
        if len(parts) > 2 or not all(p.isdigit() for p in parts):
            raise PinningError(f"--devices {devices!r}: {d!r} is not a device ordinal like 0 or 0.1")
    return ",".join(sorted(set(ids), key=lambda d: tuple(int(p) for p in d.split("."))))


def pinned_environment(backend: str, devices: str | None, inherited: dict[str, str]) -> dict[str, str]:
    """The variables a worker process pinned to `devices` must start with.

    An inherited mask that disagrees with --devices is refused: silently overriding a forgotten exported
    value is how a run lands on the wrong devices.
    """
    if backend == "cpu":
        if devices:
            raise PinningError("--devices names accelerator ids; the cpu backend has none")
        return {}
    variable = MASK_VARIABLE[backend]
    order = dict([ORDER_VARIABLE[backend]])  # PCI order for every node with a device, masked or not
    inherited_mask = inherited.get(variable)
    if devices is None:
        if inherited_mask is None:
            return order
        devices = inherited_mask
    mask = normalise_mask(devices)
    if inherited_mask is not None and normalise_mask(inherited_mask) != mask:
        raise PinningError(
            f"{variable}={inherited_mask} is already set in this environment but --devices asks for {mask}; "
            f"unset {variable} (or make it match) and start again")
    return {variable: mask, **order}


def probe_backend(preference: str = "auto") -> tuple[str, int]:
    """(backend, device count), asked of a throwaway process so the caller never initialises a runtime."""
    code = (
        "import json, torch\n"
        "pref = %r\n"
        "for b in ('xpu', 'cuda'):\n"
        "    m = getattr(torch, b, None)\n"
        "    if pref in ('auto', b) and m is not None and m.is_available():\n"
        "        print(json.dumps([b, m.device_count()])); break\n"
        "else:\n"
        "    print(json.dumps(['cpu', 0]))\n" % preference
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    backend, count = json.loads(out.stdout.strip().splitlines()[-1])
    return backend, count


def _module(backend: str):
    import torch

    return getattr(torch, backend)


def detect_backend(preference: str = "auto") -> str:
    """In the worker process itself, after pinning: xpu, then cuda, then cpu (or the configured one)."""
    import torch

    if preference != "auto":
        if preference != "cpu" and not _module(preference).is_available():
            pinning = ", ".join(f"{v}={os.environ.get(v, '<unset>')}"
                                for v in (MASK_VARIABLE[preference], ORDER_VARIABLE[preference][0]))
            raise RuntimeError(f"backend {preference!r} was configured but torch sees no {preference} device "
                               f"(torch {torch.__version__}; {pinning})")
        return preference
    for backend in ("xpu", "cuda"):
        module = getattr(torch, backend, None)
        if module is not None and module.is_available():
            return backend
    return "cpu"


def bf16_supported(backend: str) -> bool:
    if backend == "cpu":
        return False  # bf16 on CPU is emulated and slow: run fp32 there.
    if backend == "xpu":
        return bool(_module("xpu").is_bf16_supported(including_emulation=False))
    return bool(_module("cuda").is_bf16_supported())


def describe(backend: str) -> list[dict[str, Any]]:
    """What this process sees: one entry per visible device (the host's memory for cpu), with the memory free
    now (other processes' use included), as each heartbeat reports it."""
    free = free_memory(backend)
    if backend == "cpu":
        import psutil

        return [{"index": 0, "name": "cpu", "total_memory": psutil.virtual_memory().total, "free_memory": free[0],
                 "bf16": False}]
    module = _module(backend)
    bf16 = bf16_supported(backend)
    return [{"index": i, "name": module.get_device_name(i),
             "total_memory": module.get_device_properties(i).total_memory, "free_memory": free[i], "bf16": bf16}
            for i in range(module.device_count())]


def free_memory(backend: str) -> list[int]:
    """Bytes free on each visible device now, whoever holds the rest (the host's available memory for cpu)."""
    if backend == "cpu":
        import psutil

        return [psutil.virtual_memory().available]
    module = _module(backend)
    return [module.mem_get_info(i)[0] for i in range(module.device_count())]


def torch_device(backend: str) -> str:
    return "cpu" if backend == "cpu" else f"{backend}:0"


def rank_device(backend: str) -> str:
    """The device of this training process: each rank of a group takes its own (LOCAL_RANK from torchrun),
    with the whole group visible to every rank so collectives can reach the peers."""
    return "cpu" if backend == "cpu" else f"{backend}:{int(os.environ.get('LOCAL_RANK', 0))}"


def compute_dtype(backend: str):
    import torch

    return torch.bfloat16 if bf16_supported(backend) else torch.float32


def peak_memory(backend: str) -> int:
    if backend == "cpu":
        return 0
    return int(_module(backend).max_memory_allocated())


def reset_peak_memory(backend: str) -> None:
    if backend != "cpu":
        _module(backend).reset_peak_memory_stats()


def synchronize(backend: str) -> None:
    if backend != "cpu":
        _module(backend).synchronize()


def empty_cache(backend: str) -> None:
    if backend != "cpu":
        _module(backend).empty_cache()
