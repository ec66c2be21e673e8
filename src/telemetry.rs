//! The controller's own HTTP endpoint: `/metrics` (OpenMetrics text), `/healthz`, `/readyz`,
//! `GET /v1/ratios` (the last cycle as JSON), `GET /v1/ratios/{pool}` (one pool as text lines, for
//! load balancers that pull ratios), `GET /v1/history` (the last cycles, for charts) and a live
//! status page at `/` that polls `/v1/history`.
//!
//! Readiness means "the controller is doing its job": ready after the first cycle in which some pool
//! computed ratios from fresh data, unready again when no such cycle happened within
//! `unready_after_cycles` intervals.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::report::CycleReport;

pub mod history;
pub mod process;
pub mod sideband;

/// The OpenMetrics content type: prometheus-client writes OpenMetrics (`# EOF`, counter families
/// named without `_total`), which Prometheus' classic text parser would misread.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub use llm_lc_adapters::label::{labels, Labels};
type FGauge = Family<Labels, Gauge<f64, AtomicU64>>;
type FCounter = Family<Labels, Counter>;

/// Every metric the controller exports about itself. Names start with `llmlc_`.
pub struct Metrics {
    registry: Registry,
    /// The weight the controller wants for each member, exported as `llmlc_member_weight` and, for
    /// one release, under its old name `llmlc_member_ratio` (same series; it was never a 0..1 ratio).
    pub member_ratio: FGauge,
    pub member_waiting: FGauge,
    pub member_running: FGauge,
    pub member_kv_usage: FGauge,
    pub member_latency: FGauge,
    pub member_service: FGauge,
    pub member_queue_time: FGauge,
    pub member_token_time: FGauge,
    pub member_prompt_cached: FGauge,
    pub member_slots: FGauge,
    pub member_sample_age: FGauge,
    pub pool_saturation: FGauge,
    pub pool_fresh_members: FGauge,
    pub pool_up: FGauge,
    /// Priority pooling: how many tiers carry traffic (1 = local only).
    pub pool_active_tiers: FGauge,
    pub cycle_duration: Histogram,
    pub cycles: FCounter,
    pub source_errors: FCounter,
    // Per-pool series with labels besides `pool` (sink, instance, signal, outcome) that nothing
    // can list when a pool goes: reached only through [`Metrics::pool_counter`] and
    // [`Metrics::sink_instance_ok`], which note each label set so [`Metrics::forget_pool`] can drop it.
    samples_rejected: FCounter,
    pushes: FCounter,
    /// Member ratios written on load balancers, by pool and sink (each is a config change on BIG-IP).
    sink_writes: FCounter,
    sink_instance_ok: FGauge,
    noted: Mutex<HashMap<String, HashSet<(Noted, Labels)>>>,
    /// Members of the pool the controller knows (next to `pool_fresh_members`).
    pub pool_members: FGauge,
    /// Members that could not be read, by pool, member and a bounded reason.
    pub member_errors: FCounter,
    pub last_good_cycle: Gauge<f64, AtomicU64>,
    /// 1 while this replica holds the leader lease (or runs without election), else 0.
    pub leader: Gauge,
    /// `llmlc_picker_picks` (pool, door, outcome): every answer of a served endpoint picker.
    pub picker_picks: FCounter,
    /// `llmlc_picker_served` (pool, as_picked): the data plane's reports of the endpoint it used.
    pub picker_served: FCounter,
    /// `llmlc_picker_in_flight` (pool, member): requests the picker has open on the member.
    pub picker_in_flight: FGauge,
    /// Config file reloads by result (`applied`, `rejected`).
    pub config_reloads: FCounter,
    /// 1 when the last config file change was applied (or none happened), 0 when it was rejected.
    pub config_last_reload_successful: Gauge,
}

