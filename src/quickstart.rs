//! Config-less quick start: `run --dry-run --scrape HOST:PORT,...` or
//! `run --dry-run --prometheus URL --selector '{job="vllm"}'`.
//!
//! The flags are turned into the same config document a file would hold and go through the same
//! parser and validation, so the quick start behaves exactly like a one-pool config file.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::json;

use crate::config::{self, Config, ConfigErrors};

pub struct QuickStart {
    pub scrape: Option<Vec<String>>,
    pub prometheus: Option<String>,
    pub selector: Option<String>,
    pub interval: Duration,
    pub listen: SocketAddr,
    pub profile: String,
}

impl QuickStart {
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);
    /// Loopback: a quick start is someone trying the controller on their machine.
    pub const DEFAULT_LISTEN: SocketAddr =
        SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9090);

    pub fn config(&self) -> Result<Config, ConfigErrors> {
        let (source, members) = match (&self.scrape, &self.prometheus) {
            (Some(list), _) => (json!({"kind": "scrape"}), json!({"static": list})),
            (None, Some(url)) => (
                json!({"kind": "prometheus", "url": url}),
                json!({"prometheus_up": self.selector.clone().unwrap_or_else(|| "{job=\"vllm\"}".into())}),
            ),
            (None, None) => (json!({"kind": "scrape"}), json!({})),
        };
        let doc = json!({
            "interval": humantime::format_duration(self.interval).to_string(),
            "listen": self.listen.to_string(),
            "sources": {"quickstart": source},
            "pools": [{
                "name": "quickstart",
                "source": "quickstart",
                "profile": self.profile,
                "members": members,
            }],
        });
        // JSON is YAML: reuse the one parser and its validation.
        config::parse(Path::new("<command line>"), &doc.to_string())
    }
}
