//! The controller's one YAML file, as typed structs.
//!
//! Loading is two steps: [`load`] deserializes (unknown fields are errors; a parse error carries the
//! line and column the YAML crate reports and the field path), then [`Config::validate`] checks what
//! types cannot (ranges, references between sections) and reports every problem at once, each naming
//! the file and field path: `config/x.yaml: pools[1].ratio.min: must be <= ratio.max`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use llm_lc_adapters::{MemberId, SinkConfig};
pub use llm_lc_configfile::{deserialize_yaml, problems_in, ConfigError, ConfigErrors};
use serde::Deserialize;

pub use crate::cycle::OnStale;
use crate::policy::PolicyConfig;
pub use crate::ratio::RatioRange;
pub use crate::source::config::{JoinConfig, PrometheusConfig, ScrapeConfig, SourceConfig};
use crate::source::profile::{MetricOverrides, ProfileName, QueryOverrides};
use crate::source::validate as v;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// How often a control cycle runs.
    #[serde(default = "defaults::interval", with = "humantime_serde")]
    pub interval: Duration,
    /// The controller's own HTTP listener: /metrics, /healthz, /readyz, /v1/ratios.
    #[serde(default = "defaults::listen")]
    pub listen: SocketAddr,
    #[serde(default)]
    pub log_format: LogFormat,
    /// `/readyz` turns unready when no cycle succeeded within this many intervals.
    #[serde(default = "defaults::unready_after_cycles")]
    pub unready_after_cycles: u32,
    pub sources: BTreeMap<String, SourceConfig>,
    pub pools: Vec<PoolConfig>,
    /// Several replicas: only the holder of a Kubernetes Lease pushes (see `leader`).
    #[serde(default)]
    pub leader_election: crate::leader::LeaderElectionConfig,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub name: String,
    /// Name of an entry in `sources`.
    pub source: String,
    /// Which model server this pool runs; chooses metric names.
    #[serde(default)]
    pub profile: ProfileName,
    /// Replace metric names of the profile, per signal (works with both source kinds).
    #[serde(default)]
    pub metrics: MetricOverrides,
    /// Replace the generated PromQL, per signal (Prometheus sources only). Each query must aggregate
    /// `by` the join label.
    #[serde(default)]
    pub queries: QueryOverrides,
    /// Extra label matchers added to every generated query, e.g. `namespace="llm",model_name="llama"`.
    #[serde(default)]
    pub selector: Option<String>,
    /// Requests each member runs at once, where its metrics do not say (see
    /// [`crate::source::config::SlotsConfig`]): `{default: 4, members: {"10.0.0.7:8080": 1}}`.
    #[serde(default)]
    pub slots: crate::source::config::SlotsConfig,
    pub members: MembersConfig,
    #[serde(default)]
    pub join: JoinConfig,
    #[serde(default)]
    pub policy: PolicyConfig,
    #[serde(default)]
    pub ratio: RatioRange,
    /// Samples older than this are stale.
    #[serde(default = "defaults::stale_after", with = "humantime_serde")]
    pub stale_after: Duration,
    /// A member without fresh data keeps its ratio this long, then gets the pool mean.
    #[serde(default = "defaults::grace", with = "humantime_serde")]
    pub grace: Duration,
    /// What happens once the whole pool has had no fresh data for `reset_after`.
    #[serde(default)]
    pub on_stale: OnStale,
    #[serde(default = "defaults::reset_after", with = "humantime_serde")]
    pub reset_after: Duration,
    #[serde(default)]
    pub sink: SinkConfig,
    /// Which ratio moves are worth a write (default by sink: F5 20% or once a minute, 10% when the
    /// `capacity` policy feeds weighted round robin; others every change). See `crate::cycle::change`.
    #[serde(default)]
    pub change: Option<crate::cycle::change::ChangePolicy>,
    /// Priority pooling: tiers of members, the next one used only when the active ones saturate
    /// (see `crate::priority`).
    #[serde(default)]
    pub priority: Option<crate::priority::PriorityConfig>,
    /// How long one push may take, independent of the cycle (default: three intervals). A slow
    /// management plane finishes its push while later cycles report `in_progress`.
    #[serde(default, with = "humantime_serde")]
    pub push_timeout: Option<Duration>,
    /// The endpoint picker served for this pool behind the load balancers' per-request hooks
    /// (see `crate::picker`).
    #[serde(default)]
    pub picker: Option<crate::picker::PickerConfig>,
}

