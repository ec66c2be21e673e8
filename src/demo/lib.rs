//! `llm-load-controller demo`: the whole idea, live on loopback, in one command.
//!
//! It starts a heterogeneous simulated vLLM fleet (one replica much slower, like an older GPU), the
//! reference proxy in front of it (smooth weighted round robin, the `ratio` balancer), the
//! controller scraping the fleet directly and pushing ratios to the proxy through its `webhook` sink,
//! and a load generator that sends streaming completions to the proxy:
//! 1. **round robin**: the controller is not running, the proxy's weights are equal; the slow
//!    replica's queue and KV cache fill while others idle;
//! 2. **dynamic ratios**: the controller starts and pushes its ratios; load evens out;
//! 3. **spike**: the arrival rate jumps; the ratios readjust.
//!
//! A terminal view shows per-replica KV usage, queue and ratio while it runs; at the end it prints a
//! summary per phase (TTFT p50/p99 measured at the client, KV spread = time-average of max minus min
//! KV usage across replicas) and writes an HTML report with charts.

#![forbid(unsafe_code)]

mod html;
mod load;
mod view;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use llm_lc_proxy::{self as proxy, ProxyHandle};
use llm_lc_sim::{start_fleet, FleetConfig, ModelProfile, OutputLen};
use load::{Control, Lengths, Outcome};

/// Starts the controller from a config document (JSON, which is YAML) and runs it until the returned
/// sender fires or is dropped. Supplied by the controller's binary: this crate cannot depend on the
/// controller, whose binary depends on it.
pub trait ControllerLauncher: Send + Sync {
    fn start(&self, config: &str) -> anyhow::Result<ControllerTask>;
}

/// A running controller: its task (true when its last cycle was good) and the way to stop it.
pub type ControllerTask = (tokio::task::JoinHandle<bool>, tokio::sync::oneshot::Sender<()>);

/// Arguments of `llm-load-controller demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Total duration, split into three equal phases.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Speed of each simulated replica (1 = the demo GPU; the last one is an older, slower GPU).
    #[arg(long, value_delimiter = ',', default_value = "1,1,1,0.4")]
    pub speeds: Vec<f64>,
    /// Arrival rate in phases 1 and 2, as a fraction of the fleet's estimated capacity.
    #[arg(long, default_value_t = 0.7)]
    pub load: f64,
    /// Arrival rate multiplier during the spike (phase 3).
    #[arg(long, default_value_t = 1.4)]
    pub spike: f64,
    /// Where to write the HTML report.
    #[arg(long, default_value = "demo-report.html")]
    pub report: PathBuf,
    /// Seed of arrivals and lengths.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Plain progress lines instead of the live screen (automatic when stdout is not a terminal).
    #[arg(long)]
    pub plain: bool,
}

/// The demo GPU: small enough that a laptop-sized load fills its KV cache and queue, so imbalance
/// is visible within seconds (the `llama-8b-h100` profile would need hundreds of concurrent requests).
pub fn demo_profile() -> ModelProfile {
    let mut p = ModelProfile::tiny();
    p.name = "demo".into();
    p.model = "sim-demo".into();
    p.max_model_len = 4096;
    p.num_gpu_blocks = 1024; // 16k tokens of KV
    p.max_num_seqs = 32;
    p.max_num_batched_tokens = 2048;
    p.step_overhead_s = 15e-3;
    p.prefill_token_s = 40e-6;
    p.seq_s = 200e-6;
    p.kv_token_s = 400e-9;
    p
}

const LENGTHS: Lengths = Lengths {
    prompt_median: 400.0,
    prompt_sigma: 0.6,
    output_median: 80.0,
    output_sigma: 0.6,
    max_total: 4096,
};

/// Requests per second one speed-1 replica of [`demo_profile`] sustains at [`LENGTHS`]: a full batch
/// of 32 sequences, each ~80 output tokens, at ~32 ms per step (15 ms overhead + 6.4 ms per-sequence
/// + ~12k KV tokens read), with prefill on top; measured with `demo --load 1` to be about this.
const REPLICA_CAPACITY_RPS: f64 = 9.0;

pub const PHASES: [&str; 3] = ["round robin", "dynamic ratios", "spike"];

/// A sample of the fleet at one moment, for the view and the report.
#[derive(Debug, Clone)]
pub struct Tick {
    pub t: f64,
    pub phase: usize,
    pub kv: Vec<f64>,
    pub waiting: Vec<u32>,
    pub running: Vec<u32>,
    pub weights: Vec<u32>,
}

