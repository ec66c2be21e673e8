//! A pool's members, read again every cycle: from the load balancer, Prometheus `up`, EndpointSlices
//! or an InferencePool, each name checked at one door ([`admit`]) before it is a member; the pool's
//! sampling queries follow the members. Discovery that fails keeps the last known members, logged
//! once per change; while a sink backs off, a read of the load balancer that succeeds ends the wait.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use llm_lc_adapters::MemberId;

use super::PoolRuntime;
use crate::source::{FailureReason, Source, SourceError};
use crate::telemetry::{labels, Telemetry};

/// How long a read of the load balancer may take while probing whether it answers again.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl PoolRuntime {
    pub(super) async fn refresh_members(
        &mut self,
        sources: &BTreeMap<String, Source>,
        telemetry: &Telemetry,
        deadline: Duration,
    ) {
        let pool = self.cfg.name.clone();
        let from_lb = self.cfg.members.from_lb;
        let found = if let Some(sel) = &self.cfg.members.prometheus_up {
            match sources.get(&self.cfg.source) {
                Some(src) => src.discover(sel, &self.query.join).await.map(Some),
                None => Ok(None),
            }
        } else if let Some(k) = self.kubernetes.clone() {
            match tokio::time::timeout(deadline, k.members()).await {
                Ok(r) => r.map(|labelled| {
                    let (ids, labels): (Vec<MemberId>, Vec<_>) = labelled.into_iter().unzip();
                    self.endpoint_labels = ids.iter().cloned().zip(labels).collect();
                    Some(ids)
                }),
                Err(_) => Err(SourceError::Unreachable {
                    what: format!("the Kubernetes API for pool {pool:?}"),
                    detail: format!("no answer within {deadline:?}"),
                }),
            }
        } else if from_lb {
            let reader = self.reader().clone();
            match tokio::time::timeout(deadline, reader.members()).await {
                Ok(r) => r.map_err(|e| SourceError::Unreachable {
                    what: format!("{} sink of pool {pool:?}", reader.kind()),
                    detail: e.to_string(),
                }),
                Err(_) => Err(SourceError::Unreachable {
                    what: format!("{} sink of pool {pool:?}", reader.kind()),
                    detail: format!("no answer within {deadline:?}"),
                }),
            }
        } else {
            Ok(None)
        };
        match found {
            Ok(Some(members)) => {
                let members = sorted(self.admit(members, telemetry));
                if from_lb {
                    self.cycle.lb_answered();
                }
                if self.discovery_failing {
                    tracing::info!(pool = %pool, members = members.len(), "member discovery works again");
                    self.discovery_failing = false;
                }
                // The same members again (the usual case) keep the ids the cycle already holds.
                if members != self.query.members {
                    let (gone, joined) = difference(&self.query.members, &members);
                    for m in gone {
                        tracing::info!(pool = %pool, member = %m, "member left the pool");
                        telemetry.metrics.forget_member(&pool, m.as_str());
                    }
                    for m in joined {
                        tracing::info!(pool = %pool, member = %m, "member joined the pool");
                    }
                    self.query.members = members;
                }
            }
            Ok(None) => {
                // Not discovering from the LB: while the sink backs off, a cheap read tells whether it
                // answers again.
                if !from_lb && self.cycle.backing_off(Instant::now()) && self.push.is_none() {
                    let reader = self.reader().clone();
                    if let Ok(Ok(Some(_))) = tokio::time::timeout(PROBE_TIMEOUT, reader.members()).await {
                        tracing::info!(pool = %pool, sink = reader.kind(), "load balancer answers again; retrying now");
                        self.cycle.lb_answered();
                    }
                }
            }
            // Keep the last known members: a discovery hiccup must not empty the pool.
            Err(e) => {
                if !self.discovery_failing {
                    tracing::warn!(pool = %pool, error = %e, "member discovery failed; keeping the last known members");
                    self.discovery_failing = true;
                }
            }
        }
    }

    /// Discovered names are from outside (labels, the LB's pool, EndpointSlices): see [`admit`].
    fn admit(&mut self, found: Vec<MemberId>, telemetry: &Telemetry) -> Vec<MemberId> {
        let (admitted, refused) = admit(&self.cfg.name, found, telemetry, &self.refused_names);
        self.refused_names = refused;
        admitted
    }
}

