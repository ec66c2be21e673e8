#!/usr/bin/env bash
# src/bench/RESULTS.md's "On a real engine: prefix affinity": three real llama.cpp servers (2 slots
# each, RAM prompt cache off) behind real HAProxy, 3 closed-loop streaming clients whose prompts
# share one of six ~800-token openings, 30 s per row (LLMLC_PREFIX_SECS): the shipped
# deploy/haproxy/haproxy-prefix.cfg against balance leastconn, interleaved, fresh servers per row;
# then both once with llama.cpp's default RAM cache. Prints the table.
# Needs Debian's haproxy (tests/run.sh installs it); installs llama-server itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(tests/llamacpp/install.sh)"
export LLAMA_SERVER LLAMACPP_MODEL PATH="$PATH:/usr/sbin"
command -v haproxy >/dev/null || { echo "needs haproxy (apt-get install haproxy, or run tests/run.sh once)" >&2; exit 1; }
exec cargo test --release -q --test llamacpp_prefix -- --ignored --nocapture --exact real_engine_prefix_table