impl PoolConfig {
    pub fn change_policy(&self) -> crate::cycle::change::ChangePolicy {
        self.change
            .unwrap_or_else(|| crate::cycle::change::ChangePolicy::default_for(&self.sink, &self.policy))
    }
}

/// Who the members of a pool are. Exactly one of the fields.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MembersConfig {
    /// A fixed list of `host:port`.
    #[serde(default, rename = "static")]
    pub static_list: Option<Vec<MemberId>>,
    /// Prometheus targets: the series of `up{SELECTOR}` (e.g. `{job="vllm"}`), one member per value of
    /// the join label.
    #[serde(default)]
    pub prometheus_up: Option<String>,
    /// Ask the load balancer (the pool's sink) which members it has.
    #[serde(default)]
    pub from_lb: bool,
    /// The ready endpoints of a Kubernetes Service, from its EndpointSlices.
    #[serde(default)]
    pub kubernetes: Option<crate::source::kubernetes::KubernetesMembers>,
}

/// Set (to anything) to skip checking that files named in the config exist, for `check` of a config
/// meant for another machine. `check --offline` is the spelled-out form; this stays for scripts.
pub const SKIP_FILE_CHECKS_ENV: &str = "LLMLC_SKIP_FILE_CHECKS";

/// Sane ranges for durations and norms: beyond them a value is a typo, and some would overflow.
mod bounds {
    use std::time::Duration;

    pub const MIN_INTERVAL: Duration = Duration::from_millis(100);
    pub const MAX_INTERVAL: Duration = Duration::from_secs(3600);
    pub const MAX_STALE: Duration = Duration::from_secs(86400);
    pub const MAX_RESET: Duration = Duration::from_secs(7 * 86400);
    pub const MIN_NORM: f64 = 1e-6;
}

mod defaults {
    use std::net::SocketAddr;
    use std::time::Duration;

    pub fn interval() -> Duration {
        Duration::from_secs(5)
    }
    pub fn listen() -> SocketAddr {
        SocketAddr::from(([0, 0, 0, 0], 9090))
    }
    pub fn unready_after_cycles() -> u32 {
        3
    }
    pub fn stale_after() -> Duration {
        Duration::from_secs(60)
    }
    pub fn grace() -> Duration {
        Duration::from_secs(30)
    }
    pub fn reset_after() -> Duration {
        Duration::from_secs(300)
    }
}

/// The bounds of `interval`, for values that come from elsewhere than the file (`--interval`).
pub fn check_interval(d: Duration) -> Result<(), String> {
    v::duration_within(d, bounds::MIN_INTERVAL, bounds::MAX_INTERVAL)
}

/// Read, parse and validate a config file.
pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            file: path.to_path_buf(),
            location: None,
            field: String::new(),
            message: format!("cannot read: {e}"),
        }])
    })?;
    parse(path, &text)
}

/// Parse and validate config text; `path` is only used in messages.
pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigErrors> {
    parse_checked(path, text, std::env::var_os(SKIP_FILE_CHECKS_ENV).is_none())
}

/// [`load`] without reading any file the config names (CA bundles): for `check --offline` of a
/// config written for a pod, whose mounted files do not exist here.
pub fn load_offline(path: &Path) -> Result<Config, ConfigErrors> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            file: path.to_path_buf(),
            location: None,
            field: String::new(),
            message: format!("cannot read: {e}"),
        }])
    })?;
    parse_checked(path, &text, false)
}

