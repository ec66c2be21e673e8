//! The picker's own reads of the engines: every `refresh` (100 ms by default) each member's
//! metrics page is read for its waiting and running requests and KV usage, all members at once,
//! each read bounded. The ratio cycle's source may be a Prometheus a scrape interval behind; a
//! per-request choice wants what a direct read gives. A member whose page cannot be read is
//! scored from the picker's own accounting until it reads again (logged once per change).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use llm_lc_adapters::SecretRef;
use llm_lc_balance::endpoint::page::{append_within, gauges_of};
use llm_lc_balance::endpoint::Gauges;
use tokio_util::sync::CancellationToken;

use super::pool::PoolPicker;
use crate::telemetry::labels;

/// `llmlc_picker_in_flight{pool, member}`.
pub type InFlightGauge = prometheus_client::metrics::family::Family<
    crate::telemetry::Labels,
    prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64>,
>;

/// The least time a read is given, whatever the refresh period: a busy CPU engine serves its page
/// in hundreds of milliseconds, and the next read waits for it.
const READ_AT_LEAST: Duration = Duration::from_millis(500);

/// How the pages are reached: the pool's scrape source's scheme, path and credentials when it has
/// one, else plain `http://{member}/metrics`.
#[derive(Clone)]
pub struct PageAccess {
    pub client: reqwest::Client,
    pub scheme: String,
    pub path: String,
    pub token: Option<SecretRef>,
}

async fn read(access: &PageAccess, member: &str, token: Option<&str>, bound: Duration) -> Option<Gauges> {
    let fetch = async {
        let mut req = access.client.get(format!("{}://{member}{}", access.scheme, access.path));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let mut resp = req.send().await.ok()?.error_for_status().ok()?;
        let mut page = Vec::new();
        // Read in chunks so that a page larger than any engine's is dropped, not held.
        while let Some(chunk) = resp.chunk().await.ok()? {
            if !append_within(&mut page, &chunk) {
                return None;
            }
        }
        gauges_of(&page)
    };
    tokio::time::timeout(bound, fetch).await.ok().flatten()
}

/// Read `pool`'s members every `every` until `stop`, release its forgotten picks, and show its
/// requests in flight per member in `in_flight` (a member that leaves loses its series).
pub async fn run(
    pool: Arc<PoolPicker>,
    access: PageAccess,
    every: Duration,
    in_flight: InFlightGauge,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing: std::collections::HashSet<String> = Default::default();
    let mut shown: Vec<String> = Vec::new();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let members = pool.members();
        let token = access.token.as_ref().and_then(|t| t.resolve().ok());
        let bound = every.max(READ_AT_LEAST);
        let reads = join_all(members.iter().map(|m| read(&access, m, token.as_deref(), bound))).await;
        for (m, g) in members.iter().zip(reads) {
            if g.is_none() && failing.insert(m.clone()) {
                tracing::warn!(pool = %pool.name, member = %m, "picker cannot read the member's gauges; scoring it from its own accounting");
            } else if g.is_some() && failing.remove(m) {
                tracing::info!(pool = %pool.name, member = %m, "picker reads the member's gauges again");
            }
            pool.set_gauges(m, g);
        }
        failing.retain(|m| members.contains(m));
        let released = pool.sweep(Instant::now());
        if released > 0 {
            tracing::warn!(pool = %pool.name, released, "released picks whose end was never reported (max_open)");
        }
        let now: Vec<(String, u32)> = pool.in_flight();
        for gone in shown.iter().filter(|m| !now.iter().any(|(n, _)| n == *m)) {
            in_flight.remove(&labels(&[("pool", &pool.name), ("member", gone)]));
        }
        shown = now.iter().map(|(m, _)| m.clone()).collect();
        for (m, n) in &now {
            in_flight.get_or_create(&labels(&[("pool", &pool.name), ("member", m)])).set(f64::from(*n));
        }
    }
}
