//! Direct-scrape source: GET each member's Prometheus text page, with bounded concurrency.
//!
//! Fresher than Prometheus (no scrape interval in between) at the cost of one request per member per
//! cycle. Queue and running counts are summed over vLLM's per-`engine` series, KV usage averaged.
//! Mean processing and service times need two scrapes: each is the growth of its histogram's sum
//! over the growth of its count since the previous cycle, so the source keeps the last totals per
//! member and histogram.
//!
//! Each body is read as a stream and scanned chunk by chunk as it arrives ([`super::exposition`]),
//! only for the names the member's pools need, and refused past `max_body_bytes`: one member serving
//! a huge or slow page costs bounded memory and CPU, and the cycle's deadline can interrupt it
//! between chunks. Members that cannot be read are listed in the snapshot's `failures` with a reason.
//!
//! A slow member costs only itself: within a cycle each member's reads (its page, then `/props`)
//! share one budget, the cycle's deadline less a margin ([`ScrapeSource::sample_within`]). A page
//! the budget cuts short is that member's failure (`timeout`, named in the log by the controller);
//! a `/props` read cut short is recorded as a failed read, so its retry interval applies and the
//! page still counts. The other members' samples arrive either way.
//!
//! Counter ratios (llama.cpp's time per generated token, prompt-cache share) are rated the same
//! way as histograms. Slot counts of servers that publish them at `GET /props` (llama.cpp) are read
//! there, rarely ([`super::props`]); a pool's configured `slots` fill in where that fails.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use llm_lc_adapters::{MemberId, MemberMap, SecretRef};

use super::config::ScrapeConfig;
use super::exposition::{ReadError, Reader, Reading, Wanted};
use super::profile::{CounterRatio, MetricNames};
use super::props::{self, Due, SlotCache};
use super::{
    assemble, describe, http_client, FailureReason, MemberFailure, PoolQuery, Rejected, Signal, SignalValues,
    Snapshot, SourceError,
};

pub struct ScrapeSource {
    name: String,
    client: reqwest::Client,
    scheme: String,
    path: String,
    concurrency: usize,
    max_body_bytes: usize,
    token: Option<SecretRef>,
    /// Last (sum, count) of each member's timing histograms and counter ratios, for the rate
    /// between cycles.
    last_latency: Mutex<HashMap<(MemberId, String), (f64, f64)>>,
    /// Slot counts from `GET /props`.
    slots: Mutex<SlotCache>,
}

/// Why a member could not be read: the bounded reason and the error.
type Failure = (FailureReason, SourceError);

/// One member's page as read this cycle.
#[derive(Debug)]
pub struct Page {
    reading: Reading,
    at: Instant,
    /// Its slot count, where its server publishes one (known from an earlier read or read now).
    slots: Option<f64>,
    /// Why `/props` could not be read, when a read was tried this cycle and failed.
    props_error: Option<String>,
}

impl Page {
    fn new(reading: Reading, at: Instant) -> Page {
        Page { reading, at, slots: None, props_error: None }
    }
}

/// What a member's pools want of it beyond its page.
#[derive(Debug, Default)]
struct Wants {
    page: Wanted,
    /// Its slot count from `/props`, and the counter whose fall tells a restart.
    props: Option<Option<String>>,
}

/// The sample names a pool needs from each member's page.
pub fn wanted(names: &MetricNames, into: &mut Wanted) {
    for n in
        names.waiting.iter().chain(&names.running).chain(&names.kv_usage).chain(&names.prompt_cached_gauge)
    {
        into.add(n);
    }
    for h in names.latency_histogram.iter().chain(&names.service_histogram).chain(&names.queue_histogram) {
        into.add(&format!("{h}_sum"));
        into.add(&format!("{h}_count"));
    }
    for r in names.token_time.iter().chain(&names.prompt_cached) {
        for c in r.counters() {
            into.add(c);
        }
    }
}

