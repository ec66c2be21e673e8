#!/usr/bin/env bash
# src/bench/RESULTS.md, "Real vLLM": two real vLLM servers that differ in KV memory only (64 and
# 8 MiB, --max-num-seqs 8) behind a real HAProxy (balance leastconn), eight closed-loop streaming
# clients with ~1,500-token prompts, 256 tokens out, 15 s per row (LLMLC_COMPARE_SECS): a sweep of
# static weights, then the controller. Prints the table.
# Needs Debian's haproxy (tests/run.sh installs it); installs vLLM itself (~3 GB the first time).
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(tests/vllm/install.sh)"
export VLLM_PYTHON VLLM_MODEL PATH="$PATH:/usr/sbin"
command -v haproxy >/dev/null || { echo "needs haproxy (apt-get install haproxy, or run tests/run.sh once)" >&2; exit 1; }
exec cargo test --release -q --test vllm_engine -- --ignored --nocapture --exact memory_only_pair_against_a_sweep_of_static_ratios
