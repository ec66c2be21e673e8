//! `pools[].picker`: which doors a pool's endpoint picker is served on, and how fresh its view of
//! the engines is.
//!
//! ```yaml
//! picker:
//!   ext_proc: 0.0.0.0:9002     # Envoy / Gateway API Inference Extension endpoint-picker protocol
//!   health: 0.0.0.0:9003       # gRPC health of the ext_proc door (liveness, readiness)
//!   http: 0.0.0.0:9004         # sideband: POST the body's first bytes, answer ip:port or `fallback`
//!   spoe: 0.0.0.0:9005         # HAProxy SPOE agent: message `pick` sets txn vars srv, addr, id
//!   refresh: 100ms             # direct reads of the members' /metrics for the picker
//!   tls: { cert_file: /etc/tls/tls.crt, key_file: /etc/tls/tls.key }   # optional, ext_proc and health
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

/// One pool's picker.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PickerConfig {
    /// Envoy's `ext_proc` gRPC service speaking the endpoint-picker protocol (plaintext HTTP/2).
    /// One pool per address: the protocol does not name the pool.
    #[serde(default)]
    pub ext_proc: Option<SocketAddr>,
    /// gRPC health service for the `ext_proc` door (Envoy's gRPC health check, Kubernetes probes).
    #[serde(default)]
    pub health: Option<SocketAddr>,
    /// Serve `ext_proc` (and `health`) over TLS with this certificate and key (PEM files).
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// The sideband door: `POST /pick/{pool}`. Pools may share an address.
    #[serde(default)]
    pub http: Option<SocketAddr>,
    /// HAProxy's SPOE agent (SPOP 2.0). Pools may share an address (the `pool` argument names it).
    #[serde(default)]
    pub spoe: Option<SocketAddr>,
    /// How often the members' metrics pages are read for the picker, beside the ratio cycle's
    /// own source (which may be a Prometheus tens of seconds behind).
    #[serde(default = "default_refresh", with = "humantime_serde")]
    pub refresh: Duration,
    /// A picked request whose end the door never hears of is released after this long.
    #[serde(default = "default_max_open", with = "humantime_serde")]
    pub max_open: Duration,
    /// Endpoints listed after the pick, as fallbacks in order (the ext_proc header's tail).
    #[serde(default = "default_fallbacks")]
    pub fallbacks: usize,
    /// The picker's settings by name (`affinity`, `saturation_tokens`, ...; see
    /// `llm_lc_balance::endpoint::picker::Settings`). Unnamed ones keep their defaults.
    #[serde(default)]
    pub settings: BTreeMap<String, f64>,
}

/// A certificate chain and its private key, PEM.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    pub cert_file: std::path::PathBuf,
    pub key_file: std::path::PathBuf,
}

fn default_refresh() -> Duration {
    Duration::from_millis(100)
}

fn default_max_open() -> Duration {
    Duration::from_secs(600)
}

fn default_fallbacks() -> usize {
    2
}

/// The shortest refresh: a CPU engine serves its page in tens of milliseconds, and a shorter
/// period only queues reads behind each other.
const MIN_REFRESH: Duration = Duration::from_millis(20);

impl PickerConfig {
    /// The picker's settings with this config's overrides.
    pub fn settings(&self) -> Result<llm_lc_balance::endpoint::picker::Settings, String> {
        let mut s = llm_lc_balance::endpoint::picker::Settings::default();
        for (name, value) in &self.settings {
            s.set(&format!("{name}={value}"))?;
        }
        Ok(s)
    }

    /// Problems, as (field under `picker.`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        if self.ext_proc.is_none() && self.http.is_none() && self.spoe.is_none() {
            errs.push(("".into(), "names no door: give `ext_proc`, `spoe` or `http`".into()));
        }
        if self.tls.is_some() && self.ext_proc.is_none() {
            errs.push(("tls".into(), "is for the ext_proc door: give `ext_proc` too".into()));
        }
        if self.health.is_some() && self.ext_proc.is_none() {
            errs.push(("health".into(), "is the ext_proc door's health service: give `ext_proc` too".into()));
        }
        if self.refresh < MIN_REFRESH || self.refresh > Duration::from_secs(60) {
            errs.push(("refresh".into(), "must be between 20ms and 60s".into()));
        }
        if self.max_open < Duration::from_secs(1) {
            errs.push(("max_open".into(), "must be at least 1s".into()));
        }
        if self.fallbacks > 16 {
            errs.push(("fallbacks".into(), "must be at most 16".into()));
        }
        if let Err(e) = self.settings() {
            errs.push(("settings".into(), e));
        }
        errs
    }
}