/// The per-pool counters with labels besides `pool`, reached through [`Metrics::pool_counter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolCounter {
    /// `llmlc_samples_rejected` (signal, reason).
    SamplesRejected,
    /// `llmlc_pushes` (sink, outcome).
    Pushes,
    /// `llmlc_sink_writes` (sink).
    SinkWrites,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Noted {
    Counter(PoolCounter),
    InstanceOk,
}

impl Metrics {
    fn new() -> Metrics {
        let mut r = Registry::default();
        let g = |r: &mut Registry, name: &str, help: &str| {
            let f = FGauge::default();
            r.register(name, help, f.clone());
            f
        };
        let c = |r: &mut Registry, name: &str, help: &str| {
            let f = FCounter::default();
            r.register(name, help, f.clone());
            f
        };
        let member_ratio = g(
            &mut r,
            "llmlc_member_weight",
            "Weight (LB ratio) the controller wants for the member, within the pool's ratio range",
        );
        r.register(
            "llmlc_member_ratio",
            "Deprecated: the same series as llmlc_member_weight, removed in the next release",
            member_ratio.clone(),
        );
        let member_waiting =
            g(&mut r, "llmlc_member_waiting_requests", "Requests waiting on the member (last sample)");
        let member_running =
            g(&mut r, "llmlc_member_running_requests", "Requests running on the member (last sample)");
        let member_kv_usage =
            g(&mut r, "llmlc_member_kv_usage_ratio", "KV-cache usage of the member, 0..1 (last sample)");
        let member_latency =
            g(&mut r, "llmlc_member_latency_seconds", "Mean processing time of the member (last sample)");
        let member_service = g(
            &mut r,
            "llmlc_member_service_seconds",
            "Mean time requests ran on the member, queueing excluded (last sample)",
        );
        let member_queue_time = g(
            &mut r,
            "llmlc_member_queue_time_seconds",
            "Mean time requests waited in the member's queue before they ran (last sample)",
        );
        let member_token_time = g(
            &mut r,
            "llmlc_member_token_time_seconds",
            "Seconds of prompt processing and generation per generated token on the member (llama.cpp; last sample)",
        );
        let member_prompt_cached = g(
            &mut r,
            "llmlc_member_prompt_cached_ratio",
            "Share of the member's prompt tokens served from its prompt cache, 0..1 (last sample)",
        );
        let member_slots = g(
            &mut r,
            "llmlc_member_slots",
            "Requests the member runs at once: llama.cpp's slots from /props, or the pool's `slots`",
        );
        let member_sample_age =
            g(&mut r, "llmlc_member_sample_age_seconds", "Age of the member's last sample");
        let pool_saturation = g(
            &mut r,
            "llmlc_pool_saturation_ratio",
            "Mean capped load of the pool's fresh members, 0..1 (for autoscalers)",
        );
        let pool_fresh_members =
            g(&mut r, "llmlc_pool_fresh_members", "Members of the pool with fresh samples");
        let pool_up =
            g(&mut r, "llmlc_pool_up", "1 when the pool computed ratios from fresh data in the last cycle");
        let pool_active_tiers = g(
            &mut r,
            "llmlc_pool_active_tiers",
            "Priority pooling: tiers carrying traffic (1 = the preferred tier only)",
        );
        let cycle_duration = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        r.register(
            "llmlc_cycle_duration_seconds",
            "Duration of a whole control cycle",
            cycle_duration.clone(),
        );
        let cycles = c(&mut r, "llmlc_cycles", "Control cycles by result");
        let source_errors =
            c(&mut r, "llmlc_source_errors", "Failed source queries or scrapes by source and reason");
        let samples_rejected = c(
            &mut r,
            "llmlc_samples_rejected",
            "Values refused (NaN, Inf, negative, KV above 1) by pool, signal and reason",
        );
        let pushes = c(&mut r, "llmlc_pushes", "Push decisions by pool, sink and outcome");
        let sink_writes = c(
            &mut r,
            "llmlc_sink_writes",
            "Member ratios written on the load balancer by pool and sink (a configuration change on BIG-IP)",
        );
        let picker_in_flight = g(
            &mut r,
            "llmlc_picker_in_flight",
            "Requests the endpoint picker placed on the member and has not seen end (doors that report ends), by pool and member",
        );
        let picker_served = c(
            &mut r,
            "llmlc_picker_served",
            "Endpoints the data plane reported it used, by pool and whether it was the pick (as_picked true) or a fallback",
        );
        let picker_picks = c(
            &mut r,
            "llmlc_picker_picks",
            "Answers of the served endpoint picker by pool, door (ext_proc, http) and outcome (picked, no_members, outside_subset)",
        );
        let sink_instance_ok = g(
            &mut r,
            "llmlc_sink_instance_ok",
            "1 when the last push was applied on this load-balancer instance (each HAProxy instance, the ACTIVE \
             unit of a BIG-IP HA pair), else 0; only for sinks with several instances",
        );
        let pool_members = g(&mut r, "llmlc_pool_members", "Members the controller knows in the pool");
        let member_errors = c(
            &mut r,
            "llmlc_member_errors",
            "Members that could not be read in a cycle, by pool, member and reason",
        );
        let last_good_cycle = Gauge::<f64, AtomicU64>::default();
        r.register(
            "llmlc_last_good_cycle_timestamp_seconds",
            "Unix time of the last cycle in which some pool computed ratios",
            last_good_cycle.clone(),
        );
        let leader = Gauge::default();
        r.register(
            "llmlc_leader",
            "1 while this replica is the leader and pushes ratios (always 1 without leader election)",
            leader.clone(),
        );
        let config_reloads =
            c(&mut r, "llmlc_config_reloads", "Config file changes by result (applied, rejected)");
        let config_last_reload_successful = Gauge::default();
        config_last_reload_successful.set(1);
        r.register(
            "llmlc_config_last_reload_successful",
            "0 when the last change of the config file was rejected (the previous config keeps running)",
            config_last_reload_successful.clone(),
        );
        r.register_collector(Box::new(process::ProcessCollector::new()));
        Metrics {
            registry: r,
            member_ratio,
            member_waiting,
            member_running,
            member_kv_usage,
            member_latency,
            member_service,
            member_queue_time,
            member_token_time,
            member_prompt_cached,
            member_slots,
            member_sample_age,
            pool_saturation,
            pool_fresh_members,
            pool_up,
            pool_active_tiers,
            cycle_duration,
            cycles,
            source_errors,
            samples_rejected,
            pushes,
            sink_writes,
            sink_instance_ok,
            pool_members,
            member_errors,
            last_good_cycle,
            leader,
            picker_picks,
            picker_served,
            picker_in_flight,
            config_reloads,
            config_last_reload_successful,
            noted: Mutex::default(),
        }
    }

