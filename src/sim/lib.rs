//! Simulated vLLM fleet: a pure engine model and live OpenAI-compatible servers around it.
//!
//! - [`engine`]: vLLM v1's continuous-batching scheduler as a pure state machine in virtual time
//!   (no I/O, no clock); the benchmark drives it directly.
//! - [`profile`]: model/GPU numbers for the engine, with their sources.
//! - [`metrics`]: pure `/metrics` renderer (vLLM v1, vLLM legacy, SGLang names).
//! - [`fleet`]: [`start_fleet`] runs N replicas in-process, each on its own port, with runtime
//!   faults under `/admin/...` (documented there); [`server`] is one replica's HTTP API,
//!   [`openai`] its wire shapes, [`tokenize`] the token-count approximation, [`driver`] the task
//!   that steps an engine in (scaled) real time.
//! - [`run`] is `llm-load-controller sim`.

#![forbid(unsafe_code)]

pub mod driver;
pub mod engine;
pub mod fleet;
pub mod metrics;
pub mod openai;
pub mod prefix;
pub mod profile;
pub mod server;
pub mod tokenize;

use std::net::IpAddr;

use clap::Args;

pub use fleet::{start_fleet, Fleet, FleetConfig, OutputLen, ReplicaConfig, ReplicaStatus, SimError};
pub use metrics::MetricsStyle;
pub use profile::ModelProfile;

