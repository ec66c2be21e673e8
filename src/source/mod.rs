//! Metrics sources: where each pool's per-member load samples come from.
//!
//! A source answers for several pools at once, so each cycle asks Prometheus once per distinct query
//! (never once per member) and scrapes each distinct member once. Values are checked here, before any
//! policy sees them: NaN, infinities, negative numbers and KV usage above 1 are rejected and counted,
//! and a member without data is absent from the snapshot, never a zero.

pub mod config;
pub use llm_lc_common::exposition;
pub mod inference_pool;
pub mod kubernetes;
pub mod profile;
pub mod prometheus;
pub mod props;
pub mod scrape;
pub mod validate;

pub use validate::redact_url;

use std::collections::BTreeMap;
use std::time::Duration;

use llm_lc_adapters::{Aligned, MemberId, MemberMap};
use regex::Regex;
use thiserror::Error;

use self::config::{JoinConfig, SourceConfig};
use profile::Signal;

/// The load of one member at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Requests queued, not yet scheduled.
    pub waiting: f64,
    /// Requests in the running batch.
    pub running: f64,
    /// Fraction of the KV cache in use, 0..=1, where the server reports it.
    pub kv_usage: Option<f64>,
    /// Mean end-to-end processing time in seconds over the rate window, where known.
    pub latency: Option<f64>,
    /// Mean time requests spent running (first scheduled to last token, no queueing) over the
    /// rate window, where the server reports it (vLLM's `vllm:request_inference_time_seconds`).
    pub service: Option<f64>,
    /// Mean time requests waited in the queue before they first ran, over the rate window, where
    /// the server reports it (vLLM's `vllm:request_queue_time_seconds`).
    pub queue_time: Option<f64>,
    /// Seconds of work (prefill and generation) per generated token over the rate window, where
    /// the server counts them (llama.cpp): a speed, comparable across servers serving one mix.
    pub token_time: Option<f64>,
    /// Share of prompt tokens served from the server's prompt cache over the rate window, 0..=1.
    pub prompt_cached: Option<f64>,
    /// Most requests the server runs at once, where known: llama.cpp's slots (`GET /props`), or
    /// the pool's `slots`.
    pub slots: Option<f64>,
    /// How old the data is: from the Prometheus sample timestamp, or the scrape time.
    pub age: Duration,
}

/// Most slots a server can claim: beyond this a slot count is a bug or a lie (llama.cpp allocates
/// a context per slot; vLLM's own batch limit defaults to 256).
pub const MAX_SLOTS: f64 = 65_536.0;

/// One pool's members and their samples; `None` means "no data", which policies treat as such.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// In member order: data of the same pool lines up by position (see [`MemberMap`]).
    pub members: MemberMap<Option<Sample>>,
    /// Values refused on the way in.
    pub rejected: Vec<Rejected>,
    /// Members that could not be read this cycle, with a bounded reason (a metric label) and the
    /// details (for a log line). Each is also `None` in `members`.
    pub failures: Vec<MemberFailure>,
    /// Per member, the values of the series labels the pool's priority tiers name (Prometheus
    /// sources, pools with `labels` in a tier; empty otherwise).
    pub labels: BTreeMap<MemberId, BTreeMap<String, String>>,
}

/// Why one member has no sample this cycle. A small closed set, so it can be a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FailureReason {
    /// Connection refused, reset, DNS, TLS: no HTTP answer.
    Unreachable,
    /// No complete answer within the source's `timeout`.
    Timeout,
    /// An HTTP answer other than 2xx.
    HttpStatus,
    /// The page is larger than the source's `max_body_bytes`.
    TooLarge,
    /// The page is not Prometheus text, or a needed sample line is malformed.
    Unreadable,
    /// Prometheus has no series of a core signal for this member (target down, relabelled away).
    NoSeries,
    /// Prometheus gave a sample timestamp that is not finite or lies in the future.
    BadTimestamp,
    /// Discovery offered a name that is not a member name (see `llm_lc_adapters::name`); counted
    /// without the name, which is the attacker's text.
    InvalidName,
}

impl FailureReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Unreachable => "unreachable",
            FailureReason::Timeout => "timeout",
            FailureReason::HttpStatus => "http_status",
            FailureReason::TooLarge => "too_large",
            FailureReason::Unreadable => "unreadable",
            FailureReason::NoSeries => "no_series",
            FailureReason::BadTimestamp => "bad_timestamp",
            FailureReason::InvalidName => "invalid_name",
        }
    }

    /// Every reason, for forgetting a member's series.
    pub const ALL: [FailureReason; 8] = [
        FailureReason::Unreachable,
        FailureReason::Timeout,
        FailureReason::HttpStatus,
        FailureReason::TooLarge,
        FailureReason::Unreadable,
        FailureReason::NoSeries,
        FailureReason::BadTimestamp,
        FailureReason::InvalidName,
    ];
}

