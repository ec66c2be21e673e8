//! Virtual-time fleet benchmark (being built).

use clap::Args;

/// Arguments of `llm-load-controller bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Scenario to run.
    #[arg(long, default_value = "heterogeneous")]
    pub scenario: String,
}

/// Run the benchmark and print its results.
pub fn run(_args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("the benchmark is not built yet")
}
