"""The `xpu-jobs` command: worker launcher, API server, the whole stack on one machine, health checks.

Nothing here imports torch: a launcher that initialised a device runtime could no longer pin its children.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from contract.queues import backend_queue, node_queue
from worker.node.devices import MASK_VARIABLE, PinningError, pinned_environment, probe_backend


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xpu-jobs",
                                     description="xpu-jobs: fine-tuning and inference jobs on Intel GPUs",
                                     epilog="Users' commands, through the REST API (OPENAI_BASE_URL, OPENAI_API_KEY): "
                                            "xpu-jobs {files,fine-tune,batch,models,workers} --help")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="start one Celery worker node per device group, pinned to its devices")
    w.add_argument("--devices", action="append", metavar="IDS",
                   help="a device group, e.g. 0,2 (PCI order); repeat for more groups, one node each")
    w.add_argument("--backend", choices=["auto", "xpu", "cuda", "cpu"], default=None,
                   help="default: XPUJOBS_DEVICE_BACKEND, else auto (xpu, then cuda, then cpu)")
    w.add_argument("--name", default="worker", help="node name prefix (nodes are <name>[-<ids>]@<host>)")
    w.add_argument("--concurrency", type=int, default=None,
                   help="concurrent inference requests per node (default XPUJOBS_WORKER_CONCURRENCY)")
    w.add_argument("--dry-run", action="store_true", help="print each node's command and pinning, start nothing")

    a = sub.add_parser("api", help="serve the REST API")
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, default=8000)
    a.add_argument("--workers", type=int, default=None, help="API processes (default XPUJOBS_API_WORKERS)")

    u = sub.add_parser("up", help="the whole stack on this machine: Redis (embedded if none is configured), "
                                  "API, workers")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8000)
    u.add_argument("--redis-port", type=int, default=6390, help="port of the embedded Redis")
    u.add_argument("--data-dir", type=Path, default=Path("data"), help="embedded Redis files, artifacts, models")
    u.add_argument("--backend", choices=["auto", "xpu", "cuda", "cpu"], default=None)
    u.add_argument("--devices", action="append", metavar="IDS",
                   help="device groups; default one worker per detected device (one CPU worker when none)")

    d = sub.add_parser("demo-model", help="build the small local demo model (random weights; not a real model)")
    d.add_argument("--out", type=Path, default=None, help="default: <models_root>/demo-tiny")

    sub.add_parser("devices", help="print what torch sees in this environment (backend, devices, bf16)")

    dr = sub.add_parser("doctor", help="check that this host or container can run workers: driver, torch, "
                                       "pinning, kernels, Triton, bitsandbytes, collectives")
    dr.add_argument("--backend", choices=["auto", "xpu", "cuda", "cpu"], default=None)
    dr.add_argument("--devices", metavar="IDS", help="the device group to check pinning for, e.g. 0,1")
    dr.add_argument("--json", action="store_true", help="the checks as JSON")
    dr.add_argument("--versions", action="store_true",
                    help="only import the job libraries and print their versions (the image's build check)")

    h = sub.add_parser("health", help="exit 0 when the API answers or the named worker node is registered")
    target = h.add_mutually_exclusive_group(required=True)
    target.add_argument("--api", metavar="URL", help="e.g. http://127.0.0.1:8000")
    target.add_argument("--worker", metavar="NAME", help="a node name prefix, e.g. worker-0")
    return parser


def _node_name(prefix: str, devices: str | None, several: bool) -> str:
    base = f"{prefix}-{devices.replace(',', '_')}" if several and devices else prefix
    return f"{base}@{socket.gethostname()}"


def worker_commands(args: argparse.Namespace, environ: dict[str, str]) -> list[tuple[list[str], dict[str, str]]]:
    """The (argv, environment) of each worker node; raises PinningError for a bad or conflicting mask."""
    from contract.settings import Settings

    settings = Settings()
    preference = args.backend or environ.get("XPUJOBS_DEVICE_BACKEND") or settings.device_backend
    backend = preference if preference != "auto" else probe_backend("auto")[0]
    groups = args.devices or [None]
    concurrency = args.concurrency or settings.worker_concurrency
    commands = []
    for number, devices in enumerate(groups):
        pinning = pinned_environment(backend, devices, environ)
        node = _node_name(args.name, pinning.get(MASK_VARIABLE.get(backend, "")), len(groups) > 1)
        env = {**environ, **pinning, "XPUJOBS_DEVICE_BACKEND": backend, "XPUJOBS_NODE_NAME": node}
        if settings.worker_metrics_port:  # one port per node of this host
            env["XPUJOBS_WORKER_METRICS_PORT"] = str(settings.worker_metrics_port + number)
        queues = f"{backend_queue(backend)},{node_queue(node)}"
        argv = [sys.executable, "-m", "celery", "-A", "worker.node.app", "worker", "-P", "threads",
                "-c", str(concurrency), "-n", node, "-Q", queues, "-E", "--without-mingle",
                "--without-gossip", "--loglevel", "INFO"]
        commands.append((argv, env))
    return commands


def _supervise(procs: dict[str, subprocess.Popen], last: dict[str, subprocess.Popen] | None = None) -> int:
    """Wait for the children (started in sessions of their own, so a terminal's Ctrl-C reaches only us). The first
    SIGINT/SIGTERM stops them softly (SIGTERM: Celery's warm shutdown, where running fine-tunes checkpoint and go
    back on a queue), a second one at once (SIGQUIT: Celery's cold shutdown); when one child dies, the others are
    stopped softly. `last` (the embedded Redis) is stopped only once the others have exited, since their warm
    shutdown still writes to it. Each step is said on stderr, so the log shows the order. Returns 0 when every
    child stopped cleanly or on a signal it was sent (uvicorn re-raises SIGTERM on itself once it has shut down
    gracefully), else the largest exit code."""
    # Stops asked for (signals received, or a child's death); the loop acts on them, since a handler that printed
    # could interrupt a print of the loop's own.
    asked: list[int] = []
    acted = 0
    sent: dict[str, set[int]] = {}  # the signals each child was sent

    def say(message: str) -> None:
        print(f"xpu-jobs: {message}", file=sys.stderr, flush=True)

    def stop(cold: bool) -> None:
        running = [name for name, p in procs.items() if p.poll() is None]
        say(f"stopping {', '.join(running)} " + ("at once (cold shutdown)" if cold else
                                                  "softly (warm shutdown; again to stop at once)"))
        for name in running:
            signum = signal.SIGQUIT if cold else signal.SIGTERM
            sent.setdefault(name, set()).add(signum)
            procs[name].send_signal(signum)

    def code(name: str) -> int:
        returncode = procs[name].returncode
        return 0 if -returncode in sent.get(name, ()) else abs(returncode)

    signal.signal(signal.SIGTERM, lambda signum, _: asked.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _: asked.append(signum))
    ended: set[str] = set()
    while len(ended) < len(procs):
        if acted < min(len(asked), 2):
            acted = min(len(asked), 2)
            stop(cold=acted == 2)
        for name, p in procs.items():
            if p.poll() is None or name in ended:
                continue
            ended.add(name)
            if asked:
                say(f"{name} stopped" if code(name) == 0 else f"{name} exited with code {p.returncode}")
            else:
                say(f"{name} exited with code {p.returncode}; stopping the rest")
                asked.append(0)
        time.sleep(0.1)
    for name, p in (last or {}).items():
        say(f"stopping {name}")
        p.terminate()
        p.wait(30)
        say(f"{name} stopped")
    return max(code(name) for name in procs)


def cmd_worker(args: argparse.Namespace) -> int:
    try:
        commands = worker_commands(args, dict(os.environ))
    except PinningError as exc:
        print(f"xpu-jobs worker: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for argv, env in commands:
            pinned = {k: v for k, v in env.items() if k.startswith(("ZE_", "CUDA_", "XPUJOBS_NODE", "XPUJOBS_DEVICE"))}
            print(json.dumps({"argv": argv, "env": pinned}))
        return 0
    if len(commands) == 1:
        argv, env = commands[0]
        os.execvpe(argv[0], argv, env)
    return _supervise({env["XPUJOBS_NODE_NAME"]: subprocess.Popen(argv, env=env, start_new_session=True)
                       for argv, env in commands})


def cmd_api(args: argparse.Namespace) -> int:
    import tempfile

    import uvicorn

    from contract.settings import Settings

    # The API processes count their requests in files here, summed at each scrape of /metrics. Files of a
    # previous run would add to this one's counters: start from an empty directory.
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics_dir:
        Path(metrics_dir).mkdir(parents=True, exist_ok=True)
        for stale in Path(metrics_dir).glob("*.db"):
            stale.unlink()
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="xpujobs-api-metrics-")
    workers = args.workers or Settings().api_workers
    if workers > 1:
        os.environ[API_MASTER_VARIABLE] = str(os.getpid())
    uvicorn.run("worker.cli:api_app", factory=True, host=args.host, port=args.port, log_level="info",
                workers=workers)
    return 0


# Set for the API's worker processes to the pid of their uvicorn master.
API_MASTER_VARIABLE = "XPUJOBS_API_MASTER_PID"


def api_app():
    """The API for uvicorn. A worker process of a master that died (SIGKILL leaves them running, still serving
    the port, so a restart fails on it) stops itself: softly, then for good after a grace period."""
    from api.main import create_app

    master = os.environ.get(API_MASTER_VARIABLE)
    if master:
        def watch() -> None:
            while os.getppid() == int(master):
                time.sleep(1)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
            os._exit(1)

        threading.Thread(target=watch, name="xpujobs-master-watch", daemon=True).start()
    return create_app()


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return False
        except OSError:
            return True


def cmd_up(args: argparse.Namespace) -> int:
    from contract.settings import Settings
    from worker.node.redis_server import start_redis

    data_dir = args.data_dir.resolve()
    env = dict(os.environ)
    env.setdefault("XPUJOBS_ARTIFACT_ROOT", str(data_dir / "artifacts"))
    env.setdefault("XPUJOBS_MODELS_ROOT", str(data_dir / "models"))
    settings = Settings(**{k.removeprefix("XPUJOBS_").lower(): v for k, v in env.items()
                           if k in ("XPUJOBS_ARTIFACT_ROOT", "XPUJOBS_MODELS_ROOT")})
    if not settings.api_keys:
        env.setdefault("XPUJOBS_OPEN_MODE", "true")  # keys configured: they are asked for
    embedded = not settings.redis_url and not env.get("XPUJOBS_REDIS_URL")
    ports = [(args.port, args.host, f"the API's port {args.port}", "--port")]
    if embedded:
        ports.append((args.redis_port, "127.0.0.1", f"the embedded Redis's port {args.redis_port}", "--redis-port"))
    for port, host, what, option in ports:
        if _port_in_use(host, port):
            print(f"xpu-jobs up: {what} on {host} is already in use (another xpu-jobs, or another server?); stop "
                  f"it or choose another with {option}", file=sys.stderr)
            return 1
    last = {}
    if embedded:
        try:
            last["Redis"] = start_redis(args.redis_port, data_dir / "redis")
        except (RuntimeError, OSError) as exc:
            print(f"xpu-jobs up: the embedded Redis did not start: {exc}", file=sys.stderr)
            return 1
        env["XPUJOBS_REDIS_URL"] = f"redis://127.0.0.1:{args.redis_port}/0"
        print(f"xpu-jobs up: embedded Redis on port {args.redis_port}, AOF in {data_dir / 'redis'}")
    if "demo-tiny" in settings.base_models and not (settings.models_root / "demo-tiny" / "config.json").exists():
        print("xpu-jobs up: building the demo model (random weights, local tokenizer: not a real model)")
        subprocess.run([sys.executable, "-m", "worker.cli", "demo-model",
                        "--out", str(settings.models_root / "demo-tiny")], env=env, check=True)
    backend = args.backend or env.get("XPUJOBS_DEVICE_BACKEND") or settings.device_backend
    groups = args.devices
    if backend == "auto" or groups is None:
        detected, count = probe_backend(backend)
        backend = detected
        if groups is None and detected != "cpu":
            groups = [str(i) for i in range(count)]
    worker_argv = [sys.executable, "-m", "worker.cli", "worker", "--backend", backend]
    for group in groups or []:
        worker_argv += ["--devices", group]
    procs = {"the workers": subprocess.Popen(worker_argv, env=env, start_new_session=True),
             "the API": subprocess.Popen([sys.executable, "-m", "worker.cli", "api", "--host", args.host,
                                          "--port", str(args.port)], env=env, start_new_session=True)}
    access = (f"API keys required ({len(settings.api_keys)} configured)" if settings.api_keys else
              "open mode: no API key needed" if env["XPUJOBS_OPEN_MODE"].lower() in ("1", "true", "yes", "on")
              else "no API keys configured and open mode off: every call is refused")
    print(f"xpu-jobs up: API on http://{args.host}:{args.port}/v1 ({access}); Ctrl-C stops softly (running "
          "fine-tunes checkpoint), twice at once")
    return _supervise(procs, last)


def cmd_demo_model(args: argparse.Namespace) -> int:
    from contract.settings import Settings
    from worker.demo_model import build_demo_model

    out = args.out or Settings().models_root / "demo-tiny"
    print(build_demo_model(out))
    return 0


def cmd_devices(_args: argparse.Namespace) -> int:
    from contract.settings import Settings
    from worker.node import devices

    backend = devices.detect_backend(Settings().device_backend)
    print(json.dumps({"backend": backend, "devices": devices.describe(backend)}, indent=2))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from contract.settings import Settings
    from worker import doctor

    preference = args.backend or Settings().device_backend
    if args.versions:
        return doctor.print_versions(gpu=preference != "cpu")
    backend = preference if preference != "auto" else probe_backend("auto")[0]
    return doctor.report(doctor.run_checks(backend, args.devices), args.json)


def cmd_health(args: argparse.Namespace) -> int:
    if args.api:
        import httpx

        try:
            return 0 if httpx.get(args.api.rstrip("/") + "/health", timeout=5).status_code == 200 else 1
        except httpx.HTTPError:
            return 1
    from contract.redis_conn import sync_client
    from contract.registry import live_workers
    from contract.settings import Settings

    nodes = [w["node"] for w in live_workers(sync_client(Settings()))]
    return 0 if any(n.startswith(args.worker) for n in nodes) else 1


COMMANDS = {"worker": cmd_worker, "api": cmd_api, "up": cmd_up, "demo-model": cmd_demo_model,
            "devices": cmd_devices, "doctor": cmd_doctor, "health": cmd_health}


# The users' commands (client/cli.py: files, fine-tune, batch, models, workers), through the REST API.
CLIENT_COMMANDS = ("files", "fine-tune", "batch", "models", "workers")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if next((a for a in argv if a in COMMANDS or a in CLIENT_COMMANDS), None) in CLIENT_COMMANDS:
        from client.cli import main as client_main

        return client_main(argv)
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
