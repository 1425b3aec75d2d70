"""Pinning: the launcher puts the device mask into the environment of the worker process it execs, refuses a
conflicting inherited mask, and never initialises a device runtime itself."""

import json
import os
import subprocess
import sys

import pytest

from worker.node.devices import (
    MASK_VARIABLE,
    ORDER_VARIABLE,
    PinningError,
    normalise_mask,
    pinned_environment,
    probe_backend,
)


def launcher(*args: str, env_extra: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZE_", "CUDA_", "XPUJOBS_"))}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "worker.cli", "worker", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_pins_exactly_the_mask():
    result = launcher("--backend", "xpu", "--devices", "2,0", "--dry-run")
    assert result.returncode == 0, result.stderr
    [node] = [json.loads(line) for line in result.stdout.splitlines()]
    pinning = {k: v for k, v in node["env"].items() if k.startswith(("ZE_", "CUDA_"))}
    assert pinning == {"ZE_AFFINITY_MASK": "0,2", "ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}
    assert node["argv"][1:4] == ["-m", "celery", "-A"] and "-P" in node["argv"]


def test_worker_process_starts_with_the_mask_in_its_environment():
    """A real exec: the node process reads the mask it was started with and, asked for a GPU backend this
    machine lacks, stops saying so."""
    present = probe_backend("auto")[0]
    backend = "xpu" if present != "xpu" else "cuda"
    mask, order = MASK_VARIABLE[backend], "=".join(ORDER_VARIABLE[backend])
    result = launcher("--backend", backend, "--devices", "0,2")
    assert result.returncode == 78, result.stdout + result.stderr
    assert f"{mask}=0,2, {order}" in result.stderr
    assert f"torch sees no {backend} device" in result.stderr


def test_conflicting_inherited_mask_is_refused():
    result = launcher("--backend", "xpu", "--devices", "0,2", env_extra={"ZE_AFFINITY_MASK": "1"})
    assert result.returncode == 2
    assert "ZE_AFFINITY_MASK=1 is already set" in result.stderr
    matching = launcher("--backend", "xpu", "--devices", "0,2", "--dry-run", env_extra={"ZE_AFFINITY_MASK": "2,0"})
    assert matching.returncode == 0


def test_one_node_per_group_with_distinct_masks():
    result = launcher("--backend", "cuda", "--devices", "0,1", "--devices", "2,3", "--name", "gpu", "--dry-run")
    nodes = [json.loads(line) for line in result.stdout.splitlines()]
    assert [n["env"]["CUDA_VISIBLE_DEVICES"] for n in nodes] == ["0,1", "2,3"]
    assert all(n["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for n in nodes)
    names = [n["env"]["XPUJOBS_NODE_NAME"] for n in nodes]
    assert names[0].startswith("gpu-0_1@") and names[1].startswith("gpu-2_3@")


def test_cpu_backend_sets_no_mask():
    result = launcher("--backend", "cpu", "--dry-run")
    [node] = [json.loads(line) for line in result.stdout.splitlines()]
    assert not any(k.startswith(("ZE_", "CUDA_")) for k in node["env"])


def test_masks_are_normalised_and_checked():
    assert normalise_mask("3, 1,1.0,1") == "1,1.0,3"
    for bad in ["", "a", "0..1", "-1"]:
        with pytest.raises(PinningError):
            normalise_mask(bad)
    with pytest.raises(PinningError):
        pinned_environment("cpu", "0", {})
    assert pinned_environment("xpu", None, {"ZE_AFFINITY_MASK": "1"}) == {
        "ZE_AFFINITY_MASK": "1", "ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}
    # no mask at all: every device, still in PCI order (ids in logs and --devices mean the same GPUs)
    assert pinned_environment("xpu", None, {}) == {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}
    assert pinned_environment("cuda", None, {}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.mark.parametrize("module", ["worker.cli", "api.main"])
def test_launcher_and_api_never_import_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('torch', 'transformers', 'peft', 'bitsandbytes', 'accelerate')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
