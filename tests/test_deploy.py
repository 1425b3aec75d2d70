"""The deployment files (docker-compose.yml, Dockerfile.xpu, Dockerfile.api, .env.example, .dockerignore),
checked without a Docker engine.

Every command our images run is parsed with the project's own CLI parser; every worker gets its own, disjoint
device group through `--devices` and never an exported mask; the launcher accepts each worker's environment as
compose would give it. Compose schema validation and hadolint run in .ci/check_deploy.sh.
"""

import fnmatch
import json
import os
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from contract.queues import make_celery
from contract.settings import Settings
from worker.cli import build_parser, worker_commands
from worker.node.devices import normalise_mask

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_TEXT = (ROOT / "docker-compose.yml").read_text()
DOCKERFILES = {name: (ROOT / name).read_text() for name in ("Dockerfile.xpu", "Dockerfile.api")}
THIRD_PARTY = {"redis", "flower", "prometheus"}
MASK_VARIABLES = ("ZE_AFFINITY_MASK", "CUDA_VISIBLE_DEVICES", "ONEAPI_DEVICE_SELECTOR")
# Compose's own variables, documented in .env.example but never interpolated in docker-compose.yml.
COMPOSE_OWN = {"COMPOSE_PROJECT_NAME", "COMPOSE_PROFILES"}
RENDER_GID_FOR_TESTS = "993"


# --- .env.example ---------------------------------------------------------------------------------------

