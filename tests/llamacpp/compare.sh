#!/usr/bin/env bash
# docs/engines.md, "On a real engine": two real llama.cpp servers (4 slots and 1) behind a real HAProxy
# (balance leastconn), 5 closed-loop streaming clients, 128 tokens, 20 s per row (LLMLC_COMPARE_SECS):
# equal weights, hand-set 4:1, then the controller. Prints the table.
# Needs Debian's haproxy (tests/run.sh installs it); installs llama-server itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(tests/llamacpp/install.sh)"
export LLAMA_SERVER LLAMACPP_MODEL PATH="$PATH:/usr/sbin"
command -v haproxy >/dev/null || { echo "needs haproxy (apt-get install haproxy, or run tests/run.sh once)" >&2; exit 1; }
exec cargo test --release -q --test llamacpp_engine -- --ignored --nocapture --exact real_engine_table