    /// The counter `which` of `pool` with the `rest` of its labels, noted for [`Metrics::forget_pool`].
    pub fn pool_counter(&self, which: PoolCounter, pool: &str, rest: &[(&str, &str)]) -> Counter {
        let l = self.note(Noted::Counter(which), pool, rest);
        let family = match which {
            PoolCounter::SamplesRejected => &self.samples_rejected,
            PoolCounter::Pushes => &self.pushes,
            PoolCounter::SinkWrites => &self.sink_writes,
        };
        family.get_or_create(&l).clone()
    }

    /// `llmlc_sink_instance_ok` of one load-balancer instance of `pool`'s sink.
    pub fn sink_instance_ok(&self, pool: &str, sink: &str, instance: &str) -> Gauge<f64, AtomicU64> {
        let l = self.note(Noted::InstanceOk, pool, &[("sink", sink), ("instance", instance)]);
        self.sink_instance_ok.get_or_create(&l).clone()
    }

    /// Drop `pool`'s instance-health series other than `sink`'s `instances` (an instance left the
    /// sink's list, or the pool changed sink on a reload): an instance no longer pushed to would
    /// otherwise keep its last 0 or 1, and an alert on 0 would fire for it forever.
    pub fn retain_sink_instances(&self, pool: &str, sink: &str, instances: &[&str]) {
        let wanted: HashSet<Labels> =
            instances.iter().map(|i| labels(&[("pool", pool), ("sink", sink), ("instance", i)])).collect();
        let mut noted = self.noted.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(set) = noted.get_mut(pool) {
            set.retain(|(which, l)| {
                let keep = *which != Noted::InstanceOk || wanted.contains(l);
                if !keep {
                    self.sink_instance_ok.remove(l);
                }
                keep
            });
        }
    }