/// One member that could not be read.
#[derive(Debug, Clone, PartialEq)]
pub struct MemberFailure {
    pub member: MemberId,
    pub reason: FailureReason,
    /// Human words (never a URL with credentials).
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rejected {
    pub member: MemberId,
    pub signal: Signal,
    pub reason: &'static str,
    pub value: f64,
}

#[derive(Debug, Clone, Error)]
pub enum SourceError {
    #[error("cannot reach {what}: {detail}")]
    Unreachable { what: String, detail: String },
    #[error("{what} answered HTTP {status}: {detail}")]
    Http { what: String, status: u16, detail: String },
    #[error("query {query:?} failed: {detail}")]
    Query { query: String, detail: String },
    #[error("{what} sent something we cannot read: {detail}")]
    Malformed { what: String, detail: String },
    #[error("{what} sent more than {limit} bytes")]
    TooLarge { what: String, limit: usize },
    #[error("source configuration: {0}")]
    Config(String),
}

impl SourceError {
    /// Short stable label for the `reason` of the errors counter.
    pub fn reason(&self) -> &'static str {
        match self {
            SourceError::Unreachable { .. } => "unreachable",
            SourceError::Http { .. } => "http",
            SourceError::Query { .. } => "query",
            SourceError::Malformed { .. } => "malformed",
            SourceError::TooLarge { .. } => "too_large",
            SourceError::Config(_) => "config",
        }
    }
}

/// How a series label becomes a member id.
#[derive(Debug, Clone)]
pub struct Join {
    pub label: String,
    rewrite: Option<(Regex, String)>,
}

impl Join {
    /// What makes two joins turn the same label values into the same members (label, regex,
    /// replacement): pools with equal keys can share one index of a query's rows.
    pub fn key(&self) -> (&str, Option<(&str, &str)>) {
        (&self.label, self.rewrite.as_ref().map(|(re, rep)| (re.as_str(), rep.as_str())))
    }

    pub fn new(cfg: &JoinConfig) -> Result<Join, SourceError> {
        let rewrite = match &cfg.regex {
            Some(r) => {
                // Anchored like Prometheus relabelling: the regex must match the whole value.
                let re = Regex::new(&format!("^(?:{r})$"))
                    .map_err(|e| SourceError::Config(format!("join.regex: {e}")))?;
                Some((re, cfg.replacement.clone().unwrap_or_else(|| "$1".into())))
            }
            None => None,
        };
        Ok(Join { label: cfg.label.clone(), rewrite })
    }

    /// The member a label value stands for.
    pub fn member(&self, value: &str) -> MemberId {
        match &self.rewrite {
            Some((re, rep)) if re.is_match(value) => {
                MemberId::new(re.replace(value, rep.as_str()).into_owned())
            }
            _ => MemberId::new(value.to_string()),
        }
    }
}

/// What one pool needs from its source in a cycle.
#[derive(Debug, Clone)]
pub struct PoolQuery {
    pub members: Vec<MemberId>,
    pub names: profile::MetricNames,
    /// PromQL per signal (Prometheus sources).
    pub queries: Vec<(Signal, String)>,
    pub join: Join,
    /// PromQL whose series carry the labels priority tiers name, with the labels to keep.
    pub labels: Option<(String, Vec<String>)>,
    /// Configured slot counts (where the server's own cannot be read).
    pub slots: config::SlotsConfig,
}

/// Raw values per signal per member, before validation. Filled in member order where a source reads
/// members in order (appends); collected from unordered rows otherwise (one sort).
pub type SignalValues = BTreeMap<Signal, MemberMap<f64>>;

