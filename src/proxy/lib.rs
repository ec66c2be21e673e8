//! Reference proxy: two-stage routing for the OpenAI API.
//!
//! Stage 1 ([`route`]): a table of steps on the JSON body or headers picks a pool (or rejects), like a
//! BIG-IP data group walked by an iRule ([`bigip`] exports the same table for one). Stage 2
//! ([`pool`]): a weighted choice inside the pool by the controller's ratios, with the shared
//! [`llm_lc_balance`] algorithms. Around them: [`criticality`] (admission when a pool is saturated),
//! [`upstream`] (streaming forwarding with timeouts and connect retries), [`admin`] (ratio intake by
//! webhook or polling, live state), [`metrics`], [`server`] (the HTTP routes), [`split`] (model
//! canaries), [`bench`] (overhead benchmark against HAProxy).
//!
//! In-process use (the demo): [`start`] with a [`ProxyConfig`] and two bound listeners returns a
//! [`ProxyHandle`] with the bound addresses, a live view of weights and in-flight counts, and
//! [`ProxyHandle::shutdown`].
//!
//! Both listeners are served by [`listen`] (connection cap, header and keep-alive timeouts; hyper's own
//! parse-error answers get JSON bodies through [`parse_errors`]);
//! [`guard`] adds guard steps (deny rules, an external guard service) to the routing table;
//! [`body`] parses request bodies strictly (duplicate keys refused).

#![forbid(unsafe_code)]

pub mod admin;
pub mod bench;
pub mod bench_doors;
pub mod bigip;
pub mod body;
pub mod config;
pub mod criticality;
pub mod errors;
pub mod gauges;
pub mod guard;
pub mod listen;
pub mod members;
pub mod metrics;
pub mod parse_errors;
pub mod pool;
pub mod prefix_key;
pub mod route;
pub mod server;
pub mod split;
pub mod upstream;
pub mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use llm_lc_adapters::Ratios;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::{Loaded, ProxyConfig, DEFAULT_ALGORITHM};
pub use criticality::Criticality;
pub use pool::{Applied, MemberView, PoolView, WeightSource};
pub use route::{Decision, RouteTable, Target};

/// Arguments of `llm-load-controller proxy`: `proxy --config F` serves; subcommands explain, export
/// and benchmark.
#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ProxyArgs {
    /// Proxy config file (YAML) to serve.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Option<ProxyCommand>,
}

impl ProxyArgs {
    /// Whether these arguments serve traffic (`proxy --config F`), as opposed to a subcommand that
    /// checks, explains, exports or benchmarks.
    pub fn serves(&self) -> bool {
        self.command.is_none() && self.config.is_some()
    }
}

/// Tasks a busy worker runs between two looks at its sockets (tokio's default is 61).
///
/// The proxy's tasks are short: one read from a member, one write to a client. With 61 of them
/// between two polls of the sockets, a stream whose member has sent its next event waits behind a
/// whole queue of others when the machine is saturated, and that wait is what shows in the p99 at
/// 64 streams. Measured against the default in the same runs (src/proxy/RESULTS.md, "Who ran
/// before, and how often the proxy looks at its sockets"): 8 moved the p99 by a median of -6.8 ms
/// at concurrency 64 (five paired runs) and changed nothing at 1 and 16; 2 was worse than the
/// default (the polls themselves cost), 4 and 16 in between.
pub const EVENT_INTERVAL: u32 = 8;

/// Set the runtime up for serving: [`EVENT_INTERVAL`]. The rest stays tokio's default (one worker
/// per core, work stealing).
pub fn tune_runtime(builder: &mut tokio::runtime::Builder) -> &mut tokio::runtime::Builder {
    builder.event_interval(EVENT_INTERVAL)
}

#[derive(Debug, Clone, Subcommand)]
pub enum ProxyCommand {
    /// Validate a config and print its routing table.
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Show the steps a request body takes through the routing table and the pool it ends in.
    Explain {
        #[arg(long, short)]
        config: PathBuf,
        /// Request body (JSON) file; `-` reads stdin.
        #[arg(long)]
        body: PathBuf,
        /// Request headers the table may look at, `Name: value` (repeatable).
        #[arg(long = "header", short = 'H')]
        headers: Vec<String>,
    },
    /// Print the routing table as a BIG-IP data group for deploy/bigip/irule/llm_route.tcl.
    ExportBigip {
        #[arg(long, short)]
        config: PathBuf,
        /// tmsh (bigip.conf `ltm data-group internal` text) or rest (iControl REST JSON body).
        #[arg(long, value_enum, default_value_t = ExportFormat::Tmsh)]
        format: ExportFormat,
        /// Data group name (full path or short name in /Common).
        #[arg(long, default_value = "/Common/llm_routes")]
        name: String,
    },
    /// Measure the proxy's added latency and request rate next to real HAProxy on the same backend.
    Bench(bench::BenchArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    Tmsh,
    Rest,
}

/// What can stop the proxy from starting.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("invalid proxy config:\n{0}")]
    Config(String),
    #[error("cannot read the address of a listener: {0}")]
    Listener(std::io::Error),
    #[error("no pool named {0:?}")]
    NoPool(String),
}