/// The counter that tells a restart of a server whose slots come from `/props`: any counter of
/// its page goes down then; the first one its pool reads is enough.
fn restart_marker(names: &MetricNames) -> Option<String> {
    names.token_time.iter().chain(&names.prompt_cached).flat_map(|r| r.counters()).next().cloned()
}

/// Read a whole page for the names of every built-in profile, under the default cap: whether the
/// scrape source can read it (tests of other servers' pages use it).
pub fn parse(body: &str) -> Result<Reading, String> {
    use super::profile::ProfileName::*;
    let mut w = Wanted::default();
    for p in [Vllm, VllmLegacy, Sglang, Trtllm, Nim, Tgi, Llamacpp] {
        wanted(&p.metric_names(), &mut w);
    }
    super::exposition::read(body.as_bytes(), w, super::exposition::DEFAULT_MAX_BYTES)
        .map_err(|e| e.to_string())
}

impl ScrapeSource {
    pub fn new(name: &str, cfg: &ScrapeConfig) -> Result<Self, SourceError> {
        if cfg.insecure_skip_verify {
            tracing::warn!(source = name, "TLS certificate verification is OFF for this scrape source");
        }
        let client =
            http_client(cfg.timeout, cfg.ca_file.as_deref(), cfg.insecure_skip_verify, &Default::default())?;
        Ok(ScrapeSource {
            name: name.to_string(),
            client,
            scheme: cfg.scheme.clone(),
            path: cfg.path.clone(),
            concurrency: cfg.concurrency.max(1),
            max_body_bytes: cfg.max_body_bytes,
            token: cfg.bearer_token.clone(),
            last_latency: Mutex::new(HashMap::new()),
            slots: Mutex::new(SlotCache::default()),
        })
    }

    /// `GET /props` of `member`: its `total_slots`, or why not.
    async fn read_props(&self, member: &MemberId, token: Option<&str>) -> Result<f64, String> {
        let url = format!("{}://{}/props", self.scheme, member);
        let mut req = self.client.get(&url);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let mut resp = req.send().await.map_err(|e| format!("GET /props: {}", describe(&e)))?;
        if !resp.status().is_success() {
            return Err(format!("GET /props answered HTTP {}", resp.status().as_u16()));
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| format!("GET /props: {}", describe(&e)))? {
            if body.len() + chunk.len() > props::MAX_BYTES {
                return Err(format!("/props is larger than {} bytes", props::MAX_BYTES));
            }
            body.extend_from_slice(&chunk);
        }
        props::parse_total_slots(&body)
    }

    /// The page of `m`, with its slot count from `/props` where its pools want one, both read
    /// before `by` (when given).
    async fn fetch_page(
        &self,
        m: &MemberId,
        wants: Wants,
        token: Option<&str>,
        by: Option<Budget>,
    ) -> Result<Page, Failure> {
        let mut page = match within(by, self.fetch(m, wants.page, token)).await {
            Some(r) => r?,
            None => {
                let detail = by.map(|b| b.cut_short()).unwrap_or_default();
                let what = format!("scrape source {:?} member {m}", self.name);
                return Err((FailureReason::Timeout, SourceError::Unreachable { what, detail }));
            }
        };
        let Some(marker_name) = wants.props else { return Ok(page) };
        let marker = marker_name.as_deref().and_then(|n| page.reading.get(n)).map(|t| t.sum);
        let due = self.slots.lock().unwrap_or_else(|p| p.into_inner()).due(m, marker, Instant::now());
        page.slots = match due {
            Due::Keep(slots) => slots,
            Due::Read => {
                let result = match within(by, self.read_props(m, token)).await {
                    Some(r) => r,
                    None => Err(format!("GET /props: {}", by.map(|b| b.cut_short()).unwrap_or_default())),
                };
                let mut cache = self.slots.lock().unwrap_or_else(|p| p.into_inner());
                if cache.record(m, marker, &result, Instant::now()) {
                    if let Err(e) = &result {
                        tracing::warn!(
                            source = %self.name,
                            member = %m,
                            error = %e,
                            "cannot read the server's slot count; using what its metrics page shows \
                             (and the pool's `slots`, if given)"
                        );
                    }
                }
                page.props_error = result.as_ref().err().cloned();
                cache.get(m)
            }
        };
        Ok(page)
    }

