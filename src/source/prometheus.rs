//! Prometheus / Thanos Querier source: instant PromQL queries, one per signal per cycle for all pools.
//!
//! Pools that share this source and need the same query (same profile, selector and join label) share
//! its result, so adding pools does not multiply the load on Prometheus. Results are joined to members
//! by the join label. The bearer token is re-read per cycle so rotated service-account tokens work.
//!
//! The HTTP API client is ours (a GET and a small JSON shape) rather than a crate's, for three things
//! the crate did not do: keep the query parameters of the configured URL on every request (Thanos
//! tenancy on port 9092 needs `?namespace=`), report a non-2xx answer as an HTTP error whatever its
//! body, and bound the answer's size. Every answer is checked before use: sample timestamps that are
//! not finite or lie in the future make that member's sample invalid (never a panic, never "fresh").

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::join_all;
use llm_lc_adapters::{MemberId, MemberMap, SecretRef};
use serde::Deserialize;

use super::config::{query_url, PrometheusConfig};
use super::{
    assemble, describe, http_client, FailureReason, Join, MemberFailure, PoolQuery, Rejected, Signal,
    SignalValues, Snapshot, SourceError,
};

/// Largest query answer read. One series per member per query: even 10,000 members stay far below.
const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// A sample timestamp this far ahead of our clock is still accepted (clock skew between hosts).
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(5);

/// Ages are capped here: an absurdly old timestamp is simply very stale.
const MAX_AGE: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

pub struct PrometheusSource {
    name: String,
    client: reqwest::Client,
    /// `.../api/v1/query` with the configured URL's own query parameters.
    query_url: url::Url,
    token: Option<SecretRef>,
}

/// Raw rows of one query: the label set and the sample `(timestamp, value)`.
type Rows = Vec<(HashMap<String, String>, f64, f64)>;

/// A query's rows by member (value, evaluation time), built once per cycle for each join that
/// reads them. Rows come in Prometheus' order; one sort puts them in member order, and a member
/// given twice keeps its last row.
#[derive(Default)]
struct RowIndex<'q> {
    built: HashMap<(&'q str, String), MemberMap<(f64, f64)>>,
}

impl<'q> RowIndex<'q> {
    fn of(&mut self, query: &'q str, rows: &Rows, join: &Join) -> &MemberMap<(f64, f64)> {
        let key = (query, format!("{:?}", join.key()));
        self.built.entry(key).or_insert_with(|| {
            rows.iter()
                .filter_map(|(labels, ts, v)| Some((join.member(labels.get(&join.label)?), (*v, *ts))))
                .collect()
        })
    }
}

#[derive(Deserialize)]
struct Answer {
    status: String,
    #[serde(default)]
    data: Option<Data>,
    #[serde(default, rename = "errorType")]
    error_type: Option<String>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Deserialize)]
struct Data {
    #[serde(rename = "resultType")]
    result_type: String,
    #[serde(default)]
    result: serde_json::Value,
}

#[derive(Deserialize)]
struct VectorSample {
    #[serde(default)]
    metric: HashMap<String, String>,
    /// `[unix seconds, "value"]`; absent for native-histogram samples, which we skip.
    #[serde(default)]
    value: Option<(f64, String)>,
}

/// The age of a sample stamped `ts` (unix seconds) at `now`, or why the stamp is unusable.
pub fn age_of_timestamp(now: f64, ts: f64) -> Result<Duration, &'static str> {
    if !ts.is_finite() {
        return Err("timestamp_not_finite");
    }
    if ts > now + MAX_CLOCK_SKEW.as_secs_f64() {
        return Err("timestamp_in_future");
    }
    Ok(Duration::try_from_secs_f64((now - ts).max(0.0)).unwrap_or(MAX_AGE).min(MAX_AGE))
}

impl PrometheusSource {
    pub fn new(name: &str, cfg: &PrometheusConfig) -> Result<Self, SourceError> {
        if cfg.insecure_skip_verify {
            tracing::warn!(source = name, "TLS certificate verification is OFF for this Prometheus source");
        }
        let client =
            http_client(cfg.timeout, cfg.ca_file.as_deref(), cfg.insecure_skip_verify, &cfg.headers)?;
        let query_url =
            query_url(&cfg.url).map_err(|e| SourceError::Config(format!("sources.{name}.url: {e}")))?;
        Ok(PrometheusSource { name: name.to_string(), client, query_url, token: cfg.bearer_token.clone() })
    }

