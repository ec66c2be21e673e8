//! The proxy's YAML file as typed structs, loaded like the controller's config: unknown fields are
//! errors, a parse error names the file, line and field path, and [`ProxyConfig::validate`] reports
//! every other problem at once (the routing table's among them), each naming its field.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use llm_lc_adapters::{MemberId, SecretRef};
use serde::Deserialize;

use llm_lc_balance::Algorithm;
use llm_lc_configfile::{ConfigError, ConfigErrors};

use super::criticality::Criticality;
use super::route::{RouteTable, RoutesConfig};

/// Default Stage-2 algorithm, chosen by the benchmark (src/bench/RESULTS.md): weighted least-request
/// (full scan, what BIG-IP's `ratio-least-connections-member` and HAProxy's weighted `leastconn` do)
/// kept p99 TTFT within 1.25x of a per-request picker at all 21 grid points; smooth weighted round
/// robin was 4-11x worse near saturation, and the two-choices variant worse when request cost varies.
pub const DEFAULT_ALGORITHM: Algorithm = Algorithm::WeightedLeastRequest;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// The OpenAI API listener.
    #[serde(default = "defaults::listen")]
    pub listen: SocketAddr,
    #[serde(default)]
    pub admin: AdminConfig,
    /// Where ratios come from besides the webhook: polling the controller.
    #[serde(default)]
    pub ratios: RatiosConfig,
    /// Stage 2 for every pool unless a pool says otherwise.
    #[serde(default = "defaults::algorithm")]
    pub algorithm: Algorithm,
    /// Seeds the random parts of Stage 2 (P2C, tie breaks).
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub timeouts: Timeouts,
    #[serde(default)]
    pub criticality: CriticalityConfig,
    /// Derive a prefix key from the body (the model and the prompt's first 256 characters) for
    /// requests without an `x-llm-prefix-key` header. Off: only requests whose client sends the
    /// header have a key. Turn it on only for traffic that nearly all shares long prompt openings:
    /// a key for a request that shares nothing turns the prefix-affinity pick into a random one
    /// under a loose bound, which costs tail latency (src/bench/RESULTS.md, "Where nothing is shared").
    #[serde(default)]
    pub prefix_key_from_body: bool,
    pub pools: Vec<PoolConfig>,
    pub routes: RoutesConfig,
}

/// The admin listener: ratio intake (webhook) and the live state view.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Loopback by default: ratios change routing, so do not expose this without a token.
    #[serde(default = "defaults::admin_listen")]
    pub listen: SocketAddr,
    /// Required as `Authorization: Bearer ...` when set.
    #[serde(default)]
    pub bearer_token: Option<SecretRef>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig { listen: defaults::admin_listen(), bearer_token: None }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RatiosConfig {
    #[serde(default)]
    pub poll: Option<PollConfig>,
}

/// Poll the controller's `GET /v1/ratios` (its last cycle report).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollConfig {
    /// e.g. `http://127.0.0.1:9090/v1/ratios`.
    pub url: String,
    #[serde(default = "defaults::poll_interval", with = "humantime_serde")]
    pub interval: Duration,
    #[serde(default)]
    pub bearer_token: Option<SecretRef>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Larger request bodies get 413.
    #[serde(default = "defaults::max_body_bytes")]
    pub max_body_bytes: usize,
    /// Client connections served at once (per listener); the next one gets a 503 JSON error and
    /// is closed. Keep it below the process's file-descriptor limit (`ulimit -n`) minus the
    /// upstream connections.
    #[serde(default = "defaults::max_connections")]
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_body_bytes: defaults::max_body_bytes(), max_connections: defaults::max_connections() }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect to a member; a failure retries on another member.
    #[serde(default = "defaults::connect", with = "humantime_serde")]
    pub connect: Duration,
    /// From sending the request to the first byte of the response body: the model server's queue
    /// and prefill for a streamed request (the TTFT budget), but the whole generation for a
    /// non-streamed one (vLLM answers those at the end), so it must cover the longest of those.
    #[serde(default = "defaults::first_byte", with = "humantime_serde")]
    pub first_byte: Duration,
    /// Longest silence between two chunks of a response body.
    #[serde(default = "defaults::idle", with = "humantime_serde")]
    pub idle: Duration,
    /// A new client connection must complete its first request head within this (slowloris).
    #[serde(default = "defaults::header_read", with = "humantime_serde")]
    pub header_read: Duration,
    /// A kept-alive client connection with no request in progress is closed after this (it also
    /// bounds how long the head of a next request may take).
    #[serde(default = "defaults::keep_alive_idle", with = "humantime_serde")]
    pub keep_alive_idle: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: defaults::connect(),
            first_byte: defaults::first_byte(),
            idle: defaults::idle(),
            header_read: defaults::header_read(),
            keep_alive_idle: defaults::keep_alive_idle(),
        }
    }
}

