//! Sampling: each source asked once for all its pools, within the cycle's deadline, so one hung
//! source never holds up the others.

use std::time::Duration;

use crate::source::{PoolQuery, Snapshot, Source, SourceError};

/// Sample one source for its pools, giving up after `deadline` (a named function rather than an
/// async closure, so the cycle's future stays `Send` for `tokio::spawn`).
pub(super) async fn sample_within(
    name: &str,
    source: &Source,
    queries: Vec<&PoolQuery>,
    deadline: Duration,
) -> Vec<Result<Snapshot, SourceError>> {
    // Members' own reads stop a tenth early, so a slow one is its own failure and the rest of the
    // sample still arrives before the deadline cuts everything.
    let budget = deadline.saturating_sub(deadline / 10);
    match tokio::time::timeout(deadline, source.sample_within(&queries, Some(budget))).await {
        Ok(r) => r,
        Err(_) => queries
            .iter()
            .map(|_| {
                Err(SourceError::Unreachable {
                    what: format!("source {name:?}"),
                    detail: format!("no answer within the cycle interval ({deadline:?})"),
                })
            })
            .collect(),
    }
}