/// A running proxy. Dropping it without [`ProxyHandle::shutdown`] stops the servers too.
pub struct ProxyHandle {
    addr: SocketAddr,
    admin_addr: SocketAddr,
    shared: Arc<server::Shared>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl ProxyHandle {
    /// Where the OpenAI API listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the admin API (ratio webhook, state) listens.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Live view: per pool, each member's weight and in-flight count, queue, saturation.
    pub fn pools(&self) -> Vec<PoolView> {
        self.shared.pools.iter().map(|p| p.view()).collect()
    }

    /// Apply ratios to a pool directly (what the webhook does).
    pub fn apply_ratios(&self, pool: &str, ratios: &Ratios) -> Result<Applied, ProxyError> {
        admin::apply(&self.shared, pool, ratios, WeightSource::Api)
            .ok_or_else(|| ProxyError::NoPool(pool.into()))
    }

    /// The proxy's metrics in Prometheus text.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics.encode()
    }

    /// Stop accepting, let in-flight responses finish (up to 5 s), stop polling.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        for t in self.tasks.drain(..) {
            let abort = t.abort_handle();
            if tokio::time::timeout(std::time::Duration::from_secs(5), t).await.is_err() {
                abort.abort();
            }
        }
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        self.stop.cancel();
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Start the proxy on bound listeners. Validates `cfg` (the routing table included) first; its
/// `listen`/`admin.listen` are ignored in favour of the listeners given.
pub async fn start(
    cfg: ProxyConfig,
    listener: TcpListener,
    admin_listener: TcpListener,
) -> Result<ProxyHandle, ProxyError> {
    let loaded = cfg.compile().map_err(|errs| {
        ProxyError::Config(errs.into_iter().map(|(f, m)| format!("{f}: {m}")).collect::<Vec<_>>().join("\n"))
    })?;
    start_loaded(loaded, listener, admin_listener).await
}

/// [`start`] with an already validated config.
pub async fn start_loaded(
    loaded: Loaded,
    listener: TcpListener,
    admin_listener: TcpListener,
) -> Result<ProxyHandle, ProxyError> {
    let Loaded { config: cfg, table } = loaded;
    let addr = listener.local_addr().map_err(ProxyError::Listener)?;
    let admin_addr = admin_listener.local_addr().map_err(ProxyError::Listener)?;
    let shared = Arc::new(server::Shared::new(&cfg, table).map_err(ProxyError::Config)?);
    if !admin_addr.ip().is_loopback() && cfg.admin.bearer_token.is_none() {
        tracing::warn!(%admin_addr, "the admin listener is not on loopback and has no bearer token: anyone who reaches it can change routing weights");
    }
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    let limits = listen::ConnLimits {
        max: cfg.limits.max_connections,
        header_read: cfg.timeouts.header_read,
        keep_alive_idle: cfg.timeouts.keep_alive_idle,
    };
    let app = server::router(shared.clone());
    tasks.push(tokio::spawn(listen::serve(listener, app, limits, shared.metrics.conn("api"), stop.clone())));
    let admin_app = admin::router(shared.clone(), cfg.admin.bearer_token.clone());
    tasks.push(tokio::spawn(listen::serve(
        admin_listener,
        admin_app,
        limits,
        shared.metrics.conn("admin"),
        stop.clone(),
    )));
    let reads_members = |p: &&Arc<pool::Pool>| p.gauges_from == config::GaugesFrom::Members;
    for pool in shared.pools.iter().filter(|p| p.uses_endpoint_picker()).filter(reads_members) {
        let client = shared.upstream.client().clone();
        tasks.push(tokio::spawn(gauges::poll(pool.clone(), client, stop.clone())));
    }
    if let Some(poll) = cfg.ratios.poll.clone() {
        let client = shared.upstream.client().clone();
        tasks.push(tokio::spawn(admin::poll_ratios(shared.clone(), client, poll, stop.clone())));
    }
    Ok(ProxyHandle { addr, admin_addr, shared, stop, tasks })
}

