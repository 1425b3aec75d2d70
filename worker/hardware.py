"""Which torch build this host needs, for `make up` and `make test`, and which GPUs it has, for `xpu-jobs
doctor` (standard library only: make runs it as a script before any virtual environment exists).

    python3 worker/hardware.py                 # prints xpu, cuda or cpu (TORCH_BACKEND overrides)
    python3 worker/hardware.py --explain cpu   # one line saying what was picked and why
    python3 worker/hardware.py --pip-args xpu  # the pip arguments that install that build
    python3 worker/hardware.py --verify xpu    # after the install: is the torch in the venv that build?

An Intel GPU gets torch from PyTorch's XPU wheel index, added as an extra index as the guide installs it
(otherwise pip takes PyPI's CUDA build and the stack quietly runs on the CPU). An NVIDIA GPU gets PyPI's default
build, which is the CUDA one. A host with neither gets the CPU wheel index, a much smaller download; when that
index cannot be reached (an offline host with a mirror of its own), pip's configured index is used as it is.
"""

import argparse
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

BACKENDS = ("xpu", "cuda", "cpu")
WHEEL_INDEX = {"xpu": "https://download.pytorch.org/whl/xpu", "cpu": "https://download.pytorch.org/whl/cpu"}
INTEL, NVIDIA = "0x8086", "0x10de"
DISPLAY_CLASS = "0x03"  # PCI base class 03: display controllers (VGA, 3D, other)
INTEL_GPU_DRIVERS = ("i915", "xe")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def detect(root: Path = Path("/"), environ: dict[str, str] | None = None) -> tuple[str, str]:
    """(backend, reason). `root` lets the tests lay out a fake /sys and /proc."""
    environ = os.environ if environ is None else environ
    override = environ.get("TORCH_BACKEND", "").strip().lower()
    if override:
        if override not in BACKENDS:
            raise ValueError(f"TORCH_BACKEND={override!r}: use one of {', '.join(BACKENDS)}")
        return override, "TORCH_BACKEND is set"
    drm = root / "sys/class/drm"
    for node in sorted(drm.glob("renderD*")) if drm.is_dir() else []:
        driver = (node / "device/driver").resolve().name
        if driver in INTEL_GPU_DRIVERS:
            return "xpu", f"Intel GPU render node {node.name} (driver {driver})"
    displays = []
    pci = root / "sys/bus/pci/devices"
    for device in sorted(pci.iterdir()) if pci.is_dir() else []:
        if _read(device / "class").startswith(DISPLAY_CLASS):
            displays.append((_read(device / "vendor"), device.name))
    for vendor, address in displays:
        if vendor == INTEL:
            return "xpu", f"Intel display controller at PCI {address}"
    if (root / "proc/driver/nvidia/version").exists():
        return "cuda", "the NVIDIA kernel driver is loaded"
    for vendor, address in displays:
        if vendor == NVIDIA:
            return "cuda", f"NVIDIA display controller at PCI {address}"
    return "cpu", "no Intel or NVIDIA GPU on the PCI bus"


def reachable(url: str, timeout: float = 3.0) -> bool:
    host = urlparse(url).hostname or ""
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def pip_args(backend: str, can_reach=reachable) -> list[str]:
    if backend == "cuda":
        return []
    index = WHEEL_INDEX[backend]
    if backend == "cpu" and not can_reach(index):
        return []
    # xpu always names its index: without it pip would take a CUDA build; an unreachable index fails in --verify.
    return ["--extra-index-url", index]


def verify(backend: str, version: str, cuda_version: str | None) -> str | None:
    """What is wrong with the installed torch for `backend`, or None."""
    if backend == "xpu" and not version.endswith("+xpu"):
        return (f"torch {version} is not an XPU build: {WHEEL_INDEX['xpu']} could not be used. Reach it (or a "
                f"mirror of it through PIP_EXTRA_INDEX_URL), remove .venv and run make again")
    if backend == "cuda" and not cuda_version:
        return f"torch {version} has no CUDA support: remove .venv and run make again with TORCH_BACKEND=cuda"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--explain", metavar="BACKEND")
    group.add_argument("--pip-args", metavar="BACKEND")
    group.add_argument("--verify", metavar="BACKEND")
    args = parser.parse_args(argv)
    if args.explain:
        detected, reason = detect(environ={})
        if detected != args.explain:
            reason = f"TORCH_BACKEND overrides the detected {detected}: {reason}"
        note = "" if pip_args(args.explain) or args.explain == "cuda" else \
            f"; {WHEEL_INDEX['cpu']} is unreachable, so pip's configured index is used"
        print(f"torch backend: {args.explain} ({reason}{note}; override with TORCH_BACKEND=xpu|cuda|cpu)")
        return 0
    if args.pip_args:
        print(" ".join(pip_args(args.pip_args)))
        return 0
    if args.verify:
        import torch

        problem = verify(args.verify, torch.__version__, torch.version.cuda)
        if problem:
            print(f"torch backend: {problem}", file=sys.stderr)
            return 1
        print(f"torch backend: installed torch {torch.__version__}")
        return 0
    print(detect()[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