fn parse_checked(path: &Path, text: &str, check_files: bool) -> Result<Config, ConfigErrors> {
    let config: Config = deserialize_yaml(path, text)?;
    let problems = config.validate_with(check_files);
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(problems_in(path, problems))
    }
}

impl Config {
    /// Every problem types cannot catch, as `(field path, message)`.
    pub fn validate(&self) -> Vec<(String, String)> {
        self.validate_with(std::env::var_os(SKIP_FILE_CHECKS_ENV).is_none())
    }

    /// Settings that are valid but will not do what their writer wants, as `(field, why)`: `check`
    /// prints them, `run` logs them at start and on every reload. Today: a scrape source whose reads
    /// of one member may take longer than a cycle gives them (the interval less a tenth), so a
    /// member that slow is cut short, and counted as failed, every cycle.
    pub fn cautions(&self) -> Vec<(String, String)> {
        let budget = self.interval.saturating_sub(self.interval / 10);
        let mut out = Vec::new();
        for (name, src) in &self.sources {
            let (timeout, reads, what) = match src {
                SourceConfig::Scrape(sc) => {
                    let props = self
                        .pools
                        .iter()
                        .any(|p| &p.source == name && p.profile.resolve(&p.metrics).slots_from_props);
                    if props {
                        (sc.timeout, 2, "its metrics page, then GET /props, each under `timeout`")
                    } else {
                        (sc.timeout, 1, "its metrics page, under `timeout`")
                    }
                }
                // One query answers for every member at once, and its `timeout` is a ceiling, not
                // a per-member budget: nothing one member does makes it slow.
                SourceConfig::Prometheus(_) => continue,
            };
            let worst = timeout * reads;
            if worst > budget {
                out.push((
                    format!("sources.{name}.timeout"),
                    format!(
                        "one member's reads ({what}) may take {} but a cycle gives them {} (interval {} \
                         less a tenth): reads that slow are cut short and count as failures every cycle; \
                         raise `interval` or lower `timeout`",
                        humantime::format_duration(worst),
                        humantime::format_duration(budget),
                        humantime::format_duration(self.interval),
                    ),
                ));
            }
        }
        out
    }