    fn what(&self) -> String {
        format!("prometheus source {:?}", self.name)
    }

    async fn query(&self, promql: &str, token: Option<&str>) -> Result<Rows, SourceError> {
        let mut url = self.query_url.clone();
        url.query_pairs_mut().append_pair("query", promql);
        let mut req = self.client.get(url);
        if let Some(t) = token {
            let value = reqwest::header::HeaderValue::from_str(&format!("Bearer {t}")).map_err(|_| {
                SourceError::Config("bearer token contains characters not allowed in a header".into())
            })?;
            req = req.header(reqwest::header::AUTHORIZATION, value);
        }
        let unreachable =
            |e: reqwest::Error| SourceError::Unreachable { what: self.what(), detail: describe(&e) };
        let mut resp = req.send().await.map_err(unreachable)?;
        let status = resp.status();
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(unreachable)? {
            if body.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(SourceError::TooLarge { what: self.what(), limit: MAX_ANSWER_BYTES });
            }
            body.extend_from_slice(&chunk);
        }
        let answer: Result<Answer, _> = serde_json::from_slice(&body);
        if !status.is_success() {
            // Prometheus answers a bad query with 400/422 and a JSON error: that is the query's fault.
            // Anything else not 2xx (a proxy's 500 page, 503 overload, 401) is an HTTP error.
            if let (Ok(a), 400 | 422) = (&answer, status.as_u16()) {
                if a.status == "error" {
                    return Err(SourceError::Query {
                        query: promql.to_string(),
                        detail: format!(
                            "{}: {}",
                            a.error_type.as_deref().unwrap_or("error"),
                            a.error.as_deref().unwrap_or("")
                        ),
                    });
                }
            }
            let detail = match &answer {
                Ok(a) if a.error.is_some() => a.error.clone().unwrap_or_default(),
                _ => excerpt(&body),
            };
            return Err(SourceError::Http { what: self.what(), status: status.as_u16(), detail });
        }
        let answer = answer.map_err(|e| SourceError::Malformed {
            what: self.what(),
            detail: format!("answer is not Prometheus API JSON: {e}"),
        })?;
        if answer.status != "success" {
            return Err(SourceError::Query {
                query: promql.to_string(),
                detail: answer.error.unwrap_or_else(|| format!("status {:?}", answer.status)),
            });
        }
        let data = answer.data.ok_or_else(|| SourceError::Malformed {
            what: self.what(),
            detail: "answer has no `data`".into(),
        })?;
        if data.result_type != "vector" {
            return Err(SourceError::Malformed {
                what: self.what(),
                detail: format!("query {promql:?} returned a {}, not an instant vector", data.result_type),
            });
        }
        let samples: Vec<VectorSample> = serde_json::from_value(data.result).map_err(|e| {
            SourceError::Malformed { what: self.what(), detail: format!("vector result of {promql:?}: {e}") }
        })?;
        let mut rows = Vec::with_capacity(samples.len());
        for s in samples {
            let Some((ts, v)) = s.value else { continue };
            // Prometheus writes values as strings: "1.5", "NaN", "+Inf", "-Inf".
            let v = v.parse::<f64>().map_err(|_| SourceError::Malformed {
                what: self.what(),
                detail: format!("query {promql:?}: value {v:?} is not a number"),
            })?;
            rows.push((s.metric, ts, v));
        }
        Ok(rows)
    }

    fn token(&self) -> Result<Option<String>, SourceError> {
        self.token.as_ref().map(|t| t.resolve().map_err(SourceError::Config)).transpose()
    }

    pub async fn sample(&self, pools: &[&PoolQuery]) -> Vec<Result<Snapshot, SourceError>> {
        let token = match self.token() {
            Ok(t) => t,
            Err(e) => return pools.iter().map(|_| Err(e.clone())).collect(),
        };
        // Each distinct query once, however many pools need it.
        let distinct: BTreeSet<&str> = pools
            .iter()
            .flat_map(|p| {
                p.queries.iter().map(|(_, q)| q.as_str()).chain(p.labels.as_ref().map(|(q, _)| q.as_str()))
            })
            .collect();
        // A loop, not a closure: closures returning borrowing futures make callers' futures !Send.
        let mut queries = Vec::with_capacity(distinct.len());
        for q in &distinct {
            queries.push(self.query(q, token.as_deref()));
        }
        let results = join_all(queries).await;
        let by_query: BTreeMap<&str, Result<Rows, SourceError>> = distinct.into_iter().zip(results).collect();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        // Each query's rows are indexed by member once per join, not once per pool: 1,000 pools
        // sharing one query would otherwise each walk every row.
        let mut index = RowIndex::default();
        pools.iter().map(|pool| self.pool_snapshot(pool, &by_query, &mut index, now)).collect()
    }

    fn pool_snapshot<'q>(
        &self,
        pool: &PoolQuery,
        by_query: &'q BTreeMap<&'q str, Result<Rows, SourceError>>,
        index: &mut RowIndex<'q>,
        now: f64,
    ) -> Result<Snapshot, SourceError> {
        let mut values = SignalValues::new();
        let mut eval_time: MemberMap<f64> = MemberMap::with_capacity(pool.members.len());
        for (signal, q) in &pool.queries {
            let (query, rows) = match by_query.get_key_value(q.as_str()) {
                Some((query, Ok(rows))) => (*query, rows),
                // Without the core signals nothing is known; optional ones just go missing.
                Some((_, Err(e))) if matches!(signal, Signal::Waiting | Signal::Running) => {
                    return Err(e.clone())
                }
                Some((_, Err(e))) => {
                    tracing::debug!(source = %self.name, signal = signal.as_str(), error = %e, "optional signal unavailable");
                    continue;
                }
                None => continue,
            };
            let by_member = index.of(query, rows, &pool.join);
            let mut column = MemberMap::with_capacity(pool.members.len());
            for (m, found) in pool.members.iter().zip(by_member.aligned(pool.members.iter())) {
                if let Some(&(v, ts)) = found {
                    column.insert(m.clone(), v);
                    eval_time.insert(m.clone(), ts);
                }
            }
            values.insert(*signal, column);
        }
        // Slot counts are configuration here: no series carries llama.cpp's.
        if !pool.slots.is_empty() {
            let column: MemberMap<f64> =
                pool.members.iter().filter_map(|m| Some((m.clone(), pool.slots.of(m)?))).collect();
            values.insert(Signal::Slots, column);
        }
        // Ages first: a member whose timestamp cannot be trusted gets no sample at all (an age of
        // zero would make garbage look fresh; an infinite one used to panic).
        let mut ages: BTreeMap<MemberId, Duration> = BTreeMap::new();
        let mut rejected = Vec::new();
        let mut failures = Vec::new();
        for m in &pool.members {
            let sample_ts = values.get(&Signal::Timestamp).and_then(|v| v.get(m)).copied();
            // The raw sample's own timestamp when we asked for it; else the evaluation time.
            let ts = sample_ts.or_else(|| eval_time.get(m).copied()).unwrap_or(now);
            match age_of_timestamp(now, ts) {
                Ok(age) => {
                    ages.insert(m.clone(), age);
                }
                Err(reason) => {
                    rejected.push(Rejected {
                        member: m.clone(),
                        signal: Signal::Timestamp,
                        reason,
                        value: ts,
                    });
                    failures.push(MemberFailure {
                        member: m.clone(),
                        reason: FailureReason::BadTimestamp,
                        detail: format!("sample timestamp {ts} is unusable ({reason})"),
                    });
                    for s in [Signal::Waiting, Signal::Running] {
                        if let Some(v) = values.get_mut(&s) {
                            v.remove(m);
                        }
                    }
                }
            }
        }
        let mut snap = assemble(&pool.members, &values, |m, _| ages.get(m).copied().unwrap_or_default());
        snap.rejected.extend(rejected);
        for m in &pool.members {
            let has = |s: Signal| values.get(&s).is_some_and(|v| v.contains_key(m));
            if !has(Signal::Waiting) || !has(Signal::Running) {
                if failures.iter().any(|f| &f.member == m) {
                    continue;
                }
                failures.push(MemberFailure {
                    member: m.clone(),
                    reason: FailureReason::NoSeries,
                    detail: format!(
                        "no {} series with label {}={m:?}",
                        if has(Signal::Waiting) { "running" } else { "waiting" },
                        pool.join.label
                    ),
                });
            }
        }
        snap.failures = failures;
        if let Some((q, names)) = &pool.labels {
            match by_query.get(q.as_str()) {
                Some(Ok(rows)) => snap.labels = member_labels(rows, &pool.join, &pool.members, names),
                Some(Err(e)) => {
                    tracing::warn!(source = %self.name, error = %e, "tier labels unavailable; members keep the tiers last seen")
                }
                None => {}
            }
        }
        Ok(snap)
    }

    pub async fn discover(&self, selector: &str, join: &Join) -> Result<Vec<MemberId>, SourceError> {
        let token = self.token()?;
        let q = format!("up{selector}");
        let rows = self.query(&q, token.as_deref()).await?;
        let members: BTreeSet<MemberId> = rows
            .iter()
            .filter_map(|(labels, _, _)| labels.get(&join.label).map(|v| join.member(v)))
            .collect();
        Ok(members.into_iter().collect())
    }
}

