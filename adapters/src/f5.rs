//! F5 BIG-IP sink: pool member ratios over iControl REST (placeholder, being built).

use async_trait::async_trait;
use serde::Deserialize;

use crate::{Applied, RatioSink, Ratios, SinkError};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct F5Config {
    /// Base URL of the BIG-IP management interface, e.g. `https://bigip.example.com`.
    pub url: String,
    /// Pool with partition, e.g. `/Common/llm_pool`.
    pub pool: String,
}

impl F5Config {
    pub fn validate(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

pub struct F5Sink;

impl F5Sink {
    pub fn new(_cfg: &F5Config, _pool: &str) -> Result<Self, SinkError> {
        Err(SinkError::Config("the f5 sink is not built yet".into()))
    }
}

#[async_trait]
impl RatioSink for F5Sink {
    fn kind(&self) -> &'static str {
        "f5"
    }
    async fn current(&self) -> Result<Option<Ratios>, SinkError> {
        Ok(None)
    }
    async fn apply(&self, _desired: &Ratios) -> Result<Applied, SinkError> {
        Err(SinkError::Config("the f5 sink is not built yet".into()))
    }
}