/// Where a request's criticality comes from: a header wins over a body field; default otherwise.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CriticalityConfig {
    #[serde(default = "defaults::criticality_header")]
    pub header: String,
    /// Dot path into the body.
    #[serde(default = "defaults::criticality_field")]
    pub field: String,
    #[serde(default)]
    pub default: Criticality,
}

impl Default for CriticalityConfig {
    fn default() -> Self {
        CriticalityConfig {
            header: defaults::criticality_header(),
            field: defaults::criticality_field(),
            default: Criticality::Standard,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub name: String,
    /// `host:port` of each model server, as the controller names them (ratios are keyed by these).
    pub members: Vec<MemberId>,
    /// Model names this pool serves; a request for another model gets 404. Empty: anything, and
    /// `/v1/models` asks the members.
    #[serde(default)]
    pub models: Vec<String>,
    /// Overrides the top-level `algorithm`.
    #[serde(default)]
    pub algorithm: Option<Algorithm>,
    /// The proxy's own saturation signal: the pool is full when every member has this many requests
    /// in flight. Unset: never full by this count.
    #[serde(default)]
    pub max_in_flight_per_member: Option<u32>,
    /// Standard and critical requests wait here while the pool is full.
    #[serde(default = "defaults::queue_size")]
    pub queue_size: usize,
    /// Longest wait in that queue before a 503.
    #[serde(default = "defaults::queue_timeout", with = "humantime_serde")]
    pub queue_timeout: Duration,
    /// The controller's pool saturation (0..1, from polled `/v1/ratios`) at or above which sheddable
    /// requests are refused even before the proxy's own count says full.
    #[serde(default = "defaults::shed_saturation")]
    pub shed_saturation: f64,
    /// A member that refused a connection is skipped for this long.
    #[serde(default = "defaults::eject_for", with = "humantime_serde")]
    pub eject_for: Duration,
    /// Name of the BIG-IP pool for the data-group export; default: `name`.
    #[serde(default)]
    pub bigip_pool: Option<String>,
    /// Set `x-llm-prefix-key` on every request forwarded to this pool: 16 hex digits of the
    /// request's prefix key (the client's header hashed, else the model and the prompt's start).
    /// For a pool whose member is itself an LB that hashes that header (the shipped HAProxy and
    /// Envoy prefix configs): it then keeps the same groups together as the proxy would, and never
    /// sees the client's raw bytes. A request without a key goes without the header.
    #[serde(default)]
    pub set_prefix_key: bool,
    /// `algorithm: picker`: how often each member's `/metrics` page is read for its queue,
    /// running requests and KV-cache usage (vLLM's or llama.cpp's names). A page that cannot be
    /// read leaves the member scored from the picker's own accounting.
    #[serde(default = "defaults::metrics_interval", with = "humantime_serde")]
    pub metrics_interval: Duration,
    /// `algorithm: picker`: where the members' gauges come from: `members` (their own `/metrics`
    /// pages, every `metrics_interval`) or `controller` (the waiting, running and KV usage in the
    /// controller's report, polled with the ratios: one cycle old, and no connection from the
    /// proxy to the members' metrics ports).
    #[serde(default)]
    pub gauges_from: GaugesFrom,
}

/// Where `algorithm: picker` reads the members' gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GaugesFrom {
    #[default]
    Members,
    Controller,
}

/// The shortest `metrics_interval`: members' pages are not read in a busy loop.
pub const MIN_METRICS_INTERVAL: Duration = Duration::from_millis(10);

mod defaults {
    use super::*;