/// The one door for discovered names (Prometheus labels, EndpointSlices, the LB's own pool): those
/// that are not member names ([`llm_lc_adapters::name::check`]) are left out of this refresh,
/// counted (`member_errors_total{reason="invalid_name"}`, without the name) and logged, escaped,
/// once while they keep coming (`warned`: the names refused last refresh). Returns the admitted
/// members and the names refused now.
pub fn admit(
    pool: &str,
    found: Vec<MemberId>,
    telemetry: &Telemetry,
    warned: &std::collections::BTreeSet<String>,
) -> (Vec<MemberId>, std::collections::BTreeSet<String>) {
    let mut refused = std::collections::BTreeSet::new();
    let admitted = found
        .into_iter()
        .filter(|m| match llm_lc_adapters::name::check(m.as_str()) {
            Ok(()) => true,
            Err(why) => {
                let shown = m.to_string();
                if !warned.contains(&shown) {
                    tracing::warn!(pool, name = %shown, error = %why, "discovery offered a name that is not a member name; left out");
                }
                telemetry
                    .metrics
                    .member_errors
                    .get_or_create(&labels(&[("pool", pool), ("reason", FailureReason::InvalidName.as_str())]))
                    .inc();
                refused.insert(shown);
                false
            }
        })
        .collect();
    (admitted, refused)
}

/// A pool's members in member order, each once: the order the snapshot, the policy and the ratios
/// keep, so a cycle walks them side by side instead of looking members up.
pub(super) fn sorted(mut members: Vec<MemberId>) -> Vec<MemberId> {
    members.sort();
    members.dedup();
    members
}

/// Members of `old` not in `new`, and of `new` not in `old`; both sorted. One walk of each.
pub(super) fn difference<'a>(
    old: &'a [MemberId],
    new: &'a [MemberId],
) -> (Vec<&'a MemberId>, Vec<&'a MemberId>) {
    let (mut gone, mut joined) = (Vec::new(), Vec::new());
    let (mut o, mut n) = (old.iter().peekable(), new.iter().peekable());
    loop {
        match (o.peek(), n.peek()) {
            (Some(a), Some(b)) if a < b => gone.extend(o.next()),
            (Some(a), Some(b)) if a > b => joined.extend(n.next()),
            (Some(_), Some(_)) => {
                o.next();
                n.next();
            }
            (Some(_), None) => gone.extend(o.next()),
            (None, Some(_)) => joined.extend(n.next()),
            (None, None) => return (gone, joined),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(s: &[&str]) -> Vec<MemberId> {
        s.iter().map(|m| MemberId::from(*m)).collect()
    }

    #[test]
    fn members_are_kept_sorted_and_once() {
        assert_eq!(sorted(ids(&["b:1", "a:1", "b:1"])), ids(&["a:1", "b:1"]));
    }

    #[test]
    fn difference_names_who_left_and_who_joined() {
        let (old, new) = (ids(&["a:1", "b:1", "d:1"]), ids(&["b:1", "c:1", "e:1"]));
        let (gone, joined) = difference(&old, &new);
        assert_eq!(gone.iter().map(|m| m.as_str()).collect::<Vec<_>>(), ["a:1", "d:1"]);
        assert_eq!(joined.iter().map(|m| m.as_str()).collect::<Vec<_>>(), ["c:1", "e:1"]);
        let (gone, joined) = difference(&old, &old);
        assert!(gone.is_empty() && joined.is_empty());
    }
}
