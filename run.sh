#!/usr/bin/env bash
# The two entry points of the README. Each installs what is missing on first use.
#   ./run.sh serve [disagg serve flags]   start router + prefill worker + decode worker on the default model
#   ./run.sh test  [pytest args]          run the test suite
# Anything else is passed to the `disagg` CLI inside the project's virtualenv: ./run.sh generate "Hello"
set -euo pipefail
cd "$(dirname "$0")"

VENV="${DISAGG_VENV:-.venv}"
PY="${PYTHON:-python3}"
# torch-neuronx pins its own torch; pyproject keeps a range, and this pin is what
# a CPU machine installs first so that the range is met without a CUDA download.
TORCH_VERSION="${DISAGG_TORCH_VERSION:-2.13.0}"

ensure_env() {
  local extras="$1" stamp="$VENV/.installed-$1"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV" >&2
    "$PY" -m venv "$VENV"
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "==> installing torch==$TORCH_VERSION and disagg[$extras] (first run only)" >&2
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==$TORCH_VERSION"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[$extras]"
    touch "$stamp"
  fi
}

command="${1:-serve}"
[ $# -gt 0 ] && shift
case "$command" in
  serve)
    ensure_env "test"
    exec "$VENV/bin/disagg" serve "$@"
    ;;
  test)
    ensure_env "test"
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    ensure_env "test"
    exec "$VENV/bin/disagg" "$command" "$@"
    ;;
esac