/// Turn raw per-signal values into a checked snapshot for `members`. `age_of` gives each member's age
/// from its `Timestamp` value (or whatever the source knows).
pub fn assemble(
    members: &[MemberId],
    values: &SignalValues,
    age_of: impl Fn(&MemberId, Option<f64>) -> Duration,
) -> Snapshot {
    let mut snap = Snapshot::default();
    // Built in member order, so the snapshot is appended to, never searched, and each signal's
    // values are read by walking them alongside the members. Pools keep their members sorted; only
    // other callers pay for sorting here.
    let sorted;
    let ordered: &[MemberId] = if members.windows(2).all(|w| w[0] < w[1]) {
        members
    } else {
        let mut v = members.to_vec();
        v.sort();
        v.dedup();
        sorted = v;
        &sorted
    };
    // One walk per signal, in step with the members, indexed by the signal's position.
    let mut walks: [Option<Aligned<'_, f64, std::slice::Iter<'_, MemberId>>>; Signal::COUNT] =
        Default::default();
    for (s, v) in values {
        walks[*s as usize] = Some(v.aligned(ordered.iter()));
    }
    snap.members = MemberMap::with_capacity(ordered.len());
    for m in ordered {
        // Every walk moves one member on, whether or not its value is used.
        let mut raw = [None; Signal::COUNT];
        for (slot, walk) in raw.iter_mut().zip(&mut walks) {
            *slot = walk.as_mut().and_then(|w| w.next().flatten().copied());
        }
        let get = |s: Signal| raw[s as usize];
        let mut bad = false;
        let mut check = |signal: Signal, v: Option<f64>, snap: &mut Snapshot| -> Option<f64> {
            let v = v?;
            let reason = if v.is_nan() {
                Some("nan")
            } else if v.is_infinite() {
                Some("infinite")
            } else if v < 0.0 {
                Some("negative")
            } else if signal == Signal::KvUsage && v > 1.0 + 1e-9 {
                Some("kv_above_one")
            } else if signal == Signal::PromptCached && v > 1.0 + 1e-9 {
                Some("share_above_one")
            } else if signal == Signal::Slots && !(1.0..=MAX_SLOTS).contains(&v) {
                Some("slots_out_of_range")
            } else {
                None
            };
            match reason {
                Some(reason) => {
                    snap.rejected.push(Rejected { member: m.clone(), signal, reason, value: v });
                    // Timings, shares and slot counts are optional: a bad one is dropped, the
                    // gauges still count.
                    if matches!(
                        signal,
                        Signal::Waiting | Signal::Running | Signal::KvUsage | Signal::Timestamp
                    ) {
                        bad = true;
                    }
                    None
                }
                None => Some(v),
            }
        };
        let waiting = check(Signal::Waiting, get(Signal::Waiting), &mut snap);
        let running = check(Signal::Running, get(Signal::Running), &mut snap);
        let kv_usage = check(Signal::KvUsage, get(Signal::KvUsage), &mut snap);
        let latency = check(Signal::Latency, get(Signal::Latency), &mut snap);
        let service = check(Signal::Service, get(Signal::Service), &mut snap);
        let queue_time = check(Signal::QueueTime, get(Signal::QueueTime), &mut snap);
        let token_time = check(Signal::TokenTime, get(Signal::TokenTime), &mut snap);
        let prompt_cached = check(Signal::PromptCached, get(Signal::PromptCached), &mut snap);
        let slots = check(Signal::Slots, get(Signal::Slots), &mut snap);
        // A member with any core signal refused gets no sample at all: a half-valid sample would
        // look less loaded than it is.
        let sample = match (waiting, running, bad) {
            (Some(waiting), Some(running), false) => Some(Sample {
                waiting,
                running,
                kv_usage: kv_usage.map(|k| k.min(1.0)),
                latency,
                service,
                queue_time,
                token_time,
                prompt_cached: prompt_cached.map(|c| c.min(1.0)),
                slots,
                age: age_of(m, get(Signal::Timestamp)),
            }),
            _ => None,
        };
        snap.members.insert(m.clone(), sample);
    }
    snap
}

/// A configured source, ready to sample.
pub enum Source {
    Prometheus(prometheus::PrometheusSource),
    Scrape(scrape::ScrapeSource),
}

impl Source {
    pub fn new(name: &str, cfg: &SourceConfig) -> Result<Source, SourceError> {
        Ok(match cfg {
            SourceConfig::Prometheus(c) => Source::Prometheus(prometheus::PrometheusSource::new(name, c)?),
            SourceConfig::Scrape(c) => Source::Scrape(scrape::ScrapeSource::new(name, c)?),
        })
    }

    /// Sample every pool given; one result per pool, in order.
    pub async fn sample(&self, pools: &[&PoolQuery]) -> Vec<Result<Snapshot, SourceError>> {
        self.sample_within(pools, None).await
    }

