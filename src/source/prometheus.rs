//! Prometheus / Thanos Querier source: instant PromQL queries, one per signal per cycle for all pools.
//!
//! Pools that share this source and need the same query (same profile, selector and join label) share
//! its result, so adding pools does not multiply the load on Prometheus. Results are joined to members
//! by the join label. The bearer token is re-read per cycle so rotated service-account tokens work.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::join_all;
use llm_lc_adapters::{MemberId, SecretRef};
use prometheus_http_query::{Client, Error as PromError};

use super::{assemble, describe, http_client, Join, PoolQuery, SignalValues, Snapshot, SourceError};
use crate::config::PrometheusConfig;

pub struct PrometheusSource {
    name: String,
    client: Client,
    token: Option<SecretRef>,
}

/// Raw rows of one query: the label set and the sample `(timestamp, value)`.
type Rows = Vec<(std::collections::HashMap<String, String>, f64, f64)>;

impl PrometheusSource {
    pub fn new(name: &str, cfg: &PrometheusConfig) -> Result<Self, SourceError> {
        if cfg.insecure_skip_verify {
            tracing::warn!(source = name, "TLS certificate verification is OFF for this Prometheus source");
        }
        let http = http_client(cfg.timeout, cfg.ca_file.as_deref(), cfg.insecure_skip_verify, &cfg.headers)?;
        let client = Client::from(http, &cfg.url)
            .map_err(|e| SourceError::Config(format!("sources.{name}.url: {e}")))?;
        Ok(PrometheusSource { name: name.to_string(), client, token: cfg.bearer_token.clone() })
    }

    fn what(&self) -> String {
        format!("prometheus source {:?}", self.name)
    }

    async fn query(&self, promql: &str, token: Option<&str>) -> Result<Rows, SourceError> {
        let mut q = self.client.query(promql);
        if let Some(t) = token {
            let value = reqwest::header::HeaderValue::from_str(&format!("Bearer {t}")).map_err(|_| {
                SourceError::Config("bearer token contains characters not allowed in a header".into())
            })?;
            q = q.header(reqwest::header::AUTHORIZATION, value);
        }
        let res = q.get().await.map_err(|e| self.map_err(promql, e))?;
        let vector = res.data().as_vector().ok_or_else(|| SourceError::Malformed {
            what: self.what(),
            detail: format!("query {promql:?} did not return an instant vector"),
        })?;
        Ok(vector.iter().map(|v| (v.metric().clone(), v.sample().timestamp(), v.sample().value())).collect())
    }

    fn map_err(&self, promql: &str, e: PromError) -> SourceError {
        match e {
            PromError::Prometheus(p) => {
                SourceError::Query { query: promql.to_string(), detail: p.to_string() }
            }
            PromError::Client(c) => {
                let detail =
                    match std::error::Error::source(&c).and_then(|s| s.downcast_ref::<reqwest::Error>()) {
                        Some(r) => {
                            if let Some(status) = r.status() {
                                return SourceError::Http {
                                    what: self.what(),
                                    status: status.as_u16(),
                                    detail: describe(r),
                                };
                            }
                            if r.is_decode() {
                                return SourceError::Malformed { what: self.what(), detail: describe(r) };
                            }
                            describe(r)
                        }
                        None => c.to_string(),
                    };
                SourceError::Unreachable { what: self.what(), detail }
            }
            other => SourceError::Query { query: promql.to_string(), detail: other.to_string() },
        }
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
        let distinct: BTreeSet<&str> =
            pools.iter().flat_map(|p| p.queries.iter().map(|(_, q)| q.as_str())).collect();
        // A loop, not a closure: closures returning borrowing futures make callers' futures !Send.
        let mut queries = Vec::with_capacity(distinct.len());
        for q in &distinct {
            queries.push(self.query(q, token.as_deref()));
        }
        let results = join_all(queries).await;
        let by_query: BTreeMap<&str, Result<Rows, SourceError>> = distinct.into_iter().zip(results).collect();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);

        pools
            .iter()
            .map(|pool| {
                let mut values = SignalValues::new();
                let mut eval_time: BTreeMap<MemberId, f64> = BTreeMap::new();
                for (signal, q) in &pool.queries {
                    let rows = match &by_query[q.as_str()] {
                        Ok(rows) => rows,
                        // Without the core signals nothing is known; optional ones just go missing.
                        Err(e) if matches!(signal, super::Signal::Waiting | super::Signal::Running) => {
                            return Err(e.clone());
                        }
                        Err(e) => {
                            tracing::debug!(source = %self.name, signal = signal.as_str(), error = %e, "optional signal unavailable");
                            continue;
                        }
                    };
                    let slot = values.entry(*signal).or_default();
                    for (labels, ts, v) in rows {
                        let Some(label) = labels.get(&pool.join.label) else { continue };
                        let m = pool.join.member(label);
                        slot.insert(m.clone(), *v);
                        eval_time.insert(m, *ts);
                    }
                }
                Ok(assemble(&pool.members, &values, |m, sample_ts| {
                    // The raw sample's own timestamp when we asked for it; else the evaluation time.
                    let ts = sample_ts.or_else(|| eval_time.get(m).copied()).unwrap_or(now);
                    Duration::from_secs_f64((now - ts).max(0.0))
                }))
            })
            .collect()
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
