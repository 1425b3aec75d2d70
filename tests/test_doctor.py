"""`xpu-jobs doctor`: a truthful report on this machine, and the render-node checks on fake device trees."""

import json
import os
import subprocess
import sys

from worker.doctor import FAIL, OK, SKIP, check_driver


def test_doctor_reports_this_machine_truthfully():
    result = subprocess.run([sys.executable, "-m", "worker.cli", "doctor", "--json"], capture_output=True,
                            text=True, timeout=600)
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    import torch

    assert checks["torch build"]["detail"] == f"torch {torch.__version__}"
    if not any(getattr(torch, b).is_available() for b in ("xpu", "cuda")):  # this CPU machine
        assert checks["driver and render nodes"]["status"] == SKIP
        assert checks["Triton kernel"]["status"] == SKIP
        assert checks["collectives"] == {"name": "collectives", "status": OK,
                                         "detail": "gloo: a one-process all_reduce on cpu", "fix": ""}
    assert checks["bitsandbytes 4-bit"]["status"] == OK
    assert checks["engine"]["status"] == OK and checks["engine"]["detail"].startswith("native path")
    assert result.returncode == (1 if any(c["status"] == FAIL for c in checks.values()) else 0)


def make_render_node(root, name, driver, mode):
    (root / "dev/dri").mkdir(parents=True, exist_ok=True)
    node = root / "dev/dri" / name
    node.write_text("")
    node.chmod(mode)
    target = root / "sys/bus/pci/drivers" / driver
    target.mkdir(parents=True, exist_ok=True)
    device = root / "sys/devices" / name
    device.mkdir(parents=True)
    (device / "driver").symlink_to(target)
    (root / "sys/class/drm" / name).mkdir(parents=True)
    (root / "sys/class/drm" / name / "device").symlink_to(device)


def test_render_nodes_are_found_and_their_access_checked(tmp_path):
    assert check_driver(False, tmp_path).status == SKIP
    missing = check_driver(True, tmp_path)
    assert missing.status == FAIL and "i915 or xe" in missing.fix
    make_render_node(tmp_path, "renderD128", "xe", 0o666)
    assert check_driver(True, tmp_path).status == OK
    make_render_node(tmp_path, "renderD129", "i915", 0o000)
    closed = check_driver(True, tmp_path)
    if os.geteuid() != 0:  # root opens anything
        assert closed.status == FAIL and "renderD129" in closed.detail and "render group" in closed.fix
