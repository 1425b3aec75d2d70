"""worker/hardware.py: the torch build `make` installs, chosen from what the host has (fake /sys trees)."""

import subprocess
import sys
from pathlib import Path

import pytest

from worker import hardware

ROOT = Path(__file__).resolve().parents[1]


def pci_device(root: Path, address: str, vendor: str, klass: str) -> None:
    device = root / "sys/bus/pci/devices" / address
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text(klass + "\n")


def render_node(root: Path, name: str, driver: str) -> None:
    drivers = root / "sys/bus/pci/drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    device = root / "sys/devices/pci0000:00/0000:03:00.0"
    device.mkdir(parents=True, exist_ok=True)
    (device / "driver").symlink_to(drivers)
    node = root / "sys/class/drm" / name
    node.mkdir(parents=True)
    (node / "device").symlink_to(device)


def test_intel_render_node_means_xpu(tmp_path):
    render_node(tmp_path, "renderD128", "xe")
    assert hardware.detect(tmp_path, {})[0] == "xpu"


def test_intel_display_controller_means_xpu(tmp_path):
    pci_device(tmp_path, "0000:00:00.0", "0x8086", "0x060000")  # an Intel host bridge is no GPU
    pci_device(tmp_path, "0000:03:00.0", "0x8086", "0x038000")
    backend, reason = hardware.detect(tmp_path, {})
    assert backend == "xpu" and "0000:03:00.0" in reason


def test_nvidia_means_cuda(tmp_path):
    pci_device(tmp_path, "0000:00:02.0", "0x1a03", "0x030000")  # a server's BMC VGA (ASPEED)
    pci_device(tmp_path, "0000:17:00.0", "0x10de", "0x030200")
    assert hardware.detect(tmp_path, {})[0] == "cuda"
    nvidia_driver = tmp_path / "proc/driver/nvidia/version"
    nvidia_driver.parent.mkdir(parents=True)
    nvidia_driver.write_text("NVRM version")
    assert hardware.detect(tmp_path, {}) == ("cuda", "the NVIDIA kernel driver is loaded")


def test_no_gpu_means_cpu_and_the_override_wins(tmp_path):
    pci_device(tmp_path, "0000:00:00.0", "0x8086", "0x060000")
    pci_device(tmp_path, "0000:00:02.0", "0x1a03", "0x030000")
    assert hardware.detect(tmp_path, {})[0] == "cpu"
    assert hardware.detect(tmp_path, {"TORCH_BACKEND": "XPU"})[0] == "xpu"
    with pytest.raises(ValueError, match="TORCH_BACKEND"):
        hardware.detect(tmp_path, {"TORCH_BACKEND": "rocm"})


def test_pip_arguments_per_backend():
    index = "https://download.pytorch.org/whl/"
    assert hardware.pip_args("xpu", lambda url: False) == ["--extra-index-url", index + "xpu"]
    assert hardware.pip_args("cuda", lambda url: True) == []
    assert hardware.pip_args("cpu", lambda url: True) == ["--extra-index-url", index + "cpu"]
    assert hardware.pip_args("cpu", lambda url: False) == []  # an offline host's own index serves it


def test_verify_catches_the_wrong_build():
    assert "not an XPU build" in hardware.verify("xpu", "2.13.0", "12.8")
    assert hardware.verify("xpu", "2.13.0+xpu", None) is None
    assert "no CUDA" in hardware.verify("cuda", "2.13.0+cpu", None)
    assert hardware.verify("cpu", "2.13.0+cpu", None) is None


def test_this_machine_gets_a_build_that_works_here():
    """What `make` picks here, and that the torch it installed passes the check for that pick."""
    picked = subprocess.run([sys.executable, str(ROOT / "worker/hardware.py")], capture_output=True,
                            text=True, check=True).stdout.strip()
    assert picked in ("xpu", "cuda", "cpu")
    check = subprocess.run([sys.executable, str(ROOT / "worker/hardware.py"), "--verify", picked],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
