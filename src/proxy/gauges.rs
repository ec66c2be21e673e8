//! The members' own gauges for `algorithm: picker`: every pool's `metrics_interval` (100 ms by
//! default), each member's `/metrics` page is read for its waiting and running requests and its
//! KV-cache usage, vLLM's names or llama.cpp's, all members at once, each read bounded by the
//! interval. A page that cannot be read, or reads without the gauges, leaves the member without
//! gauges: the picker scores it from its own accounting until a page reads again. A read may take
//! up to [`READ_AT_LEAST`] when the interval is shorter (a busy CPU engine serves its page in
//! hundreds of milliseconds); the next read waits for it.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use llm_lc_balance::endpoint::page::{append_within, gauges_of, MAX_PAGE_BYTES};
use llm_lc_balance::endpoint::Gauges;
use tokio_util::sync::CancellationToken;

use super::pool::Pool;

/// The least time a read is given, whatever the interval.
pub const READ_AT_LEAST: Duration = Duration::from_millis(500);

async fn read_member(client: &reqwest::Client, base: &str, timeout: Duration) -> Option<Gauges> {
    let fetch = async {
        let mut resp = client.get(format!("{base}/metrics")).send().await.ok()?.error_for_status().ok()?;
        if resp.content_length().is_some_and(|n| n > MAX_PAGE_BYTES as u64) {
            return None;
        }
        // In chunks: a page without a length that never ends is dropped at the bound, not held.
        let mut page = Vec::new();
        while let Some(chunk) = resp.chunk().await.ok()? {
            if !append_within(&mut page, &chunk) {
                return None;
            }
        }
        gauges_of(&page)
    };
    tokio::time::timeout(timeout, fetch).await.ok().flatten()
}

/// Read `pool`'s members' gauges every `metrics_interval` until `stop`.
pub async fn poll(pool: Arc<Pool>, client: reqwest::Client, stop: CancellationToken) {
    let every = pool.metrics_interval;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = vec![false; pool.members.len()];
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let bound = every.max(READ_AT_LEAST);
        let reads = join_all(pool.bases.iter().map(|b| read_member(&client, b, bound))).await;
        for (i, g) in reads.into_iter().enumerate() {
            // Logged once per change from readable to not, never per read.
            if g.is_none() != failing[i] {
                failing[i] = g.is_none();
                if failing[i] {
                    tracing::warn!(pool = %pool.name, member = %pool.members[i], "cannot read the member's gauges; scoring it from the picker's own accounting");
                } else {
                    tracing::info!(pool = %pool.name, member = %pool.members[i], "the member's gauges read again");
                }
            }
            pool.set_gauges(i, g);
        }
    }
}
