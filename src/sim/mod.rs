//! Simulated vLLM fleet: a pure engine model and live OpenAI-compatible servers around it.

pub mod engine;
pub mod metrics;
pub mod profile;

use clap::Args;

/// Arguments of `llm-load-controller sim`.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Number of replicas to start.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Port of the first replica; the others follow.
    #[arg(long, default_value_t = 18000)]
    pub base_port: u16,
}

/// Run a simulated fleet until Ctrl-C.
pub async fn run(_args: SimArgs) -> anyhow::Result<()> {
    anyhow::bail!("the simulated fleet is not built yet")
}
