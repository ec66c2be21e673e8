//! The `llm-load-controller` command: parse arguments, then hand over to the library.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use llm_load_controller::config::{self, LogFormat};
use llm_load_controller::control_loop::{self, Output};
use llm_load_controller::controller::Controller;
use llm_load_controller::leader::{self, Leadership};
use llm_load_controller::overrides::{Overrides, QuickStartFlags};
use llm_load_controller::quickstart::QuickStart;
use llm_load_controller::telemetry::Telemetry;
use llm_load_controller::{adapters, reload, signal};

#[derive(Parser)]
#[command(
    name = "llm-load-controller",
    version,
    about = "Keeps load balancers weighted by the live load of LLM model servers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the control loop until SIGTERM/SIGINT.
    Run(RunArgs),
    /// Validate a config file and print the plan: pools, members, the exact PromQL; then try to
    /// connect to every address it names (Prometheus, static members, LBs) and name each one that
    /// cannot be reached. Exits 2 on an invalid config, 0 otherwise.
    Check {
        #[arg(long, short, env = "LLMLC_CONFIG")]
        config: PathBuf,
        /// Reach nothing: read no file the config names (CA bundles, Secrets) and no network; list
        /// what was taken on trust. For a config written for a pod, checked on a laptop or in CI.
        #[arg(long)]
        offline: bool,
    },
    /// Helpers for the endpoint picker's doors.
    #[command(subcommand)]
    Picker(PickerCommand),
    /// Run a simulated vLLM fleet (OpenAI API + vLLM metrics).
    #[cfg(feature = "tools")]
    Sim(llm_lc_sim::SimArgs),
    /// Virtual-time benchmark: balancers and policies compared on simulated fleets.
    #[cfg(feature = "tools")]
    Bench(llm_lc_bench::BenchArgs),
    /// Reference proxy: routing table on the request body, then weighted choice by ratios.
    #[cfg(feature = "tools")]
    Proxy(llm_lc_proxy::ProxyArgs),
    /// Live demonstration on a simulated fleet: round robin, then dynamic ratios, then a spike.
    #[cfg(feature = "tools")]
    Demo(llm_lc_demo::DemoArgs),
}

#[derive(Subcommand)]
enum PickerCommand {
    /// Print one `use-server` rule per server of an HAProxy backend, following the SPOE agent's
    /// answer (for HAProxy before 2.6.12, whose `use-server` takes literal names only).
    HaproxyRules {
        /// HAProxy's runtime API (a `stats socket` line's address: unix:/path or host:port).
        #[arg(long)]
        runtime: String,
        /// The backend the rules go in.
        #[arg(long)]
        backend: String,
        /// The SPOE agent's `option var-prefix`.
        #[arg(long, default_value = "llmlc")]
        var_prefix: String,
    },
}

/// `run`'s flags. Every common flag also reads an `LLMLC_*` environment variable (the flag wins);
/// how they combine with `--config` is [`overrides`]' business.
#[derive(clap::Args)]
struct RunArgs {
    /// Config file (YAML).
    #[arg(long, short, env = "LLMLC_CONFIG")]
    config: Option<PathBuf>,
    /// Quick start without a config file: scrape these servers' /metrics directly (HOST:PORT,HOST:PORT).
    #[arg(long, value_delimiter = ',', conflicts_with = "prometheus", env = "LLMLC_SCRAPE")]
    scrape: Option<Vec<String>>,
    /// Quick start without a config file: Prometheus/Thanos URL; members are the `up` series of --selector.
    #[arg(long, env = "LLMLC_PROMETHEUS")]
    prometheus: Option<String>,
    /// Quick start: label selector of the members' `up` series, with --prometheus [default: {job="vllm"}].
    #[arg(long, env = "LLMLC_SELECTOR")]
    selector: Option<String>,
    /// Cycle interval [default: 5s, or the config's `interval`]. Overrides the config file.
    #[arg(long, value_parser = humantime::parse_duration, env = "LLMLC_INTERVAL")]
    interval: Option<Duration>,
    /// Listen address of /metrics, /readyz, /v1/ratios [default: 127.0.0.1:9090 for a quick start, or
    /// the config's `listen`]. Overrides the config file.
    #[arg(long, env = "LLMLC_LISTEN")]
    listen: Option<SocketAddr>,
    /// Quick start: server profile (vllm, vllm-legacy, sglang, trtllm, nim, tgi, llamacpp) [default: vllm].
    #[arg(long, env = "LLMLC_PROFILE")]
    profile: Option<String>,
    /// Compute and print ratios, push nothing, whatever sinks are configured.
    #[arg(long, env = "LLMLC_DRY_RUN")]
    dry_run: bool,
    /// One cycle, then exit 0 if every pool computed ratios, 1 otherwise. Binds no listener.
    #[arg(long)]
    once: bool,
    /// What to print per cycle on stdout. Default: text with --dry-run or --once, quiet otherwise.
    #[arg(long, value_enum, env = "LLMLC_OUTPUT")]
    output: Option<Output>,
    /// Log format on stderr. Overrides the config's `log_format`.
    #[arg(long, value_enum, env = "LLMLC_LOG_FORMAT")]
    log_format: Option<LogFormatArg>,
}