/// `llm-load-controller proxy ...`. Serving stops when `shutdown` resolves (the caller decides which
/// signals mean stop).
pub async fn run(args: ProxyArgs, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    match (args.command, args.config) {
        (Some(ProxyCommand::Check { config }), _) => {
            let l = config::load(&config).map_err(|e| anyhow::anyhow!("{e}"))?;
            out(&format!("{}\nconfig OK\n", describe(&l)))
        }
        (Some(ProxyCommand::Explain { config, body, headers }), _) => {
            let l = config::load(&config).map_err(|e| anyhow::anyhow!("{e}"))?;
            out(&explain(&l, &body, &headers)?)
        }
        (Some(ProxyCommand::ExportBigip { config, format, name }), _) => {
            let l = config::load(&config).map_err(|e| anyhow::anyhow!("{e}"))?;
            for w in bigip::guard_warnings(&l.table) {
                eprintln!("warning: {w}");
            }
            match format {
                ExportFormat::Tmsh => out(&bigip::tmsh(&l.table, &l.config, &name)),
                ExportFormat::Rest => {
                    out(&format!("{}\n", serde_json::to_string_pretty(&bigip::icontrol_rest(&l.table, &l.config, &name))?))
                }
            }
        }
        (Some(ProxyCommand::Bench(b)), _) => bench::run(b).await,
        (None, Some(config)) => serve(&config, shutdown).await,
        (None, None) => anyhow::bail!(
            "give --config FILE to serve, or a subcommand (check, explain, export-bigip, bench); see `proxy --help`"
        ),
    }
}