/// The values of `names` on each member's rows; a member with rows that disagree (two clusters
/// claiming one address) keeps the first row's.
fn member_labels(
    rows: &Rows,
    join: &Join,
    members: &[MemberId],
    names: &[String],
) -> BTreeMap<MemberId, BTreeMap<String, String>> {
    let wanted: BTreeSet<&MemberId> = members.iter().collect();
    let mut out = BTreeMap::new();
    for (labels, _, _) in rows {
        let Some(m) = labels.get(&join.label).map(|v| join.member(v)) else { continue };
        if !wanted.contains(&m) || out.contains_key(&m) {
            continue;
        }
        let kept: BTreeMap<String, String> =
            names.iter().filter_map(|n| Some((n.clone(), labels.get(n)?.clone()))).collect();
        out.insert(m, kept);
    }
    out
}

/// The start of a non-JSON error body on one line, for messages.
fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]);
    let one_line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.is_empty() {
        "(empty body)".into()
    } else {
        one_line
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::config::JoinConfig;

    #[test]
    fn a_querys_rows_are_indexed_once_per_join_and_a_repeated_member_keeps_its_last_row() {
        let row = |instance: &str, pod: &str, v: f64| {
            let labels = [("instance", instance), ("pod", pod)].map(|(k, v)| (k.to_string(), v.to_string()));
            (labels.into_iter().collect::<HashMap<_, _>>(), 100.0 + v, v)
        };
        let rows: Rows =
            vec![row("b:1", "vllm-2", 2.0), row("a:1", "vllm-1", 1.0), row("b:1", "vllm-3", 3.0)];
        let by_instance = Join::new(&JoinConfig { label: "instance".into(), regex: None, replacement: None })
            .expect("join");
        let by_pod = Join::new(&JoinConfig {
            label: "pod".into(),
            regex: Some("vllm-(\\d+)".into()),
            replacement: Some("10.0.0.$1:8000".into()),
        })
        .expect("join");
        let mut index = RowIndex::default();
        let got = index.of("q", &rows, &by_instance).clone();
        assert_eq!(
            got.iter().map(|(m, v)| (m.as_str(), *v)).collect::<Vec<_>>(),
            [("a:1", (1.0, 101.0)), ("b:1", (3.0, 103.0))]
        );
        let pods = index.of("q", &rows, &by_pod);
        assert_eq!(
            pods.keys().map(|m| m.as_str()).collect::<Vec<_>>(),
            ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
        );
        // A second pool with the same join shares the first index.
        let _ = index.of("q", &rows, &by_instance);
        assert_eq!(index.built.len(), 2);
    }

    #[test]
    fn timestamps_that_are_not_finite_or_in_the_future_are_refused() {
        let now = 1_700_000_000.0;
        for ts in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(age_of_timestamp(now, ts), Err("timestamp_not_finite"), "{ts}");
        }
        assert_eq!(age_of_timestamp(now, now + 60.0), Err("timestamp_in_future"));
        assert_eq!(age_of_timestamp(now, now + 1.0), Ok(Duration::ZERO), "small skew is fine");
        assert_eq!(age_of_timestamp(now, now - 2.5), Ok(Duration::from_millis(2500)));
        assert_eq!(age_of_timestamp(now, -1.8e19), Ok(MAX_AGE), "absurdly old is just stale");
        assert_eq!(age_of_timestamp(now, f64::MIN), Ok(MAX_AGE));
    }

    #[test]
    fn query_url_keeps_prefix_and_parameters() {
        let u = query_url("https://thanos:9092/prefix/?namespace=llm&x=1").expect("url");
        assert_eq!(u.as_str(), "https://thanos:9092/prefix/api/v1/query?namespace=llm&x=1");
        let u = query_url("http://p:9090").expect("url");
        assert_eq!(u.as_str(), "http://p:9090/api/v1/query");
        assert!(query_url("ftp://x").is_err());
    }
}
