//! HAProxy sink: runtime-API weights (placeholder, being built).

use async_trait::async_trait;
use serde::Deserialize;

use crate::{Applied, RatioSink, Ratios, SinkError};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HaproxyConfig {
    /// Runtime API address: `unix:/path/to/socket` or `host:port`.
    pub address: String,
    /// Backend whose servers get the weights.
    pub backend: String,
}

impl HaproxyConfig {
    pub fn validate(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

pub struct HaproxySink;

impl HaproxySink {
    pub fn new(_cfg: &HaproxyConfig, _pool: &str) -> Result<Self, SinkError> {
        Err(SinkError::Config("the haproxy sink is not built yet".into()))
    }
}

#[async_trait]
impl RatioSink for HaproxySink {
    fn kind(&self) -> &'static str {
        "haproxy"
    }
    async fn current(&self) -> Result<Option<Ratios>, SinkError> {
        Ok(None)
    }
    async fn apply(&self, _desired: &Ratios) -> Result<Applied, SinkError> {
        Err(SinkError::Config("the haproxy sink is not built yet".into()))
    }
}
