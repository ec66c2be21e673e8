#!/usr/bin/env bash
# Run one real vLLM server (CPU) on 127.0.0.1:PORT with the tests' tiny model, in the foreground:
#   tests/vllm/serve.sh PORT KV_BYTES MAX_NUM_SEQS CORE [more vLLM arguments...]
# KV_BYTES   KV cache size (--kv-cache-memory-bytes); without one vLLM sizes it at ~21 GiB. The tiny
#            model takes 2 KiB per token: 8 MiB = 4096 tokens = 32 blocks of 128 (the CPU block size).
# MAX_NUM_SEQS  requests decoded at once; the rest wait (vllm:num_requests_waiting).
# CORE       the CPU core the worker's OpenMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND): two
#            servers on cores 0 and 1 do not share one.
# The served model name is tiny-llama (VLLM_SERVED_MODEL_NAME overrides). --max-model-len defaults to
# what one request can hold, (blocks - 1) * 128 (vLLM keeps a null block), at most the model's 8192:
# vLLM refuses to start when one request of max-model-len cannot fit. A --max-model-len after CORE
# wins. --enforce-eager always: starts in ~30 s, needs no compiler. Ready when GET /v1/models
# answers; SIGTERM stops it and its engine processes.
# Needs tests/vllm/install.sh first (VLLM_PYTHON and VLLM_MODEL override the paths it uses).
# State (sockets, caches) goes under target/vllm/run/PORT, emptied at each start.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
if [ $# -lt 4 ]; then
  sed -n '2,15s/^# \{0,1\}//p' "$0" >&2
  exit 2
fi
port="$1" kv="$2" seqs="$3" core="$4"
shift 4
python="${VLLM_PYTHON:-$root/target/vllm-venv/bin/python}"
model="${VLLM_MODEL:-$root/target/vllm/model}"
[ -x "$python" ] && [ -s "$model/config.json" ] || { echo "run tests/vllm/install.sh first" >&2; exit 1; }

# Tokens one request can have in the KV cache, in whole 128-token blocks, at most the model's context.
max_len="$("$python" - "$model/config.json" "$kv" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
heads = c["num_attention_heads"]
head_dim = c.get("head_dim") or c["hidden_size"] // heads
elt = {"float32": 4}.get(c.get("dtype") or c.get("torch_dtype"), 2)
per_token = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim * elt
# One block is vLLM's null block: a request can use all but one.
print(min(c["max_position_embeddings"], (int(sys.argv[2]) // per_token // 128 - 1) * 128))
EOF
)"
[ "$max_len" -gt 0 ] || { echo "KV_BYTES $kv holds less than two 128-token blocks" >&2; exit 2; }

run="$root/target/vllm/run/$port"
rm -rf "$run"
mkdir -p "$run/tmp" "$run/cache"
export VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  HF_HOME="$run/cache/hf" VLLM_CACHE_ROOT="$run/cache/vllm" XDG_CACHE_HOME="$run/cache" \
  TORCHINDUCTOR_CACHE_DIR="$run/cache/inductor" TRITON_CACHE_DIR="$run/cache/triton" \
  NUMBA_CACHE_DIR="$run/cache/numba" VLLM_CONFIG_ROOT="$run/config" \
  VLLM_RPC_BASE_PATH="$run/tmp" TMPDIR="$run/tmp" \
  VLLM_CPU_OMP_THREADS_BIND="$core"

exec "$python" -m vllm.entrypoints.openai.api_server \
  --model "$model" --served-model-name "${VLLM_SERVED_MODEL_NAME:-tiny-llama}" \
  --host 127.0.0.1 --port "$port" \
  --kv-cache-memory-bytes "$kv" --max-num-seqs "$seqs" --max-model-len "$max_len" \
  --enforce-eager "$@"