    async fn fetch(&self, member: &MemberId, wanted: Wanted, token: Option<&str>) -> Result<Page, Failure> {
        let url = format!("{}://{}{}", self.scheme, member, self.path);
        let what = format!("scrape source {:?} member {member}", self.name);
        let transport = |e: reqwest::Error| {
            let reason = if e.is_timeout() { FailureReason::Timeout } else { FailureReason::Unreachable };
            (reason, SourceError::Unreachable { what: what.clone(), detail: describe(&e) })
        };
        let mut req = self.client.get(&url);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let mut resp = req.send().await.map_err(transport)?;
        let status = resp.status();
        if !status.is_success() {
            return Err((
                FailureReason::HttpStatus,
                SourceError::Http { what, status: status.as_u16(), detail: status.to_string() },
            ));
        }
        let too_large = || {
            (
                FailureReason::TooLarge,
                SourceError::TooLarge { what: what.clone(), limit: self.max_body_bytes },
            )
        };
        if resp.content_length().is_some_and(|n| n > self.max_body_bytes as u64) {
            return Err(too_large());
        }
        let mut reader = Reader::new(wanted, self.max_body_bytes);
        let unreadable = |e: ReadError| match e {
            ReadError::TooLarge { .. } => too_large(),
            e @ ReadError::Malformed { .. } => (
                FailureReason::Unreadable,
                SourceError::Malformed { what: what.clone(), detail: e.to_string() },
            ),
        };
        // Scanned as it arrives: each chunk costs microseconds, and between chunks the task yields,
        // so the client timeout and the cycle deadline apply to a slow or huge page.
        while let Some(chunk) = resp.chunk().await.map_err(transport)? {
            reader.feed(&chunk).map_err(unreadable)?;
        }
        let at = Instant::now();
        let reading = reader.finish().map_err(unreadable)?;
        Ok(Page::new(reading, at))
    }

    async fn fetch_one<'a>(
        &self,
        m: &'a MemberId,
        wants: Wants,
        token: Option<&str>,
        by: Option<Budget>,
    ) -> (&'a MemberId, Result<Page, Failure>) {
        (m, self.fetch_page(m, wants, token, by).await)
    }

    /// Sample every pool given, each member's reads bounded only by the client's timeout.
    pub async fn sample(&self, pools: &[&PoolQuery]) -> Vec<Result<Snapshot, SourceError>> {
        self.sample_within(pools, None).await
    }

    /// Sample every pool given, every member's reads done within `budget` from now (when given):
    /// a member still reading then is its own failure, not the whole sample's.
    pub async fn sample_within(
        &self,
        pools: &[&PoolQuery],
        budget: Option<Duration>,
    ) -> Vec<Result<Snapshot, SourceError>> {
        let by = budget.map(|b| Budget { until: tokio::time::Instant::now() + b, length: b });
        let token = match self.token.as_ref().map(|t| t.resolve()).transpose() {
            Ok(t) => t,
            Err(e) => return pools.iter().map(|_| Err(SourceError::Config(e.clone()))).collect(),
        };
        // Each member once, even when it is in several pools; read for the names all of them need.
        let mut wants: HashMap<&MemberId, Wants> = HashMap::new();
        for p in pools {
            for m in &p.members {
                let w = wants.entry(m).or_default();
                wanted(&p.names, &mut w.page);
                if p.names.slots_from_props && w.props.is_none() {
                    w.props = Some(restart_marker(&p.names));
                }
            }
        }
        let distinct: BTreeSet<&MemberId> = wants.keys().copied().collect();
        // Futures built in a loop, not a closure: closures returning borrowing futures make callers'
        // futures !Send.
        let mut fetches = Vec::with_capacity(distinct.len());
        for m in distinct {
            let w = wants.remove(m).unwrap_or_default();
            fetches.push(self.fetch_one(m, w, token.as_deref(), by));
        }
        let fetched: HashMap<&MemberId, Result<Page, Failure>> =
            stream::iter(fetches).buffer_unordered(self.concurrency).collect().await;
        // A member that left, or whose page failed (it may be restarting with other slots), has its
        // slot count read again when it is back.
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|m| matches!(fetched.get(m), Some(Ok(_))));
        for (m, r) in &fetched {
            if let Err((_, e)) = r {
                tracing::debug!(source = %self.name, member = %m, error = %e, "scrape failed");
            }
        }
        let mut last = self.last_latency.lock().unwrap_or_else(|p| p.into_inner());
        // Members that left take their counters with them: a member that comes back starts a new
        // window instead of one mean over its whole absence, and pod churn does not grow the map.
        last.retain(|(m, _), _| fetched.contains_key(m));
        // One mean per member and histogram per sample, shared by every pool the member is in: the
        // counters' baseline moves once, so a second pool does not see a zero-length window.
        let mut means = HashMap::new();
        pools.iter().map(|pool| pool_snapshot(pool, &fetched, &mut last, &mut means)).collect()
    }
}