/// Arguments of `llm-load-controller sim`.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Number of replicas to start.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Port of the first replica; the others follow (0 = free ports chosen by the OS).
    #[arg(long, default_value_t = 18000)]
    pub base_port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Speed factor per replica, comma-separated (1 = the profile's GPU, 0.5 = half as fast);
    /// missing ones are 1.
    #[arg(long, value_delimiter = ',')]
    pub speeds: Vec<f64>,
    /// Model/GPU profile: llama-8b-h100, llamacpp-cpu (llama.cpp on a CPU; use with
    /// `--metrics-style llamacpp`) or tiny.
    #[arg(long, default_value = "llama-8b-h100")]
    pub profile: String,
    /// Run K times faster than real time (latency metrics still show model time).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Metric names to expose: vllm (v1), vllm-legacy (before 0.11), sglang or llamacpp (which
    /// also serves `GET /props`).
    #[arg(long, value_enum, default_value_t = MetricsStyle::Vllm)]
    pub metrics_style: MetricsStyle,
    /// Served model name: one for every replica, or one per replica, comma-separated; `a|b` gives
    /// a replica two names. Default: the profile's model.
    #[arg(long = "model", value_delimiter = ',')]
    pub models: Vec<String>,
    /// LoRA adapters to serve, comma-separated (requests name them as the model).
    #[arg(long, value_delimiter = ',')]
    pub lora: Vec<String>,
    /// Replicas (indexes) that load the --lora adapters; default: all.
    #[arg(long, value_delimiter = ',')]
    pub lora_replicas: Vec<usize>,
    /// Median output length, in tokens, of requests without max_tokens.
    #[arg(long, default_value_t = 200.0)]
    pub output_median: f64,
    /// Spread (sigma of the log) of those output lengths.
    #[arg(long, default_value_t = 0.8)]
    pub output_sigma: f64,
    /// Slots (batch limit) per replica, comma-separated, as llama-server's `--parallel`: each
    /// brings its own context; missing ones keep the profile's.
    #[arg(long, value_delimiter = ',')]
    pub slots: Vec<u32>,
    /// Seed of fault injection and output lengths.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Turn command-line arguments into a fleet config, with errors that say which flag is wrong.
pub fn fleet_config(args: &SimArgs) -> Result<FleetConfig, SimError> {
    let n = args.replicas;
    if n == 0 {
        return Err(SimError::Invalid("--replicas must be at least 1".into()));
    }
    if args.speeds.len() > n {
        return Err(SimError::Invalid(format!("--speeds has {} values for {n} replicas", args.speeds.len())));
    }
    if !(args.models.is_empty() || args.models.len() == 1 || args.models.len() == n) {
        return Err(SimError::Invalid(format!(
            "--model has {} values; give one for all replicas or one per replica ({n})",
            args.models.len()
        )));
    }
    if args.slots.len() > n {
        return Err(SimError::Invalid(format!("--slots has {} values for {n} replicas", args.slots.len())));
    }
    if let Some(bad) = args.lora_replicas.iter().find(|&&i| i >= n) {
        return Err(SimError::Invalid(format!("--lora-replicas names replica {bad}, but there are {n}")));
    }
    let profile = ModelProfile::by_name(&args.profile)?;
    let speeds: Vec<f64> = (0..n).map(|i| args.speeds.get(i).copied().unwrap_or(1.0)).collect();
    let mut cfg = FleetConfig::new(profile, &speeds);
    cfg.host = args.host;
    cfg.base_port = args.base_port;
    cfg.time_scale = args.time_scale;
    cfg.metrics_style = args.metrics_style;
    cfg.output_len = OutputLen { median: args.output_median, sigma: args.output_sigma };
    cfg.seed = args.seed;
    for (i, r) in cfg.replicas.iter_mut().enumerate() {
        if let Some(m) = args.models.get(if args.models.len() == 1 { 0 } else { i }) {
            r.models = m.split('|').map(|s| s.trim().to_string()).collect();
        }
        r.slots = args.slots.get(i).copied();
        if args.lora_replicas.is_empty() || args.lora_replicas.contains(&i) {
            r.lora_adapters = args.lora.iter().map(|s| s.trim().to_string()).collect();
        }
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Run a simulated fleet until `shutdown` resolves (SIGINT or SIGTERM from the command line).
pub async fn run(args: SimArgs, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    let cfg = fleet_config(&args)?;
    let fleet = start_fleet(cfg.clone()).await?;
    for (s, r) in fleet.status().iter().zip(&cfg.replicas) {
        let lora = if r.lora_adapters.is_empty() {
            String::new()
        } else {
            format!(" lora={}", r.lora_adapters.join(","))
        };
        println!(
            "replica {}: http://{} model={} speed={}{lora}",
            s.index,
            s.addr,
            s.models.join("|"),
            s.speed
        );
    }
    println!(
        "sim: {} replicas ready (profile {}, time scale {}, metrics {:?}); admin at /admin/replicas; Ctrl-C stops",
        fleet.len(),
        cfg.profile.name,
        cfg.time_scale,
        cfg.metrics_style
    );
    shutdown.await;
    fleet.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }

    fn parse(args: &[&str]) -> SimArgs {
        Cli::try_parse_from(std::iter::once("sim").chain(args.iter().copied())).unwrap().sim
    }

    #[test]
    fn issue_example_parses() {
        let a = parse(&["--replicas", "3", "--base-port", "18000", "--speeds", "1,1,0.5"]);
        let c = fleet_config(&a).unwrap();
        let speeds: Vec<f64> = c.replicas.iter().map(|r| r.speed).collect();
        assert_eq!(speeds, vec![1.0, 1.0, 0.5]);
        assert_eq!(c.base_port, 18000);
        assert_eq!(c.profile.name, "llama-8b-h100");
    }

    #[test]
    fn models_and_lora_per_replica() {
        let a = parse(&["--replicas", "2", "--model", "a|b,c", "--lora", "sql,chat", "--lora-replicas", "1"]);
        let c = fleet_config(&a).unwrap();
        assert_eq!(c.replicas[0].models, vec!["a", "b"]);
        assert_eq!(c.replicas[1].models, vec!["c"]);
        assert!(c.replicas[0].lora_adapters.is_empty());
        assert_eq!(c.replicas[1].lora_adapters, vec!["sql", "chat"]);
    }

    #[test]
    fn bad_flags_are_named() {
        for (args, needle) in [
            (&["--replicas", "2", "--speeds", "1,1,1"][..], "--speeds"),
            (&["--replicas", "3", "--model", "a,b"][..], "--model"),
            (&["--lora-replicas", "7"][..], "--lora-replicas"),
            (&["--profile", "nope"][..], "unknown profile"),
            (&["--speeds", "0"][..], "speed 0"),
            (&["--time-scale=-1"][..], "time scale"),
        ] {
            let e = fleet_config(&parse(args)).unwrap_err().to_string();
            assert!(e.contains(needle), "{args:?}: {e}");
        }
    }
}
