//! Direct-scrape source: GET each member's Prometheus text page, with bounded concurrency.
//!
//! Fresher than Prometheus (no scrape interval in between) at the cost of one request per member per
//! cycle. Queue and running counts are summed over vLLM's per-`engine` series, KV usage averaged.
//! Mean processing time needs two scrapes: it is the growth of the latency histogram's sum over the
//! growth of its count since the previous cycle, so the source keeps the last totals per member.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use llm_lc_adapters::{MemberId, SecretRef};
use openmetrics_parser::{MetricsExposition, PrometheusType, PrometheusValue};

use super::{assemble, describe, http_client, PoolQuery, Signal, SignalValues, Snapshot, SourceError};
use crate::config::ScrapeConfig;

pub struct ScrapeSource {
    name: String,
    client: reqwest::Client,
    scheme: String,
    path: String,
    concurrency: usize,
    token: Option<SecretRef>,
    /// Last (sum, count) of each member's latency histogram, for the rate between cycles.
    last_latency: Mutex<HashMap<(MemberId, String), (f64, f64)>>,
}

type Exposition = MetricsExposition<PrometheusType, PrometheusValue>;

impl ScrapeSource {
    pub fn new(name: &str, cfg: &ScrapeConfig) -> Result<Self, SourceError> {
        if cfg.insecure_skip_verify {
            tracing::warn!(source = name, "TLS certificate verification is OFF for this scrape source");
        }
        let client =
            http_client(cfg.timeout, cfg.ca_file.as_deref(), cfg.insecure_skip_verify, &BTreeMap::new())?;
        Ok(ScrapeSource {
            name: name.to_string(),
            client,
            scheme: cfg.scheme.clone(),
            path: cfg.path.clone(),
            concurrency: cfg.concurrency.max(1),
            token: cfg.bearer_token.clone(),
            last_latency: Mutex::new(HashMap::new()),
        })
    }

    async fn fetch(
        &self,
        member: &MemberId,
        token: Option<&str>,
    ) -> Result<(Exposition, Instant), SourceError> {
        let url = format!("{}://{}{}", self.scheme, member, self.path);
        let what = format!("scrape source {:?} member {member}", self.name);
        let mut req = self.client.get(&url);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| SourceError::Unreachable { what: what.clone(), detail: describe(&e) })?;
        let status = resp.status();
        if !status.is_success() {
            return Err(SourceError::Http { what, status: status.as_u16(), detail: status.to_string() });
        }
        let body = resp
            .text()
            .await
            .map_err(|e| SourceError::Unreachable { what: what.clone(), detail: describe(&e) })?;
        let at = Instant::now();
        let parsed = parse(&body).map_err(|detail| SourceError::Malformed { what, detail })?;
        Ok((parsed, at))
    }

    async fn fetch_one<'a>(
        &self,
        m: &'a MemberId,
        token: Option<&str>,
    ) -> (&'a MemberId, Result<(Exposition, Instant), SourceError>) {
        (m, self.fetch(m, token).await)
    }

    pub async fn sample(&self, pools: &[&PoolQuery]) -> Vec<Result<Snapshot, SourceError>> {
        let token = match self.token.as_ref().map(|t| t.resolve()).transpose() {
            Ok(t) => t,
            Err(e) => return pools.iter().map(|_| Err(SourceError::Config(e.clone()))).collect(),
        };
        // Each member once, even when it is in several pools.
        let distinct: BTreeSet<&MemberId> = pools.iter().flat_map(|p| p.members.iter()).collect();
        // Futures built in a loop, not a closure: closures returning borrowing futures make callers'
        // futures !Send.
        let mut fetches = Vec::with_capacity(distinct.len());
        for m in distinct {
            fetches.push(self.fetch_one(m, token.as_deref()));
        }
        let fetched: HashMap<&MemberId, Result<(Exposition, Instant), SourceError>> =
            stream::iter(fetches).buffer_unordered(self.concurrency).collect().await;
        for (m, r) in &fetched {
            if let Err(e) = r {
                tracing::debug!(source = %self.name, member = %m, error = %e, "scrape failed");
            }
        }
        let mut last = self.last_latency.lock().unwrap_or_else(|p| p.into_inner());
        pools
            .iter()
            .map(|pool| {
                // Only when no member of the pool answered is the source "down" for it; single failures
                // are members without data.
                if !pool.members.is_empty()
                    && pool.members.iter().all(|m| matches!(fetched.get(m), Some(Err(_))))
                {
                    let first =
                        pool.members.iter().find_map(|m| fetched.get(m).and_then(|r| r.as_ref().err()));
                    if let Some(e) = first {
                        return Err(e.clone());
                    }
                }
                let mut values = SignalValues::new();
                let mut ages: HashMap<&MemberId, Duration> = HashMap::new();
                for m in &pool.members {
                    let Some(Ok((expo, at))) = fetched.get(m) else { continue };
                    ages.insert(m, at.elapsed());
                    let mut put = |s: Signal, v: Option<f64>| {
                        if let Some(v) = v {
                            values.entry(s).or_default().insert(m.clone(), v);
                        }
                    };
                    put(Signal::Waiting, first_of(expo, &pool.names.waiting, Agg::Sum));
                    put(Signal::Running, first_of(expo, &pool.names.running, Agg::Sum));
                    put(Signal::KvUsage, first_of(expo, &pool.names.kv_usage, Agg::Mean));
                    if let Some((hist, sum, count)) = histogram_totals(expo, &pool.names.latency_histogram) {
                        let key = (m.clone(), hist);
                        if let Some((s0, c0)) = last.insert(key, (sum, count)) {
                            let dc = count - c0;
                            // A counter that went down means the server restarted: no rate this time.
                            if dc > 0.0 && sum >= s0 {
                                put(Signal::Latency, Some((sum - s0) / dc));
                            }
                        }
                    }
                }
                Ok(assemble(&pool.members, &values, |m, _| ages.get(m).copied().unwrap_or_default()))
            })
            .collect()
    }
}

