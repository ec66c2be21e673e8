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
use llm_lc_balance::endpoint::Gauges;
use llm_lc_common::exposition::{self, Reading, Wanted};
use tokio_util::sync::CancellationToken;

use super::pool::Pool;

/// Where each gauge is read, in order of preference: vLLM's names (its older KV name too), then
/// llama.cpp's.
const WAITING: &[&str] = &["vllm:num_requests_waiting", "llamacpp:requests_deferred"];
const RUNNING: &[&str] = &["vllm:num_requests_running", "llamacpp:requests_processing"];
const KV_USAGE: &[&str] =
    &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio"];

/// The least time a read is given, whatever the interval.
pub const READ_AT_LEAST: Duration = Duration::from_millis(500);

/// A metrics page larger than this is not a model server's.
const MAX_PAGE_BYTES: usize = exposition::DEFAULT_MAX_BYTES;

fn wanted() -> Wanted {
    Wanted::new(WAITING.iter().chain(RUNNING).chain(KV_USAGE))
}

/// The first of `names` the page has, summed over its series (several engines' series, or one
/// per model, add up).
fn first_of(r: &Reading, names: &[&str]) -> Option<f64> {
    names.iter().find_map(|n| r.get(n)).map(|t| t.sum).filter(|v| v.is_finite() && *v >= 0.0)
}

/// The gauges of one page, `None` when it has no queue gauge at all.
pub fn gauges_of(page: &[u8]) -> Option<Gauges> {
    let r = exposition::read(page, wanted(), MAX_PAGE_BYTES).ok()?;
    let waiting = first_of(&r, WAITING)?;
    let running = first_of(&r, RUNNING).unwrap_or(0.0);
    let kv_usage = first_of(&r, KV_USAGE).unwrap_or(0.0);
    Some(Gauges { waiting: waiting.round() as u32, running: running.round() as u32, kv_usage })
}

async fn read_member(client: &reqwest::Client, base: &str, timeout: Duration) -> Option<Gauges> {
    let fetch = async {
        let resp = client.get(format!("{base}/metrics")).send().await.ok()?.error_for_status().ok()?;
        if resp.content_length().is_some_and(|n| n > MAX_PAGE_BYTES as u64) {
            return None;
        }
        let body = resp.bytes().await.ok()?;
        gauges_of(&body)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_llamacpp_pages_give_their_gauges_and_others_none() {
        let vllm = b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 3\nvllm:num_requests_running{model_name=\"m\"} 7\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n";
        assert_eq!(gauges_of(vllm), Some(Gauges { waiting: 3, running: 7, kv_usage: 0.25 }));
        let llama = b"llamacpp:requests_deferred 1\nllamacpp:requests_processing 2\nllamacpp:kv_cache_usage_ratio 0.5\n";
        assert_eq!(gauges_of(llama), Some(Gauges { waiting: 1, running: 2, kv_usage: 0.5 }));
        assert_eq!(gauges_of(b"process_cpu_seconds_total 3\n"), None);
        assert_eq!(gauges_of(b"vllm:num_requests_waiting{ 3\n"), None, "a malformed page reads as nothing");
        // A negative or NaN KV usage is not a usage.
        let odd = b"vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc NaN\n";
        assert_eq!(gauges_of(odd), Some(Gauges { waiting: 0, running: 0, kv_usage: 0.0 }));
    }
}
