#!/usr/bin/env bash
# The two entry points of the README. Each installs what is missing on first use.
#   ./run.sh serve [disagg serve flags]   start router + prefill worker + decode worker on the default model
#   ./run.sh test  [pytest args]          run the test suite (with no pytest paths: then the neuron suite
#                                         again under NxDI's transformers release, in a second virtualenv)
# Anything else is passed to the `disagg` CLI inside the project's virtualenv (the base package only,
# as for serve): ./run.sh generate "Hello"
set -euo pipefail
cd "$(dirname "$0")"

VENV="${DISAGG_VENV:-.venv}"
# NxDI 0.8/0.9 pin transformers 4.57 (NxDI itself is not on PyPI): the router, the
# neuron workers (on the stand-in) and the neuron tests run there too.
NXDI_VENV="${DISAGG_NXDI_VENV:-.venv-nxdi-transformers}"
NXDI_TRANSFORMERS="${DISAGG_NXDI_TRANSFORMERS:-4.57.6}"
NXDI_TESTS=(tests/test_neuron*.py tests/test_detokenizer.py tests/test_validation.py)
PY="${PYTHON:-python3}"
# torch-neuronx pins its own torch; pyproject keeps a range, and this pin is what
# a CPU machine installs first so that the range is met without a CUDA download.
TORCH_VERSION="${DISAGG_TORCH_VERSION:-2.13.0}"

# installed VENV EXTRAS: the project is installed there with these extras (or with the test extra,
# which holds the base package), since pyproject.toml last changed.
installed() {
  local venv="$1" extras="$2" stamp
  local stamps=("$venv/.installed-${extras:-base}")
  [ -n "$extras" ] || stamps+=("$venv/.installed-test")
  for stamp in "${stamps[@]}"; do
    if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
      return 0
    fi
  done
  return 1
}

# ensure_env VENV EXTRAS [PIP REQUIREMENTS...]: the virtualenv with torch first, then the project.
ensure_env() {
  local venv="$1" extras="$2"
  shift 2
  local stamp="$venv/.installed-${extras:-base}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "==> creating $venv" >&2
    "$PY" -m venv "$venv"
  fi
  if ! installed "$venv" "$extras"; then
    echo "==> installing torch==$TORCH_VERSION and disagg${extras:+[$extras]} $* into $venv (first run only)" >&2
    # Compiled at install (not --no-compile, 39 s faster here): where PYTHONDONTWRITEBYTECODE is set, as on these
    # machines, nothing imported is ever cached, and every test's process compiled torch again (the suite 1.5x longer).
    "$venv/bin/pip" install --quiet --disable-pip-version-check "torch==$TORCH_VERSION"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}" "$@"
    touch "$stamp"
  fi
}

# Pytest arguments that name tests (not options): then only those run, in the main virtualenv.
names_tests() {
  local arg
  for arg in "$@"; do
    case "$arg" in -*) ;; *) [ -e "${arg%%::*}" ] && return 0 ;; esac
  done
  return 1
}

command="${1:-serve}"
[ $# -gt 0 ] && shift
case "$command" in
  serve)
    ensure_env "$VENV" ""
    exec "$VENV/bin/disagg" serve "$@"
    ;;
  test)
    ensure_env "$VENV" "test"
    if names_tests "$@"; then
      exec "$VENV/bin/python" -m pytest "$@"
    fi
    # The neuron suite's virtualenv is installed meanwhile (a pip install of a minute or two, in the core the
    # tests, each waiting on its processes much of the time, leave idle), its output kept for a failure.
    nxdi_log="$(mktemp)"
    ensure_env "$NXDI_VENV" "test" "transformers==$NXDI_TRANSFORMERS" >"$nxdi_log" 2>&1 &
    nxdi_install=$!
    status=0
    "$VENV/bin/python" -m pytest "$@" || status=$?
    if ! wait "$nxdi_install"; then
      cat "$nxdi_log" >&2
      echo "==> installing $NXDI_VENV failed" >&2
      exit 1
    fi
    rm -f "$nxdi_log"
    [ "$status" -eq 0 ] || exit "$status"
    echo "==> the neuron suite under transformers $NXDI_TRANSFORMERS (NxDI's pin), in $NXDI_VENV" >&2
    exec "$NXDI_VENV/bin/python" -m pytest "$@" "${NXDI_TESTS[@]}"
    ;;
  *)
    ensure_env "$VENV" ""  # the CLI needs the base package only; the test extra is for `test`
    exec "$VENV/bin/disagg" "$command" "$@"
    ;;
esac