def _read_env_example() -> tuple[dict[str, str], dict[str, list[str]]]:
    """(active NAME=value lines, every documented NAME -> values, commented-out lines included)."""
    active, documented = {}, {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        m = re.match(r"^(#\s*)?([A-Z][A-Z0-9_]*)=(.*)$", line)
        if not m:
            continue
        value = m.group(3).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        documented.setdefault(m.group(2), []).append(value)
        if not m.group(1):
            active[m.group(2)] = value
    return active, documented


ENV_ACTIVE, ENV_DOCUMENTED = _read_env_example()


# --- compose, interpolated as docker compose would with .env.example (and RENDER_GID set) ---------------

_VARIABLE = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^{}]*))?\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: dict[str, str]) -> str:
    def substitute(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg, value = m.group("op"), m.group("arg") or "", env.get(name)
        if op is None:
            return value or ""
        if op in (":-", "-"):
            return value if (value if op == ":-" else value is not None) else arg
        if op in (":?", "?"):
            if not (value if op == ":?" else value is not None):
                raise KeyError(f"{name}: {arg}")
            return value
        return arg if (value if op == ":+" else value is not None) else ""
    return _VARIABLE.sub(substitute, text)


def _resolve(node, env):
    if isinstance(node, dict):
        return {k: _resolve(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


RAW = yaml.safe_load(COMPOSE_TEXT)
COMPOSE = _resolve(RAW, {**ENV_ACTIVE, "RENDER_GID": RENDER_GID_FOR_TESTS})
SERVICES = COMPOSE["services"]
OURS = {name: s for name, s in SERVICES.items() if "build" in s}
WORKERS = {name: s for name, s in OURS.items() if s["command"][:2] == ["xpu-jobs", "worker"]}


def environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict((item.split("=", 1) + [None])[:2] for item in env)
    return {k: (None if v is None else str(v)) for k, v in env.items()}


def parse_cli(argv: list[str], where: str):
    assert argv and argv[0] == "xpu-jobs", f"{where}: {argv!r} does not run the xpu-jobs CLI"
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{where}: {shlex.join(argv)} is not a valid xpu-jobs invocation")


def healthcheck_argv(test) -> list[str] | None:
    """The argv of a healthcheck test, or None for one that does not run a single command."""
    if isinstance(test, str):
        return shlex.split(test)
    if test[0] == "CMD":
        return list(test[1:])
    if test[0] == "CMD-SHELL":
        return shlex.split(test[1])
    return None


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def overlap(a: str, b: str) -> bool:
    """Device ids overlap when equal, or when one is a tile of the other (0 and 0.1)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


# --- services and their commands --------------------------------------------------------------------------

def test_every_service_is_ours_or_a_known_third_party_image():
    assert set(SERVICES) - set(OURS) == THIRD_PARTY
    assert {"api", *WORKERS} <= set(OURS)
    for name, service in OURS.items():
        assert service["build"]["dockerfile"] in DOCKERFILES, name
        assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name


@pytest.mark.parametrize("name", sorted(OURS))
def test_command_is_a_valid_invocation_of_our_cli(name):
    command = OURS[name]["command"]
    assert isinstance(command, list), f"{name}: use the list form, so no shell re-splits the arguments"
    parse_cli(command, name)


@pytest.mark.parametrize("name", sorted(OURS))
def test_healthcheck_runs_our_cli(name):
    service = OURS[name]
    if service.get("restart") == "no":
        return  # one-shot job
    argv = healthcheck_argv(service["healthcheck"]["test"])
    args = parse_cli(argv, f"{name} healthcheck")
    assert args.command == "health"
    if name in WORKERS:
        node_prefix = parse_cli(service["command"], name).name
        # Exactly this container's node: <name>@<container hostname>, not every node whose name starts alike.
        assert args.worker == f"{node_prefix}@$(hostname)"
    else:
        assert args.api == "http://127.0.0.1:8000"


def test_there_are_workers_and_each_gets_one_distinct_device_group():
    assert WORKERS, "no worker service"
    seen: dict[str, str] = {}
    names = set()
    for name, service in WORKERS.items():
        args = parse_cli(service["command"], name)
        assert args.devices and len(args.devices) == 1, f"{name}: one worker service per device group"
        assert args.backend == "xpu", f"{name}: pin the backend, so a missing device fails instead of using CPU"
        assert not args.dry_run
        assert args.name not in names, f"{name}: node name {args.name!r} used twice"
        names.add(args.name)
        for device in normalise_mask(args.devices[0]).split(","):
            clash = [other for d, other in seen.items() if overlap(d, device)]
            assert not clash, f"{name}: device {device} is already given to {clash[0]}"
            seen[device] = name


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_worker_gets_devices_only_through_its_command(name):
    service = WORKERS[name]
    env = environment(service)
    for variable in MASK_VARIABLES:
        assert variable not in env, f"{name} exports {variable}"
    assert "env_file" not in service, f"{name}: an env_file could smuggle in a mask"
    for variable in MASK_VARIABLES:
        assert variable not in ENV_DOCUMENTED, f".env.example sets {variable}"
        assert not re.search(rf"^\s*(ENV|ARG)\s+{variable}\b", DOCKERFILES["Dockerfile.xpu"], re.M)


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_launcher_accepts_the_worker_as_compose_starts_it(name):
    service = WORKERS[name]
    args = parse_cli(service["command"], name)
    env = {k: v for k, v in environment(service).items() if v is not None}
    [(argv, child_env)] = worker_commands(args, env)
    assert child_env["ZE_AFFINITY_MASK"] == normalise_mask(args.devices[0])
    assert child_env["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] == "1"
    assert child_env["XPUJOBS_DEVICE_BACKEND"] == "xpu"
    assert argv[argv.index("-n") + 1].startswith(f"{args.name}@")


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_worker_container_can_reach_its_gpus_and_stop_softly(name):
    service = WORKERS[name]
    assert "/dev/dri:/dev/dri" in service["devices"]
    raw_groups = RAW["services"][name].get("group_add") or RAW["x-worker"]["group_add"]
    assert [g.startswith("${RENDER_GID") for g in raw_groups] == [True], "group_add must come from RENDER_GID"
    assert service["group_add"] == [RENDER_GID_FOR_TESTS]
    assert service["shm_size"]
    assert service.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert seconds(service["stop_grace_period"]) > 60, "must outlast a 60 s checkpoint in warm shutdown"
    assert service.get("init") is True
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "artifacts:/data/artifacts" in service["volumes"]
    assert COMPOSE["volumes"]["artifacts"]["name"]


def test_api_and_workers_share_the_artifact_volume_and_every_setting():
    for name in ["api", *WORKERS]:
        service = SERVICES[name]
        assert any(v.startswith("artifacts:/data/artifacts") for v in service["volumes"]), name
        env = environment(service)
        for field in Settings.model_fields:
            assert f"XPUJOBS_{field.upper()}" in env, f"{name} does not pass XPUJOBS_{field.upper()}"
        assert env["XPUJOBS_ARTIFACT_ROOT"] == "/data/artifacts"
        assert env["XPUJOBS_REDIS_URL"] == "redis://redis:6379/0"


def test_long_running_services_restart_and_have_healthchecks():
    for name, service in SERVICES.items():
        if service.get("restart") == "no":
            assert service.get("profiles"), f"{name}: a one-shot service belongs in a profile"
            continue
        assert service.get("restart") in ("always", "unless-stopped", "on-failure"), name
        assert service.get("healthcheck", {}).get("test"), name


def test_redis_is_durable():
    redis = SERVICES["redis"]
    command = redis["command"]
    pairs = {command[i]: command[i + 1] for i in range(1, len(command) - 1) if command[i].startswith("--")}
    assert command[0] == "redis-server"
    assert pairs["--appendonly"] == "yes"
    assert pairs["--appendfsync"] == "everysec"
    assert pairs["--maxmemory-policy"] == "noeviction"
    assert "--save" in command, "keep RDB snapshots next to the AOF"
    [data] = [v for v in redis["volumes"] if v.endswith(":/data")]
    assert data.split(":")[0] in COMPOSE["volumes"], "Redis data must live on a named volume"


def test_monitoring_profile():
    for name in ("flower", "prometheus"):
        assert SERVICES[name]["profiles"] == ["monitoring"]
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert "flower:5555" in targets


def test_flower_uses_the_workers_visibility_timeout():
    """Any consumer of the broker puts back unacked messages older than its own visibility timeout."""
    namespace: dict = {}
    exec((ROOT / "deploy/flower/xpujobs_celeryconfig.py").read_text(), namespace)
    app = make_celery(Settings(_env_file=None, redis_url="redis://redis:6379/0"))
    assert (namespace["broker_transport_options"]["visibility_timeout"]
            == app.conf.broker_transport_options["visibility_timeout"])
    assert "--config" in SERVICES["flower"]["command"]
    assert "xpujobs_celeryconfig" in SERVICES["flower"]["command"]


def test_bind_mounted_files_exist():
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).is_file(), f"{name} mounts missing {source}"


# --- .env.example -----------------------------------------------------------------------------------------

def compose_variables() -> set[str]:
    """Variables docker-compose.yml interpolates, and keys it passes through from the environment."""
    names = {m.group("name") or m.group("bare") for m in _VARIABLE.finditer(COMPOSE_TEXT) if m.group(0) != "$$"}
    names.discard(None)

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("environment", "args") and isinstance(value, dict):
                    names.update(k for k, v in value.items() if v is None)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)
    walk(RAW)
    return names


def test_env_example_documents_every_compose_variable_and_nothing_stale():
    used = compose_variables()
    documented = set(ENV_DOCUMENTED)
    assert not used - documented, f"undocumented in .env.example: {sorted(used - documented)}"
    settings = {f"XPUJOBS_{f.upper()}" for f in Settings.model_fields}
    stale = documented - used - settings - COMPOSE_OWN
    assert not stale, f".env.example documents variables nothing reads: {sorted(stale)}"
    duplicated = [n for n, values in ENV_DOCUMENTED.items() if len(values) > 1]
    assert not duplicated, f"documented twice: {duplicated}"


def test_env_example_values_are_the_compose_defaults():
    for m in _VARIABLE.finditer(COMPOSE_TEXT):
        name, op = m.group("name"), m.group("op")
        if name in ENV_ACTIVE and op in (":-", "-"):
            assert ENV_ACTIVE[name] == m.group("arg"), f"{name}: .env.example and docker-compose.yml disagree"
    assert "RENDER_GID" in ENV_ACTIVE and ENV_ACTIVE["RENDER_GID"] == "", "RENDER_GID has no safe default"


def test_env_example_documents_every_setting_with_its_default(monkeypatch):
    for variable in [v for v in os.environ if v.startswith("XPUJOBS_")]:
        monkeypatch.delenv(variable)
    defaults = Settings(_env_file=None)
    for field in Settings.model_fields:
        variable = f"XPUJOBS_{field.upper()}"
        assert variable in ENV_DOCUMENTED, f".env.example does not document {variable}"
        assert variable not in ENV_ACTIVE, f"{variable}: leave settings commented out so their defaults apply"
        [value] = ENV_DOCUMENTED[variable]
        monkeypatch.setenv(variable, value)
        documented = getattr(Settings(_env_file=None), field)
        monkeypatch.delenv(variable)
        assert documented == getattr(defaults, field), f"{variable}={value} is not the default"


# --- Dockerfiles and build context ------------------------------------------------------------------------

def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    lines = [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_worker_image_pins_match_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = dict(re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(.+)$", d).groups()
                for d in pyproject["project"]["optional-dependencies"]["worker"] if "==" in d)
    args = dict(re.match(r"(\w+)=(.*)", a).groups() for i, a in _instructions(DOCKERFILES["Dockerfile.xpu"])
                if i == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == pins["torch"]
    assert args["TRANSFORMERS_VERSION"] == pins["transformers"]


def test_worker_image_is_intels_current_stack():
    text = DOCKERFILES["Dockerfile.xpu"]
    instructions = _instructions(text)
    assert instructions[0] == ("FROM", "ubuntu:24.04")
    for package in ("libze-intel-gpu1", "libze1", "intel-opencl-icd"):
        assert package in text
    assert "--extra-index-url" in text and "https://download.pytorch.org/whl/${TORCH_BACKEND}" in text
    assert not [a for _, a in instructions if "intel-extension-for-pytorch" in a or "ipex" in a.lower()]
    assert "prefetch_kernels.py" in text and "KERNELS_CACHE" in text


def test_api_image_has_no_torch():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requirements = pyproject["project"]["dependencies"] + pyproject["project"]["optional-dependencies"]["api"]
    heavy = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "kernels")
    assert not [r for r in requirements if re.split(r"[\[<>=~! ;]", r)[0].lower() in heavy]
    runs = " ".join(a for i, a in _instructions(DOCKERFILES["Dockerfile.api"]) if i == "RUN")
    assert '".[api]"' in runs and "worker]" not in runs and "torch==" not in runs


@pytest.mark.parametrize("dockerfile", sorted(DOCKERFILES))
def test_image_runs_as_non_root_with_a_healthcheck_of_our_cli(dockerfile):
    instructions = _instructions(DOCKERFILES[dockerfile])
    users = [a for i, a in instructions if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    [health] = [a for i, a in instructions if i == "HEALTHCHECK"]
    argv = json.loads(health[health.index("CMD") + 3:].strip())
    if argv[:2] == ["/bin/sh", "-c"]:
        argv = shlex.split(argv[2])
    parse_cli(argv, f"{dockerfile} HEALTHCHECK")
    [cmd] = [a for i, a in instructions if i == "CMD"]
    parse_cli(json.loads(cmd), f"{dockerfile} CMD")


def _dockerignore_includes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    included = True
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        patterns = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        if any(fnmatch.fnmatchcase(c, p) for c in candidates for p in patterns):
            included = negate
    return included


def test_build_context_holds_what_the_dockerfiles_copy_and_nothing_private():
    for dockerfile, text in DOCKERFILES.items():
        for instruction, args in _instructions(text):
            if instruction != "COPY" or "--from=" in args:
                continue
            sources = [a for a in args.split() if not a.startswith("--")][:-1]
            for source in sources:
                assert _dockerignore_includes(source), f"{dockerfile}: .dockerignore leaves out {source}"
                assert (ROOT / source).exists(), f"{dockerfile}: no {source}"
    for private in (".env", ".venv/bin/python", ".git/config", "data/artifacts/x", "tests/test_deploy.py"):
        assert not _dockerignore_includes(private), private


def test_prometheus_scrapes_the_api_and_every_worker_and_the_dashboard_uses_real_metrics():
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    port = environment(next(iter(WORKERS.values())))["XPUJOBS_WORKER_METRICS_PORT"]
    assert {"api:8000", *(f"{name}:{port}" for name in WORKERS)} <= targets
    exported = (ROOT / "api/metrics.py").read_text() + (ROOT / "worker/node/metrics.py").read_text()
    dashboard = (ROOT / "deploy/grafana/xpu-jobs-dashboard.json").read_text()
    used = {re.sub(r"_(bucket|count|sum)$", "", m) for m in re.findall(r"xpujobs_\w+", dashboard)}
    assert used and all(f'"{name}' in exported for name in used), sorted(used)