    fn note(&self, which: Noted, pool: &str, rest: &[(&str, &str)]) -> Labels {
        let l = labels(&[&[("pool", pool)], rest].concat());
        let mut noted = self.noted.lock().unwrap_or_else(|p| p.into_inner());
        noted.entry(pool.to_string()).or_default().insert((which, l.clone()));
        l
    }

    /// Forget every series of a pool the config no longer has: its pool gauges, the count of
    /// refused member names, and every noted series (push outcomes, writes, instance health,
    /// rejected samples). Its members' series go through [`Metrics::forget_member`].
    pub fn forget_pool(&self, pool: &str) {
        let l = labels(&[("pool", pool)]);
        for f in [
            &self.pool_saturation,
            &self.pool_fresh_members,
            &self.pool_up,
            &self.pool_active_tiers,
            &self.pool_members,
        ] {
            f.remove(&l);
        }
        // Refused names are counted per pool, without a member label, so no member's forgetting
        // reaches them.
        let reason = crate::source::FailureReason::InvalidName.as_str();
        self.member_errors.remove(&labels(&[("pool", pool), ("reason", reason)]));
        let noted = self.noted.lock().unwrap_or_else(|p| p.into_inner()).remove(pool).unwrap_or_default();
        for (which, l) in noted {
            match which {
                Noted::Counter(PoolCounter::SamplesRejected) => self.samples_rejected.remove(&l),
                Noted::Counter(PoolCounter::Pushes) => self.pushes.remove(&l),
                Noted::Counter(PoolCounter::SinkWrites) => self.sink_writes.remove(&l),
                Noted::InstanceOk => self.sink_instance_ok.remove(&l),
            };
        }
    }

    pub fn encode(&self) -> String {
        let mut s = String::new();
        if encode(&mut s, &self.registry).is_err() {
            s.clear();
        }
        s
    }

    /// Forget per-member series of members that left a pool, so dashboards do not show ghosts.
    pub fn forget_member(&self, pool: &str, member: &str) {
        let l = labels(&[("pool", pool), ("member", member)]);
        for f in [
            &self.member_ratio,
            &self.member_waiting,
            &self.member_running,
            &self.member_kv_usage,
            &self.member_latency,
            &self.member_service,
            &self.member_queue_time,
            &self.member_token_time,
            &self.member_prompt_cached,
            &self.member_slots,
            &self.member_sample_age,
        ] {
            f.remove(&l);
        }
        for reason in crate::source::FailureReason::ALL {
            self.member_errors.remove(&labels(&[
                ("pool", pool),
                ("member", member),
                ("reason", reason.as_str()),
            ]));
        }
    }
}

/// Shared between the control loop (writer) and the HTTP handlers (readers).
pub struct Telemetry {
    pub metrics: Metrics,
    state: Mutex<Status>,
    /// Each cycle's report, for whoever follows them (the served endpoint pickers).
    reports: tokio::sync::watch::Sender<Option<Arc<CycleReport>>>,
}

struct Status {
    last: Option<CycleReport>,
    history: history::History,
    last_good: Option<Instant>,
    /// The cycle interval and `unready_after_cycles` in force (a config reload may change them).
    interval: Duration,
    unready_after_cycles: u32,
    /// Extra lines for `/readyz` that do not change readiness: the leader role, a rejected reload.
    notes: std::collections::BTreeMap<&'static str, String>,
}