    /// [`Config::validate`]; `check_files`: files named by the config must exist and parse, as
    /// `run` requires. Off when checking a config written for another machine (a pod's mounted
    /// secrets, checked in CI or on a laptop).
    pub fn validate_with(&self, check_files: bool) -> Vec<(String, String)> {
        let mut errs: Vec<(String, String)> = Vec::new();
        let mut err = |field: String, msg: &str| errs.push((field, msg.to_string()));
        if let Err(m) = check_interval(self.interval) {
            err("interval".into(), &m);
        }
        if self.unready_after_cycles == 0 {
            err("unready_after_cycles".into(), "must be >= 1");
        }
        if self.pools.is_empty() {
            err("pools".into(), "at least one pool is needed");
        }
        for (field, msg) in self.leader_election.validate() {
            err(format!("leader_election.{field}"), &msg);
        }
        for (name, src) in &self.sources {
            for (field, msg) in src.validate(check_files) {
                err(format!("sources.{name}.{field}"), &msg);
            }
        }
        for (field, msg) in crate::picker::validate(self) {
            err(field, &msg);
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, p) in self.pools.iter().enumerate() {
            let at = |f: &str| format!("pools[{i}].{f}");
            if p.name.is_empty() {
                err(at("name"), "must not be empty");
            } else if !seen.insert(p.name.as_str()) {
                err(at("name"), &format!("duplicate pool name {:?}", p.name));
            }
            let source = self.sources.get(&p.source);
            match source {
                None => {
                    let known = self.sources.keys().cloned().collect::<Vec<_>>().join(", ");
                    err(at("source"), &format!("no source named {:?} (sources: {known})", p.source));
                }
                Some(SourceConfig::Scrape(_)) => {
                    if !p.queries.is_empty() {
                        err(at("queries"), "PromQL overrides need a prometheus source; use `metrics` to rename metrics for scrape");
                    }
                    if p.members.prometheus_up.is_some() {
                        err(at("members.prometheus_up"), "needs a prometheus source");
                    }
                    // Tier labels come from Prometheus series, or from the endpoints of
                    // Kubernetes members (`zone`, `node`); a server's own page has neither.
                    let from_endpoints = |name: &String| {
                        p.members.kubernetes.is_some()
                            && crate::source::kubernetes::ENDPOINT_LABELS.contains(&name.as_str())
                    };
                    for (j, t) in p.priority.iter().flat_map(|pr| pr.tiers.iter()).enumerate() {
                        if !t.labels.keys().all(from_endpoints) {
                            err(
                                at(&format!("priority.tiers[{j}].labels")),
                                "needs a prometheus source (a server's own /metrics carries no cluster or region \
                                 label), or `zone`/`node` with `members: { kubernetes }`; name the tier's members \
                                 with `members` instead",
                            );
                        }
                    }
                }
                Some(SourceConfig::Prometheus(_)) => {}
            }
            let count = p.members.static_list.is_some() as u8
                + p.members.prometheus_up.is_some() as u8
                + p.members.from_lb as u8
                + p.members.kubernetes.is_some() as u8;
            if count != 1 {
                err(at("members"), "set exactly one of `static`, `prometheus_up`, `from_lb`, `kubernetes`");
            }
            if let Some(k) = &p.members.kubernetes {
                for (field, msg) in k.validate() {
                    err(at(&format!("members.kubernetes.{field}")), &msg);
                }
                if let Some(ca) = k.ca_file.as_ref().filter(|_| check_files) {
                    if let Err(m) = v::ca_file(ca) {
                        err(at("members.kubernetes.ca_file"), &m);
                    }
                }
            }
            if let Some(list) = &p.members.static_list {
                if list.is_empty() {
                    err(at("members.static"), "must list at least one member");
                }
                let mut dup = std::collections::BTreeSet::new();
                for (j, m) in list.iter().enumerate() {
                    if let Err(msg) = v::member(m) {
                        err(at(&format!("members.static[{j}]")), &msg);
                    }
                    if !dup.insert(m) {
                        err(at(&format!("members.static[{j}]")), &format!("duplicate member {m}"));
                    }
                }
            }
            if let Some(sel) = &p.members.prometheus_up {
                if let Err(m) = v::braced_selector(sel) {
                    err(at("members.prometheus_up"), &m);
                }
            }
            let readable = match &p.sink {
                SinkConfig::DryRun | SinkConfig::Webhook(_) => false,
                SinkConfig::Envoy(e) => e.can_read_members(),
                SinkConfig::F5(_) | SinkConfig::Haproxy(_) => true,
            };
            if p.members.from_lb && !readable {
                let hint = if matches!(p.sink, SinkConfig::Envoy(_)) {
                    " (give the sink `admin: http://ENVOY:9901` to read Envoy's cluster)"
                } else {
                    ""
                };
                err(
                    at("members.from_lb"),
                    &format!("the {} sink has no pool to read members from{hint}", p.sink.kind()),
                );
            }
            if let Some(sel) = &p.selector {
                if sel.trim_start().starts_with('{') {
                    err(at("selector"), "write label matchers without braces, e.g. namespace=\"llm\"");
                } else if let Err(m) = v::selector(sel) {
                    err(at("selector"), &m);
                }
            }
            for (field, msg) in p.join.validate() {
                err(at(&format!("join.{field}")), &msg);
            }
            for (field, msg) in p.ratio.validate() {
                err(at(&format!("ratio.{field}")), &msg);
            }
            for (d, f, min, max) in [
                (p.stale_after, "stale_after", bounds::MIN_INTERVAL, bounds::MAX_STALE),
                (p.grace, "grace", Duration::ZERO, bounds::MAX_STALE),
                (p.reset_after, "reset_after", bounds::MIN_INTERVAL, bounds::MAX_RESET),
            ] {
                if let Err(m) = v::duration_within(d, min, max) {
                    err(at(f), &m);
                }
            }
            if p.profile == ProfileName::Custom {
                let missing = p.queries.waiting.is_none() && p.metrics.waiting.is_none()
                    || p.queries.running.is_none() && p.metrics.running.is_none();
                if missing {
                    err(at("profile"), "custom needs at least waiting and running in `queries` or `metrics`");
                }
            }
            for (field, msg) in p.policy.validate() {
                err(at(&format!("policy.{field}")), &msg);
            }
            for (field, msg) in p.slots.validate() {
                err(at(&format!("slots.{field}")), &msg);
            }
            let (queue_norm, running_norm) = p.policy.norms();
            for (x, f) in [(queue_norm, "queue_norm"), (running_norm, "running_norm")] {
                // policy.validate() already refuses <= 0 and non-finite; tiny values overflow loads.
                if x > 0.0 && x < bounds::MIN_NORM {
                    err(at(&format!("policy.{f}")), "must be >= 1e-6");
                }
            }
            for (field, msg) in p.sink.validate() {
                err(at(&format!("sink.{field}")), &msg);
            }
            if let SinkConfig::F5(f5) = &p.sink {
                if p.ratio.max > f5.max_ratio {
                    err(
                        at("ratio.max"),
                        &format!(
                            "{} is above the F5 sink's max_ratio {}: F5 documents pool member ratio as 1..100 \
                             (AS3, Ansible), and a BIG-IP that enforces it fails the whole transaction. Lower \
                             ratio.max, or set sink.max_ratio (up to 65535) if your BIG-IP accepts more",
                            p.ratio.max, f5.max_ratio
                        ),
                    );
                }
            }
            if let Some(c) = &p.change {
                for (field, msg) in c.validate() {
                    err(at(&field), &msg);
                }
            }
            if let Some(pr) = &p.priority {
                for (field, msg) in pr.validate() {
                    err(at(&format!("priority.{field}")), &msg);
                }
                // Inactive tiers get ratio 0; not every sink can say "no new traffic".
                match &p.sink {
                    SinkConfig::F5(f) if f.mode == llm_lc_adapters::f5::F5Mode::Sideband => err(
                        at("priority"),
                        "not supported with the f5 sink in sideband mode (the iRule reads ratios, and BIG-IP has no \
                         ratio 0); use mode push with priority_groups: true",
                    ),
                    SinkConfig::F5(f) if !f.priority_groups => err(
                        at("priority"),
                        "needs `sink.priority_groups: true` with the f5 sink: BIG-IP has no ratio 0, so inactive tiers \
                         become priority group 1 (active ones 2); the pool needs min-active-members >= 1",
                    ),
                    SinkConfig::Haproxy(h) if !h.allow_drain => err(
                        at("priority"),
                        "needs `sink.allow_drain: true`: an inactive tier gets weight 0 (otherwise it would keep weight 1)",
                    ),
                    _ => {}
                }
            }
            if p.push_timeout.is_some_and(|t| t.is_zero()) {
                err(at("push_timeout"), "must be > 0");
            }
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(s: &str) -> Result<Config, ConfigErrors> {
        parse(Path::new("test.yaml"), s)
    }

    const MINIMAL: &str = r#"
sources:
  direct: { kind: scrape }
pools:
  - name: p
    source: direct
    members: { static: ["10.0.0.1:8000", "10.0.0.2:8000"] }
"#;

    #[test]
    fn minimal_config_gets_defaults() {
        let c = parse_str(MINIMAL).expect("valid");
        assert_eq!(c.interval, Duration::from_secs(5));
        assert_eq!(c.pools[0].ratio, RatioRange { min: 1, max: 100 });
        assert_eq!(c.pools[0].join.label, "instance");
        assert!(matches!(c.pools[0].sink, SinkConfig::DryRun));
    }

    #[test]
    fn the_default_change_policy_follows_the_sink_and_how_the_ratios_are_used() {
        use crate::cycle::change::ChangePolicy;
        let pool = |extra: &str| {
            let text = format!("{MINIMAL}{extra}");
            parse_str(&text).expect("valid").pools[0].change_policy()
        };
        let f5 = "    sink: { kind: f5, url: 'https://bigip.example.com', pool: /Common/p, username: u, password: { value: x } }\n";
        assert_eq!(pool(""), ChangePolicy::EVERY_CHANGE);
        assert_eq!(pool(f5), ChangePolicy::CONFIGURATION);
        let rr = format!("{f5}    policy: {{ kind: capacity, mode: round-robin }}\n");
        assert_eq!(pool(&rr), ChangePolicy::CONFIGURATION_ROUND_ROBIN);
        let explicit = format!("{rr}    change: {{ min_change: 0.3, max_hold: 2m }}\n");
        assert_eq!(pool(&explicit).min_change, 0.3);
    }

    #[test]
    fn misspelt_field_names_file_line_and_path() {
        let text = MINIMAL.replace("    source: direct", "    source: direct\n    sourse: x");
        let e = parse_str(&text).expect_err("unknown field");
        let msg = e.to_string();
        assert!(msg.starts_with("test.yaml:"), "{msg}");
        assert!(msg.contains("pools[0]"), "{msg}");
        assert!(msg.contains("sourse"), "{msg}");
        assert_eq!(e.0[0].location.map(|l| l.0), Some(7), "{msg}");
    }

    #[test]
    fn bad_duration_names_the_field() {
        let text = format!("interval: -5s\n{MINIMAL}");
        let e = parse_str(&text).expect_err("negative interval");
        assert_eq!(e.0[0].field, "interval", "{e}");
        assert_eq!(e.0[0].location.map(|l| l.0), Some(1), "{e}");
    }

    #[test]
    fn zero_interval_and_bad_range_are_all_reported() {
        let text = format!("interval: 0s\n{MINIMAL}    ratio: {{ min: 50, max: 10 }}\n");
        let e = parse_str(&text).expect_err("invalid");
        let fields: Vec<_> = e.0.iter().map(|x| x.field.as_str()).collect();
        assert!(fields.contains(&"interval"), "{e}");
        assert!(fields.contains(&"pools[0].ratio.min"), "{e}");
        assert!(e.to_string().contains("pools[0].ratio.min: must be <= ratio.max"), "{e}");
    }

    #[test]
    fn unknown_source_is_named() {
        let text = MINIMAL.replace("source: direct", "source: nowhere");
        let e = parse_str(&text).expect_err("unknown source");
        assert!(
            e.to_string().contains("pools[0].source: no source named \"nowhere\" (sources: direct)"),
            "{e}"
        );
    }

    #[test]
    fn members_need_exactly_one_form() {
        let text = MINIMAL.replace(
            r#"members: { static: ["10.0.0.1:8000", "10.0.0.2:8000"] }"#,
            r#"members: { static: ["10.0.0.1:8000"], prometheus_up: '{job="x"}' }"#,
        );
        let e = parse_str(&text).expect_err("two forms");
        assert!(e.to_string().contains("pools[0].members: set exactly one"), "{e}");
        assert!(e.to_string().contains("members.prometheus_up: needs a prometheus source"), "{e}");
    }

    #[test]
    fn bad_member_and_regex_are_reported() {
        let text =
            MINIMAL.replace("\"10.0.0.2:8000\"", "\"nope\"") + "    join: { label: pod, regex: '(' }\n";
        let e = parse_str(&text).expect_err("invalid");
        let s = e.to_string();
        assert!(s.contains("pools[0].members.static[1]: \"nope\" is not host:port"), "{s}");
        assert!(s.contains("pools[0].join.regex: invalid regex"), "{s}");
    }
}
