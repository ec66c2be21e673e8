#!/usr/bin/env bash
# src/bench/RESULTS.md, "The picker behind real Envoy and HAProxy (issue 42)": the three real vLLM
# servers of prefix.sh (8 MiB of KV, --max-num-seqs 4), the controller serving the endpoint picker,
# and five ways in: Envoy asking the picker over ext_proc (deploy/envoy/envoy-epp.yaml), Envoy's
# ring hash with the client's group as its key and its least-request cluster
# (envoy-eds-ring-hash.yaml), HAProxy asking the picker over SPOE (haproxy-spoe.cfg) and HAProxy's
# prefix hash on the body (haproxy-prefix.cfg). 3 closed-loop streaming clients whose prompts share
# one of eight ~700-token openings, 30 s per row (LLMLC_PREFIX_SECS), interleaved forwards and
# backwards. Prints the table. Installs vLLM itself (~3 GB the first time).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PATH:/usr/sbin"
eval "$(tests/vllm/install.sh)"
export VLLM_PYTHON VLLM_MODEL
exec cargo test --release -q --test vllm_prefix -- --ignored --nocapture --exact real_vllm_doors_table
