//! Errors a sink reports. Each says which pool and member it concerns and whether retrying can help.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SinkError {
    /// The load balancer could not be reached or did not answer in time. Worth retrying.
    #[error("{target}: cannot reach the load balancer: {detail}")]
    Unreachable { target: String, detail: String },

    /// The load balancer answered with an error it may not repeat (restarting, overloaded). Worth retrying.
    #[error("{target}: temporary failure: {detail}")]
    Temporary { target: String, detail: String },

    /// The load balancer refused the change (unknown pool or server, permission, range). Retrying the
    /// same request will fail the same way: fix the configuration or the LB.
    #[error("{target}: rejected: {detail}")]
    Rejected { target: String, detail: String },

    /// Credentials are missing or refused.
    #[error("{target}: authentication failed: {detail}")]
    Auth { target: String, detail: String },

    /// The credentials are fine but the user's role may not make this change. Retrying cannot help;
    /// the load balancer's admin must grant the role.
    #[error("{target}: role cannot modify pool members: {detail}")]
    Forbidden { target: String, detail: String },

    /// The sink's own configuration cannot work (bad URL, unreadable CA file, ...).
    #[error("sink configuration: {0}")]
    Config(String),
}

impl SinkError {
    /// Whether the same call may succeed later without anyone changing anything.
    pub fn retryable(&self) -> bool {
        matches!(self, SinkError::Unreachable { .. } | SinkError::Temporary { .. })
    }

    /// Short stable label for metrics (`outcome` / `reason`).
    pub fn kind(&self) -> &'static str {
        match self {
            SinkError::Unreachable { .. } => "unreachable",
            SinkError::Temporary { .. } => "temporary",
            SinkError::Rejected { .. } => "rejected",
            SinkError::Auth { .. } => "auth",
            SinkError::Forbidden { .. } => "forbidden",
            SinkError::Config(_) => "config",
        }
    }
}
