//! What a cycle tells about its pool: each member's report line and gauges, members that could not
//! be read (counted by reason, logged once per change), and the pool's state changes (logged once,
//! not every cycle).

use std::collections::BTreeMap;

use llm_lc_adapters::{MemberId, Ratios};

use super::PoolRuntime;
use crate::report::MemberReport;
use crate::source::Snapshot;
use crate::telemetry::{labels, Telemetry};

impl PoolRuntime {
    /// Count and log members that could not be read: a warning when a member starts failing (or
    /// fails differently), an info line when it is readable again; never one line per cycle. The
    /// policy treats such a member as without data: it keeps its ratio for `grace`, then gets the
    /// pool mean.
    pub(super) fn member_health(&mut self, snap: &Snapshot, telemetry: &Telemetry) {
        let pool = self.cfg.name.clone();
        let mut now_failing = BTreeMap::new();
        for f in &snap.failures {
            let reason = f.reason.as_str();
            telemetry
                .metrics
                .member_errors
                .get_or_create(&labels(&[("pool", &pool), ("member", f.member.as_str()), ("reason", reason)]))
                .inc();
            if self.failing.get(&f.member) != Some(&reason) {
                tracing::warn!(pool = %pool, member = %f.member, reason, detail = %f.detail, "member cannot be read; it keeps its ratio for `grace`, then gets the pool mean");
            }
            now_failing.insert(f.member.clone(), reason);
        }
        for (m, _) in self.failing.iter().filter(|(m, _)| !now_failing.contains_key(*m)) {
            if snap.members.contains_key(m) {
                tracing::info!(pool = %pool, member = %m, "member is readable again");
            }
        }
        self.failing = now_failing;
    }

    /// One report line per member: the ratio wanted now, the last computed one, and the sample.
    pub(super) fn member_reports(
        &self,
        snap: Option<&Snapshot>,
        desired: &Ratios,
        before: &Ratios,
        telemetry: &Telemetry,
    ) -> Vec<MemberReport> {
        let m = &telemetry.metrics;
        let pool = &self.cfg.name;
        let report = |member: &MemberId, s: Option<&crate::source::Sample>| {
            let ml = labels(&[("pool", pool), ("member", member.as_str())]);
            let ratio = desired.get(member).unwrap_or(0);
            m.member_ratio.get_or_create(&ml).set(f64::from(ratio));
            if let Some(s) = s {
                m.member_waiting.get_or_create(&ml).set(s.waiting);
                m.member_running.get_or_create(&ml).set(s.running);
                if let Some(kv) = s.kv_usage {
                    m.member_kv_usage.get_or_create(&ml).set(kv);
                }
                if let Some(l) = s.latency {
                    m.member_latency.get_or_create(&ml).set(l);
                }
                for (family, v) in [
                    (&m.member_service, s.service),
                    (&m.member_queue_time, s.queue_time),
                    (&m.member_token_time, s.token_time),
                    (&m.member_prompt_cached, s.prompt_cached),
                    (&m.member_slots, s.slots),
                ] {
                    if let Some(v) = v {
                        family.get_or_create(&ml).set(v);
                    }
                }
                m.member_sample_age.get_or_create(&ml).set(s.age.as_secs_f64());
            }
            MemberReport {
                member: member.to_string(),
                ratio,
                old_ratio: before.get(member),
                waiting: s.map(|s| s.waiting),
                running: s.map(|s| s.running),
                kv_usage: s.and_then(|s| s.kv_usage),
                latency_s: s.and_then(|s| s.latency),
                service_s: s.and_then(|s| s.service),
                queue_time_s: s.and_then(|s| s.queue_time),
                token_time_s: s.and_then(|s| s.token_time),
                prompt_cached: s.and_then(|s| s.prompt_cached),
                slots: s.and_then(|s| s.slots),
                age_s: s.map(|s| s.age.as_secs_f64()),
                tier: self.cycle.tier_of(member).map(str::to_string),
            }
        };
        match snap {
            Some(snap) if !snap.members.is_empty() => {
                snap.members.iter().map(|(member, s)| report(member, s.as_ref())).collect()
            }
            // No sample this cycle: the members found now, not members the ratios still remember
            // (a member that left while sampling failed would otherwise come back as a series).
            _ => desired
                .iter()
                .filter(|(m, _)| self.query.members.is_empty() || self.query.members.binary_search(m).is_ok())
                .map(|(member, _)| report(member, None))
                .collect(),
        }
    }
}

pub(super) fn log_state_change(
    pool: &str,
    _old: crate::cycle::PoolState,
    new: crate::cycle::PoolState,
    detail: Option<&str>,
) {
    use crate::cycle::PoolState;
    match new {
        PoolState::Ok => tracing::info!(pool = %pool, "pool has fresh data again; computing ratios"),
        PoolState::SourceDown => tracing::warn!(
            pool = %pool,
            error = detail.unwrap_or(""),
            "source failed; load balancer keeps its last ratios (fail-static)"
        ),
        PoolState::Stale => tracing::warn!(
            pool = %pool,
            "no member has fresh samples; load balancer keeps its last ratios (fail-static)"
        ),
        PoolState::Starting => {}
    }
}
