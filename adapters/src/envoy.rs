//! Envoy sink: endpoint weights over EDS (placeholder, being built).

use async_trait::async_trait;
use serde::Deserialize;

use crate::{Applied, RatioSink, Ratios, SinkError};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyConfig {
    /// Envoy cluster whose endpoints this pool's ratios weight.
    pub cluster: String,
}

impl EnvoyConfig {
    pub fn validate(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// What the controller's EDS endpoint serves: one ClusterLoadAssignment per cluster. Shared between
/// the sinks (writers) and the HTTP handler (reader).
#[derive(Debug, Default)]
pub struct EdsRegistry {}

impl EdsRegistry {
    /// Routes to merge into the controller's listener (`POST /v3/discovery:endpoints`).
    pub fn router(self: std::sync::Arc<Self>) -> axum::Router {
        axum::Router::new()
    }
}

pub struct EnvoySink;

impl EnvoySink {
    pub fn new(_cfg: &EnvoyConfig, _pool: &str, _eds: std::sync::Arc<EdsRegistry>) -> Result<Self, SinkError> {
        Err(SinkError::Config("the envoy sink is not built yet".into()))
    }
}

#[async_trait]
impl RatioSink for EnvoySink {
    fn kind(&self) -> &'static str {
        "envoy"
    }
    async fn current(&self) -> Result<Option<Ratios>, SinkError> {
        Ok(None)
    }
    async fn apply(&self, _desired: &Ratios) -> Result<Applied, SinkError> {
        Err(SinkError::Config("the envoy sink is not built yet".into()))
    }
}