    pub fn metrics_interval() -> Duration {
        Duration::from_millis(100)
    }
    pub fn listen() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 8080))
    }
    pub fn admin_listen() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 9191))
    }
    pub fn algorithm() -> Algorithm {
        DEFAULT_ALGORITHM
    }
    pub fn poll_interval() -> Duration {
        Duration::from_secs(5)
    }
    pub fn max_body_bytes() -> usize {
        4 << 20
    }
    pub fn max_connections() -> usize {
        4096
    }
    pub fn header_read() -> Duration {
        Duration::from_secs(10)
    }
    pub fn keep_alive_idle() -> Duration {
        Duration::from_secs(30)
    }
    pub fn connect() -> Duration {
        Duration::from_secs(2)
    }
    pub fn first_byte() -> Duration {
        Duration::from_secs(300)
    }
    pub fn idle() -> Duration {
        Duration::from_secs(60)
    }
    pub fn criticality_header() -> String {
        "x-criticality".into()
    }
    pub fn criticality_field() -> String {
        "metadata.criticality".into()
    }
    pub fn queue_size() -> usize {
        256
    }
    pub fn queue_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub fn shed_saturation() -> f64 {
        0.9
    }
    pub fn eject_for() -> Duration {
        Duration::from_secs(5)
    }
}

/// A loaded, validated config with its compiled routing table.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: ProxyConfig,
    pub table: RouteTable,
}

/// Read, parse and validate a proxy config file.
pub fn load(path: &Path) -> Result<Loaded, ConfigErrors> {
    let text =
        std::fs::read_to_string(path).map_err(|e| one(path, String::new(), format!("cannot read: {e}")))?;
    parse(path, &text)
}

fn one(path: &Path, field: String, message: String) -> ConfigErrors {
    ConfigErrors(vec![ConfigError { file: path.to_path_buf(), location: None, field, message }])
}

/// Parse and validate config text; `path` is only used in messages.
pub fn parse(path: &Path, text: &str) -> Result<Loaded, ConfigErrors> {
    let config: ProxyConfig = llm_lc_configfile::deserialize_yaml(path, text)?;
    config.compile().map_err(|problems| llm_lc_configfile::problems_in(path, problems))
}

impl ProxyConfig {
    /// Validate everything and compile the routing table; every problem as `(field path, message)`.
    pub fn compile(self) -> Result<Loaded, Vec<(String, String)>> {
        let mut errs = self.validate();
        let pools: Vec<String> = self.pools.iter().map(|p| p.name.clone()).collect();
        match RouteTable::compile(&self.routes, &pools) {
            Ok(table) if errs.is_empty() => return Ok(Loaded { config: self, table }),
            Ok(_) => {}
            Err(e) => errs.extend(e),
        }
        Err(errs)
    }

