//! Reference proxy: routing table on the JSON body, then weighted choice by ratios (being built).

use clap::Args;

/// Arguments of `llm-load-controller proxy`.
#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// Proxy config file (YAML).
    #[arg(long, short)]
    pub config: std::path::PathBuf,
}

/// Run the proxy until Ctrl-C.
pub async fn run(_args: ProxyArgs) -> anyhow::Result<()> {
    anyhow::bail!("the reference proxy is not built yet")
}