/// Print to stdout; a closed pipe (`| head`) is not an error.
fn out(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

async fn serve(
    path: &std::path::Path,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let l = config::load(path).map_err(|e| anyhow::anyhow!("{e}"))?;
    let listener = TcpListener::bind(l.config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", l.config.listen))?;
    let admin = TcpListener::bind(l.config.admin.listen)
        .await
        .with_context(|| format!("cannot listen on {} (admin.listen)", l.config.admin.listen))?;
    let pools = l.config.pools.len();
    let steps = l.table.steps.len();
    let handle = start_loaded(l, listener, admin).await?;
    tracing::info!(listen = %handle.addr(), admin = %handle.admin_addr(), pools, steps, "proxy started");
    println!("proxy: listening on http://{} (admin http://{})", handle.addr(), handle.admin_addr());
    shutdown.await;
    handle.shutdown().await;
    tracing::info!("proxy stopped");
    Ok(())
}

/// A short description of a loaded config: pools and steps.
pub fn describe(l: &Loaded) -> String {
    let mut s = String::new();
    for p in &l.config.pools {
        let algo = p.algorithm.unwrap_or(l.config.algorithm);
        s.push_str(&format!("pool {}: {} members, {:?}", p.name, p.members.len(), algo));
        // The picker reads gauges from somewhere: say where, so `check` shows what it will reach.
        if algo == llm_lc_balance::Algorithm::Picker {
            match p.gauges_from {
                config::GaugesFrom::Members => s.push_str(&format!(
                    ", gauges from each member's /metrics every {} ms",
                    p.metrics_interval.as_millis()
                )),
                config::GaugesFrom::Controller => s.push_str(", gauges from the controller's polled report"),
            }
        }
        s.push('\n');
    }
    for (i, st) in l.table.steps.iter().enumerate() {
        let start = if i == l.table.start { " (start)" } else { "" };
        if let Some(g) = st.describe_guard() {
            s.push_str(&format!(
                "step {}{start}: guard {g} ? allow: {} : block\n",
                st.id,
                l.table.describe_target(&st.on_match)
            ));
            continue;
        }
        let value = st.value.as_ref().map(|v| format!(" {v}")).unwrap_or_default();
        s.push_str(&format!(
            "step {}{start}: {} {}{value} ? {} : {}\n",
            st.id,
            st.source.describe(),
            st.op.as_str(),
            l.table.describe_target(&st.on_match),
            l.table.describe_target(&st.on_miss)
        ));
    }
    s
}

/// `proxy explain`: the steps a body takes.
pub fn explain(l: &Loaded, body: &std::path::Path, headers: &[String]) -> anyhow::Result<String> {
    let text = if body.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("cannot read the body from stdin")?
    } else {
        std::fs::read_to_string(body).with_context(|| format!("cannot read {}", body.display()))?
    };
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON; the proxy would answer 400", body.display()))?;
    let mut map = axum::http::HeaderMap::new();
    for h in headers {
        let (k, v) = h.split_once(':').with_context(|| format!("header {h:?} must be `Name: value`"))?;
        let name = axum::http::HeaderName::from_bytes(k.trim().as_bytes())
            .with_context(|| format!("{k:?} is not a header name"))?;
        let value = axum::http::HeaderValue::from_str(v.trim())
            .with_context(|| format!("bad header value in {h:?}"))?;
        map.append(name, value);
    }
    let d = l.table.evaluate(&json, &map);
    Ok(l.table.explain(&d))
}

#[cfg(test)]
mod tests {
    #[test]
    fn check_says_where_the_picker_reads_its_gauges() {
        let yaml = "algorithm: picker\npools:\n  - name: a\n    members: ['127.0.0.1:1']\n  - name: b\n    members: ['127.0.0.1:2']\n    algorithm: weighted-round-robin\nroutes:\n  steps:\n    - id: s\n      field: model\n      op: exists\n      match: { pool: a }\n      miss: { pool: b }\n";
        let cfg: super::ProxyConfig = serde_yaml_ng::from_str(yaml).expect("parses");
        let loaded = cfg.compile().expect("valid");
        let text = super::describe(&loaded);
        assert!(
            text.contains("pool a: 1 members, Picker, gauges from each member's /metrics every 100 ms"),
            "{text}"
        );
        assert!(text.contains("pool b: 1 members, WeightedRoundRobin\n"), "{text}");
    }

    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        proxy: ProxyArgs,
    }

    fn parse(args: &[&str]) -> Result<ProxyArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("proxy").chain(args.iter().copied())).map(|c| c.proxy)
    }

    #[test]
    fn serve_and_subcommands_parse() {
        let a = parse(&["--config", "p.yaml"]).unwrap();
        assert_eq!(a.config.as_deref(), Some(std::path::Path::new("p.yaml")));
        assert!(a.command.is_none());
        let a = parse(&["explain", "-c", "p.yaml", "--body", "b.json", "-H", "x-a: 1"]).unwrap();
        assert!(matches!(a.command, Some(ProxyCommand::Explain { headers, .. }) if headers == ["x-a: 1"]));
        let a = parse(&["export-bigip", "--config", "p.yaml", "--format", "rest"]).unwrap();
        assert!(matches!(a.command, Some(ProxyCommand::ExportBigip { format: ExportFormat::Rest, .. })));
        let a = parse(&["bench", "--requests", "10", "--concurrency", "1,16,64"]).unwrap();
        assert!(
            matches!(a.command, Some(ProxyCommand::Bench(b)) if b.requests == 10 && b.concurrency == [1, 16, 64])
        );
        assert!(parse(&["--config", "p.yaml", "explain", "-c", "p.yaml", "--body", "b"]).is_err());
    }

    #[test]
    fn only_serving_gets_the_tuned_runtime() {
        // The bench's load generator and backend stay on tokio's defaults: the harness is the same
        // for every target it measures, HAProxy included.
        assert!(parse(&["--config", "p.yaml"]).unwrap().serves());
        assert!(!parse(&["bench"]).unwrap().serves());
        assert!(!parse(&["bench", "--backend-listen", "127.0.0.1:1"]).unwrap().serves());
        assert!(!parse(&["check", "--config", "p.yaml"]).unwrap().serves());
        assert!(!parse(&[]).unwrap().serves());
        let mut b = tokio::runtime::Builder::new_multi_thread();
        assert!(tune_runtime(b.enable_all()).build().is_ok());
    }

    #[test]
    fn explain_reads_headers() {
        let l = config::parse(
            std::path::Path::new("p.yaml"),
            "pools:\n  - name: a\n    members: ['127.0.0.1:1']\n  - name: b\n    members: ['127.0.0.1:2']\nroutes:\n  steps:\n    - id: t\n      header: x-tier\n      op: one-of\n      value: [gold, silver]\n      match: { pool: a }\n      miss: { pool: b }\n",
        )
        .unwrap();
        let dir = std::env::temp_dir().join(format!("proxy-explain-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let body = dir.join("b.json");
        std::fs::write(&body, "{}").unwrap();
        let out = explain(&l, &body, &["X-Tier: silver".into()]).unwrap();
        assert!(out.contains("header x-tier = \"silver\" one-of") && out.contains("result: pool a"), "{out}");
        assert!(explain(&l, &body, &["no colon".into()]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