    /// Problems outside the routing table.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        let mut err = |f: String, m: String| errs.push((f, m));
        if self.listen == self.admin.listen && self.listen.port() != 0 {
            err("admin.listen".into(), "must differ from `listen`".into());
        }
        if self.pools.is_empty() {
            err("pools".into(), "needs at least one pool".into());
        }
        for (i, p) in self.pools.iter().enumerate() {
            let at = format!("pools[{i}]");
            if p.name.trim().is_empty() {
                err(format!("{at}.name"), "must not be empty".into());
            }
            if self.pools[..i].iter().any(|q| q.name == p.name) {
                err(format!("{at}.name"), format!("pool {:?} is defined twice", p.name));
            }
            if p.members.is_empty() {
                err(format!("{at}.members"), format!("pool {:?} needs at least one member", p.name));
            }
            for (j, m) in p.members.iter().enumerate() {
                if m.host_port().is_none() || !llm_lc_adapters::name::is_host_port(m.as_str()) {
                    err(format!("{at}.members[{j}]"), format!("{m:?} is not host:port"));
                }
                if p.members[..j].contains(m) {
                    err(format!("{at}.members[{j}]"), format!("{m} is listed twice"));
                }
            }
            if p.max_in_flight_per_member == Some(0) {
                err(
                    format!("{at}.max_in_flight_per_member"),
                    "must be >= 1 (or left out for no limit)".into(),
                );
            }
            if !(p.shed_saturation > 0.0 && p.shed_saturation <= 1.0) {
                err(format!("{at}.shed_saturation"), "must be in (0, 1]".into());
            }
            if p.queue_timeout.is_zero() {
                err(format!("{at}.queue_timeout"), "must be > 0".into());
            }
            if p.gauges_from == GaugesFrom::Controller && self.ratios.poll.is_none() {
                err(
                    format!("{at}.gauges_from"),
                    "`controller` reads the gauges from the polled report: set ratios.poll".into(),
                );
            }
            if p.metrics_interval < MIN_METRICS_INTERVAL {
                err(
                    format!("{at}.metrics_interval"),
                    format!("must be at least {} ms", MIN_METRICS_INTERVAL.as_millis()),
                );
            }
        }
        if self.limits.max_body_bytes == 0 {
            err("limits.max_body_bytes".into(), "must be > 0".into());
        }
        if self.limits.max_connections == 0 {
            err("limits.max_connections".into(), "must be > 0".into());
        }
        for (name, d) in [
            ("connect", self.timeouts.connect),
            ("first_byte", self.timeouts.first_byte),
            ("idle", self.timeouts.idle),
            ("header_read", self.timeouts.header_read),
            ("keep_alive_idle", self.timeouts.keep_alive_idle),
        ] {
            if d.is_zero() {
                err(format!("timeouts.{name}"), "must be > 0".into());
            }
        }
        if let Some(p) = &self.ratios.poll {
            match url::Url::parse(&p.url) {
                Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
                Ok(u) => {
                    err("ratios.poll.url".into(), format!("scheme must be http or https, not {}", u.scheme()))
                }
                Err(e) => err("ratios.poll.url".into(), format!("not a URL: {e}")),
            }
            if p.interval.is_zero() {
                err("ratios.poll.interval".into(), "must be > 0".into());
            }
        }
        if super::route::parse_path(&self.criticality.field).is_err() {
            err("criticality.field".into(), "must be a dot path such as metadata.criticality".into());
        }
        if axum::http::HeaderName::from_bytes(self.criticality.header.as_bytes()).is_err() {
            err("criticality.header".into(), "is not a valid header name".into());
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = "pools:\n  - name: a\n    members: ['127.0.0.1:1']\nroutes:\n  steps:\n    - id: s\n      field: model\n      op: exists\n      match: { pool: a }\n      miss: { reject: 404 }\n";

    #[test]
    fn minimal_config_has_defaults() {
        let l = parse(Path::new("p.yaml"), MIN).unwrap();
        assert_eq!(l.config.algorithm, DEFAULT_ALGORITHM);
        assert_eq!(l.config.admin.listen.ip().to_string(), "127.0.0.1");
        assert_eq!(l.table.steps.len(), 1);
    }

    #[test]
    fn errors_name_file_line_and_field() {
        let bad = MIN.replace("members:", "membres:");
        let e = parse(Path::new("p.yaml"), &bad).unwrap_err().to_string();
        assert!(e.starts_with("p.yaml:3:5: pools[0].membres: unknown field `membres`"), "{e}");
        let bad = MIN.replace("{ pool: a }", "{ pool: nope }");
        let e = parse(Path::new("p.yaml"), &bad).unwrap_err().to_string();
        assert!(e.contains("p.yaml: routes.steps[0] (step \"s\").match: no pool named \"nope\""), "{e}");
        let bad = MIN.replace("'127.0.0.1:1'", "'nohost'");
        let e = parse(Path::new("p.yaml"), &bad).unwrap_err().to_string();
        assert!(e.contains("pools[0].members[0]"), "{e}");
    }
}
