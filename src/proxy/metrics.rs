//! The proxy's `/metrics`: requests by pool, member and status; route decisions by step; TTFT and
//! duration as the proxy sees them; in-flight and queued requests; admissions and refusals by
//! criticality; member weights; guard verdicts; client connections open, refused and timed out.
//! Names start with `llmlc_proxy_`. The per-request paths hold cloned handles of their series
//! (see `server::Shared`), so a request does not build label sets and hash them.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

pub use llm_lc_adapters::label::{labels, Labels};
pub type FCounter = Family<Labels, Counter>;
type FGauge = Family<Labels, Gauge<i64, std::sync::atomic::AtomicI64>>;
type FFGauge = Family<Labels, Gauge<f64, AtomicU64>>;
type FHist = Family<Labels, Histogram, fn() -> Histogram>;

pub struct ProxyMetrics {
    registry: Registry,
    pub requests: FCounter,
    pub route_steps: FCounter,
    pub route_results: FCounter,
    pub admissions: FCounter,
    pub refusals: FCounter,
    pub retries: FCounter,
    pub ratio_updates: FCounter,
    pub unknown_ratio_members: FCounter,
    pub ttft: FHist,
    pub duration: FHist,
    pub in_flight: FGauge,
    pub queued: FGauge,
    pub weight: FFGauge,
    pub guard: FCounter,
    pub connections: FGauge,
    pub connections_refused: FCounter,
    pub connections_timed_out: FCounter,
}

fn latency_hist() -> Histogram {
    // 1 ms .. ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ProxyMetrics {
    pub fn new() -> ProxyMetrics {
        let mut r = Registry::default();
        fn c(r: &mut Registry, name: &str, help: &str) -> FCounter {
            let f = FCounter::default();
            r.register(name, help, f.clone());
            f
        }
        fn h(r: &mut Registry, name: &str, help: &str) -> FHist {
            let f = FHist::new_with_constructor(latency_hist as fn() -> Histogram);
            r.register(name, help, f.clone());
            f
        }
        let requests =
            c(&mut r, "llmlc_proxy_requests", "Requests answered, by pool, member and HTTP status");
        let route_steps = c(
            &mut r,
            "llmlc_proxy_route_steps",
            "Routing-table steps evaluated, by step and branch (match/miss)",
        );
        let route_results =
            c(&mut r, "llmlc_proxy_route_results", "Routing outcomes, by route result (pool:X or reject:N)");
        let admissions =
            c(&mut r, "llmlc_proxy_admitted", "Requests admitted to a pool, by pool and criticality");
        let refusals = c(
            &mut r,
            "llmlc_proxy_refused",
            "Requests refused at admission, by pool, criticality and reason (shed, queue_full, queue_timeout, displaced)",
        );
        let retries = c(
            &mut r,
            "llmlc_proxy_connect_retries",
            "Connect failures retried on another member, by pool and member",
        );
        let ratio_updates =
            c(&mut r, "llmlc_proxy_ratio_updates", "Ratio sets applied, by pool and source (webhook/poll)");
        let unknown_ratio_members = c(
            &mut r,
            "llmlc_proxy_unknown_ratio_members",
            "Members named by applied ratios that the pool does not have (ignored), by pool",
        );
        let ttft = h(
            &mut r,
            "llmlc_proxy_ttft_seconds",
            "Time from receiving a request to the first response body byte, by pool",
        );
        let duration = h(
            &mut r,
            "llmlc_proxy_request_duration_seconds",
            "Time from receiving a request to the end of its response, by pool",
        );
        let in_flight = FGauge::default();
        r.register("llmlc_proxy_in_flight", "Requests in flight, by pool and member", in_flight.clone());
        let queued = FGauge::default();
        r.register("llmlc_proxy_queued", "Requests waiting for admission, by pool", queued.clone());
        let weight = FFGauge::default();
        r.register(
            "llmlc_proxy_member_weight",
            "Stage-2 weight in force, by pool and member",
            weight.clone(),
        );
        let guard = c(
            &mut r,
            "llmlc_proxy_guard_verdicts",
            "Guard step outcomes, by step and outcome (allow, block, route, deny-rule, error-allow, error-block)",
        );
        let connections = FGauge::default();
        r.register(
            "llmlc_proxy_connections",
            "Client connections open, by listener (api/admin)",
            connections.clone(),
        );
        let connections_refused = c(
            &mut r,
            "llmlc_proxy_connections_refused",
            "Client connections refused at limits.max_connections (answered 503), by listener",
        );
        let connections_timed_out = c(
            &mut r,
            "llmlc_proxy_connections_timed_out",
            "Client connections closed for not sending a request head in time (timeouts.header_read / keep_alive_idle), by listener",
        );
        ProxyMetrics {
            registry: r,
            guard,
            connections,
            connections_refused,
            connections_timed_out,
            requests,
            route_steps,
            route_results,
            admissions,
            refusals,
            retries,
            ratio_updates,
            unknown_ratio_members,
            ttft,
            duration,
            in_flight,
            queued,
            weight,
        }
    }

    /// Handles of one listener's connection series.
    pub fn conn(&self, listener: &str) -> super::listen::ConnMetrics {
        let l = labels(&[("listener", listener)]);
        super::listen::ConnMetrics {
            open: self.connections.get_or_create(&l).clone(),
            refused: self.connections_refused.get_or_create(&l).clone(),
            timed_out: self.connections_timed_out.get_or_create(&l).clone(),
        }
    }

    pub fn encode(&self) -> String {
        let mut s = String::new();
        if encode(&mut s, &self.registry).is_err() {
            s.clear();
        }
        s
    }
}
