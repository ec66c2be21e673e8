//! A sink that POSTs a pool's ratios as JSON. The reference proxy's admin listener consumes it; anything
//! else that speaks HTTP can too.
//!
//! Body: `{"pool":"NAME","ratios":{"10.0.0.1:8000":57,...}}`. Any 2xx is success.

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::{Applied, RatioSink, Ratios, SecretRef, SinkError};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// Where to POST, e.g. `http://127.0.0.1:9001/admin/ratios`.
    pub url: String,
    /// Sent as `Authorization: Bearer ...` when set.
    #[serde(default)]
    pub bearer_token: Option<SecretRef>,
    /// Extra CA bundle (PEM) for https URLs.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

fn default_timeout() -> Duration {
    Duration::from_secs(3)
}

impl WebhookConfig {
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        match reqwest::Url::parse(&self.url) {
            Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
            Ok(u) => errs.push(("url".into(), format!("scheme must be http or https, not {}", u.scheme()))),
            Err(e) => errs.push(("url".into(), format!("not a URL: {e}"))),
        }
        if self.timeout.is_zero() {
            errs.push(("timeout".into(), "must be > 0".into()));
        }
        errs
    }
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct WebhookPayload {
    pub pool: String,
    pub ratios: Ratios,
}

pub struct WebhookSink {
    client: reqwest::Client,
    url: String,
    token: Option<SecretRef>,
    pool: String,
}

impl WebhookSink {
    pub fn new(cfg: &WebhookConfig, pool: &str) -> Result<Self, SinkError> {
        let client = crate::tls::client_builder(cfg.timeout, cfg.ca_file.as_deref(), false)
            .map_err(SinkError::Config)?
            .build()
            .map_err(|e| SinkError::Config(e.to_string()))?;
        Ok(WebhookSink {
            client,
            url: cfg.url.clone(),
            token: cfg.bearer_token.clone(),
            pool: pool.to_string(),
        })
    }
}

#[async_trait]
impl RatioSink for WebhookSink {
    fn kind(&self) -> &'static str {
        "webhook"
    }

    async fn apply(&self, desired: &Ratios) -> Result<Applied, SinkError> {
        let target = format!("webhook {}", self.url);
        let mut req = self
            .client
            .post(&self.url)
            .json(&WebhookPayload { pool: self.pool.clone(), ratios: desired.clone() });
        if let Some(t) = &self.token {
            let token = t.resolve().map_err(|detail| SinkError::Auth { target: target.clone(), detail })?;
            req = req.bearer_auth(token);
        }
        let resp = req.send().await.map_err(|e| SinkError::Unreachable {
            target: target.clone(),
            detail: e.without_url().to_string(),
        })?;
        let status = resp.status();
        if status.is_success() {
            return Ok(Applied { changed: desired.len(), unchanged: 0, warnings: Vec::new() });
        }
        let body: String = resp.text().await.unwrap_or_default().chars().take(300).collect();
        let detail = format!("HTTP {status}: {body}");
        Err(match status.as_u16() {
            401 | 403 => SinkError::Auth { target, detail },
            429 | 500..=599 => SinkError::Temporary { target, detail },
            _ => SinkError::Rejected { target, detail },
        })
    }
}
