#!/usr/bin/env bash
# src/bench/RESULTS.md, "Prefix caching on real vLLM": three real vLLM servers (8 MiB of KV,
# --max-num-seqs 4) behind real HAProxy, 3 closed-loop streaming clients whose prompts share one
# of eight ~700-token openings, 30 s per row (LLMLC_PREFIX_SECS): the shipped
# deploy/haproxy/haproxy-prefix.cfg (body key on) against its balance leastconn backend,
# interleaved, twice. Prints the table.
# Needs Debian's haproxy (tests/run.sh installs it); installs vLLM itself (~3 GB the first time).
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(tests/vllm/install.sh)"
export VLLM_PYTHON VLLM_MODEL PATH="$PATH:/usr/sbin"
command -v haproxy >/dev/null || { echo "needs haproxy (apt-get install haproxy, or run tests/run.sh once)" >&2; exit 1; }
exec cargo test --release -q --test vllm_prefix -- --ignored --nocapture --exact real_vllm_prefix_table
