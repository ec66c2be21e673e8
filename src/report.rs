//! What one control cycle saw and did, in the shapes users read: a JSON line per cycle
//! (`--output json`, and `GET /v1/ratios`) and a human table per pool.

use std::fmt::Write as _;

use serde::Serialize;

use crate::cycle::{PoolState, PushOutcome};

#[derive(Debug, Clone, Serialize, Default)]
pub struct CycleReport {
    /// RFC 3339 UTC time the cycle started.
    pub ts: String,
    pub pools: Vec<PoolReport>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct PoolReport {
    pub pool: String,
    /// `ok`, `source_down` or `stale`.
    pub state: PoolState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub policy: &'static str,
    pub sink: &'static str,
    /// What happened to the push: `pushed`, `unchanged`, `dry_run`, `held` (fail-static), `backoff`,
    /// `refused_drain`, `follower` (another replica holds the leader lease), `in_progress` (the
    /// previous push still runs) or `error`.
    pub push: PushOutcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saturation: Option<f64>,
    /// Priority pooling: the tiers carrying traffic, preferred first (members of the others are at 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_tiers: Option<Vec<String>>,
    pub members: Vec<MemberReport>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct MemberReport {
    pub member: String,
    /// The ratio the controller wants now.
    pub ratio: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub old_ratio: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub running: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_usage: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_s: Option<f64>,
    /// Mean time requests ran, queue excluded (vLLM's `vllm:request_inference_time_seconds`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_s: Option<f64>,
    /// Mean time requests waited in the queue (vLLM's `vllm:request_queue_time_seconds`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_time_s: Option<f64>,
    /// Seconds of prompt processing and generation per generated token (llama.cpp's counters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_time_s: Option<f64>,
    /// Share of prompt tokens served from the prompt cache, 0..1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_cached: Option<f64>,
    /// Requests the member runs at once (llama.cpp's slots, or the pool's `slots`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slots: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub age_s: Option<f64>,
    /// Priority pooling: the member's tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
}

impl CycleReport {
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"cannot encode report: {e}\"}}"))
    }

    /// One table per pool: member, waiting, running, KV %, age, old -> new ratio.
    /// One line per pool header, error and member, whatever the names and messages hold: names
    /// are shown as one token, messages with their control characters escaped.
    pub fn to_table(&self) -> String {
        use llm_lc_adapters::name::{escape_controls, escape_name};
        let mut s = String::new();
        for p in &self.pools {
            let _ = write!(
                s,
                "{}  pool {}  [{} -> {}]  state={} push={}",
                self.ts,
                escape_name(&p.pool),
                p.policy,
                p.sink,
                p.state.as_str(),
                p.push.as_str()
            );
            if let Some(sat) = p.saturation {
                let _ = write!(s, " saturation={:.0}%", sat * 100.0);
            }
            if let Some(e) = &p.error {
                let _ = write!(s, "\n  error: {}", escape_controls(e));
            }
            let _ = writeln!(s);
            // Servers without a KV gauge (llama.cpp) show their slots instead.
            let slots = p.members.iter().any(|m| m.slots.is_some() && m.kv_usage.is_none());
            let _ = writeln!(
                s,
                "  {:<28} {:>8} {:>8} {:>6} {:>7}  {:>13}",
                "MEMBER",
                "WAITING",
                "RUNNING",
                if slots { "SLOTS" } else { "KV%" },
                "AGE",
                "RATIO"
            );
            for m in &p.members {
                let num = |v: Option<f64>| v.map(|v| format!("{v:.0}")).unwrap_or_else(|| "-".into());
                let kv = match (m.kv_usage, slots) {
                    (Some(v), _) => format!("{:.0}", v * 100.0),
                    (None, true) => num(m.slots),
                    (None, false) => "-".into(),
                };
                let age = m.age_s.map(|v| format!("{v:.1}s")).unwrap_or_else(|| "-".into());
                let old = m.old_ratio.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
                let _ = writeln!(
                    s,
                    "  {:<28} {:>8} {:>8} {:>6} {:>7}  {:>5} -> {:<5}",
                    escape_name(&m.member),
                    num(m.waiting),
                    num(m.running),
                    kv,
                    age,
                    old,
                    m.ratio
                );
            }
        }
        s
    }
}

/// Now as RFC 3339 UTC, for reports and logs.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}
