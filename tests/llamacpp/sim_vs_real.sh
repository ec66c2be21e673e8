#!/usr/bin/env bash
# The simulator against a real llama-server (src/bench/RESULTS.md): each case's real server is
# measured first (step table, prompt cost), then the same seeded open-loop load runs on it, on the
# simulated server priced by it (profile llamacpp-cpu, llama.cpp metrics), and on it again, at 1 and
# 4 slots; prints TTFT percentiles and mean queues, fails if the simulator is more than 25% from
# the two real runs' mean. LLMLC_FIDELITY_CASES=slots:load,... (load: a fraction of the measured
# capacity, default 1:0.6,4:0.6), LLMLC_FIDELITY_SECS, LLMLC_FIDELITY_SEED change the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(tests/llamacpp/install.sh)"
export LLAMA_SERVER LLAMACPP_MODEL
exec cargo test --release -q --test llamacpp_engine -- --ignored --nocapture --exact the_simulator_against_a_real_llama_server