/// The time one sample's reads of each member must end by.
#[derive(Debug, Clone, Copy)]
struct Budget {
    until: tokio::time::Instant,
    length: Duration,
}

impl Budget {
    fn cut_short(&self) -> String {
        format!(
            "no answer within the cycle's budget of {:?} (the interval, less a margin); the other \
             members are read all the same",
            self.length
        )
    }
}

/// `fut`, or `None` if `by` came first.
async fn within<T>(by: Option<Budget>, fut: impl std::future::Future<Output = T>) -> Option<T> {
    match by {
        Some(b) => tokio::time::timeout_at(b.until, fut).await.ok(),
        None => Some(fut.await),
    }
}

/// The growth of `(numerator, denominator)` since the last cycle, per member and key: the mean of a
/// histogram (sum over count), or a ratio of counters. Computed once per member and key per cycle
/// (`means`), so several pools share one window. A total that went down is a restart: no value.
fn rated(
    m: &MemberId,
    key: String,
    now: (f64, f64),
    last: &mut HashMap<(MemberId, String), (f64, f64)>,
    means: &mut HashMap<(MemberId, String), Option<f64>>,
) -> Option<f64> {
    let key = (m.clone(), key);
    *means.entry(key.clone()).or_insert_with(|| {
        let (n0, d0) = last.insert(key, now)?;
        let dd = now.1 - d0;
        (dd > 0.0 && now.0 >= n0).then(|| (now.0 - n0) / dd)
    })
}

/// The totals a counter ratio needs from a page: `None` unless every counter is there.
fn ratio_totals(r: &CounterRatio, reading: &Reading) -> Option<(f64, f64)> {
    let sum = |names: &[String]| names.iter().map(|n| reading.get(n).map(|t| t.sum)).sum::<Option<f64>>();
    Some((sum(&r.numerators)?, sum(&r.denominators)?))
}

