//! What a user writes under `sources:`: a Prometheus/Thanos endpoint or direct scraping of the
//! members' metrics pages, with the checks that need no network. `config.rs` puts these into the
//! whole file and prefixes each problem with `sources.NAME.`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use llm_lc_adapters::{MemberId, SecretRef};
use serde::Deserialize;

use super::validate as v;

/// How a series is matched to a member: the value of `label`, optionally rewritten by `regex` ->
/// `replacement` (regex syntax of the `regex` crate; `$1` refers to a group), must equal the member id.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinConfig {
    #[serde(default = "default_join_label")]
    pub label: String,
    #[serde(default)]
    pub regex: Option<String>,
    #[serde(default)]
    pub replacement: Option<String>,
}

impl Default for JoinConfig {
    fn default() -> Self {
        JoinConfig { label: default_join_label(), regex: None, replacement: None }
    }
}

fn default_join_label() -> String {
    "instance".into()
}

impl JoinConfig {
    /// Problems as `(field, message)`, the field relative to `join`.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if self.label.is_empty() {
            out.push(("label".into(), "must not be empty".into()));
        }
        match (&self.regex, &self.replacement) {
            (Some(r), _) => {
                if let Err(e) = regex::Regex::new(r) {
                    out.push(("regex".into(), format!("invalid regex: {}", v::regex_error(&e))));
                }
            }
            (None, Some(_)) => out.push(("replacement".into(), "needs join.regex".into())),
            (None, None) => {}
        }
        out
    }
}

/// `base` + `/api/v1/query`, keeping the base's path prefix and query parameters.
pub fn query_url(base: &str) -> Result<url::Url, String> {
    let mut u = url::Url::parse(base).map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!("scheme must be http or https, not {}", u.scheme()));
    }
    let path = format!("{}/api/v1/query", u.path().trim_end_matches('/'));
    u.set_path(&path);
    u.set_fragment(None);
    Ok(u)
}

/// Where samples come from. Several pools may share one source; each cycle queries a source once per
/// signal for all its pools.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum SourceConfig {
    Prometheus(PrometheusConfig),
    Scrape(ScrapeConfig),
}

/// Prometheus or Thanos Querier (same HTTP API).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrometheusConfig {
    /// Base URL, e.g. `https://thanos-querier.openshift-monitoring.svc:9091`.
    pub url: String,
    /// Sent as `Authorization: Bearer`. On OpenShift: `file: /var/run/secrets/kubernetes.io/serviceaccount/token`.
    #[serde(default)]
    pub bearer_token: Option<SecretRef>,
    /// Extra CA bundle (PEM), e.g. the service CA for Thanos Querier.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Turns TLS certificate verification off. Logged as a warning at start.
    #[serde(default)]
    pub insecure_skip_verify: bool,
    #[serde(default = "defaults::prom_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Extra request headers (a tenant header for Thanos/Cortex, for example).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Window of `rate()` for the mean processing time from the latency histogram.
    #[serde(default = "defaults::rate_window", with = "humantime_serde")]
    pub rate_window: Duration,
}

/// GET each member's metrics page directly: fresher than Prometheus, one request per member.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScrapeConfig {
    #[serde(default = "defaults::scrape_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// At most this many scrapes in flight at once.
    #[serde(default = "defaults::concurrency")]
    pub concurrency: usize,
    #[serde(default = "defaults::scheme")]
    pub scheme: String,
    #[serde(default = "defaults::metrics_path")]
    pub path: String,
    #[serde(default)]
    pub bearer_token: Option<SecretRef>,
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub insecure_skip_verify: bool,
    /// Largest metrics page read; a larger one makes that member unreadable (`too_large`).
    #[serde(default = "defaults::max_body_bytes")]
    pub max_body_bytes: usize,
}

/// How many requests each member runs at once (its slots, its batch limit), for servers whose
/// metrics do not say: llama.cpp read through Prometheus (its `--parallel`; the scrape source reads
/// `GET /props` and uses these only where that fails), TGI, or any server without a KV gauge.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotsConfig {
    /// Every member's count, unless listed in `members`.
    #[serde(default)]
    pub default: Option<u32>,
    /// Per member id (`host:port`).
    #[serde(default)]
    pub members: BTreeMap<MemberId, u32>,
}