impl Telemetry {
    pub fn new(interval: Duration, unready_after_cycles: u32) -> Arc<Telemetry> {
        Arc::new(Telemetry {
            metrics: Metrics::new(),
            reports: tokio::sync::watch::Sender::new(None),
            state: Mutex::new(Status {
                last: None,
                history: Default::default(),
                last_good: None,
                interval,
                unready_after_cycles,
                notes: Default::default(),
            }),
        })
    }

    /// A reloaded config's interval and `unready_after_cycles` (the readiness window follows them).
    pub fn set_schedule(&self, interval: Duration, unready_after_cycles: u32) {
        let mut st = self.status();
        st.interval = interval;
        st.unready_after_cycles = unready_after_cycles;
    }

    /// Set or clear a note shown by `/readyz` after the readiness reason. Notes never change readiness.
    /// A note may carry text from outside (a Lease holder's identity, a config error quoting the
    /// file): it is kept on one line, control characters escaped.
    pub fn set_note(&self, key: &'static str, note: Option<String>) {
        let mut st = self.status();
        match note {
            Some(n) => st.notes.insert(key, llm_lc_adapters::name::escape_controls(&n).into_owned()),
            None => st.notes.remove(key),
        };
    }

    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record a finished cycle. `good` when some pool computed ratios from fresh data.
    pub fn record(&self, report: CycleReport, good: bool) {
        let mut st = self.status();
        if good {
            st.last_good = Some(Instant::now());
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            self.metrics.last_good_cycle.set(now);
        }
        st.history.push(&report);
        self.reports.send_replace(Some(Arc::new(report.clone())));
        st.last = Some(report);
    }

    /// The cycles' reports as they come (the last one at once, if any).
    pub fn reports(&self) -> tokio::sync::watch::Receiver<Option<Arc<CycleReport>>> {
        self.reports.subscribe()
    }

    /// Ready, with a one-line reason either way, followed by the notes (`; ` separated).
    pub fn readiness(&self) -> (bool, String) {
        let st = self.status();
        let (ok, mut why) = Self::readiness_of(&st);
        for (k, n) in &st.notes {
            why.push_str(&format!("; {k}: {n}"));
        }
        (ok, why)
    }

    fn readiness_of(st: &Status) -> (bool, String) {
        match st.last_good {
            None => (false, "no good cycle yet".into()),
            Some(t) => {
                let limit = st.interval * st.unready_after_cycles;
                let age = t.elapsed();
                if age > limit {
                    (
                        false,
                        format!(
                            "no good cycle for {:.0}s (limit {:.0}s)",
                            age.as_secs_f64(),
                            limit.as_secs_f64()
                        ),
                    )
                } else {
                    (true, format!("last good cycle {:.1}s ago", age.as_secs_f64()))
                }
            }
        }
    }

    pub fn last_report(&self) -> Option<CycleReport> {
        self.status().last.clone()
    }

    /// The last cycles per pool and member, with readiness and the interval (for the status page).
    pub fn history(&self) -> HistoryResponse {
        let st = self.status();
        let (ready, reason) = Self::readiness_of(&st);
        let view = st.history.view();
        HistoryResponse {
            ready,
            reason,
            interval_s: st.interval.as_secs_f64(),
            cycles: view.pools.values().map(|p| p.ts.len()).max().unwrap_or(0),
            view,
        }
    }

    /// The HTTP routes. Merge more (the Envoy EDS endpoint) before serving.
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/", get(status_page))
            .route("/metrics", get(metrics))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .route("/v1/ratios", get(ratios))
            .route("/v1/ratios/{pool}", get(pool_ratios_text))
            .route("/v1/history", get(history_json))
            .with_state(self.clone())
    }
}

async fn metrics(State(t): State<Arc<Telemetry>>) -> Response {
    ([(header::CONTENT_TYPE, OPENMETRICS)], t.metrics.encode()).into_response()
}

