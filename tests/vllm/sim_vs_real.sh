#!/usr/bin/env bash
# src/bench/RESULTS.md, "The simulator against real vLLM": per case a real vLLM server (32 MiB of
# KV, --max-num-seqs N) is measured (time per token at 1..N streams, prompt cost), a simulated
# vLLM server is priced by it, and the same seeded open-loop load runs on real, sim, real again;
# prints TTFT percentiles and mean queues, fails if the simulator is more than 25% from the real
# runs' mean. LLMLC_FIDELITY_CASES=seqs:load,... (default 1:0.6,4:0.6), LLMLC_FIDELITY_SECS,
# LLMLC_FIDELITY_SEED change the run. Installs vLLM itself (~3 GB the first time).
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(tests/vllm/install.sh)"
export VLLM_PYTHON VLLM_MODEL
exec cargo test --release -q --test vllm_fidelity -- --ignored --nocapture --exact the_simulator_against_a_real_vllm_server