impl SlotsConfig {
    /// The count configured for `m`.
    pub fn of(&self, m: &MemberId) -> Option<f64> {
        self.members.get(m).copied().or(self.default).map(f64::from)
    }

    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.members.is_empty()
    }

    /// Problems as `(field, message)`, relative to `slots`: 0 or an absurd count names the member.
    pub fn validate(&self) -> Vec<(String, String)> {
        let bad = |n: u32| n == 0 || f64::from(n) > super::MAX_SLOTS;
        let msg = format!("must be 1..={} (requests a server runs at once)", super::MAX_SLOTS);
        let mut e = Vec::new();
        if self.default.is_some_and(bad) {
            e.push(("default".to_string(), msg.clone()));
        }
        for (m, n) in &self.members {
            if bad(*n) {
                e.push((format!("members.{m:?}"), format!("{msg}; member {m} has {n}")));
            }
        }
        e
    }
}

/// Sane ranges: beyond them a value is a typo.
const MIN_TIMEOUT: Duration = Duration::from_millis(10);
const MAX_TIMEOUT: Duration = Duration::from_secs(300);
const MAX_RATE_WINDOW: Duration = Duration::from_secs(86400);

impl SourceConfig {
    /// Problems as `(field, message)`, fields relative to the source. `check_files`: CA files must
    /// exist and parse (off when checking a config written for another machine).
    pub fn validate(&self, check_files: bool) -> Vec<(String, String)> {
        let mut errs: Vec<(String, String)> = Vec::new();
        let mut err = |field: String, msg: &str| errs.push((field, msg.to_string()));
        let at = |f: &str| f.to_string();
        match self {
            SourceConfig::Prometheus(p) => {
                // The same function the source builds its query URL with, so `check` and `run` agree.
                if let Err(m) = query_url(&p.url) {
                    err(at("url"), &m);
                }
                if let Err(m) = v::duration_within(p.timeout, MIN_TIMEOUT, MAX_TIMEOUT) {
                    err(at("timeout"), &m);
                }
                for (k, val) in &p.headers {
                    if let Err(m) = v::header(k, val) {
                        err(at(&format!("headers.{k}")), &m);
                    }
                }
                if let Some(ca) = p.ca_file.as_ref().filter(|_| check_files) {
                    if let Err(m) = v::ca_file(ca) {
                        err(at("ca_file"), &m);
                    }
                }
                if p.rate_window > MAX_RATE_WINDOW {
                    err(at("rate_window"), "must be at most 1d");
                }
                if p.rate_window < Duration::from_secs(1) {
                    err(at("rate_window"), "must be at least 1s (and should cover a few scrape intervals)");
                }
            }
            SourceConfig::Scrape(s) => {
                if let Err(m) = v::duration_within(s.timeout, MIN_TIMEOUT, MAX_TIMEOUT) {
                    err(at("timeout"), &m);
                }
                if let Some(ca) = s.ca_file.as_ref().filter(|_| check_files) {
                    if let Err(m) = v::ca_file(ca) {
                        err(at("ca_file"), &m);
                    }
                }
                if !(1024..=1 << 30).contains(&s.max_body_bytes) {
                    err(at("max_body_bytes"), "must be between 1024 and 1073741824 (1 GiB)");
                }
                if s.concurrency == 0 {
                    err(at("concurrency"), "must be >= 1");
                }
                if !matches!(s.scheme.as_str(), "http" | "https") {
                    err(at("scheme"), "must be http or https");
                }
                if !s.path.starts_with('/') {
                    err(at("path"), "must start with /");
                }
            }
        }
        errs
    }
}

mod defaults {
    use std::time::Duration;

    pub fn prom_timeout() -> Duration {
        Duration::from_secs(5)
    }
    pub fn rate_window() -> Duration {
        Duration::from_secs(60)
    }
    pub fn scrape_timeout() -> Duration {
        Duration::from_secs(2)
    }
    pub fn concurrency() -> usize {
        16
    }
    pub fn scheme() -> String {
        "http".into()
    }
    pub fn max_body_bytes() -> usize {
        crate::source::exposition::DEFAULT_MAX_BYTES
    }
    pub fn metrics_path() -> String {
        "/metrics".into()
    }
}