/// `llm-load-controller demo`; `launcher` starts the real controller in phase 2, and `shutdown`
/// (Ctrl-C) ends the demo early with its report.
pub async fn run(
    args: DemoArgs,
    launcher: &dyn ControllerLauncher,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    anyhow::ensure!(!args.speeds.is_empty(), "--speeds needs at least one replica");
    anyhow::ensure!(args.load > 0.0 && args.load.is_finite(), "--load must be > 0");
    let profile = demo_profile();
    let mut fleet_cfg = FleetConfig::new(profile.clone(), &args.speeds);
    fleet_cfg.output_len = OutputLen { median: LENGTHS.output_median, sigma: LENGTHS.output_sigma };
    fleet_cfg.seed = args.seed;
    let fleet = start_fleet(fleet_cfg).await.context("starting the simulated fleet")?;
    let members: Vec<String> = fleet.addrs().iter().map(|a| a.to_string()).collect();
    let n = members.len();

    let capacity: f64 = args.speeds.iter().map(|s| s * REPLICA_CAPACITY_RPS).sum();
    let base_rate = capacity * args.load;
    let proxy = start_proxy(&members, args.seed).await?;
    let proxy_url = format!("http://{}", proxy.addr());
    let webhook = format!("http://{}/admin/ratios", proxy.admin_addr());
    let control = Arc::new(Mutex::new(Control { phase: 0, rate: base_rate, stop: false }));
    let outcomes = Arc::new(Mutex::new(Vec::<Outcome>::new()));
    let generator = tokio::spawn(load::generate(
        proxy_url.clone(),
        profile.model.clone(),
        control.clone(),
        LENGTHS,
        args.seed,
        outcomes.clone(),
    ));

    let plain = args.plain || !std::io::IsTerminal::is_terminal(&std::io::stdout());
    let phase_len = args.duration / 3;
    let started = Instant::now();
    let mut ticks: Vec<Tick> = Vec::new();
    let mut controller_task: Option<ControllerTask> = None;
    let mut every = tokio::time::interval(Duration::from_millis(500));
    tokio::pin!(shutdown);
    let mut interrupted = false;
    println!(
        "demo: {n} simulated replicas (speeds {:?}) on {}, proxy {proxy_url}; ~{:.1} req/s ({:.0}% of capacity), spike x{}; {:?} per phase",
        args.speeds,
        members.join(", "),
        base_rate,
        args.load * 100.0,
        args.spike,
        phase_len
    );

    loop {
        tokio::select! {
            _ = &mut shutdown => { interrupted = true; break; }
            _ = every.tick() => {}
        }
        let t = started.elapsed();
        if t >= args.duration {
            break;
        }
        let phase = ((t.as_secs_f64() / phase_len.as_secs_f64()) as usize).min(2);
        if let Ok(mut c) = control.lock() {
            c.phase = phase;
            c.rate = if phase == 2 { base_rate * args.spike } else { base_rate };
        }
        // Phase 2 starts the controller: a fresh policy, so nothing learnt while its ratios were
        // ignored carries over.
        if phase >= 1 && controller_task.is_none() {
            controller_task = Some(launcher.start(&controller_config(&members, &webhook))?);
        }
        let weights = weights_in_proxy(&proxy, &members);
        let stats: Vec<_> = (0..n).filter_map(|i| fleet.stats(i).ok()).collect();
        let tick = Tick {
            t: t.as_secs_f64(),
            phase,
            kv: stats.iter().map(|s| s.kv_usage).collect(),
            waiting: stats.iter().map(|s| s.waiting).collect(),
            running: stats.iter().map(|s| s.running).collect(),
            weights,
        };
        let done = outcomes.lock().map(|o| o.clone()).unwrap_or_default();
        ticks.push(tick);
        view::draw(&ticks, &members, &args.speeds, &done, args.duration, plain);
    }

    if let Ok(mut c) = control.lock() {
        c.stop = true;
    }
    let _ = generator.await;
    if let Some((task, stop)) = controller_task {
        let _ = stop.send(());
        let _ = task.await;
    }
    proxy.shutdown().await;
    fleet.shutdown().await;

    let done = outcomes.lock().map(|o| o.clone()).unwrap_or_default();
    let summary = view::summary(&ticks, &done);
    println!("\n{summary}");
    std::fs::write(&args.report, html::report(&ticks, &done, &members, &args.speeds, &summary))
        .with_context(|| format!("writing {}", args.report.display()))?;
    println!("report: {}", args.report.display());
    if interrupted {
        println!("(stopped early by Ctrl-C)");
    }
    Ok(())
}

/// The reference proxy in front of the fleet: one pool, every request routed to it, smooth weighted
/// round robin so the weights alone decide the split.
async fn start_proxy(members: &[String], seed: u64) -> anyhow::Result<ProxyHandle> {
    let doc = serde_json::json!({
        "algorithm": "weighted-round-robin",
        "seed": seed,
        "pools": [{"name": "demo", "members": members}],
        "routes": {"steps": [{"id": "all", "field": "model", "op": "exists", "match": {"pool": "demo"}, "miss": {"pool": "demo"}}]},
    });
    let loaded = proxy::config::parse(std::path::Path::new("<demo proxy>"), &doc.to_string())
        .map_err(|e| anyhow::anyhow!("demo proxy config: {e}"))?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("proxy listener")?;
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("proxy admin listener")?;
    proxy::start_loaded(loaded, listener, admin).await.map_err(|e| anyhow::anyhow!("starting the proxy: {e}"))
}

/// The weights the proxy applies now, in member order.
fn weights_in_proxy(proxy: &ProxyHandle, members: &[String]) -> Vec<u32> {
    let pools = proxy.pools();
    let Some(pool) = pools.first() else { return vec![1; members.len()] };
    members
        .iter()
        .map(|m| pool.members.iter().find(|v| v.member.as_str() == m).map(|v| v.weight).unwrap_or(1))
        .collect()
}

/// The real controller's config: direct scrape every second, capacity policy, ratios pushed to the proxy by the
/// `webhook` sink, exactly as a deployment would.
fn controller_config(members: &[String], webhook: &str) -> String {
    serde_json::json!({
        "interval": "1s",
        "listen": "127.0.0.1:0",
        "sources": {"direct": {"kind": "scrape", "timeout": "500ms"}},
        "pools": [{
            "name": "demo",
            "source": "direct",
            "members": {"static": members},
            "stale_after": "6s",
            "grace": "4s",
            // The proxy runs weighted round robin, so the ratios must carry each replica's throughput
            // capacity (`mode: round-robin`), and the backlog phase 1 left on the slow replica is
            // what users feel: the capacity policy's delay factor keeps new requests off it while it
            // drains, then gives its share back.
            "policy": {"kind": "capacity", "mode": "round-robin"},
            "sink": {"kind": "webhook", "url": webhook},
        }],
    })
    .to_string()
}
