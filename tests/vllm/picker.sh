#!/usr/bin/env bash
# src/bench/RESULTS.md, "The endpoint picker on real vLLM": the three real vLLM servers of
# prefix.sh (8 MiB of KV, --max-num-seqs 4) behind the reference proxy with algorithm picker,
# prefix-affinity (body key) and weighted-least-request, 3 closed-loop streaming clients whose
# prompts share one of eight ~700-token openings, 30 s per row (LLMLC_PREFIX_SECS), interleaved
# forwards and backwards. Prints the table. Installs vLLM itself (~3 GB the first time).
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(tests/vllm/install.sh)"
export VLLM_PYTHON VLLM_MODEL
exec cargo test --release -q --test vllm_prefix -- --ignored --nocapture --exact real_vllm_picker_table