/// Parse Prometheus text exposition.
pub fn parse(body: &str) -> Result<Exposition, String> {
    // The parser wants a final newline, which some exporters omit.
    if body.ends_with('\n') {
        openmetrics_parser::prometheus::parse_prometheus(body).map_err(|e| e.to_string())
    } else {
        openmetrics_parser::prometheus::parse_prometheus(&format!("{body}\n")).map_err(|e| e.to_string())
    }
}

#[derive(Clone, Copy)]
enum Agg {
    Sum,
    Mean,
}

fn scalar(v: &PrometheusValue) -> Option<f64> {
    match v {
        PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => Some(n.as_f64()),
        PrometheusValue::Counter(c) => Some(c.value.as_f64()),
        PrometheusValue::Histogram(_) | PrometheusValue::Summary(_) => None,
    }
}

/// The value of the first metric name present, aggregated over its series (engines).
fn first_of(expo: &Exposition, names: &[String], agg: Agg) -> Option<f64> {
    names.iter().find_map(|name| {
        let fam = expo.families.get(name)?;
        let vals: Vec<f64> = fam.iter_samples().filter_map(|s| scalar(&s.value)).collect();
        if vals.is_empty() {
            return None;
        }
        let sum: f64 = vals.iter().sum();
        Some(match agg {
            Agg::Sum => sum,
            Agg::Mean => sum / vals.len() as f64,
        })
    })
}

/// `(name, sum, count)` of the first latency histogram present, summed over its series.
fn histogram_totals(expo: &Exposition, names: &[String]) -> Option<(String, f64, f64)> {
    names.iter().find_map(|name| {
        let fam = expo.families.get(name)?;
        let (mut sum, mut count, mut any) = (0.0, 0.0, false);
        for s in fam.iter_samples() {
            if let PrometheusValue::Histogram(h) = &s.value {
                sum += h.sum.as_ref().map(|n| n.as_f64()).unwrap_or(0.0);
                count += h.count.unwrap_or(0) as f64;
                any = true;
            }
        }
        any.then(|| (name.clone(), sum, count))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM_TEXT: &str = r#"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 6.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.7
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m \"quoted\", with comma"} 12.0
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 8.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 4.0
"#;

    fn names() -> crate::source::profile::MetricNames {
        crate::source::profile::ProfileName::Vllm.metric_names()
    }

    #[test]
    fn vllm_text_sums_engines_and_averages_kv() {
        let e = parse(VLLM_TEXT).expect("parses");
        let n = names();
        assert_eq!(first_of(&e, &n.waiting, Agg::Sum), Some(5.0));
        assert_eq!(first_of(&e, &n.running, Agg::Sum), Some(16.0));
        let kv = first_of(&e, &n.kv_usage, Agg::Mean).expect("kv");
        assert!((kv - 0.6).abs() < 1e-9);
        assert_eq!(
            histogram_totals(&e, &n.latency_histogram),
            Some(("vllm:e2e_request_latency_seconds".into(), 8.0, 4.0))
        );
    }

    #[test]
    fn legacy_kv_name_is_read_when_the_new_one_is_absent() {
        let text = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.25";
        let e = parse(text).expect("parses without final newline");
        assert_eq!(first_of(&e, &names().kv_usage, Agg::Mean), Some(0.25));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(parse("vllm:num_requests_waiting{engine=\"0\" 3\n").is_err());
    }
}