impl RunArgs {
    fn overrides(&self) -> Overrides {
        Overrides { listen: self.listen, interval: self.interval }
    }

    fn quick_start(&self) -> QuickStartFlags {
        QuickStartFlags {
            scrape: self.scrape.is_some(),
            prometheus: self.prometheus.is_some(),
            selector: self.selector.is_some(),
            profile: self.profile.is_some(),
        }
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormatArg {
    Text,
    Json,
}

fn init_logging(format: LogFormat) {
    use tracing_subscriber::field::MakeExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        // `message` at the top level, next to `level` and `target`: what log stores (Loki, Elastic,
        // OpenShift's logging) index as the log line. Without flattening it sits under `fields`.
        LogFormat::Json => b.json().flatten_event(true).init(),
        // Field values may hold text from outside (a member's name, a model name, an error body):
        // control characters are escaped so each record stays one line and cannot drive a terminal.
        LogFormat::Text => b
            .fmt_fields(
                tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
                    let text = format!("{value:?}");
                    let text = llm_lc_adapters::name::escape_controls(&text);
                    if field.name() == "message" {
                        write!(w, "{text}")
                    } else {
                        write!(w, "{field}={text}")
                    }
                })
                .delimited(" "),
            )
            .init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    #[cfg(feature = "tools")]
    if let Command::Proxy(args) = &cli.command {
        if args.serves() {
            llm_lc_proxy::tune_runtime(&mut runtime);
        }
    }
    match runtime.build() {
        Ok(runtime) => runtime.block_on(command(cli)),
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn command(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Check { config, offline } => check(&config, offline).await,
        Command::Run(args) => run(args).await,
        Command::Picker(PickerCommand::HaproxyRules { runtime, backend, var_prefix }) => {
            match llm_load_controller::picker::rules::haproxy_rules(&runtime, &backend, &var_prefix).await {
                Ok(rules) => {
                    print!("{rules}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
        #[cfg(feature = "tools")]
        Command::Sim(args) => {
            init_logging(LogFormat::Text);
            report(llm_lc_sim::run(args, signal::shutdown()).await)
        }
        #[cfg(feature = "tools")]
        Command::Bench(args) => report(llm_load_controller::tools::bench(args)),
        #[cfg(feature = "tools")]
        Command::Demo(args) => {
            init_logging(LogFormat::Text);
            report(llm_lc_demo::run(args, &llm_load_controller::tools::InProcess, signal::shutdown()).await)
        }
        #[cfg(feature = "tools")]
        Command::Proxy(args) => {
            init_logging(LogFormat::Text);
            report(llm_lc_proxy::run(args, signal::shutdown()).await)
        }
    }
}

#[cfg(feature = "tools")]
fn report(r: anyhow::Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn check(path: &std::path::Path, offline: bool) -> ExitCode {
    let loaded = if offline { config::load_offline(path) } else { config::load(path) };
    match loaded {
        Ok(cfg) => {
            print!("{}", llm_load_controller::plan::describe(&cfg));
            // YAML comments, so the plan still parses.
            for (field, why) in cfg.cautions() {
                println!("# caution: {field}: {why}");
            }
            if offline {
                // YAML comments: the plan above still parses as it does without --offline.
                let text = std::fs::read_to_string(path).unwrap_or_default();
                let trusted = llm_load_controller::offline::unverified(&text);
                println!("# offline: {} things not verified", trusted.len());
                for (field, what) in trusted {
                    println!("#   {field}: {}", llm_lc_adapters::name::escape_controls(&what));
                }
            } else {
                // Also comments. A valid config exits 0 whatever is reachable: the report says what
                // to fix, and a deploy pipeline that checks before the LB exists still passes.
                let targets = llm_load_controller::reach::targets(&cfg);
                print!("{}", llm_load_controller::reach::report(&targets).await.0);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: RunArgs) -> ExitCode {
    // With a config file, its bytes are kept to notice changes (live reload).
    let mut file_text = None;
    let overrides = args.overrides();
    let cfg = match &args.config {
        Some(path) => {
            // Flags that build the quick-start pool say nothing a file cannot say better: refused,
            // rather than silently ignored. `--listen` and `--interval` override the file.
            if let Err(msg) = args.quick_start().refuse_with_config(path) {
                eprintln!("error: {msg}");
                return ExitCode::from(2);
            }
            reload::read(path).and_then(|(cfg, text)| {
                file_text = Some(text);
                overrides.apply(path, cfg)
            })
        }
        // (Checked here rather than by clap's `requires`, so that a stray LLMLC_SELECTOR next to
        // --config gets the refusal above, which says what to do.)
        None if args.selector.is_some() && args.prometheus.is_none() => {
            eprintln!("error: --selector (LLMLC_SELECTOR) selects `up` series and needs --prometheus URL");
            return ExitCode::from(2);
        }
        None if args.scrape.is_some() || args.prometheus.is_some() => QuickStart {
            scrape: args.scrape.clone(),
            prometheus: args.prometheus.clone(),
            selector: args.selector.clone(),
            interval: args.interval.unwrap_or(QuickStart::DEFAULT_INTERVAL),
            listen: args.listen.unwrap_or(QuickStart::DEFAULT_LISTEN),
            profile: args.profile.clone().unwrap_or_else(|| "vllm".into()),
        }
        .config(),
        None => {
            eprintln!(
                "error: give --config FILE (or LLMLC_CONFIG), or --scrape HOST:PORT,... or --prometheus URL for a quick start"
            );
            return ExitCode::from(2);
        }
    };
    let cfg = match cfg {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let log_format = match args.log_format {
        Some(LogFormatArg::Json) => LogFormat::Json,
        Some(LogFormatArg::Text) => LogFormat::Text,
        None => cfg.log_format,
    };
    init_logging(log_format);
    let output = args.output.unwrap_or(if args.dry_run || args.once { Output::Text } else { Output::Quiet });

    let telemetry = Telemetry::new(cfg.interval, cfg.unready_after_cycles);
    let ctx = adapters::SinkContext::default();
    let mut controller = match Controller::new(&cfg, telemetry.clone(), args.dry_run, &ctx) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    // Several replicas: only the Lease holder pushes. A dry run pushes nothing, so it never takes
    // the Lease from a live controller.
    let leadership = match leader::elector_from_config(&cfg.leader_election) {
        _ if args.dry_run => Leadership::single(),
        Ok(None) => Leadership::single(),
        Ok(Some(e)) if args.once => Leadership::single_round(e).await,
        Ok(Some(e)) => Leadership::spawn(e),
        Err(e) => {
            eprintln!("error: leader election: {e}");
            return ExitCode::from(2);
        }
    };
    leadership.report_to(telemetry.clone());
    controller.set_leadership(leadership.subscribe());
    // `--once` prints one cycle and exits: it serves nothing, so it needs no port.
    let listener = if args.once {
        None
    } else {
        match tokio::net::TcpListener::bind(cfg.listen).await {
            Ok(l) => Some(l),
            Err(e) => {
                eprintln!("error: cannot listen on {}: {e}", cfg.listen);
                leadership.stop().await;
                return ExitCode::from(2);
            }
        }
    };
    let addr = listener.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or_default();
    tracing::info!(listen = %addr, pools = cfg.pools.len(), interval = ?cfg.interval, dry_run = args.dry_run, "controller started");
    let stop_serving = tokio_util::sync::CancellationToken::new();
    let server = listener.map(|listener| {
        let app = telemetry.router().merge(ctx.eds.clone().router());
        let stop = stop_serving.clone();
        tokio::spawn(async move {
            axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await
        })
    });

    // The endpoint pickers' doors: on every replica, leader or not. A dry run serves them too
    // (they push nothing; a load balancer asks them).
    let pickers = if args.once {
        None
    } else {
        match llm_load_controller::picker::serve(&cfg, telemetry.clone(), stop_serving.clone()).await {
            Ok(s) => {
                for ((pool, door), at) in &s.bound {
                    tracing::info!(pool = %pool, door = %door, listen = %at, "endpoint picker serving");
                }
                Some(s)
            }
            Err(e) => {
                eprintln!("error: {e}");
                stop_serving.cancel();
                leadership.stop().await;
                return ExitCode::from(2);
            }
        }
    };

    let reloader = match (&args.config, file_text) {
        (Some(path), Some(text)) if !args.once => {
            let configs = reload::watch_file(path, text, cfg.interval, overrides, telemetry.clone());
            let builder = reload::Builder {
                telemetry: telemetry.clone(),
                dry_run: args.dry_run,
                ctx,
                leader: leadership.subscribe(),
            };
            Some(reload::Reloader::new(configs, builder, cfg, path))
        }
        _ => None,
    };
    let ok = control_loop::run(controller, output, args.once, signal::shutdown(), reloader).await;
    // Let open requests (a scrape, an EDS poll) finish, but do not wait on a client that hangs.
    stop_serving.cancel();
    if let Some(server) = server {
        let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    }
    if let Some(p) = pickers {
        let _ = tokio::time::timeout(Duration::from_secs(5), p.join()).await;
    }
    leadership.stop().await;
    tracing::info!("controller stopped");
    if ok || !args.once {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
