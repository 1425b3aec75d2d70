"""`xpu-jobs doctor`: is this host (or container) ready to run workers? One table of checks, each with what it saw
and, for a problem, how to fix it. Exits 1 when a check fails (a worker would not run, or would run on the wrong
device), else 0.

Everything that touches a device runtime runs in a child process of its own: the device mask must be in the
environment before the runtime starts (so "with" and "without the mask" need two processes), and a probe that
crashes or hangs in a driver must not take the report with it.
"""

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from worker.node.devices import DISTRIBUTED_BACKEND, MASK_VARIABLE, PinningError, pinned_environment

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
PROBE_TIMEOUT = 300
INTEL_GPU_DRIVERS = ("i915", "xe")
HUB_KERNELS = ("kernels-community/flash-attn2", "kernels-community/rmsnorm", "kernels-community/activation",
               "kernels-community/rotary")


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def probe(code: str, env: dict[str, str] | None = None, timeout: float = PROBE_TIMEOUT) -> tuple[dict | None, str]:
    """Run `code` in a fresh interpreter with no device mask but those in `env`; it prints one JSON object
    last. (result, error text)."""
    unmasked = {k: v for k, v in os.environ.items() if k not in MASK_VARIABLE.values()}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                             env={**unmasked, **(env or {})})
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {timeout:.0f} s"
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return None, (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
    return json.loads(lines[-1]), ""


def render_nodes(root: Path = Path("/")) -> list[tuple[str, str, bool]]:
    """(render node, kernel driver, can this process open it read-write) for each /dev/dri/renderD*."""
    found = []
    for node in sorted((root / "dev/dri").glob("renderD*")):
        driver = (root / "sys/class/drm" / node.name / "device/driver").resolve().name
        found.append((node.name, driver, os.access(node, os.R_OK | os.W_OK)))
    return found


def check_driver(intel_gpu: bool, root: Path = Path("/")) -> Check:
    nodes = render_nodes(root)
    intel = [n for n in nodes if n[1] in INTEL_GPU_DRIVERS]
    if not intel:
        if intel_gpu:
            return Check("driver and render nodes", FAIL, "an Intel GPU is on the PCI bus but no /dev/dri render "
                         "node of the i915 or xe driver is visible",
                         "load the GPU kernel driver on the host (i915 or xe; the HWE kernel for Arc B-series); in "
                         "a container, pass the devices in (compose: devices: /dev/dri:/dev/dri)")
        return Check("driver and render nodes", SKIP, "no Intel GPU render node here" +
                     (f" (render nodes: {', '.join(f'{n} ({d})' for n, d, _ in nodes)})" if nodes else ""))
    closed = [n for n, _, can_open in intel if not can_open]
    listing = ", ".join(f"{n} ({d})" for n, d, _ in intel)
    if closed:
        return Check("driver and render nodes", FAIL, f"{listing}; this user cannot open {', '.join(closed)}",
                     "add the user to the host's render group (getent group render); in compose, set "
                     "RENDER_GID in .env to that group's number")
    return Check("driver and render nodes", OK, listing)


TORCH_PROBE = """
import json, torch
b = %r
m = getattr(torch, b, None) if b != "cpu" else None
out = {"torch": torch.__version__, "available": bool(m and m.is_available())}
if out["available"]:
    n = m.device_count()
    out["devices"] = [{"name": m.get_device_name(i), "memory": m.get_device_properties(i).total_memory,
                       "free": m.mem_get_info(i)[0]} for i in range(n)]
    out["bf16"] = bool(m.is_bf16_supported(including_emulation=False) if b == "xpu" else m.is_bf16_supported())
print(json.dumps(out))
"""


def check_torch(backend: str, devices: str | None, intel_gpu: bool) -> list[Check]:
    unmasked, error = probe(TORCH_PROBE % backend)
    if unmasked is None:
        return [Check("torch", FAIL, f"torch does not import: {error}", "run make (it installs torch) or check "
                      "the image build")]
    version = unmasked["torch"]
    checks = []
    if intel_gpu and not version.endswith("+xpu"):
        checks.append(Check("torch build", FAIL, f"torch {version} on a host with an Intel GPU",
                            "install torch from the XPU index: rm -r .venv && make TORCH_BACKEND=xpu (or pip "
                            "install torch --extra-index-url https://download.pytorch.org/whl/xpu)"))
    else:
        checks.append(Check("torch build", OK, f"torch {version}"))
    if backend == "cpu":
        checks.append(Check("devices", OK, "cpu backend: no accelerator is used"))
        return checks
    if not unmasked["available"]:
        checks.append(Check("devices", FAIL, f"torch.{backend}.is_available() is False",
                            "check the driver and render nodes above, and that torch is a " + backend + " build"))
        return checks
    try:
        pinning = pinned_environment(backend, devices, {})
    except PinningError as exc:
        checks.append(Check("devices", FAIL, str(exc), "give --devices ordinals like 0 or 0,1"))
        return checks
    masked, error = probe(TORCH_PROBE % backend, pinning)
    names = "; ".join(f"{d['name']} {d['memory'] / 2**30:.0f} GiB ({d['free'] / 2**30:.0f} free)"
                      for d in unmasked["devices"])
    detail = f"{len(unmasked['devices'])} without a mask: {names}; bf16 {'yes' if unmasked['bf16'] else 'no'}"
    if masked is None or not masked.get("available"):
        checks.append(Check("devices", FAIL, f"{detail}; with {pinning}: {error or 'none visible'}",
                            "--devices names ordinals this host does not have"))
        return checks
    checks.append(Check("devices", OK, f"{detail}; with {' '.join(f'{k}={v}' for k, v in pinning.items())}: "
                                       f"{len(masked['devices'])}"))
    return checks


def check_pinning(backend: str, devices: str | None) -> Check:
    try:
        pinning = pinned_environment(backend, devices, dict(os.environ))
    except PinningError as exc:
        return Check("pinning", FAIL, str(exc), "unset the exported mask; the launcher sets it per node")
    if not pinning:
        return Check("pinning", OK, "cpu backend: no mask")
    return Check("pinning", OK, "the launcher would start the node with " +
                 " ".join(f"{k}={v}" for k, v in pinning.items()))


def hub_reachable(timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False


def cached_kernels() -> list[str]:
    roots = [Path(os.environ["KERNELS_CACHE"])] if os.environ.get("KERNELS_CACHE") else []
    roots.append(Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface")) / "hub")
    names = set()
    for root in roots:
        for repo in HUB_KERNELS:
            if (root / ("models--" + repo.replace("/", "--"))).is_dir():
                names.add(repo)
    return sorted(names)


def check_kernels(backend: str) -> Check:
    result, error = probe("import json, transformers.utils as u\n"
                          "try:\n    import kernels; v = kernels.__version__\nexcept ImportError:\n    v = None\n"
                          "print(json.dumps({'version': v, 'usable': bool(u.is_kernels_available())}))")
    if result is None:
        return Check("Hub kernels", FAIL, error)
    if result["version"] is None:
        status = SKIP if backend == "cpu" else WARN
        return Check("Hub kernels", status, "the kernels package is not installed: flash_attention_2 and "
                     "use_kernels are refused", "" if backend == "cpu" else "make installs it on GPU hosts (the "
                     "kernels extra); the image carries it")
    if not result["usable"]:
        return Check("Hub kernels", FAIL, f"kernels {result['version']} does not fit the installed transformers",
                     "pip install -e '.[kernels]' (the version range transformers accepts)")
    cached = cached_kernels()
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or not hub_reachable()
    where = f"cached: {', '.join(cached) or 'none'}; Hub {'unreachable' if offline else 'reachable'}"
    if offline and not cached:
        return Check("Hub kernels", WARN, f"kernels {result['version']}; {where}",
                     "prefetch them (deploy/prefetch_kernels.py, as the image build does) or leave "
                     "flash_attention_2 and use_kernels off")
    return Check("Hub kernels", OK, f"kernels {result['version']}; {where}")


# One of the engine's own kernels: Triton compiles only kernels defined in a file (`python -c` code has no source),
# and these are the ones a job runs.
TRITON_PROBE = """
import json, torch, triton
from worker.engine.triton_kernels import silu_mul_rows
gu = torch.randn(8, 2048, device=%r)
out = silu_mul_rows(gu)
want = torch.nn.functional.silu(gu[:, :1024]) * gu[:, 1024:]
print(json.dumps({"triton": triton.__version__, "equal": bool(torch.allclose(out, want))}))
"""


def check_triton(backend: str) -> Check:
    if backend == "cpu":
        return Check("Triton kernel", SKIP, "the engine's Triton kernels run on xpu and cuda only")
    result, error = probe(TRITON_PROBE % f"{backend}:0")
    if result is None or not result["equal"]:
        return Check("Triton kernel", FAIL, error or "wrong result", "Triton compiles a launcher at first use: "
                     "install a C compiler (build-essential) and, on XPU, the Level Zero headers (level-zero-dev); "
                     "the engine falls back to torch ops meanwhile")
    return Check("Triton kernel", OK, f"triton {result['triton']}: compiled and ran")


BNB_PROBE = """
import json, torch, bitsandbytes as bnb
device = %r
torch.manual_seed(0)
w = torch.randn(64, 128)
layer = bnb.nn.Linear4bit(128, 64, bias=False, quant_type="nf4", compute_dtype=torch.float32)
layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
layer = layer.to(device)
x = torch.randn(8, 128)
ref = x @ w.T
err = ((layer(x.to(device)).float().cpu() - ref).norm() / ref.norm()).item()
print(json.dumps({"bnb": bnb.__version__, "relative_error": err}))
"""


def check_bitsandbytes(backend: str) -> Check:
    device = "cpu" if backend == "cpu" else f"{backend}:0"
    result, error = probe(BNB_PROBE % device)
    if result is None:
        return Check("bitsandbytes 4-bit", FAIL, error, "QLoRA and 4-bit inference are unavailable: check the "
                     "bitsandbytes install (its XPU backend needs Triton, above)")
    if result["relative_error"] > 0.2:  # nf4 is ~0.1 off on random weights; far more means a broken kernel
        return Check("bitsandbytes 4-bit", FAIL, f"relative error {result['relative_error']:.2f}")
    return Check("bitsandbytes 4-bit", OK, f"bitsandbytes {result['bnb']}: nf4 linear on {device}, relative "
                 f"error {result['relative_error']:.3f}")


COLLECTIVE_PROBE = """
import json, os, torch, torch.distributed as dist
backend, device = %r, %r
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=%r)
dist.init_process_group(backend, rank=0, world_size=1)
t = torch.ones(4, device=device)
dist.all_reduce(t)
dist.destroy_process_group()
print(json.dumps({"sum": t.sum().item()}))
"""


def check_collectives(backend: str) -> Check:
    from worker.node.redis_server import free_port

    name = DISTRIBUTED_BACKEND[backend]
    device = "cpu" if backend == "cpu" else f"{backend}:0"
    result, error = probe(COLLECTIVE_PROBE % (name, device, str(free_port())))
    if result is None or result["sum"] != 4:
        return Check("collectives", FAIL, f"{name}: {error or 'wrong all_reduce'}",
                     "multi-process fine-tunes need it; torch >= 2.8 ships xccl for XPU")
    return Check("collectives", OK, f"{name}: a one-process all_reduce on {device}")


ENGINE_PROBE = """
import json, tempfile, torch
from pathlib import Path
from contract.settings import Settings
from worker.demo_model import build_demo_model
from worker.engine.messages import ModelKey
from worker.engine.model_cache import ModelCache
from worker.engine.requests import GenerationRequest, SamplingParams

backend = %r
root = Path(tempfile.mkdtemp())
build_demo_model(root / "demo-tiny")
cache = ModelCache(Settings(models_root=root, base_models=["demo-tiny"]), backend)
engine = cache.get(ModelKey("demo-tiny")).engine
prompts = [[5, 9, 13, 2, 7], [11, 3, 8]]
results = engine.generate([GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=8, temperature=0,
                                                                        ignore_eos=True))
                           for i, p in enumerate(prompts)])
model = engine.model
same = 0
for p, r in zip(prompts, results):
    ids = torch.tensor([p], device=model.device)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(p):].tolist()
    same += ref == r.output_ids
stats = engine.stats
cache.close()
print(json.dumps({"path": stats.get("path"), "kernels": stats.get("kernels"), "reason": stats.get("fallback_reason"),
                  "graphs": stats.get("graphs_captured", 0), "same": same, "of": len(prompts),
                  "dtype": str(next(model.parameters()).dtype)}))
"""


def check_engine(backend: str) -> Check:
    result, error = probe(ENGINE_PROBE % backend)
    if result is None:
        return Check("engine", FAIL, f"the engine did not run the demo model: {error}",
                     "see the worker log; inference would fail the same way")
    detail = (f"{result['path']} path, {result['kernels'] or 'model forward'} kernels, {result['graphs']} device "
              f"graphs captured; greedy tokens equal generate's for {result['same']} of {result['of']} prompts "
              f"({result['dtype']})")
    if result["path"] != "native":
        return Check("engine", WARN, f"{detail}; not native: {result['reason']}",
                     "the fallback path is slower: check the Triton kernel above")
    status = OK if result["same"] == result["of"] or "float32" not in result["dtype"] else FAIL
    return Check("engine", status, detail, "" if status == OK else "the native path computes wrong tokens here")


def run_checks(backend: str, devices: str | None) -> list[Check]:
    from worker.hardware import detect

    intel_gpu = detect(environ={})[0] == "xpu"
    checks = [check_driver(intel_gpu)]
    checks += check_torch(backend, devices, intel_gpu)
    checks += [check_pinning(backend, devices), check_kernels(backend), check_triton(backend),
               check_bitsandbytes(backend), check_collectives(backend), check_engine(backend)]
    return checks


def print_versions(gpu: bool) -> int:
    """Import every library a job uses (the Hub kernels and Triton too on a GPU build) and print the versions."""
    import importlib
    import importlib.metadata

    names = ["torch", "transformers", "peft", "bitsandbytes", "accelerate"] + (["kernels", "triton"] if gpu else [])
    for name in names:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', None) or importlib.metadata.version(name)}")
    return 0


def report(checks: list[Check], as_json: bool) -> int:
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        colour = {OK: "green", WARN: "yellow", FAIL: "red", SKIP: "dim"}
        table = Table(title="xpu-jobs doctor")
        for column in ("check", "status", "what it saw", "how to fix it"):
            table.add_column(column, overflow="fold")
        for c in checks:
            table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail, c.fix)
        Console().print(table)
    return 1 if any(c.status == FAIL for c in checks) else 0