fn pool_snapshot(
    pool: &PoolQuery,
    fetched: &HashMap<&MemberId, Result<Page, Failure>>,
    last: &mut HashMap<(MemberId, String), (f64, f64)>,
    means: &mut HashMap<(MemberId, String), Option<f64>>,
) -> Result<Snapshot, SourceError> {
    // Only when no member of the pool answered is the source "down" for it; single failures are
    // members without data, listed in `failures`.
    if !pool.members.is_empty() && pool.members.iter().all(|m| matches!(fetched.get(m), Some(Err(_)))) {
        let first = pool.members.iter().find_map(|m| fetched.get(m).and_then(|r| r.as_ref().err()));
        if let Some((_, e)) = first {
            return Err(e.clone());
        }
    }
    let mut values = SignalValues::new();
    let mut ages: HashMap<&MemberId, Duration> = HashMap::new();
    let mut failures = Vec::new();
    let mut props_errors = Vec::new();
    for m in &pool.members {
        let page = match fetched.get(m) {
            Some(Ok(p)) => p,
            Some(Err((reason, e))) => {
                failures.push(MemberFailure { member: m.clone(), reason: *reason, detail: e.to_string() });
                continue;
            }
            None => continue,
        };
        let reading = &page.reading;
        ages.insert(m, page.at.elapsed());
        let mut put = |s: Signal, v: Option<f64>| {
            if let Some(v) = v {
                let n = pool.members.len();
                values.entry(s).or_insert_with(|| MemberMap::with_capacity(n)).insert(m.clone(), v);
            }
        };
        // The first name present wins: one profile reads servers on both sides of a rename.
        let first = |names: &[String]| names.iter().find_map(|n| reading.get(n));
        let waiting = first(&pool.names.waiting);
        let running = first(&pool.names.running);
        put(Signal::Waiting, waiting.map(|t| t.sum));
        put(Signal::Running, running.map(|t| t.sum));
        put(Signal::KvUsage, first(&pool.names.kv_usage).map(|t| t.mean()));
        if waiting.is_none() || running.is_none() {
            let missing = if waiting.is_none() { &pool.names.waiting } else { &pool.names.running };
            failures.push(MemberFailure {
                member: m.clone(),
                reason: FailureReason::NoSeries,
                detail: format!("the metrics page has none of {missing:?}; is the pool's `profile` right?"),
            });
        }
        for (signal, names) in [
            (Signal::Latency, &pool.names.latency_histogram),
            (Signal::Service, &pool.names.service_histogram),
            (Signal::QueueTime, &pool.names.queue_histogram),
        ] {
            let hist = names.iter().find_map(|h| {
                let sum = reading.get(&format!("{h}_sum"))?;
                let count = reading.get(&format!("{h}_count"))?;
                Some((h.clone(), sum.sum, count.sum))
            });
            if let Some((hist, sum, count)) = hist {
                put(signal, rated(m, hist, (sum, count), last, means));
            }
        }
        for (signal, ratio) in
            [(Signal::TokenTime, &pool.names.token_time), (Signal::PromptCached, &pool.names.prompt_cached)]
        {
            if let Some((r, totals)) = ratio.as_ref().and_then(|r| Some((r, ratio_totals(r, reading)?))) {
                put(signal, rated(m, format!("{signal:?}:{}", r.numerators.join("+")), totals, last, means));
            }
        }
        if pool.names.prompt_cached.is_none() {
            put(Signal::PromptCached, first(&pool.names.prompt_cached_gauge).map(|t| t.mean()));
        }
        if pool.names.slots_from_props {
            if let Some(e) = &page.props_error {
                props_errors.push((m.clone(), e.clone()));
            }
        }
        // The server's own count first; the pool's configured one where it has none.
        put(Signal::Slots, page.slots.or_else(|| pool.slots.of(m)));
    }
    let mut snap = assemble(&pool.members, &values, |m, _| ages.get(m).copied().unwrap_or_default());
    snap.failures = failures;
    for (member, _) in props_errors {
        snap.rejected.push(Rejected {
            member,
            signal: Signal::Slots,
            reason: "props_unreadable",
            value: f64::NAN,
        });
    }
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::exposition::read;

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
# TYPE vllm:request_inference_time_seconds histogram
vllm:request_inference_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_inference_time_seconds_sum{engine="0",model_name="m"} 3.0
vllm:request_inference_time_seconds_count{engine="0",model_name="m"} 4.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 4.0
"#;

    fn names() -> MetricNames {
        crate::source::profile::ProfileName::Vllm.metric_names()
    }

    fn pool(members: &[&str]) -> PoolQuery {
        PoolQuery {
            members: members.iter().map(|m| MemberId::from(*m)).collect(),
            names: names(),
            queries: vec![],
            join: super::super::Join::new(&Default::default()).expect("join"),
            labels: None,
            slots: Default::default(),
        }
    }

    fn reading(text: &str) -> Reading {
        let mut w = Wanted::default();
        wanted(&names(), &mut w);
        read(text.as_bytes(), w, 1 << 20).expect("reads")
    }

    #[test]
    fn vllm_text_sums_engines_averages_kv_and_rates_latency() {
        let page = reading(VLLM_TEXT);
        let later = reading(
            &VLLM_TEXT
                .replace(
                    "inference_time_seconds_sum{engine=\"0\",model_name=\"m\"} 3.0",
                    "inference_time_seconds_sum{engine=\"0\",model_name=\"m\"} 7.0",
                )
                .replace(
                    "inference_time_seconds_count{engine=\"0\",model_name=\"m\"} 4.0",
                    "inference_time_seconds_count{engine=\"0\",model_name=\"m\"} 8.0",
                )
                .replace(
                    "queue_time_seconds_sum{engine=\"0\",model_name=\"m\"} 1.0",
                    "queue_time_seconds_sum{engine=\"0\",model_name=\"m\"} 9.0",
                )
                .replace(
                    "_sum{engine=\"0\",model_name=\"m\"} 8.0",
                    "_sum{engine=\"0\",model_name=\"m\"} 20.0",
                )
                .replace(
                    "_count{engine=\"0\",model_name=\"m\"} 4.0",
                    "_count{engine=\"0\",model_name=\"m\"} 8.0",
                ),
        );
        let p = pool(&["a:1"]);
        let m = MemberId::from("a:1");
        let mut last = HashMap::new();
        let first: HashMap<&MemberId, Result<Page, Failure>> =
            [(&m, Ok(Page::new(page, Instant::now())))].into_iter().collect();
        let snap = pool_snapshot(&p, &first, &mut last, &mut HashMap::new()).expect("snapshot");
        let s = snap.members[&m].as_ref().expect("sample");
        assert_eq!((s.waiting, s.running), (5.0, 16.0));
        assert!((s.kv_usage.expect("kv") - 0.6).abs() < 1e-9);
        assert_eq!(s.latency, None, "needs two scrapes");
        let second: HashMap<&MemberId, Result<Page, Failure>> =
            [(&m, Ok(Page::new(later, Instant::now())))].into_iter().collect();
        let snap = pool_snapshot(&p, &second, &mut last, &mut HashMap::new()).expect("snapshot");
        let s = snap.members[&m].as_ref().expect("sample");
        assert_eq!(s.latency, Some(3.0), "(20-8)/(8-4)");
        assert_eq!(s.service, Some(1.0), "time running, its own histogram: (7-3)/(8-4)");
        assert_eq!(s.queue_time, Some(2.0), "time queued, its own histogram: (9-1)/(8-4)");
        assert!(snap.failures.is_empty());
    }

    #[test]
    fn a_real_llama_server_page_gives_its_queue_speed_and_cache_reuse() {
        // Captured from llama-server (4 slots, 6 requests in flight: 4 running, 2 deferred).
        let page = include_str!("../../tests/llamacpp/fixtures/metrics-busy.txt");
        let names = crate::source::profile::ProfileName::Llamacpp.metric_names();
        let read_page = |text: &str| {
            let mut w = Wanted::default();
            wanted(&names, &mut w);
            read(text.as_bytes(), w, 1 << 20).expect("reads")
        };
        let p = PoolQuery { names: names.clone(), ..pool(&["a:1"]) };
        let m = MemberId::from("a:1");
        let mut last = HashMap::new();
        let mut page1 = Page::new(read_page(page), Instant::now());
        page1.slots = Some(4.0);
        let first: HashMap<&MemberId, Result<Page, Failure>> = [(&m, Ok(page1))].into_iter().collect();
        let snap = pool_snapshot(&p, &first, &mut last, &mut HashMap::new()).expect("snapshot");
        let s = snap.members[&m].as_ref().expect("sample");
        assert_eq!((s.waiting, s.running, s.kv_usage, s.slots), (2.0, 4.0, None, Some(4.0)));
        assert_eq!((s.token_time, s.prompt_cached), (None, None), "rates need two pages");
        // 128 more tokens in 0.5 s of generation and 0.02 s of prompt; 48 prompt tokens, 16 cached.
        let later = page
            .replace("tokens_predicted_total 128", "tokens_predicted_total 256")
            .replace("tokens_predicted_seconds_total 0.301402", "tokens_predicted_seconds_total 0.801402")
            .replace("prompt_seconds_total 0.051844", "prompt_seconds_total 0.071844")
            .replace("prompt_tokens_total 56", "prompt_tokens_total 88")
            .replace("prompt_tokens_cached_total 8", "prompt_tokens_cached_total 24");
        let second: HashMap<&MemberId, Result<Page, Failure>> =
            [(&m, Ok(Page::new(read_page(&later), Instant::now())))].into_iter().collect();
        // No slot count from /props this time and none configured: none in the sample.
        let snap = pool_snapshot(&p, &second, &mut last, &mut HashMap::new()).expect("snapshot");
        let s = snap.members[&m].as_ref().expect("sample");
        assert!((s.token_time.expect("token time") - 0.52 / 128.0).abs() < 1e-9, "{s:?}");
        assert!((s.prompt_cached.expect("cache share") - 16.0 / 48.0).abs() < 1e-9, "{s:?}");
        assert_eq!(s.slots, None);
        // The pool's configured count fills in where the server's own is unknown.
        let configured = PoolQuery {
            slots: crate::source::config::SlotsConfig { default: Some(3), ..Default::default() },
            ..p.clone()
        };
        let snap = pool_snapshot(&configured, &second, &mut last, &mut HashMap::new()).expect("snapshot");
        assert_eq!(snap.members[&m].as_ref().and_then(|s| s.slots), Some(3.0));
    }

    #[test]
    fn legacy_kv_name_is_read_when_the_new_one_is_absent() {
        let r = reading("vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.25");
        assert_eq!(names().kv_usage.iter().find_map(|n| r.get(n)).map(|t| t.mean()), Some(0.25));
    }

    #[test]
    fn failed_members_are_listed_with_their_reason_and_the_rest_still_read() {
        let p = pool(&["a:1", "b:1", "c:1"]);
        let (a, b, c) = (MemberId::from("a:1"), MemberId::from("b:1"), MemberId::from("c:1"));
        let too_large = SourceError::TooLarge { what: "member b:1".into(), limit: 10 };
        let fetched: HashMap<&MemberId, Result<Page, Failure>> = [
            (&a, Ok(Page::new(reading(VLLM_TEXT), Instant::now()))),
            (&b, Err((FailureReason::TooLarge, too_large))),
            (&c, Ok(Page::new(reading("unrelated_metric 1\n"), Instant::now()))),
        ]
        .into_iter()
        .collect();
        let snap = pool_snapshot(&p, &fetched, &mut HashMap::new(), &mut HashMap::new())
            .expect("one member answered");
        assert!(snap.members[&a].is_some());
        assert!(snap.members[&b].is_none() && snap.members[&c].is_none());
        let got: Vec<_> = snap.failures.iter().map(|f| (f.member.as_str(), f.reason.as_str())).collect();
        assert_eq!(got, vec![("b:1", "too_large"), ("c:1", "no_series")]);
        assert!(snap.failures[0].detail.contains("more than 10 bytes"), "{:?}", snap.failures);
    }
}
