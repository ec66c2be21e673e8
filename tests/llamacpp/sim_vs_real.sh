#!/usr/bin/env bash
# The simulator against a real llama-server (src/bench/RESULTS.md): the same seeded open-loop load
# on a real server and on the simulated one (profile llamacpp-cpu, llama.cpp metrics) at 1 and 4
# slots; prints TTFT percentiles and mean queues, fails if any differs by more than 25%.
# LLMLC_FIDELITY_CASES=slots:rate,... LLMLC_FIDELITY_SECS, LLMLC_FIDELITY_SEED change the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(tests/llamacpp/install.sh)"
export LLAMA_SERVER LLAMACPP_MODEL
exec cargo test --release -q --test llamacpp_engine -- --ignored --nocapture --exact the_simulator_against_a_real_llama_server