async fn readyz(State(t): State<Arc<Telemetry>>) -> Response {
    let (ok, why) = t.readiness();
    let code = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, format!("{}: {why}\n", if ok { "ready" } else { "not ready" })).into_response()
}

async fn ratios(State(t): State<Arc<Telemetry>>) -> Response {
    match t.last_report() {
        Some(r) => Json(r).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"error": "no cycle has completed yet"})),
        )
            .into_response(),
    }
}

/// `GET /v1/ratios/{pool}`: the pool's ratios as text lines (see [`sideband`]).
async fn pool_ratios_text(State(t): State<Arc<Telemetry>>, Path(pool): Path<String>) -> Response {
    let Some(report) = t.last_report() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "# no cycle has completed yet\n").into_response();
    };
    match sideband::pool_text(&report, &pool) {
        Some(text) => ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response(),
        None => {
            let known: Vec<&str> = report.pools.iter().map(|p| p.pool.as_str()).collect();
            (StatusCode::NOT_FOUND, format!("# no pool {pool:?}; pools: {}\n", known.join(", ")))
                .into_response()
        }
    }
}

/// `GET /v1/history`: always 200, so the status page's polling never logs a failed request while
/// the controller is merely not ready.
#[derive(serde::Serialize)]
pub struct HistoryResponse {
    pub ready: bool,
    pub reason: String,
    pub interval_s: f64,
    /// Cycles held (0 before the first one completes).
    pub cycles: usize,
    #[serde(flatten)]
    pub view: history::HistoryView,
}

async fn history_json(State(t): State<Arc<Telemetry>>) -> Json<HistoryResponse> {
    Json(t.history())
}

/// The page is static: it fetches its data, so a slow browser never holds the telemetry lock.
async fn status_page() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")],
        include_str!("telemetry/status.html"),
    )
        .into_response()
}

#[cfg(test)]
mod note_tests {
    use super::*;

    #[test]
    fn a_note_from_outside_stays_on_one_line_without_terminal_control() {
        let t = Telemetry::new(Duration::from_secs(1), 3);
        t.set_note("leader", Some("follower (leader: pod-a\r\u{1b}[2Jforged\nready)".into()));
        let (_, why) = t.readiness();
        assert!(!why.chars().any(char::is_control), "{why:?}");
        assert!(why.contains("pod-a\\r\\u{1b}[2Jforged\\nready"), "{why}");
    }
}

#[cfg(test)]
mod series_tests {
    use super::*;

    #[test]
    fn an_instance_that_left_the_sink_loses_its_health_series() {
        let t = Telemetry::new(Duration::from_secs(1), 3);
        let m = &t.metrics;
        let series = |m: &Metrics| -> Vec<String> {
            m.encode()
                .lines()
                .filter(|l| l.starts_with("llmlc_sink_instance_ok{"))
                .map(str::to_string)
                .collect()
        };
        for i in ["10.0.0.1:9999", "10.0.0.2:9999"] {
            m.sink_instance_ok("p", "haproxy", i).set(0.0);
            m.sink_instance_ok("q", "haproxy", i).set(1.0);
        }
        m.retain_sink_instances("p", "haproxy", &["10.0.0.1:9999"]);
        let left = series(m);
        assert_eq!(left.len(), 3, "{left:?}");
        assert!(!left.iter().any(|l| l.contains("pool=\"p\"") && l.contains("10.0.0.2")), "{left:?}");
        // The pool moved to another sink: none of the old sink's instances stay.
        m.retain_sink_instances("p", "bigip", &[]);
        assert!(series(m).iter().all(|l| l.contains("pool=\"q\"")), "{:?}", series(m));
        // A series set again after being dropped is noted again.
        m.sink_instance_ok("p", "haproxy", "10.0.0.2:9999").set(1.0);
        m.forget_pool("p");
        assert_eq!(series(m).len(), 2, "{:?}", series(m));
    }
}