    /// As [`Source::sample`], each member's reads (direct scrape) ending within `budget`: one slow
    /// member then costs only its own sample. Prometheus answers for all members at once and is
    /// bounded by its own `timeout` and the caller's deadline.
    pub async fn sample_within(
        &self,
        pools: &[&PoolQuery],
        budget: Option<Duration>,
    ) -> Vec<Result<Snapshot, SourceError>> {
        match self {
            Source::Prometheus(p) => p.sample(pools).await,
            Source::Scrape(s) => s.sample_within(pools, budget).await,
        }
    }

    /// Members from `up{selector}` (Prometheus sources only).
    pub async fn discover(&self, selector: &str, join: &Join) -> Result<Vec<MemberId>, SourceError> {
        match self {
            Source::Prometheus(p) => p.discover(selector, join).await,
            Source::Scrape(_) => {
                Err(SourceError::Config("member discovery needs a prometheus source".into()))
            }
        }
    }
}

/// Build a reqwest client with the TLS and timeout settings shared by both sources.
pub(crate) fn http_client(
    timeout: Duration,
    ca_file: Option<&std::path::Path>,
    insecure: bool,
    headers: &BTreeMap<String, String>,
) -> Result<reqwest::Client, SourceError> {
    let mut h = reqwest::header::HeaderMap::new();
    for (k, v) in headers {
        let name = reqwest::header::HeaderName::from_bytes(k.as_bytes())
            .map_err(|e| SourceError::Config(format!("header name {k:?}: {e}")))?;
        let value = reqwest::header::HeaderValue::from_str(v)
            .map_err(|e| SourceError::Config(format!("header {k}: {e}")))?;
        h.insert(name, value);
    }
    llm_lc_adapters::tls::client_builder(timeout, ca_file, insecure)
        .map_err(SourceError::Config)?
        .default_headers(h)
        .build()
        .map_err(|e| SourceError::Config(format!("HTTP client: {e}")))
}

/// The error text of a reqwest failure without the URL (which may carry credentials), with its cause.
pub(crate) fn describe(e: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut s = if e.is_timeout() {
        "timed out".to_string()
    } else {
        // reqwest appends " for url (...)"; cut it.
        let full = e.to_string();
        full.split(" for url (").next().unwrap_or_default().to_string()
    };
    let mut src = e.source();
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(s: &str) -> MemberId {
        MemberId::from(s)
    }

    #[test]
    fn bad_values_are_rejected_and_never_become_samples() {
        let members = vec![m("a:1"), m("b:1"), m("c:1"), m("d:1"), m("e:1")];
        let mut values = SignalValues::new();
        values.insert(
            Signal::Waiting,
            [(m("a:1"), 1.0), (m("b:1"), f64::NAN), (m("c:1"), 2.0), (m("d:1"), -1.0)].into_iter().collect(),
        );
        values.insert(
            Signal::Running,
            [(m("a:1"), 3.0), (m("b:1"), 1.0), (m("c:1"), 1.0), (m("d:1"), 1.0)].into_iter().collect(),
        );
        values.insert(Signal::KvUsage, [(m("a:1"), 0.5), (m("c:1"), 1.7)].into_iter().collect());
        values.insert(Signal::Latency, [(m("a:1"), f64::INFINITY)].into_iter().collect());
        let snap = assemble(&members, &values, |_, _| Duration::from_secs(1));
        let a = snap.members[&m("a:1")].as_ref().expect("a is valid");
        assert_eq!((a.waiting, a.running, a.kv_usage, a.latency), (1.0, 3.0, Some(0.5), None));
        assert!(snap.members[&m("b:1")].is_none(), "NaN waiting");
        assert!(snap.members[&m("c:1")].is_none(), "kv above one");
        assert!(snap.members[&m("d:1")].is_none(), "negative");
        assert!(snap.members[&m("e:1")].is_none(), "no data is None, not zero");
        let reasons: Vec<_> = snap.rejected.iter().map(|r| r.reason).collect();
        assert_eq!(reasons, vec!["infinite", "nan", "kv_above_one", "negative"]);
    }

    #[test]
    fn join_rewrites_whole_values_only() {
        let j = Join::new(&JoinConfig {
            label: "pod".into(),
            regex: Some("vllm-(\\d+)".into()),
            replacement: Some("10.0.0.$1:8000".into()),
        })
        .expect("valid");
        assert_eq!(j.member("vllm-3"), m("10.0.0.3:8000"));
        assert_eq!(j.member("xvllm-3"), m("xvllm-3"), "unanchored match must not rewrite");
    }
}
