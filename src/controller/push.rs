//! A pool's push in flight: it runs as a task of its own with its own time budget, and a later
//! cycle settles it (waiting for it until the cycle's own deadline, at most) and counts the outcome.

use std::time::Instant;

use llm_lc_adapters::SinkError;

use super::PoolRuntime;
use crate::cycle::{PushOutcome, PushResult};
use crate::telemetry::{PoolCounter, Telemetry};

impl PoolRuntime {
    /// Wait for the push in flight until `by`; if it ended, hand its result to the cycle and return
    /// the outcome, else report it as still in progress.
    pub(super) async fn settle_push(&mut self, telemetry: &Telemetry, by: Instant) -> PushOutcome {
        let Some(task) = self.push.as_mut() else { return PushOutcome::Unchanged };
        let wait = by.saturating_duration_since(Instant::now());
        let joined = match tokio::time::timeout(wait, task).await {
            Err(_) => return PushOutcome::InProgress,
            Ok(joined) => joined,
        };
        self.push = None;
        let pool = self.cfg.name.clone();
        let kind = self.sink.kind();
        let failures_before = self.cycle.failures();
        let result = match joined {
            Ok(Ok(Ok(applied))) => Ok(applied),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_elapsed)) => Err(SinkError::Unreachable {
                target: format!("pool {pool:?}"),
                detail: format!("push not done within its budget of {:?} (push_timeout)", self.push_timeout),
            }),
            Err(join) => Err(SinkError::Unreachable {
                target: format!("pool {pool:?}"),
                detail: format!("push task ended: {join}"),
            }),
        };
        let now = Instant::now();
        let instances = self.sink.instances();
        for inst in &instances {
            let ok = if inst.ok { 1.0 } else { 0.0 };
            telemetry.metrics.sink_instance_ok(&pool, kind, &inst.address).set(ok);
        }
        let addresses: Vec<&str> = instances.iter().map(|i| i.address.as_str()).collect();
        telemetry.metrics.retain_sink_instances(&pool, kind, &addresses);
        match result {
            Ok(applied) => {
                // Reconciling sinks report the same warnings every cycle, and some only the first
                // time: log each warning when it appears, not again while it stays or when another
                // one comes or goes. Sinks leave the logging to this one place.
                for w in applied.warnings.iter().filter(|w| !self.last_warnings.contains(w)) {
                    tracing::warn!(pool = %pool, sink = kind, "{w}");
                }
                self.last_warnings = applied.warnings.clone();
                if failures_before > 0 {
                    tracing::info!(pool = %pool, sink = kind, "sink recovered");
                }
                if applied.changed > 0 && self.sink.reaches_lb() {
                    telemetry
                        .metrics
                        .pool_counter(PoolCounter::SinkWrites, &pool, &[("sink", kind)])
                        .inc_by(applied.changed as u64);
                }
                let outcome = self.cycle.pushed(PushResult::Applied { changed: applied.changed }, now);
                if outcome == PushOutcome::Pushed {
                    tracing::info!(pool = %pool, sink = kind, changed = applied.changed, "pushed ratios");
                }
                outcome
            }
            Err(e) => {
                let outcome = self.cycle.pushed(PushResult::Failed { retryable: e.retryable() }, now);
                let retry_in_s = self.cycle.retry_wait().unwrap_or_default().as_secs_f64();
                let attempt = self.cycle.failures();
                if !e.retryable() || attempt == 1 {
                    tracing::error!(pool = %pool, sink = kind, error = %e, retry_in_s, "push failed");
                } else {
                    tracing::warn!(pool = %pool, sink = kind, error = %e, retry_in_s, attempt, "push failed again");
                }
                outcome
            }
        }
    }
}

pub(super) fn count_push(telemetry: &Telemetry, pool: &str, sink: &str, outcome: PushOutcome) {
    telemetry
        .metrics
        .pool_counter(PoolCounter::Pushes, pool, &[("sink", sink), ("outcome", outcome.as_str())])
        .inc();
}
